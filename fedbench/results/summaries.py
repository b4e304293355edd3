"""Per-run summaries of a metric's history that the papers report.

* mean / max over the last k evaluated rounds (FedLap Tables 1/4: mean of the last 3; Table 2: max);
* first round whose value reaches a threshold (FedLap Table 3, FOLA Table II; None = never).
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Sequence


def _series(history: Sequence[Mapping[str, Any]], metric: str) -> List[tuple]:
    out = []
    for row in history:
        v = row.get(metric)
        if v is not None and not (isinstance(v, float) and math.isnan(v)):
            out.append((int(row["round"]), float(v)))
    return out


def last_k(history, metric: str = "accuracy", k: int = 3, how: str = "mean") -> Optional[float]:
    s = [v for _, v in _series(history, metric)][-k:]
    if not s:
        return None
    return sum(s) / len(s) if how == "mean" else max(s)


def first_round_reaching(history, threshold: float, metric: str = "accuracy") -> Optional[int]:
    for r, v in _series(history, metric):
        if v >= threshold:
            return r
    return None


def summarize(history, *, metric: str = "accuracy", last: int = 3, thresholds: Sequence[float] = ()) -> Dict[str, Any]:
    out: Dict[str, Any] = {
        f"last{last}_mean_{metric}": last_k(history, metric, last, "mean"),
        f"last{last}_max_{metric}": last_k(history, metric, last, "max"),
    }
    for t in thresholds:
        out[f"first_round_{metric}_ge_{t:g}"] = first_round_reaching(history, t, metric)
    return out
