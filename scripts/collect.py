#!/usr/bin/env python
"""Collect a preset's run records into results/tables/<paper>_<table>[_<profile>].md (+ _runs.csv), beside
the paper's numbers; no training. Same as `make tables EXP=... PROFILE=...`.

    python scripts/collect.py experiment=fedfisher/table2 profile=paper dataset=fmnist
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from scripts.reproduce import main as reproduce_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(reproduce_main(["--collect-only", *sys.argv[1:]]))
