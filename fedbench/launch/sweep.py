"""Expand a Hydra sweep (CLI sweep overrides + a preset's ``hydra.sweeper.params``) into single runs,
and submit the missing ones as one submitit job array without waiting (non-blocking).

hydra-submitit-launcher blocks until every job of a sweep has finished (ecosystem note C.3);
``scripts/submit.py`` uses this module instead: it composes each run's config with the compose
API, skips runs whose record is already ``ok`` (so a preempted sweep can simply be resubmitted),
and returns as soon as the array is queued.
"""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple
import json

from omegaconf import DictConfig, OmegaConf

from fedbench.config import CONF_DIR
from fedbench.config.compose import allow_pretrained, compose_config, parse_overrides, without_hydra
from fedbench.config.profiles import quote_value, set_overrides, table_profile
from fedbench.config.validate import validate_config
from fedbench.errors import FedbenchError
from fedbench.numerics import is_current
from fedbench.results.records import compute_run_id, find_record_dir, read_record
from fedbench.config.aggregators import aggregator_run_ids


def _split(overrides: Sequence[str]) -> Tuple[List[str], Dict[str, List[str]]]:
    fixed, sweeps = [], {}
    for ov in parse_overrides(allow_pretrained(overrides)):
        if ov.is_sweep_override():
            sweeps[ov.get_key_element()] = list(ov.sweep_string_iterator())
        else:
            fixed.append(ov.input_line)
    return fixed, sweeps


_q = quote_value


def _same(a: str, b: str) -> bool:
    a, b = str(a).strip("'\""), str(b).strip("'\"")
    if a == b:
        return True
    try:
        return float(a) == float(b)
    except ValueError:
        return False


def _axis_values(key: str, value) -> List[str]:
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    _, parsed = _split([f"{key}={value}"])
    return parsed.get(key, [str(value)])


def expand_sweep(overrides: Sequence[str], conf_dir: Path = CONF_DIR) -> List[List[str]]:
    """Every single-run override list of a sweep.

    Axes come from an experiment preset's ``table.sweeps`` (a list of blocks, each a cartesian
    product; their union is the table) and its ``table.profiles[profile]`` (``sweep``: axes added to
    every block, e.g. seeds; ``set``: fixed overrides, e.g. fewer epochs), or, without a preset, from
    ``hydra.sweeper.params``; CLI sweeps (``seed=0,1,2``) replace an axis and a fixed CLI override
    (``dataset=fmnist``) removes it, which is how a table is restricted to one data set.
    """
    fixed, sweeps = _split(overrides)
    fixed_values = {f.split("=", 1)[0].lstrip("+~"): f.split("=", 1)[1] if "=" in f else "" for f in fixed}
    fixed_keys = set(fixed_values)
    # a preset's table needs no hydra node, and without it compose_config reuses the shared base of its group
    # choices (a full Hydra composition is most of reading a table's sweep); hydra.sweeper.params needs the node
    base = compose_config(fixed, conf_dir)
    if not base.get("table"):
        base = compose_config(fixed, conf_dir, with_hydra=True)
    blocks: List[Dict] = [{}]
    profile_sweep: Dict = {}
    profile_set: List[str] = []
    table = base.get("table")
    if table:
        t = OmegaConf.to_container(table, resolve=False)
        blocks = t.get("sweeps") or [{}]
        prof = table_profile(t, base.get("profile"))
        profile_sweep = prof.get("sweep") or {}
        profile_set = set_overrides(prof, fixed_keys)
    else:
        table_profile(None, base.get("profile"))   # profile= without a preset table is an error
        params = base.hydra.sweeper.get("params")
        blocks = [OmegaConf.to_container(params, resolve=False)] if params else [{}]
    runs: List[List[str]] = []
    seen = set()
    for block in blocks:
        axes: Dict[str, List[str]] = {}
        for src in (block, profile_sweep):
            for key, val in src.items():
                axes[key] = _axis_values(key, val)
        axes.update(sweeps)
        for key in list(axes):
            if key in fixed_keys:   # a fixed CLI value restricts the axis to itself (dataset=fmnist)
                want = fixed_values[key]
                if not any(_same(v, want) for v in axes[key]):
                    axes = None
                    break
                del axes[key]
        if axes is None:
            continue
        keys = list(axes)
        sets = [o for o in profile_set if o.split("=", 1)[0] not in axes]
        for combo in itertools.product(*(axes[k] for k in keys)) if keys else [()]:
            run = fixed + sets + [f"{k}={_q(v)}" for k, v in zip(keys, combo)]
            if tuple(run) not in seen:
                seen.add(tuple(run))
                runs.append(run)
    return runs


def compose_run(overrides: Sequence[str], conf_dir: Path = CONF_DIR) -> DictConfig:
    return compose_config(overrides, conf_dir)


def run_dir(cfg: DictConfig, launch_dir: str, run_id: Optional[str] = None) -> Path:
    root = Path(cfg.paths.output_root)
    root = root if root.is_absolute() else Path(launch_dir) / root
    return root / "runs" / (run_id or compute_run_id(cfg))


def is_finished(cfg: DictConfig, launch_dir: str, run_id: Optional[str] = None) -> bool:
    """A complete, current record exists locally or in the committed store (results/records); ``run_id``: of one
    of ``cfg``'s aggregators (``aggregator_run_ids``), which share its output root."""
    run_id = run_id or compute_run_id(cfg)
    return find_record_dir(run_dir(cfg, launch_dir, run_id).parents[1], run_id,
                           need_model=bool(cfg.get("save_model"))) is not None


def plan(overrides: Sequence[str], launch_dir: str, force: bool = False, allow_missing: bool = False,
         check: Optional[Callable[[DictConfig, Path], None]] = None):
    """(todo, done): override lists still to run, and those whose ok record exists.

    A preset naming a method that is not implemented yet fails here with a message naming it;
    ``allow_missing`` drops such methods from the aggregator lists instead (announced, never silent).
    ``check(cfg, conf_dir)``: a further check of every run (the runner's ``check_methods``: the methods' own
    option rules, which need torch; the callers that are about to train pass it).
    """
    todo, done = [], []
    for ovs in expand_sweep(overrides):
        cfg = compose_config(ovs, with_hydra=True)   # the hydra node names the group choices for validation
        if cfg.get("aggregators") and allow_missing:
            ovs = ovs + [f"aggregators={_present_aggregators(cfg)}"]
            cfg = compose_config(ovs, with_hydra=True)
        validate_config(cfg, launch_dir=launch_dir, allow_missing=allow_missing)   # every run of the sweep, before any is submitted or run
        if check is not None:
            check(cfg, CONF_DIR)
        if cfg.get("aggregators"):
            ids = aggregator_run_ids(without_hydra(cfg), CONF_DIR)
            finished = all(is_finished(cfg, launch_dir, rid) for rid in ids)
        else:
            finished = is_finished(cfg, launch_dir)
        # force=true among the overrides reruns too (run.py honours it; the plan used to skip such runs silently)
        (done if finished and not (force or cfg.get("force", False)) else todo).append(ovs)
    return todo, done


def validate_cluster(cluster: str) -> str:
    if cluster not in ("slurm", "local", "debug", "auto"):
        raise FedbenchError(f"--cluster must be slurm, local, debug or auto, got '{cluster}'")
    return cluster


def missing_methods(overrides: Sequence[str]) -> List[str]:
    names = []
    for ovs in expand_sweep(overrides)[:1]:
        cfg = compose_run(ovs)
        if cfg.get("aggregators") is None:   # one algorithm a run (a study preset, a plain run): nothing listed
            continue
        for entry in OmegaConf.to_container(cfg.aggregators, resolve=True):
            name = entry if isinstance(entry, str) else entry.get("name")
            if not (CONF_DIR / "algorithm" / f"{name}.yaml").exists():
                names.append(name)
    return names


def _present_aggregators(cfg: DictConfig) -> str:
    """The aggregator list without unimplemented methods, as one Hydra override value."""

    keep = []
    for entry in OmegaConf.to_container(cfg.aggregators, resolve=True):
        name = entry if isinstance(entry, str) else entry.get("name")
        if (CONF_DIR / "algorithm" / f"{name}.yaml").exists():
            keep.append(entry)
    items = []
    for e in keep:
        if isinstance(e, str):
            items.append(e)
        else:
            items.append("{" + ",".join(f"{k}:{json.dumps(v) if isinstance(v, str) else v}" for k, v in e.items()) + "}")
    return "[" + ",".join(items) + "]"


def study_runs(overrides: Sequence[str], output_root: Path) -> List[Dict[str, Any]]:
    """One entry per run of the study preset's sweep: overrides, config, run id, folder, record (or None). The
    folder is the run's own (``<output_root>/runs/<id>``) unless only the committed store holds its finished record
    (a fresh clone: the study's tables are there, its binaries are not)."""
    out = []
    for ovs in expand_sweep(overrides):
        cfg = compose_run(ovs)
        rid = compute_run_id(cfg)
        folder = find_record_dir(output_root, rid) or Path(output_root) / "runs" / rid
        rec = read_record(folder / "metrics.json")
        out.append({"overrides": ovs, "config": cfg, "run_id": rid, "dir": folder,
                    "record": rec if rec and rec.get("status") == "ok" and rec.get("run_id") == rid
                    and is_current(rec) else None})
    return out
