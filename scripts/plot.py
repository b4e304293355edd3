#!/usr/bin/env python
"""Draw a preset's figure from its run records (paper numbers as x markers): accuracy over rounds, or a
metric against a swept setting for presets with ``table.figure.kind: sweep`` (FedBEns Figs. 2-5, FedFisher Fig. 1).

    python scripts/plot.py experiment=fedlap/table1 profile=paper dataset=uci_credit
    python scripts/plot.py experiment=fedlap/table1 profile=quick --metric nll
    python scripts/plot.py experiment=fedbens/figure2 profile=quick dataset=fmnist

Writes results/figures/<paper>_<table>[_<profile>]_<metric>.png.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fedbench.errors import FedbenchError  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--metric", default=None, help="accuracy, nll, ece, local_accuracy, ... (default: the preset's "
                    "table.figure.metric, else accuracy)")
    ap.add_argument("--out", default=str(Path("results") / "figures"))
    args = ap.parse_args(argv)
    try:
        from fedbench.config.preflight import check_script_overrides
        check_script_overrides(args.overrides)   # bad overrides: one line, before pandas or torch is imported
    except FedbenchError as e:
        print(f"fedbench: error: {e}", file=sys.stderr)
        return 2
    from fedbench.papers import load_papers
    from fedbench.report.figures import plot_preset_figures, plot_table

    load_papers()   # the papers' plot kinds and row keys, which the report reads
    try:   # presets naming their plots (table.plots: FOLA Figs. 3-12) get those instead
        named = plot_preset_figures(args.overrides, Path(os.environ.get("FEDBENCH_OUTPUTS", "outputs")), Path(args.out))
    except FedbenchError as e:
        print(f"fedbench: error: {e}", file=sys.stderr)
        return 2
    for p in named:
        print(f"figure written: {p}")
    if named:
        return 0
    try:
        path = plot_table(args.overrides, Path(os.environ.get("FEDBENCH_OUTPUTS", "outputs")), Path(args.out),
                          args.metric)
    except FedbenchError as e:
        print(f"fedbench: error: {e}", file=sys.stderr)
        return 2
    print(f"figure written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
