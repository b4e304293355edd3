#!/usr/bin/env python
"""Reading a table a second time in one process: resolving every run again vs fedbench's resolved-run cache.

    python scripts/bench_tables.py                       # FedLap Table 1 and FedLPA Table 6 (MNIST), from results/records
    python scripts/bench_tables.py --collections fedbens_table1 --rounds 5

`make tables` writes each committed table and then the scoreboard reads every table's runs again (``table_runs``).
Both reads share one composition per sweep (``sweep_configs``); the second read also finds each run's resolved
config and run id in ``fedbench.report.tables.resolved_run``'s cache instead of resolving it again. Each round
times the second read, in CPU seconds (``time.process_time``), once with the cache as the first read left it and
once with it emptied; both must give identical rows. Prints CPU seconds per read and the ratio; never a pass/fail.
Compare on the same machine.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--collections", nargs="+", default=["fedlap_table1", "fedlpa_table6"],
                    help="names in results/collections.yaml")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault("FEDBENCH_RECORDS", str(ROOT / "results" / "records"))

    from fedbench.papers import load_papers
    from fedbench.report import tables

    load_papers()   # the papers' row keys and labels

    entries = {e["name"]: e for e in tables.read_collections(ROOT / "results" / tables.COLLECTIONS)}
    unknown = [n for n in args.collections if n not in entries]
    if unknown:
        raise SystemExit(f"error: not in results/collections.yaml: {', '.join(unknown)}")
    sweeps = [list(entries[n]["overrides"]) for n in args.collections]
    no_outputs = ROOT / "outputs" / "bench_tables_none"   # read from the committed records only

    def read_all():
        t = time.process_time()
        frames = [tables.table_runs(o, no_outputs) for o in sweeps]
        return time.process_time() - t, frames

    first, reference = read_all()   # composes and resolves every run once
    secs = {"resolved again": [], "cached": []}
    for _ in range(args.rounds):
        for name in secs:
            if name == "resolved again":
                tables._RESOLVED.clear()
            s, frames = read_all()
            secs[name].append(s)
            if any(not a.equals(b) for a, b in zip(frames, reference)):
                raise SystemExit(f"the second read ({name}) differs from the first")
    runs = sum(len(f) for f in reference)
    per = {k: min(v) for k, v in secs.items()}
    print(f"{', '.join(args.collections)}: {runs} rows; first read (compose + resolve) {first:.2f} CPU s")
    print(f"second read, best of {args.rounds} rounds, CPU s:")
    print(f"  resolved again   {per['resolved again']:.2f}")
    print(f"  cached           {per['cached']:.2f}")
    print(f"  ratio: {per['resolved again'] / per['cached']:.2f}x (identical rows)")


if __name__ == "__main__":
    main()
