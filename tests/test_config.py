"""Every config option composes (Hydra compose API) and names a registered component."""
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import run  # noqa: F401  (registers the fedbench_run_id resolver)
from fedbench.algorithms import ALGORITHMS
from fedbench.data import DATASETS
from fedbench.models import MODELS
from fedbench.partition import PARTITIONS

CONF = Path(__file__).resolve().parents[1] / "conf"
REGISTRIES = {"dataset": DATASETS, "partition": PARTITIONS, "model": MODELS, "algorithm": ALGORITHMS}


def options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _compose(overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=overrides, return_hydra_config=True)


@pytest.mark.parametrize("group", ["dataset", "partition", "model", "algorithm", "hardware", "logger"])
def test_every_option_composes(group):
    opts = options(group)
    assert opts, group
    for opt in opts:
        cfg = _compose([f"{group}={opt}"])
        node = OmegaConf.to_container(cfg[group], resolve=True)
        assert "name" in node or group == "hardware"
        if group in REGISTRIES:
            name = node["name"]
            if not name.startswith("noniid-#label"):
                assert name in REGISTRIES[group], f"{group}/{opt}.yaml names unregistered '{name}'"


def test_defaults_and_run_dir():
    cfg = _compose([])
    assert cfg.dataset.name == "fmnist" and cfg.algorithm.name == "fedavg" and cfg.num_clients == 5
    run_dir = cfg.hydra.run.dir
    assert run_dir.startswith(str(cfg.paths.output_root)) and len(run_dir.rsplit("/", 1)[1]) == 12
    # the run directory is the run_id: changes with what is computed, not with hardware
    assert _compose(["hardware=cpu"]).hydra.run.dir == run_dir
    assert _compose(["seed=1"]).hydra.run.dir != run_dir


@pytest.mark.parametrize("arg, start", [("local.lr=[1,2", "cannot parse override 'local.lr=[1,2'"),
                                        ("seed={a:", "cannot parse override 'seed={a:'"),
                                        ("=3", "override '=3' has no key"),
                                        ("bare", "override 'bare' is not key=value"),
                                        ("foo=1", "unknown config key 'foo'")])
def test_compose_config_names_a_malformed_or_unknown_override_in_one_line(arg, start):
    """compose_config lets Hydra parse the overrides and parses them itself only when Hydra fails, so a grammar
    error still reads as fedbench's one line naming the override, not Hydra's listing."""
    from fedbench.config.compose import compose_config
    from fedbench.errors import FedbenchError

    with pytest.raises(FedbenchError) as err:
        compose_config(["seed=1", arg])
    assert str(err.value).startswith(start) and "\n" not in str(err.value)
