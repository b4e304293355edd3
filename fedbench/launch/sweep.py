"""Expand a Hydra sweep (CLI sweep overrides + a preset's ``hydra.sweeper.params``) into single runs,
and submit the missing ones as one submitit job array without waiting (non-blocking).

hydra-submitit-launcher blocks until every job of a sweep has finished (ecosystem note C.3);
``scripts/submit.py`` uses this module instead: it composes each run's config with the compose
API, skips runs whose record is already ``ok`` (so a preempted sweep can simply be resubmitted),
and returns as soon as the array is queued.
"""
from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from fedbench.errors import FedbenchError
from fedbench.results.records import compute_run_id, is_complete

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def _register_resolver() -> None:
    from fedbench.results.records import compute_run_id as _cid

    if not OmegaConf.has_resolver("fedbench_run_id"):
        OmegaConf.register_new_resolver("fedbench_run_id", lambda *, _root_: _cid(_root_))


def _split(overrides: Sequence[str]) -> Tuple[List[str], Dict[str, List[str]]]:
    parser = OverridesParser.create()
    fixed, sweeps = [], {}
    for ov in parser.parse_overrides(list(overrides)):
        if ov.is_sweep_override():
            sweeps[ov.get_key_element()] = list(ov.sweep_string_iterator())
        else:
            fixed.append(ov.input_line)
    return fixed, sweeps


def expand_sweep(overrides: Sequence[str], conf_dir: Path = CONF_DIR) -> List[List[str]]:
    """Every single-run override list of the sweep (CLI sweeps override preset sweeper params)."""
    _register_resolver()
    fixed, sweeps = _split(overrides)
    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        base = compose("config", overrides=fixed, return_hydra_config=True)
    params = base.hydra.sweeper.get("params")
    preset = OmegaConf.to_container(params, resolve=False) if params else {}
    preset_sweeps = {}
    for key, val in preset.items():
        if key in sweeps or any(f.split("=", 1)[0].lstrip("+~") == key for f in fixed):
            continue
        _, parsed = _split([f"{key}={val}"])
        preset_sweeps[key] = parsed.get(key, [str(val)])
    axes = {**preset_sweeps, **sweeps}
    keys = list(axes)
    combos = itertools.product(*(axes[k] for k in keys)) if keys else [()]
    return [fixed + [f"{k}={v}" for k, v in zip(keys, combo)] for combo in combos]


def compose_run(overrides: Sequence[str], conf_dir: Path = CONF_DIR) -> DictConfig:
    _register_resolver()
    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def run_dir(cfg: DictConfig, launch_dir: str) -> Path:
    root = Path(cfg.paths.output_root)
    root = root if root.is_absolute() else Path(launch_dir) / root
    return root / "runs" / compute_run_id(cfg)


def run_job(overrides: List[str], launch_dir: str) -> Dict:
    """What one array task executes (also importable for local debugging)."""
    from fedbench.runner import execute_all

    os.chdir(launch_dir)
    cfg = compose_run(overrides)
    recs = execute_all(cfg, run_dir(cfg, launch_dir), CONF_DIR, launch_dir=launch_dir)
    return {"run_ids": [r["run_id"] for r in recs], "status": [r["status"] for r in recs]}


def plan(overrides: Sequence[str], launch_dir: str, force: bool = False):
    """(todo, done): override lists still to run, and those whose ok record exists."""
    todo, done = [], []
    for ovs in expand_sweep(overrides):
        cfg = compose_run(ovs)
        if cfg.get("aggregators"):
            from fedbench.runner import expand_aggregators

            subs = expand_aggregators(cfg, CONF_DIR)
            finished = all(is_complete(run_dir(s, launch_dir) / "metrics.json", compute_run_id(s)) for s in subs)
        else:
            finished = is_complete(run_dir(cfg, launch_dir) / "metrics.json", compute_run_id(cfg))
        (done if finished and not force else todo).append(ovs)
    return todo, done


def submit(overrides: Sequence[str], *, cluster: str = "slurm", folder: str | None = None,
           launch_dir: str | None = None, force: bool = False, params: Dict | None = None):
    import submitit

    launch_dir = launch_dir or os.getcwd()
    todo, done = plan(overrides, launch_dir, force)
    if not todo:
        return [], todo, done
    folder = folder or str(Path(launch_dir) / "outputs" / "submitit" / "%j")
    executor = submitit.AutoExecutor(folder=folder, cluster=None if cluster == "auto" else cluster)
    params = dict(params or {})
    if executor.cluster != "slurm":
        params = {k: v for k, v in params.items() if not k.startswith("slurm_")}
    if params:
        executor.update_parameters(**params)
    if force:
        todo = [ovs + ["force=true"] for ovs in todo]
    jobs = executor.map_array(run_job, todo, [launch_dir] * len(todo))
    return jobs, todo, done


def validate_cluster(cluster: str) -> str:
    if cluster not in ("slurm", "local", "debug", "auto"):
        raise FedbenchError(f"--cluster must be slurm, local, debug or auto, got '{cluster}'")
    return cluster
