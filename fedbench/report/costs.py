"""Cost cells of the papers' cost tables (FedLPA Tables 4/12, FedFisher Table 1, FedBEns Table 4).

A cost column is a ``table.columns`` entry whose ``metric`` is a cost unit of the reference CSVs (``seconds``,
``minutes``, ``mb``) and whose ``value`` reads the record's ``timing.*`` (seconds per run) or ``communication.*``
(bytes per run). Its values are converted to the paper's unit when the runs are read (``to_paper_unit``; with
``per_client: true`` divided by the run's ``num_clients``, as papers that average over clients do), so the
paper's number joins the cell as any other reference number.

Hardware differs, so the absolute costs are never marked ✓/✗: each cell also shows its ratio to the baseline
method's cost in the same row and column (FedAvg unless the preset names ``table.cost_baseline``) with the
paper's own ratio beside it (``attach_ratios``, ``format_cost_cell``).

FedBEns prints its own costs per mixture (``30.9·M``, ``7.2·M²``: the reference's ``scales_with``): its cell
shows our cost divided by M (or M²) beside that coefficient, and the ratios compare the costs at the run's M
(read from the method's ``members=`` label, ``table.label_keys: {fedbens: [members]}``).
"""
from __future__ import annotations

import math
import re
from typing import Any, Dict, Optional

import pandas as pd

from fedbench.errors import FedbenchError
from fedbench.results.summaries import parse_source

# paper unit -> (record section it is read from, factor from the record's unit: seconds or bytes)
UNITS: Dict[str, tuple] = {"seconds": ("timing", 1.0), "minutes": ("timing", 1 / 60), "mb": ("communication", 1e-6)}
SYMBOL = {"seconds": "s", "minutes": "min", "mb": "MB"}   # as the papers' headers write them (MB = 10^6 bytes)


def is_cost(metric: Any) -> bool:
    return isinstance(metric, str) and metric in UNITS


def check_cost_column(col: Dict[str, Any], where: str) -> None:
    """A cost column reads the record section its unit comes from (time from timing.*, MB from communication.*)."""
    metric = col.get("metric", "accuracy")
    if col.get("per_client") and not is_cost(metric):
        raise FedbenchError(f"{where}: {col['name']!r} sets per_client, which only a cost metric "
                            f"({', '.join(UNITS)}) takes")
    if not is_cost(metric):
        return
    section = parse_source(col["value"])[1]
    if section != UNITS[metric][0]:
        raise FedbenchError(f"{where}: {col['name']!r} is in {metric} but reads {col['value']!r}; "
                            f"{metric} is read from {UNITS[metric][0]}.<key>")


def to_paper_unit(value: Optional[float], metric: str, per_client: bool, num_clients: Any) -> Optional[float]:
    """A record's seconds or bytes per run in the paper's unit, per client where the paper averages over clients."""
    if value is None or not is_cost(metric):
        return value
    out = float(value) * UNITS[metric][1]
    if per_client:
        if not num_clients or int(num_clients) <= 0:
            raise FedbenchError(f"per-client cost needs num_clients > 0, got {num_clients!r}")
        out /= int(num_clients)
    return out


def _missing(x) -> bool:
    return x is None or x is pd.NA or (isinstance(x, float) and math.isnan(x))


def mixtures(r: Dict[str, Any]) -> Optional[int]:
    """FedBEns' M of a cell, from its ``members=`` label (``fedbens(members=5)`` or the merged variant)."""
    m = re.search(r"members=(\d+)", f"{r.get('method', '')}{r.get('variant') or ''}")
    return int(m.group(1)) if m else None


def scale_power(r: Dict[str, Any]) -> int:
    """The paper's printed cost is coefficient·M^k: k from the reference's ``scales_with`` (M, M^2), else 0."""
    s = r.get("scales_with")
    if _missing(s) or not str(s).strip():
        return 0
    s = str(s).strip()
    if s == "M":
        return 1
    if s in ("M^2", "M²"):
        return 2
    raise FedbenchError(f"reference scales_with {s!r}: expected M or M^2")


def paper_at_run_scale(r: Dict[str, Any]) -> float:
    """The paper's cost for the cell's run: its number, times M^k where it printed a per-mixture coefficient
    (NaN where M is unknown)."""
    paper = r.get("paper")
    if _missing(paper):
        return math.nan
    k = scale_power(r)
    if k == 0:
        return float(paper)
    m = mixtures(r)
    return float(paper) * m ** k if m else math.nan


def _ratio(x, base) -> float:
    if _missing(x) or _missing(base) or float(base) <= 0:
        return math.nan
    return float(x) / float(base)


def attach_ratios(summary: pd.DataFrame, meta: Dict[str, Any]) -> pd.DataFrame:
    """``ratio`` (ours / the baseline's cost) and ``paper_ratio`` (the paper's / the paper's baseline cost) for
    every cost cell, the baseline taken in the same row keys and column; NaN where either is missing."""
    if summary.empty or "metric" not in summary or not summary["metric"].map(is_cost).any():
        return summary
    base_name = str(meta.get("cost_baseline") or "fedavg")
    keys = [k for k in list(meta.get("rows") or ["dataset", "partition"]) + ["column"] if k in summary]
    out = summary.copy()
    out["ratio"], out["paper_ratio"] = math.nan, math.nan
    out["baseline"] = base_name
    for _, g in out.groupby(keys, sort=False, dropna=False):
        cost = g[g["metric"].map(is_cost)]
        base = cost[cost["method"] == base_name]
        b = base.iloc[0].to_dict() if len(base) else {}
        base_ours = b.get("mean") if b and int(b.get("n") or 0) > 0 else math.nan
        base_paper = paper_at_run_scale(b) if b else math.nan
        for i, r in cost.iterrows():
            rd = r.to_dict()
            out.at[i, "ratio"] = _ratio(rd.get("mean") if int(rd.get("n") or 0) > 0 else math.nan, base_ours)
            out.at[i, "paper_ratio"] = _ratio(paper_at_run_scale(rd), base_paper)
    return out


def _num(x: float) -> str:
    """Costs with 3 significant digits, without exponents: 0.0123, 1.23, 12.3, 123, 1234."""
    x = float(x)
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:#.3g}" if abs(x) < 10 else f"{x:.1f}"


def _ratio_text(x) -> str:
    if _missing(x):
        return "—"
    return f"{x:.2f}×" if abs(x) < 10 else f"{_num(x)}×"   # 1.10×, 12.2×, 164×


def format_cost_cell(r: Dict[str, Any], show_n: bool = True) -> str:
    """``3.10 min (1.30× fedavg; paper 65.0 min, 1.30×)``; FedBEns' per-mixture cells ``32.1·M s (…)``."""
    unit, k = SYMBOL[r["metric"]], scale_power(r)
    per = {0: "", 1: "·M", 2: "·M²"}[k]
    paper = "—" if _missing(r.get("paper")) else f"{_num(r['paper'])}{per} {unit}"
    base = r.get("baseline") or "fedavg"
    pr = _ratio_text(r.get("paper_ratio"))
    n, finished = int(r.get("n") or 0), r.get("finished")
    if n == 0:
        done = int(finished) if not _missing(finished) else 0
        ours = f"not run (0/{int(r.get('planned') or 0)})" if done == 0 else f"no value ({done} finished)"
        return f"{ours} (paper {paper}, {pr})"
    m = mixtures(r)
    if k and not m:
        ours = f"{_num(r['mean'])} {unit} (M unknown)"
    else:
        ours = f"{_num(r['mean'] / (m ** k if k else 1))}{per} {unit}"
    ours += f" (n={n})" if show_n and n > 1 else ""
    return f"{ours} ({_ratio_text(r.get('ratio'))} {base}; paper {paper}, {pr})"


def header_note(meta: Dict[str, Any], one_n: Optional[int] = None) -> str:
    """The cost tables' reading guide under the header (``one_n``: the seeds of every cell that ran, if one)."""
    base = meta.get("cost_baseline") or "fedavg"
    seeds = f"**n = {one_n}** seed(s) in every cell that ran" if one_n else "n seeds"
    return (f"Costs: ours in the paper's unit (min = timing seconds / 60, MB = 10^6 bytes; per client where the column "
            f"says so), mean over {seeds}, then its ratio to {base}'s cost in the same row, and the paper's number with "
            f"the paper's own ratio. Hardware differs, so costs get no ✓/✗ and are not scored: compare the ratios side "
            f"by side. `·M`, `·M²`: per-mixture coefficient as the paper prints it (our cost / M^k).")
