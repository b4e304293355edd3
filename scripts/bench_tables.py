#!/usr/bin/env python
"""Planning a table's runs: composing and resolving every run on its own vs fedbench's shared plans.

    python scripts/bench_tables.py                       # FedLap Table 1, FedLPA Table 6, FOLA Fig. 3, from results/records
    python scripts/bench_tables.py --collections fedbens_table1 --rounds 3

A table reads every run of its sweep: each run's config (Hydra composition, one config per aggregator) and its
resolved config and run id. Two measurements, in CPU seconds (``time.process_time``), best of ``--rounds``:

1. first read, plain: every run composed (``compose_run`` + ``expand_runs``) and resolved in full
   (``OmegaConf.to_container``), vs shared (``fedbench.report.plans``): runs that differ only in values share one
   composition and ``applied`` sets the values in place; a shared config is resolved in full once and then only its
   value keys and the interpolations that read them are read again. Both must give the same run ids in the same order.
2. second read in one process (`make tables`, then the scoreboard): ``table_runs`` again with each run's resolution
   found in the cache, vs with the caches emptied. Both must give identical rows.

Prints seconds and ratios; never a pass/fail. Compare on the same machine.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--collections", nargs="+", default=["fedlap_table1", "fedlpa_table6", "fola_figure3_reduced"],
                    help="names in results/collections.yaml")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    os.environ.setdefault("FEDBENCH_RECORDS", str(ROOT / "results" / "records"))

    from omegaconf import OmegaConf

    from fedbench.config import CONF_DIR
    from fedbench.launch.sweep import expand_sweep
    from fedbench.papers import load_papers
    from fedbench.report import plans, tables
    from fedbench.results.records import compute_run_id

    load_papers()   # the papers' row keys and labels

    entries = {e["name"]: e for e in tables.read_collections(ROOT / "results" / tables.COLLECTIONS)}
    unknown = [n for n in args.collections if n not in entries]
    if unknown:
        raise SystemExit(f"error: not in results/collections.yaml: {', '.join(unknown)}")
    sweeps = [list(entries[n]["overrides"]) for n in args.collections]
    no_outputs = ROOT / "outputs" / "bench_tables_none"   # read from the committed records only

    def forget():
        plans.sweep_configs.cache_clear()
        plans._RESOLVED.clear()
        plans._TEMPLATES.clear()

    def plan_plain():
        ids = []
        for o in sweeps:
            for e in plans._compose_sweep(expand_sweep(o, CONF_DIR), CONF_DIR, reuse=False):
                ids += [compute_run_id(OmegaConf.to_container(s, resolve=True)) for s in e.subs]
        return ids

    def plan_shared():
        ids = []
        for o in sweeps:
            for e in plans.sweep_configs(tuple(o), CONF_DIR):
                with plans.applied(e) as (_, subs):
                    ids += [plans.resolved_run(s, shared=True)[1] for s in subs]
        return ids

    def timed(fn):
        t = time.process_time()
        out = fn()
        return time.process_time() - t, out

    first = {"plain": [], "shared": []}
    for _ in range(args.rounds):
        forget()
        s, plain_ids = timed(plan_plain)
        first["plain"].append(s)
        forget()
        s, shared_ids = timed(plan_shared)
        first["shared"].append(s)
        if plain_ids != shared_ids:
            raise SystemExit("the shared plans give other run ids than composing every run")

    forget()
    _, reference = timed(lambda: [tables.table_runs(o, no_outputs) for o in sweeps])
    second = {"resolved again": [], "cached": []}
    for _ in range(args.rounds):
        for name in second:
            if name == "resolved again":
                plans._RESOLVED.clear()
                plans._TEMPLATES.clear()
            s, frames = timed(lambda: [tables.table_runs(o, no_outputs) for o in sweeps])
            second[name].append(s)
            if any(not a.equals(b) for a, b in zip(frames, reference)):
                raise SystemExit(f"the second read ({name}) differs from the first")

    best = {k: min(v) for k, v in {**first, **second}.items()}
    print(f"{', '.join(args.collections)}: {len(plain_ids)} runs (one per aggregator); CPU s, best of {args.rounds}")
    print(f"first read:  plain {best['plain']:.2f}   shared {best['shared']:.2f}   "
          f"ratio {best['plain'] / best['shared']:.1f}x (same run ids)")
    print(f"second read: resolved again {best['resolved again']:.2f}   cached {best['cached']:.2f}   "
          f"ratio {best['resolved again'] / best['cached']:.1f}x (identical rows)")


if __name__ == "__main__":
    main()
