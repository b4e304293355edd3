"""fedbench.config.file_cache keeps Hydra's parsed config files between compositions, and compose_config shares one
base composition among runs with the same group choices: the compositions must equal Hydra's own, an edited file
must be read again, and what Hydra changes in a loaded file must not leak into the next."""
import shutil

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from fedbench.config import CONF_DIR, compose as composing, file_cache
from fedbench.config.compose import allow_pretrained, compose_config
from fedbench.launch.sweep import expand_sweep
from fedbench.results.records import compute_run_id


def _uncached(monkeypatch):
    """Hydra's own loaders, as they were before install()."""
    for cls in file_cache.cached_sources():
        monkeypatch.setattr(cls, "load_config", cls.load_config.__wrapped__)


def _runs():
    fmnist100 = ["experiment=fedlap/table1", "profile=paper", "dataset=fmnist", "partition=size_class_dirichlet",
                 "num_clients=100", "seed=2"]
    return [fmnist100, expand_sweep(["experiment=fedlpa/table6", "profile=paper"])[-1],
            expand_sweep(["experiment=fedbens/table1", "profile=paper"])[0], ["algorithm=fedprox", "local.epochs=3"]]


def test_cached_compositions_equal_hydras_own(monkeypatch):
    runs = _runs()
    cached = [compose_config(r, with_hydra=True) for r in runs for _ in range(2)]   # the second one reads the cache
    assert file_cache._CACHE, "nothing was cached"
    _uncached(monkeypatch)
    monkeypatch.setattr(composing, "_BASES", type(composing._BASES)())   # bases composed from the cache go too
    plain = [compose_config(r, with_hydra=True) for r in runs for _ in range(2)]
    for a, b in zip(cached, plain):
        assert OmegaConf.to_yaml(a, resolve=False) == OmegaConf.to_yaml(b, resolve=False)
        assert compute_run_id(a) == compute_run_id(b)


def test_an_edited_file_is_read_again_and_hydras_edits_do_not_leak(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    first = compose_config(["algorithm=fedprox"], conf)
    again = compose_config(["algorithm=fedprox"], conf)   # Hydra removed 'defaults' from what it loaded first
    assert OmegaConf.to_yaml(first) == OmegaConf.to_yaml(again)
    path = conf / "algorithm" / "fedprox.yaml"
    text = path.read_text()
    mu = OmegaConf.load(path).get("mu")
    assert mu is not None
    path.write_text(text.replace(f"mu: {mu}", "mu: 0.123456"))
    assert compose_config(["algorithm=fedprox"], conf).algorithm.mu == pytest.approx(0.123456)
    path.write_text(text)
    assert compose_config(["algorithm=fedprox"], conf).algorithm.mu == first.algorithm.mu


VALUE_OVERRIDES = [
    ["experiment=fedlpa/table6", "profile=paper", "seed=1", "partition.spec='beta=0.01'"],
    ["seed=2", "experiment=fedlpa/table6", "partition.spec='beta=0.01'", "profile=paper"],   # values before groups
    ["experiment=fedlap/table1", "profile=paper", "dataset=fmnist", "num_clients=100",
     "aggregators=[{name:fedlap_func,delta:0.5},fedavg]"],
    ["algorithm=fedprox", "+extra.note=hi", "++seed=3", "eval={every:2}", "~eval.thresholds"],   # add, force, merge, delete
    ["model=lenet", "model.pretrained=ckpt.pt", "algorithm.mu=0.5", "algorithm=fedprox"],  # ++pretrained, value first
]


@pytest.mark.parametrize("with_hydra", [False, True])
@pytest.mark.parametrize("overrides", VALUE_OVERRIDES, ids=lambda o: " ".join(o)[:40])
def test_a_shared_base_with_value_overrides_equals_hydras_composition(overrides, with_hydra, monkeypatch):
    """Also with the hydra node (sweep plans and preflight validate with it): its task overrides and override_dirname
    name the run's value overrides, not its base's, whichever run composed the base first."""
    monkeypatch.setattr(composing, "_BASES", type(composing._BASES)())
    groups_only = [o for o in overrides if o.split("=")[0] in ("experiment", "profile", "dataset", "algorithm",
                                                               "model")]
    compose_config(groups_only + ["seed=7"], with_hydra=with_hydra)   # another run composes the shared base first
    ours = compose_config(overrides, with_hydra=with_hydra)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        hydra = compose("config", overrides=allow_pretrained(overrides), return_hydra_config=with_hydra)
    assert len(composing._BASES) == 1
    assert OmegaConf.to_yaml(ours) == OmegaConf.to_yaml(hydra)
    assert OmegaConf.is_struct(ours) and OmegaConf.is_struct(hydra)
    assert compute_run_id(ours) == compute_run_id(hydra)
    if with_hydra:
        assert list(ours.hydra.overrides.task) == allow_pretrained(overrides)


def test_runs_that_differ_in_values_share_one_base_and_do_not_share_edits(monkeypatch):
    monkeypatch.setattr(composing, "_BASES", type(composing._BASES)())
    runs = [["experiment=fedlpa/table6", "profile=paper", f"seed={s}", f"partition.spec='beta={b}'"]
            for s in (0, 1) for b in (0.1, 0.5)]
    cfgs = [compose_config(r) for r in runs]
    assert len(composing._BASES) == 1
    assert [(c.seed, c.partition.spec) for c in cfgs] == [(0, "beta=0.1"), (0, "beta=0.5"), (1, "beta=0.1"),
                                                         (1, "beta=0.5")]
    cfgs[0].local.epochs = 999                                   # a caller's edit stays in its own copy
    assert compose_config(runs[0]).local.epochs != 999
    compose_config(["experiment=fedlpa/table6", "dataset=mnist", "seed=0"])   # another group choice: another base
    assert len(composing._BASES) == 2


def test_config_groups_are_what_hydras_repository_says():
    """compose_config and the table plans split overrides into group choices and values with is_config_group, a
    folder test that works outside a Hydra context: it must answer as Hydra's repository does for every folder of
    conf/ (nested ones too), for value keys and for keys that are neither."""
    from hydra.core.global_hydra import GlobalHydra

    from fedbench.config.compose import is_config_group

    folders = [p.relative_to(CONF_DIR).as_posix() for p in CONF_DIR.rglob("*") if p.is_dir()]
    keys = folders + ["seed", "local.lr", "partition.spec", "dataset.normalize", "experiment.fedlpa",
                      "experiment/fedlpa/table6", "no_such_group", "algorithm.mu"]
    assert "experiment/fedlpa" in folders and len(folders) > len({f.split("/")[0] for f in folders})
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        repo = GlobalHydra.instance().hydra.config_loader.repository
        hydra = {k: repo.group_exists(k) for k in keys}
    ours = {k: is_config_group(k) for k in keys}
    assert ours == hydra and sum(ours.values()) == len(folders)


def test_load_yaml_reads_an_edited_file_again_and_hands_out_copies(tmp_path):
    path = tmp_path / "a.yaml"
    path.write_text("name: a\nmu: 0.1\n")
    first = file_cache.load_yaml(path)
    first.mu = 99.0                                   # a caller's edit stays its own
    assert file_cache.load_yaml(path).mu == 0.1
    path.write_text("name: a\nmu: 0.25\n")            # another size: read again
    assert file_cache.load_yaml(path).mu == 0.25


@pytest.mark.parametrize("overrides", [["experiment=fola/figure3", "profile=reduced", "num_clients=50"],
                                       ["experiment=fedlpa/table6", "profile=paper"]], ids=["fola", "fedlpa"])
def test_a_plans_aggregator_run_ids_equal_the_expanded_runs(overrides):
    """sweep.plan asks aggregator_run_ids (one working copy, no hydra node) where it used to expand every
    aggregator of the with-hydra composition: the same run ids, in order, for lists with FedProx's mu entries."""
    from fedbench.config.aggregators import aggregator_run_ids, expand_aggregators
    from fedbench.config.compose import without_hydra

    for run in expand_sweep(overrides)[:3]:
        cfg = compose_config(run, with_hydra=True)
        want = [compute_run_id(s) for s in expand_aggregators(cfg, CONF_DIR)]
        assert aggregator_run_ids(without_hydra(cfg), CONF_DIR) == want
        assert len(set(want)) == len(cfg.aggregators) > 1
        assert "hydra" not in without_hydra(cfg) and OmegaConf.is_struct(without_hydra(cfg))
