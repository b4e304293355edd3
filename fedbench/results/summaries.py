"""Per-run summaries of a metric's history that the papers report.

* mean / max over the last k evaluated rounds (FedLap Tables 1/4: mean of the last 3; Table 2: max);
* first round whose value reaches a threshold (FedLap Table 3, FOLA Table II; None = never);
* the value a table cell reads from a run record (``record_value``: a metric, a summary, or the min / max / mean
  over a family of metrics such as FedBEns' per-component accuracies, Table 8);
* the same summaries as they stood at an earlier round (``summary.last3_max_accuracy@10``), from the run's history
  (``history_value``: FedLap App. E.5 prints the mean and the max of the last 3 rounds at rounds 10 / 25 / 50).
"""
from __future__ import annotations

import fnmatch
import math
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple
from fedbench.errors import FedbenchError


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


def last_k_at(history, at: int, metric: str = "accuracy", k: int = 3, how: str = "mean") -> Optional[float]:
    """``last_k`` as it stood at round ``at`` (over the rounds up to it); None when the history does not reach it."""
    upto = [h for h in history if int(h["round"]) <= at]
    return last_k(upto, metric, k, how) if upto and int(upto[-1]["round"]) == at else None


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


# --- what a table cell reads from one run record (a preset's ``table.columns[*].value``) ----------------------
# ``metrics.<key>`` (final-round metrics), ``summary.<key>`` (the summaries above), a bare ``<key>`` (= metrics),
# or ``min|max|mean|sum(<section>.<glob>)`` over every key matching the glob (FedBEns' ``component*_accuracy``;
# the cost tables' ``sum(timing.client_*_compute_s)``); sections also ``timing`` and ``communication``.
_SOURCE = re.compile(r"^(?:(min|max|mean|sum)\((.+)\)|(.+))$")
SECTIONS = ("metrics", "summary", "timing", "communication")   # timing / communication: the cost tables


def parse_source(text: str) -> Tuple[Optional[str], str, str]:
    """``'max(metrics.component*_accuracy)'`` -> ``('max', 'metrics', 'component*_accuracy')``."""

    m = _SOURCE.match(str(text).strip())
    how, body = (m.group(1), m.group(2)) if m and m.group(1) else (None, m.group(3) if m else "")
    section, dot, key = body.partition(".")   # only the first dot: 'first_round_accuracy_ge_97.5' keeps its own
    if not dot or section not in SECTIONS:
        section, key = "metrics", body
    if not key or any(c in key for c in "() \t"):
        raise FedbenchError(f"table column value {text!r}: expected metrics.<key>, summary.<key> or "
                            f"min|max|mean|sum(<section>.<glob>)")
    if how is None and any(c in key for c in "*?["):
        raise FedbenchError(f"table column value {text!r}: a glob needs min(...), max(...), mean(...) or sum(...)")
    return how, section, key


def _number(v) -> Optional[float]:
    if v is None or isinstance(v, bool):
        return None
    try:
        v = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) else v


_FIRST_ROUND = re.compile(r"^first_round_([A-Za-z0-9]+(?:_[A-Za-z0-9]+)*?)_ge_([0-9.eE+-]+)$")
_LAST_K_AT = re.compile(r"^last([1-9][0-9]*)_(mean|max)_([A-Za-z0-9_]+)@([1-9][0-9]*)$")


def history_value(history, source: str) -> Tuple[Optional[float], str]:
    """(value, state) of a summary that the run did not record, from its round history:

    * ``summary.first_round_<metric>_ge_<t>`` (its ``eval.thresholds`` did not list t): the same
      ``first_round_reaching`` the run would have stored. So a rounds-to-accuracy table reads the runs of an
      accuracy table with the same settings (FedLap Table 3 from Table 1's): ``eval.thresholds`` is part of the run
      identity.
    * ``summary.last<k>_<mean|max>_<metric>@<r>``: the last-k summary as it stood at round r, over the rounds up to
      r; "absent" when the history does not reach round r (a shorter run has no such cell).

    ("absent" for any other source.)"""
    how, section, key = parse_source(source)
    if how is not None or section != "summary" or not history:
        return None, "absent"
    m = _LAST_K_AT.match(key)
    if m:
        k, agg, metric, at = int(m.group(1)), m.group(2), m.group(3), int(m.group(4))
        v = last_k_at(history, at, metric, k, agg) if metric in history[0] else None
        return (v, "value") if v is not None else (None, "absent")
    m = _FIRST_ROUND.match(key)
    if not m:
        return None, "absent"
    metric, t = m.group(1), float(m.group(2))
    if metric not in history[0]:
        return None, "absent"
    r = first_round_reaching(history, t, metric)
    return (float(r), "value") if r is not None else (None, "null")


def record_value(record: Mapping[str, Any], source: str) -> Tuple[Optional[float], str]:
    """(value, state) of ``source`` in a run record; state is ``value``, ``null`` (the key exists without a
    number: for ``first_round_*`` summaries, the threshold was never reached) or ``absent``."""
    how, section, key = parse_source(source)
    data = record.get(section) or {}
    if how is None:
        if key not in data:
            return None, "absent"
        v = _number(data[key])
        return (v, "value") if v is not None else (None, "null")
    vals = [x for k, v in data.items() if fnmatch.fnmatchcase(k, key) for x in [_number(v)] if x is not None]
    if not vals:
        return None, "absent"
    return {"min": min, "max": max, "mean": lambda s: sum(s) / len(s), "sum": sum}[how](vals), "value"
