"""The five papers' reported numbers, transcribed from the engineering notes (results/reference/).

One CSV per paper table, ``results/reference/<paper>_<table>.csv``, in long form: one row per table cell,
with the table's row/column keys as columns (``dataset``, ``partition``, ``num_clients``, ...), then
``method``, ``method_label``, ``metric`` (``threshold`` where needed), ``mean``, ``std``, ``raw`` (the cell as
the note gives it) and ``note``. Cells lost in the source stay in the file with an empty ``mean``.
The format is described in results/reference/README.md.

``load_reference`` returns ``mean``/``std`` (and ``delta_vs_feddyn``) as floats (NaN when absent); a key
column whose values are all integers (``num_clients``, ``local_epochs``, ``rounds``, ...) as nullable
``Int64``; every other column as text with missing values as NA. Text keys keep the paper's spelling
(``beta=1.0``, ``alpha=0.1``, ``lambda`` = ``0.001``), so ``astype(str)`` compares them with run configs.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import List, Tuple

import pandas as pd

from fedbench.errors import FedbenchError

REFERENCE_DIR = Path(__file__).resolve().parents[2] / "results" / "reference"

PAPERS = ("fedlpa", "fola", "fedfisher", "fedbens", "fedlap")
REQUIRED_COLUMNS = ("paper", "table", "method", "method_label", "metric", "mean", "std", "raw", "note")
FLOAT_COLUMNS = ("mean", "std", "delta_vs_feddyn")
_INT = re.compile(r"-?\d+")


def available_tables() -> List[Tuple[str, str]]:
    """(paper, table) for every CSV in REFERENCE_DIR, sorted by paper then table number."""
    out = []
    for p in REFERENCE_DIR.glob("*.csv"):
        paper, sep, table = p.stem.partition("_")
        if sep and paper in PAPERS:
            out.append((paper, table))

    def order(pt):
        nums = re.findall(r"\d+", pt[1])
        return (PAPERS.index(pt[0]), not pt[1].startswith("table"), int(nums[0]) if nums else 0, pt[1])

    return sorted(out, key=order)


def load_reference(paper: str, table: str) -> pd.DataFrame:
    """The transcribed cells of one paper table (see the module docstring for the dtypes)."""
    paper, table = str(paper).strip().lower(), str(table).strip()
    table = table if table.startswith(("table", "app")) else f"table{table}"
    path = REFERENCE_DIR / f"{paper}_{table}.csv"
    if not path.is_file():
        avail = ", ".join(f"{p}/{t}" for p, t in available_tables()) or "none"
        raise FedbenchError(f"no reference table {paper}/{table} in {REFERENCE_DIR}; available: {avail}")
    df = pd.read_csv(path, dtype=str, keep_default_na=False)
    for col in df.columns:
        s = df[col]
        if col in FLOAT_COLUMNS:
            df[col] = pd.to_numeric(s.where(s != "", None), errors="raise").astype(float)
            continue
        present = s[s != ""]
        if col not in ("raw", "note", "method_label") and len(present) and present.map(
                lambda v: bool(_INT.fullmatch(v))).all():
            df[col] = pd.array([int(v) if v != "" else pd.NA for v in s], dtype="Int64")
        else:
            df[col] = pd.Series([v if v != "" else pd.NA for v in s], index=df.index, dtype="object")
    df.attrs["paper"], df.attrs["table"], df.attrs["path"] = paper, table, str(path)
    return df
