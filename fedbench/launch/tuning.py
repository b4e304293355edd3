"""``tuning=on``: run a preset's tuning protocol (fedbench/config/tuning.py) instead of its fixed picks.

For every run of the preset's sweep (a cell: data set, split, seed, ...) and every method in it:
1. one selection run per grid point, with ``tuning_val.fraction`` set: it trains on the training data minus a seeded
   hold-out and is evaluated on that hold-out (the test set is dropped from its data, fedbench/data/tuning_split.py);
2. the best point by the protocol's metric at its round;
3. the final run with the chosen values on the full training data, evaluated on the test set: an ordinary run
   (its run_id is that of a fixed-pick run with the same values), whose record gets a ``tuning`` section.
The choice is also kept in ``<output_root>/tuning/<selection key>.json`` for the table (``tuned_config``); a table's
collect publishes it to the committed ``results/tuning/`` (``records.tuning_store``) with its selection runs' records
(also those of a selection still under way: a fresh machine then goes on from them).
Runs with an ok record are skipped, so an interrupted tuning resumes where it stopped.
"""
from __future__ import annotations

import csv
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from omegaconf import DictConfig, OmegaConf

from fedbench.config import CONF_DIR
from fedbench.config.compose import compose_config
from fedbench.config.profiles import quote_value
from fedbench.config.tuning import (TuningSpec, better, grid_points, method_grids, parse_tuning, selection_key)
from fedbench.config.aggregators import expand_runs
from fedbench.errors import FedbenchError
from fedbench.launch.sweep import expand_sweep, is_finished
from fedbench.results.claims import ClaimHeld, is_held
from fedbench.results.records import (compute_run_id, find_record_dir, identity_config, read_record, tuning_store,
                                      write_json_atomic)
from fedbench.runner import execute

DEFERRED = "deferred"   # tune_task's answer when everything it could train now is another process's run


@dataclass
class Task:
    """One (cell, method) to tune: the cell's overrides, the method's position in its aggregator list, its grid."""
    overrides: List[str]
    index: int
    method: str
    fixed: DictConfig            # the preset's fixed-pick run of this method
    grid: Dict[str, list]        # {} = no grid: the fixed picks stay


def with_overrides(overrides: Sequence[str], values: Dict[str, Any]) -> List[str]:
    """``overrides`` with each key of ``values`` replaced (or added)."""
    keys = set(values)
    kept = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] not in keys]
    return kept + [f"{k}={quote_value(v)}" for k, v in values.items()]


def method_runs(overrides: Sequence[str], conf_dir: Path = CONF_DIR) -> List[DictConfig]:
    """The run configs of one cell: one per aggregator of its list (or the cell itself), with tuning switched off."""
    cfg = compose_config(overrides, conf_dir)
    subs = expand_runs(cfg, conf_dir)
    for s in subs:
        s.tuning = "off"   # not part of the run id; a run itself never tunes
    return subs


def tuning_tasks(overrides: Sequence[str], conf_dir: Path = CONF_DIR) -> Tuple[TuningSpec, List[Task]]:
    """The preset's spec and its (cell, method) tasks; the config of every selection run is composed (and so
    checked) here, before anything trains."""
    spec, tasks = None, []
    for ovs in expand_sweep(overrides, conf_dir):
        cfg = compose_config(ovs, conf_dir)
        spec = spec or parse_tuning(OmegaConf.to_container(cfg.table, resolve=True) if cfg.get("table") else None)
        grids = method_grids(spec, OmegaConf.to_container(cfg, resolve=True))
        for i, sub in enumerate(method_runs(ovs, conf_dir)):
            grid = grids.get(str(sub.algorithm.name), {})
            tasks.append(Task(list(ovs), i, str(sub.algorithm.name), sub, grid))
            check_grid_reaches_runs(tasks[-1], spec, conf_dir)   # a bad or idle grid key fails here, not mid-way
    if spec is None:
        raise FedbenchError("tuning=on: the overrides select no run of the preset")
    return spec, tasks


def run_settings(cfg: DictConfig) -> Dict[str, Any]:
    """What a run computes: its run identity without ``hp``, which only holds values for interpolations (hp is part of
    the identity, so two runs that differ only in an hp value nothing reads have different ids yet train alike)."""
    return {k: v for k, v in identity_config(cfg).items() if k != "hp"}


def check_grid_reaches_runs(task: Task, spec: TuningSpec, conf_dir: Path = CONF_DIR) -> None:
    """Every key of a method's grid must change its selection runs: moved alone from the grid's first point to its
    second value, the run's settings must differ. An aggregator entry's literal value wins over an override of the
    cell, and a bare name in an ``aggregators`` list ignores ``hp.*`` altogether; either would make every selection
    run the same run."""
    if not task.grid:
        return
    first = grid_points(task.grid)[0]
    base = selection_config(task, spec, first, conf_dir)
    for key, values in task.grid.items():
        if len(values) < 2:
            continue
        moved = selection_config(task, spec, {**first, key: values[1]}, conf_dir)
        # idle: a key outside the run identity (progress, hardware), or an hp value no setting reads
        if run_settings(moved) == run_settings(base):
            hint = ("an aggregator entry's own value wins over an override of the cell: tune algorithm.<option>"
                    if not key.startswith("hp.") else
                    f"no setting of {task.method}'s run reads ${{{key}}}: its aggregators entry must interpolate it")
            raise FedbenchError(f"tuning: the grid key {key} of {task.method} does not change its runs ({hint})")


def split_point(point: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(overrides of the cell, ``algorithm.<key>`` values). The latter set the method's own option after its aggregator
    entry is expanded: an entry's literal value (FedLPA Table 6's ``{name: fedprox, mu: 0.01}``) would win over any
    override of the cell."""
    algo = {k: v for k, v in point.items() if k.startswith("algorithm.")}
    return {k: v for k, v in point.items() if k not in algo}, algo


def with_algorithm(sub: DictConfig, algo: Dict[str, Any], method: str) -> DictConfig:
    for key, value in algo.items():
        if OmegaConf.select(sub, key, default="__absent__") == "__absent__":
            raise FedbenchError(f"tuning: {method} has no option {key[len('algorithm.'):]!r} to tune ({key})")
        OmegaConf.update(sub, key, value, merge=False)
    return sub


def selection_config(task: Task, spec: TuningSpec, point: Dict[str, Any], conf_dir: Path = CONF_DIR) -> DictConfig:
    """The selection run of one grid point: the point, the protocol's ``select`` overrides and the hold-out."""
    cell, algo = split_point(point)
    ovs = with_overrides(task.overrides, {**cell, **spec.select, "tuning_val.fraction": spec.val_fraction,
                                          "tuning_val.seed": spec.val_seed})
    return with_algorithm(method_runs(ovs, conf_dir)[task.index], algo, task.method)


def final_config(task: Task, chosen: Dict[str, Any], conf_dir: Path = CONF_DIR) -> DictConfig:
    cell, algo = split_point(chosen)
    return with_algorithm(method_runs(with_overrides(task.overrides, cell), conf_dir)[task.index], algo, task.method)


def scores_at(run_dir: Path, at_round: Optional[int]) -> Dict[str, Optional[float]]:
    """{accuracy, nll} of a run's history at ``at_round`` (None = its last row); None where the round is missing."""
    try:
        with open(run_dir / "history.csv") as f:
            rows = list(csv.DictReader(f))
    except OSError:
        rows = []
    row = rows[-1] if rows and at_round is None else next((r for r in rows if int(r["round"]) == at_round), None)

    def num(key):
        v = (row or {}).get(key)
        return float(v) if v not in (None, "") else None
    return {"accuracy": num("accuracy"), "nll": num("nll")}


def _run(cfg: DictConfig, output_root: Path, launch_dir: str, wait_for_claim: bool = True) -> Optional[Path] | str:
    """Execute one run (skipped when its ok record exists); the folder of its record, or None if it failed, or
    DEFERRED when another process claimed it after the busy check (``wait_for_claim=False``)."""
    rid = compute_run_id(cfg)
    try:
        execute(cfg, output_root / "runs" / rid, launch_dir=launch_dir, wait_for_claim=wait_for_claim)
    except ClaimHeld:
        return DEFERRED
    except Exception as e:   # one failed grid point does not stop the tuning
        print(f"fedbench: error: tuning run {rid} ({cfg.algorithm.name}): {e}", file=sys.stderr)
    return find_record_dir(output_root, rid)


def _held_elsewhere(cfg: DictConfig, output_root: Path) -> bool:
    """Whether a live holder (another launcher on the same outputs) is training this run now."""
    return is_held(Path(output_root) / "runs" / compute_run_id(cfg) / ".claim")


def tune_task(task: Task, spec: TuningSpec, output_root: Path, launch_dir: str,
              conf_dir: Path = CONF_DIR, defer_busy: bool = False) -> Optional[Dict[str, Any]] | str:
    """Select, then run the final run; returns the selection (also written to its file and the final record).

    With ``defer_busy`` a run another process is training is left to it: the next free grid point goes first, and
    when nothing of the task is free the task returns ``DEFERRED`` (run_tuning comes back to it at the end, when
    the other process's runs are skipped as done). Two launchers on one tuning thus split its runs. A run another
    process claims between the busy check and its start (two launchers picking it at one moment) is passed over the
    same way, found at its claim."""
    def busy(cfg: DictConfig) -> bool:
        return defer_busy and _held_elsewhere(cfg, output_root)

    if not task.grid:   # no grid for this method: its fixed picks are its final run
        if busy(task.fixed) or _run(task.fixed, output_root, launch_dir, not defer_busy) == DEFERRED:
            return DEFERRED
        return None
    points = grid_points(task.grid)
    cfgs = [selection_config(task, spec, point, conf_dir) for point in points]
    dirs: Dict[int, Optional[Path]] = {}
    taken = set()   # claimed by another process when their turn came
    while len(dirs) < len(points):
        free = [i for i in range(len(points)) if i not in dirs and i not in taken and not busy(cfgs[i])]
        if not free:
            return DEFERRED
        d = _run(cfgs[free[0]], output_root, launch_dir, not defer_busy)
        if d == DEFERRED:
            taken.add(free[0])
        else:
            dirs[free[0]] = d
    trials, best = [], None
    for i, point in enumerate(points):   # scored in grid order, whoever trained each: ties go the same way
        sc = scores_at(dirs[i], spec.at_round) if dirs[i] else {"accuracy": None, "nll": None}
        trials.append({"values": point, "run_id": compute_run_id(cfgs[i]), **sc})
        if better(sc, best, spec.metric):
            best = {"values": point, **sc}
    if best is None:
        print(f"fedbench: error: tuning {task.method}: no selection run gave a {spec.metric}; no final run",
              file=sys.stderr)
        return None
    final = final_config(task, best["values"], conf_dir)
    selection = {"method": task.method, "protocol": spec.protocol(), "grid": task.grid, "chosen": best["values"],
                 "val_metric": trials, "fixed_run_id": compute_run_id(task.fixed), "final_run_id": compute_run_id(final),
                 "final_config": OmegaConf.to_container(final, resolve=True)}
    write_json_atomic(selection_path(output_root, task.fixed, spec, task.grid), selection)
    if busy(final):
        return DEFERRED
    d = _run(final, output_root, launch_dir, not defer_busy)
    if d == DEFERRED:
        return DEFERRED
    # the chosen values reach the final run's record; a committed record (results/records) is never rewritten: it got
    # its tuning section before it was published
    if d is not None and Path(d).resolve().is_relative_to(Path(output_root).resolve()):
        rec = read_record(d / "metrics.json")
        rec["tuning"] = {k: v for k, v in selection.items() if k != "final_config"}
        write_json_atomic(d / "metrics.json", rec)
    return selection


def finished_selection_runs(overrides: Sequence[str], output_root: Path, conf_dir: Path = CONF_DIR) -> List[Path]:
    """The record folders of every finished selection run of a ``tuning=on`` preset, its selection complete or not.
    A table's collect publishes them, so a fresh machine's tuning skips them and resumes where this one stopped."""
    spec, tasks = tuning_tasks(overrides, conf_dir)
    ids = dict.fromkeys(compute_run_id(selection_config(t, spec, point, conf_dir))   # cells share seed 0's runs
                        for t in tasks for point in grid_points(t.grid))
    return [d for d in (find_record_dir(output_root, rid) for rid in ids) if d is not None]


def selection_path(output_root: Path, fixed: DictConfig, spec: TuningSpec, grid: Dict[str, list]) -> Path:
    return Path(output_root) / "tuning" / f"{selection_key(compute_run_id(fixed), spec, grid)}.json"


def tuning_plan(overrides: Sequence[str], launch_dir: str, conf_dir: Path = CONF_DIR) -> Dict[str, int]:
    """What ``tuning=on`` still has to train, without training: selection runs done / in all, and (cell, method)
    tasks finished (a method without a grid: its fixed run; with one: its selection file and chosen final run)."""
    spec, tasks = tuning_tasks(overrides, conf_dir)
    root = Path(str(tasks[0].fixed.paths.output_root)) if tasks else Path("outputs")
    root = root if root.is_absolute() else Path(launch_dir) / root
    out = {"tasks": len(tasks), "tasks_done": 0, "selection_runs": 0, "selection_done": 0}
    for t in tasks:
        if not t.grid:
            out["tasks_done"] += is_finished(t.fixed, launch_dir)
            continue
        for point in grid_points(t.grid):
            out["selection_runs"] += 1
            out["selection_done"] += is_finished(selection_config(t, spec, point, conf_dir), launch_dir)
        path = selection_path(root, t.fixed, spec, t.grid)
        sel = read_record(path) or read_record(tuning_store() / path.name)   # local first, then committed
        if sel:
            out["tasks_done"] += find_record_dir(root, sel["final_run_id"]) is not None
    return out


def run_tuning(overrides: Sequence[str], launch_dir: str, conf_dir: Path = CONF_DIR) -> List[Dict[str, Any]]:
    """``scripts/reproduce.py ... tuning=on``: tune every (cell, method) of the preset; returns the selections."""
    spec, tasks = tuning_tasks(overrides, conf_dir)
    root = Path(str(tasks[0].fixed.paths.output_root)) if tasks else Path("outputs")
    root = root if root.is_absolute() else Path(launch_dir) / root
    n_sel = sum(len(grid_points(t.grid)) for t in tasks if t.grid)
    print(f"tuning: {len(tasks)} (cell, method) task(s), {n_sel} selection run(s) on a {spec.val_fraction:g} "
          f"hold-out of the training data (seed {spec.val_seed}), {spec.metric} at round "
          f"{spec.at_round or 'last'}; then one final run each")
    chosen: Dict[int, Dict[str, Any]] = {}
    later: List[int] = []

    def tune(k: int, defer: bool) -> None:
        t = tasks[k]
        sel = tune_task(t, spec, root, launch_dir, conf_dir, defer_busy=defer)
        if sel == DEFERRED:
            print(f"fedbench: tuning {t.method} seed {t.fixed.seed}: its next run is being trained by another "
                  "process; left for the end", file=sys.stderr, flush=True)
            later.append(k)
        elif sel:
            print(f"tuning: {t.method} seed {t.fixed.seed}: chosen {sel['chosen']}")
            chosen[k] = sel

    # a second launcher on the same outputs (another terminal or core) splits the work: what one is training the
    # other leaves for the end of its pass, then waits for it there (usually to find the record and skip it)
    for k in range(len(tasks)):
        tune(k, defer=True)
    for k in list(later):
        tune(k, defer=False)
    return [chosen[k] for k in sorted(chosen)]


def tuned_config(sub: DictConfig, cfg: DictConfig, output_root: Path) -> Tuple[Optional[DictConfig], Optional[Dict]]:
    """For a table with ``tuning=on``: the final run config of a fixed-pick run ``sub`` of cell ``cfg`` and its
    selection; ``sub`` itself when its method has no grid; (None, None) when it is not tuned yet."""
    spec = parse_tuning(OmegaConf.to_container(cfg.table, resolve=True))
    grid = method_grids(spec, OmegaConf.to_container(cfg, resolve=True)).get(str(sub.algorithm.name))
    if not grid:
        return sub, None
    fixed = OmegaConf.merge(sub, {"tuning": "off"})   # sub may be read-only (report.plans.sweep_configs)
    path = selection_path(output_root, fixed, spec, grid)
    for where in (path, tuning_store() / path.name):   # local first, then the committed selections
        sel = read_record(where)
        if sel:
            return OmegaConf.create(sel["final_config"]), {**sel, "_path": str(where)}
    return None, None
