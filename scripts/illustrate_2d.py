#!/usr/bin/env python
"""The papers' 2-D aggregation illustrations (fedbench.papers.gaussian_2d), as PNGs under results/figures/:

    python scripts/illustrate_2d.py                       # all three
    python scripts/illustrate_2d.py --only fedlpa6 --out /tmp/figs

fedlpa_figure6.png (FedLPA vs Fisher diagonal vs FedAvg), fola_figure2.png (ridge vs valley),
fedbens_figure1.png (a bimodal client; single Laplace vs FedBEns' mixture product). Analytic, seconds on a CPU.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fedbench.papers import gaussian_2d_figures as figs  # noqa: E402

FIGURES = {"fedlpa6": ("fedlpa_figure6.png", figs.figure_fedlpa6),
           "fola2": ("fola_figure2.png", figs.figure_fola2),
           "fedbens1": ("fedbens_figure1.png", figs.figure_fedbens1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/figures", help="output folder")
    ap.add_argument("--only", nargs="+", choices=sorted(FIGURES), help="draw only these")
    args = ap.parse_args(argv)
    for key in args.only or FIGURES:
        name, draw = FIGURES[key]
        path = Path(args.out) / name
        numbers = draw(path)
        shown = ", ".join(f"{k}={np.round(v, 3).tolist()}" for k, v in numbers.items())
        print(f"{path} ({path.stat().st_size // 1024} KB): {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
