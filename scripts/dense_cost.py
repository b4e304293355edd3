#!/usr/bin/env python
"""What a full DENSE run would cost, from a reduced run's server trace (trace.csv beside its record).

    python scripts/dense_cost.py outputs/runs/<run_id> --epochs 200

Prints the measured seconds of the reduced run and the extrapolated seconds of ``--epochs`` epochs (synthesis
constant per epoch, KD linear in the pool size: fedbench.algorithms.dense.extrapolate_cost), on the same machine.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fedbench.algorithms.dense import extrapolate_cost  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path, help="a DENSE run's folder (metrics.json + trace.csv)")
    ap.add_argument("--epochs", type=int, default=None,
                    help="the full run's epochs: 200 for FedLPA's DENSE (dense), 20 for FedFisher/FedBEns' (dense_fedfisher)")
    a = ap.parse_args(argv)
    trace_path = a.run_dir / "trace.csv"
    if not trace_path.is_file():
        print(f"fedbench: error: no trace.csv in {a.run_dir} (is it a DENSE run that finished?)", file=sys.stderr)
        return 2
    if a.epochs is None or a.epochs < 1:
        print("fedbench: error: give the full run's epochs with --epochs N (N >= 1)", file=sys.stderr)
        return 2
    with open(trace_path, newline="") as f:
        rows = list(csv.DictReader(f))
    need = {"pool", "synthesis_s", "kd_s"}
    if not rows or not need <= set(rows[0]):
        print(f"fedbench: error: {trace_path} is not a DENSE trace (needs rows with {', '.join(sorted(need))})",
              file=sys.stderr)
        return 2
    rec_path = a.run_dir / "metrics.json"
    server_s = json.loads(rec_path.read_text())["timing"]["server_s"] if rec_path.is_file() else float("nan")
    est = extrapolate_cost(rows, a.epochs)
    n = int(est["epochs_measured"])
    print(f"reduced: {n} epochs, {est['measured_s']:.1f} s in synthesis + KD (record's server_s {server_s:.1f} s)")
    print(f"  synthesis {est['synthesis_s_per_epoch']:.1f} s/epoch, KD {1e3 * est['kd_s_per_image']:.3f} ms/image")
    print(f"full:    {a.epochs} epochs, ~{est['total_s']:.0f} s (synthesis {est['synthesis_s']:.0f} s + KD {est['kd_s']:.0f} s)"
          f" = {est['total_s'] / max(est['measured_s'], 1e-9):.1f}x the reduced run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
