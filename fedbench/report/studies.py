"""Experiment presets that drive a study instead of ``run.py``: the studies the papers register
(fedbench.report.registry.register_study, e.g. FOLA's §IV-E softmax-regression study and FedFisher's GMI attack).

A preset declares ``table.study: <name>`` (a registered ``Study``: ``settings(cfg)``, ``run(cfg, out_dir,
launch_dir=...)``, optionally ``publish``) and otherwise looks like any preset: its sweep and profiles expand into
runs (``fedbench.launch.sweep.expand_sweep``), each run's config has a run id, and the study writes its files
into ``<output_root>/runs/<run_id>/`` with a ``metrics.json`` record (``status: ok``, the resolved config, the
files), so a finished study is skipped on the next ``make reproduce`` exactly as a finished run is.

A study preset with ``table.columns`` also gets a table (``collect_study_table``: the records' values beside the
paper's numbers, as ``fedbench.report.tables.collect``). With ``table.column_methods: true`` every derived
column is one method of the paper's table (one study run measures all of them, e.g. the three levels of
server access of FedFisher Table 6), so a column's name is the ``method`` its reference row is joined on.
A study may have ``publish(runs, figures_dir, profile, suffix=None)`` to copy its figures into results/figures/
(``suffix``: a named collection's, so that it never overwrites the preset's own figure).
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from omegaconf import OmegaConf

from fedbench.config import CONF_DIR
from fedbench.errors import FedbenchError
from fedbench.launch.sweep import compose_run, expand_sweep, study_runs
from fedbench.numerics import current
from fedbench.results.records import publish_record, write_json_atomic
from fedbench.report.figures import plot_preset_figures
from fedbench.report.registry import STUDIES, registered
from fedbench.report.tables import collect, preset_meta


def study_name(overrides: Sequence[str]) -> Optional[str]:
    """The preset's ``table.study`` (checked), or None for an ordinary preset (or no preset)."""

    runs = expand_sweep(overrides)
    if not runs:
        return None
    table = compose_run(runs[0]).get("table")
    name = table.get("study") if table is not None else None
    if name is None:
        return None
    if name not in registered(STUDIES):
        raise FedbenchError(f"table.study must be one of {', '.join(STUDIES)}, got {name!r}")
    return str(name)


def run_study_preset(overrides: Sequence[str], launch_dir: Optional[str] = None, *, force: bool = False,
                     log=print) -> List[Dict[str, Any]]:
    """Run every study of the preset's sweep that has no ok record yet (all of them with ``force``)."""

    launch_dir = launch_dir or os.getcwd()
    name = study_name(overrides)
    if name is None:
        raise FedbenchError("not a study preset (its table has no `study` key)")
    study = STUDIES[name]
    output_root = Path(os.environ.get("FEDBENCH_OUTPUTS", "outputs"))
    output_root = output_root if output_root.is_absolute() else Path(launch_dir) / output_root
    runs = study_runs(overrides, output_root)
    for r in runs:   # reject bad settings of every run before computing any
        study.settings(r["config"])
    todo = [r for r in runs if force or r["record"] is None]
    log(f"{len(todo)} study run(s) to do, {len(runs) - len(todo)} already done")
    for i, r in enumerate(todo, 1):
        log(f"[{i}/{len(todo)}] {' '.join(r['overrides'])}")
        t0 = time.perf_counter()
        extra = study.run(r["config"], r["dir"], launch_dir=launch_dir, log=log)
        rec = {"run_id": r["run_id"], "status": "ok", "study": name, "algorithm": f"study:{name}",
               "numerics": current(f"study:{name}"),
               "config": OmegaConf.to_container(r["config"], resolve=True),
               "timing": {"total_s": time.perf_counter() - t0}, **extra}
        write_json_atomic(r["dir"] / "metrics.json", rec)
        r["record"] = rec
    return runs


def reproduce_study(overrides: Sequence[str], launch_dir: Optional[str] = None, *, run: bool = True,
                    suffix: Optional[str] = None) -> List[Path]:
    """``make reproduce`` for a study preset: run what is missing (unless ``run`` is False), then draw the
    preset's ``table.plots`` and write its table; returns the figure and table paths. ``suffix`` (``--name``)
    names a collection with other settings: its table and figures get the suffix, so they never overwrite the
    preset's own."""

    launch_dir = launch_dir or os.getcwd()
    if run:
        run_study_preset(overrides, launch_dir)
    output_root = Path(os.environ.get("FEDBENCH_OUTPUTS", "outputs"))
    output_root = output_root if output_root.is_absolute() else Path(launch_dir) / output_root
    for r in study_runs(overrides, output_root):   # the finished studies' records and tables into the committed store
        if r["record"] is not None:
            publish_record(r["dir"])
    figures_dir = Path(launch_dir) / "results" / "figures"
    paths = plot_preset_figures(overrides, output_root, figures_dir, suffix=suffix)
    study = STUDIES[study_name(overrides)]
    if study.publish is not None:
        runs = study_runs(overrides, output_root)
        profile = str(runs[0]["config"].get("profile") or "paper") if runs else "paper"
        paths += study.publish(runs, figures_dir, profile, suffix=suffix)
    table = collect_study_table(overrides, output_root, Path(launch_dir) / "results" / "tables", publish=True,
                                suffix=suffix)
    return paths + ([table] if table is not None else [])


def redraw_committed_studies(output_root: Path, figures_dir: Path, conf_dir: Path = CONF_DIR) -> List[Path]:
    """``make tables`` for the study presets that have figures and no table (FOLA Figs. 10-12): redraw each one's
    paper-profile figures from its finished records (the committed store's, on a fresh clone); presets with no
    finished study run are left alone. The studies with a table are collections and are redrawn as those."""
    paths: List[Path] = []
    for yaml_path in sorted((Path(conf_dir) / "experiment").rglob("*.yaml")):
        preset = f"experiment={yaml_path.relative_to(Path(conf_dir) / 'experiment').with_suffix('').as_posix()}"
        table = compose_run([preset]).get("table")   # the preset itself, not its (possibly huge) sweep
        if table is None or table.get("study") is None or not table.get("plots") or table.get("columns"):
            continue
        overrides = [preset, "profile=paper"]
        if any(r["record"] is not None for r in study_runs(overrides, output_root)):
            paths += plot_preset_figures(overrides, output_root, figures_dir)
    return paths


def collect_study_table(overrides: Sequence[str], output_root: Path, tables_dir: Path, *,
                        publish: bool = False, suffix: Optional[str] = None) -> Optional[Path]:
    """The study preset's table (``table.columns``) from its run records, beside the paper's numbers: ``collect``'s
    ``<tables_dir>/<paper>_<id>[_<profile>].md`` (+ ``_runs.csv``); with ``publish`` its finished records go into
    results/records and the collection into results/collections.yaml, as any table's. None without columns."""

    if not preset_meta(overrides).get("columns"):   # collect reads the records once
        return None
    return collect(overrides, Path(output_root), tables_dir, publish=publish, suffix=suffix)
