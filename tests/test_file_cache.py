"""fedbench.config.file_cache keeps Hydra's parsed config files between compositions: the compositions must equal
Hydra's own, an edited file must be read again, and what Hydra changes in a loaded file must not leak into the next."""
import shutil

import pytest
from omegaconf import OmegaConf

from fedbench.config import CONF_DIR, file_cache
from fedbench.config.compose import compose_config
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
