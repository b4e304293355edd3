#!/usr/bin/env python
"""Draw a preset's accuracy-over-rounds figure from its run records (paper numbers as x markers).

    python scripts/plot.py experiment=fedlap/table1 profile=paper dataset=uci_credit
    python scripts/plot.py experiment=fedlap/table1 profile=quick --metric nll

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
    ap.add_argument("--metric", default="accuracy", help="a history column: accuracy, nll, ece, local_accuracy, ...")
    ap.add_argument("--out", default=str(Path("results") / "figures"))
    args = ap.parse_args(argv)
    from fedbench.results.figures import plot_table
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
