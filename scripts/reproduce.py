#!/usr/bin/env python
"""Regenerate a paper table: run its preset's sweep locally (skipping finished runs), then collect.

    python scripts/reproduce.py experiment=fedlpa/table6 profile=quick dataset=fmnist
    make reproduce EXP=fedlpa/table6 PROFILE=quick ARGS="dataset=fmnist"

On a cluster use scripts/submit.py with the same overrides, then scripts/collect.py (tables) and
scripts/plot.py (figures). Multi-round tables also get their accuracy-over-rounds figure here, and figure
presets their figure (``table.figure``).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fedbench.errors import FedbenchError  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--allow-missing", action="store_true",
                    help="run the table without methods that are not implemented yet (they are listed)")
    ap.add_argument("--collect-only", action="store_true")
    ap.add_argument("--dry-run", action="store_true",
                    help="print how many runs are done and still to do (tuning=on: selection runs and methods), "
                         "train nothing and write no table")
    ap.add_argument("--parallel", type=int, default=None, metavar="N",
                    help="runs at once (default: hardware.jobs, auto = cores // hardware.num_threads; 1 on CUDA)")
    ap.add_argument("--metric", default=None,
                    help="the table's metric (default: the preset's table.metric, else accuracy; table.columns override it); "
                         "also timing.<key> or communication.<key> of the records, e.g. timing.server_s")
    ap.add_argument("--name", default=None,
                    help="suffix of the table's file name (results/tables/<paper>_<table>[_<profile>]_<name>.md), so "
                         "a collection with other methods or settings does not overwrite the preset's own table")
    ap.add_argument("--all", action="store_true",
                    help="with --collect-only: regenerate every committed table listed in results/collections.yaml "
                         "(and its figure) from the records, then the scoreboard (results/REPRODUCTION.md)")
    args = ap.parse_intermixed_args(argv)   # options may follow overrides
    if args.all:
        return regenerate_all()
    from pathlib import Path

    failed = 0
    try:
        from fedbench.config.preflight import check_script_overrides
        check_script_overrides(args.overrides)   # bad overrides: one line, before pandas or torch is imported
        from fedbench.launch.jobs import run_local
        from fedbench.launch.parallel import default_jobs, summary_line
        from fedbench.launch.sweep import missing_methods, plan
        from fedbench.runner import check_methods   # the methods' own option rules, before any run trains
        from fedbench.papers import load_papers
        from fedbench.report.tables import check_table_suffix, collect, preset_meta, table_suffix
        load_papers()   # the papers' row keys, labels, plots and studies, which the report reads
        check_table_suffix(args.name)   # a bad --name fails before any training
        from fedbench.report.studies import reproduce_study, study_name
        if study_name(args.overrides):   # a study preset (FOLA Figs. 10-12) runs its study, not run.py
            if args.dry_run:
                return dry_run_study(args.overrides)
            for p in reproduce_study(args.overrides, os.getcwd(), run=not args.collect_only,
                                     suffix=table_suffix(args.overrides, args.name)):
                print(f"{'table' if str(p).endswith('.md') else 'figure'} written: {p}")
            return 0
        meta = preset_meta(args.overrides)   # bad table / figure declarations fail before any training
        from fedbench.config.tuning import tuning_on
        if args.dry_run:
            return dry_run(args.overrides)
        if tuning_on(args.overrides) and not args.collect_only:   # grids on a validation split, then final runs
            from fedbench.launch.tuning import run_tuning
            t0 = time.time()
            run_tuning(args.overrides, os.getcwd())
            print(f"tuning finished in {time.time() - t0:.0f} s")
        elif not args.collect_only:
            missing = missing_methods(args.overrides)
            if missing and not args.allow_missing:
                why = f"; {meta['missing']}" if meta.get("missing") else ""
                from fedbench.config import CONF_DIR
                from fedbench.config.validate import did_you_mean
                known = [p.stem for p in (CONF_DIR / "algorithm").glob("*.yaml")]
                hints = "".join(did_you_mean(m, known) for m in missing)
                raise FedbenchError(f"methods not implemented yet: {', '.join(missing)}{why}{hints} "
                                    "(rerun with --allow-missing to run the other columns)")
            if missing:
                print(f"fedbench: WARNING: skipping unimplemented methods: {', '.join(missing)}", file=sys.stderr)
            todo, done = plan(args.overrides, os.getcwd(), allow_missing=args.allow_missing, check=check_methods)
            jobs = default_jobs(todo[0], args.parallel) if todo else 1
            print(f"{len(todo)} run(s) to do, {len(done)} already done; {min(jobs, max(len(todo), 1))} at once")
            t0 = time.time()
            total = run_local(todo, os.getcwd(), jobs)   # each run succeeds or fails on its own
            print(f"runs finished in {time.time() - t0:.0f} s")
            print(summary_line({**total, "skipped": total["skipped"] + len(done)}),
                  file=sys.stderr if total["failed"] else sys.stdout, flush=True)
            failed = total["failed"]
        out_root = Path(os.environ.get("FEDBENCH_OUTPUTS", "outputs"))
        path = collect(args.overrides, out_root, Path("results") / "tables", args.metric, suffix=args.name)
        print(f"table written: {path}")
        from fedbench.report.figures import plot_table
        suffix = table_suffix(args.overrides, args.name)   # the figure is named as its table
        try:
            print(f"figure written: {plot_table(args.overrides, out_root, Path('results') / 'figures', suffix=suffix)}")
        except FedbenchError as e:
            print(f"no figure: {e}")
        from fedbench.report.figures import plot_preset_figures
        try:   # the preset's named plots (table.plots: FOLA Figs. 3-9)
            for p in plot_preset_figures(args.overrides, out_root, Path("results") / "figures", suffix=suffix):
                print(f"figure written: {p}")
        except FedbenchError as e:
            print(f"no figure: {e}")
    except FedbenchError as e:
        print(f"fedbench: error: {e}", file=sys.stderr)
        return 2
    return 1 if failed else 0   # the table is still written from the runs that finished


def dry_run_study(overrides) -> int:
    """``--dry-run`` of a study preset (FedFisher Table 6, FOLA Figs. 10-12): its runs done and to do."""
    from pathlib import Path

    from fedbench.report.studies import study_runs

    out_root = Path(os.environ.get("FEDBENCH_OUTPUTS", "outputs"))
    runs = study_runs(overrides, out_root if out_root.is_absolute() else Path(os.getcwd()) / out_root)
    done = sum(r["record"] is not None for r in runs)
    print(f"dry run: {done}/{len(runs)} study run(s) done, {len(runs) - done} to do")
    return 0


def dry_run(overrides) -> int:
    """``--dry-run``: the plan of a reproduce call, one line, nothing trained or written."""
    from fedbench.config.tuning import tuning_on
    from fedbench.launch.sweep import plan

    if tuning_on(overrides):
        from fedbench.launch.tuning import tuning_plan
        p = tuning_plan(overrides, os.getcwd())
        print(f"dry run: tuning {p['selection_done']}/{p['selection_runs']} selection run(s) done, "
              f"{p['tasks_done']}/{p['tasks']} (cell, method) task(s) finished")
        return 0
    todo, done = plan(overrides, os.getcwd())
    print(f"dry run: {len(done)}/{len(todo) + len(done)} run(s) done, {len(todo)} to do")
    return 0


def regenerate_all() -> int:
    """`make tables`: every committed collection, from the committed records (and any local ones), no training."""
    from pathlib import Path

    from fedbench.papers import load_papers
    from fedbench.report.figures import plot_table
    from fedbench.report.tables import COLLECTIONS, collect, read_collections, runs_read_once

    load_papers()   # the papers' row keys, labels, plots and studies, which the report reads
    out_root = Path(os.environ.get("FEDBENCH_OUTPUTS", "outputs"))
    unpublished: list = []   # finished records read from out_root that results/records lacks
    try:
        with runs_read_once():   # the tables, their figures and the scoreboard read the same sweeps
            entries = read_collections(Path("results") / COLLECTIONS)
            for e in entries:
                ovs = list(e["overrides"])
                path = collect(ovs, out_root, Path("results") / "tables", e.get("metric"), suffix=e.get("suffix"),
                               publish=False, unpublished=unpublished)
                print(f"table written: {path}")
                try:
                    print(f"figure written: {plot_table(ovs, out_root, Path('results') / 'figures', suffix=e.get('suffix'))}")
                except FedbenchError:
                    pass
            from fedbench.report.studies import redraw_committed_studies
            for path in redraw_committed_studies(out_root, Path("results") / "figures"):
                print(f"figure written: {path}")
            from fedbench.report.scoreboard import write_scoreboard
            print(f"scoreboard written: {write_scoreboard(Path('results'), out_root)}")
        if unpublished:
            # the tables count them, a fresh clone's would not (and tests/test_scoreboard.py fails on the difference)
            print(f"fedbench: WARNING: these tables read {len(set(unpublished))} finished record(s) from {out_root} "
                  "that results/records/ lacks; publish them first (bash scripts/campaign.sh --collect <step>, or "
                  "scripts/reproduce.py --collect-only <the table's overrides>), or a fresh clone's tables differ",
                  file=sys.stderr)
    except FedbenchError as e:
        print(f"fedbench: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
