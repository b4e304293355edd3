"""``aggregators: [...]``: one full config per aggregator, each with its algorithm group's YAML."""
from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from fedbench.config.file_cache import load_yaml
from fedbench.errors import FedbenchError
from fedbench.results.records import compute_run_id


def expand_runs(cfg: DictConfig, conf_dir: Path, allow_missing: bool = False) -> list:
    """The runs a config stands for: one per entry of its ``aggregators`` list, else the config itself."""
    return expand_aggregators(cfg, conf_dir, allow_missing) if cfg.get("aggregators") else [cfg]


def expand_aggregators(cfg: DictConfig, conf_dir: Path, allow_missing: bool = False) -> list:
    """``aggregators: [fedavg, fednova, {name: fedprox, mu: 0.1}, ...]`` -> one full config per aggregator.

    Each gets the algorithm group's YAML (updated by the dict's keys), so its run_id equals that of
    a plain ``algorithm=<name>`` run and the records are interchangeable; all share the cached clients.
    """
    out = []
    for entry in cfg.aggregators:
        sub = OmegaConf.merge(cfg, {"aggregators": None})
        sub.algorithm = _algorithm(entry, conf_dir, allow_missing)
        out.append(sub)
    return out


def aggregator_run_ids(cfg: DictConfig, conf_dir: Path) -> list:
    """The run ids of ``expand_aggregators(cfg, conf_dir)``, from one working copy of the config rather than a copy
    per aggregator (a sweep plan asks for them for every run)."""
    work = OmegaConf.merge(cfg, {"aggregators": None})
    ids = []
    for entry in cfg.aggregators:
        work.algorithm = _algorithm(entry, conf_dir, False)
        ids.append(compute_run_id(work))
    return ids


def _algorithm(entry, conf_dir: Path, allow_missing: bool) -> DictConfig:
    """An aggregator entry's ``algorithm`` node: its YAML, updated by the entry's keys."""
    entry = OmegaConf.to_container(entry, resolve=True) if OmegaConf.is_config(entry) else entry
    name = entry if isinstance(entry, str) else entry.get("name") if isinstance(entry, dict) else None
    path = conf_dir / "algorithm" / f"{name}.yaml"
    if not name or not path.exists():
        if allow_missing and name:   # collect: mark the column as not implemented yet
            return OmegaConf.create({"name": name, "_missing": True})
        options = sorted(p.stem for p in (conf_dir / "algorithm").glob("*.yaml"))
        raise FedbenchError(f"aggregators: algorithm {entry!r} is not implemented yet (no conf/algorithm/"
                            f"{name}.yaml); available: {', '.join(options)}")
    algo = load_yaml(path)
    if isinstance(entry, dict):   # the entry's name picks the YAML (e.g. dense_fedfisher, whose method is dense)
        algo = OmegaConf.merge(algo, {k: v for k, v in entry.items() if k != "name"})
    return algo
