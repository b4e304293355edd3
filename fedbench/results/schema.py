"""The record schema, declared once: ``RoundLog`` is one round of a run (a row of ``history.csv``); the history
columns, the fields that are not metrics, and the record's ``communication`` / ``timing`` totals are all derived
from its fields. A new per-round cost is one field here, e.g.

    upload_s: float = cost("timing")   # appears in history.csv, is kept out of ``metrics``, summed into timing

Torch-free: the round loop (fedbench.fl.loop) fills it, the runner writes it, tables and figures read it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Type

# the metrics every record's history has a column for, in this order (a method's extra metrics follow the schema)
STANDARD_METRICS = ("accuracy", "nll", "ece", "mse", "local_accuracy")


def cost(total: Optional[str] = None, default: Any = 0.0):
    """A per-round field that is not a metric; ``total``: the record section its sum goes into
    (``communication`` or ``timing``), None = not summed."""
    return field(default=default, metadata={"total": total})


@dataclass
class RoundLog:
    """One round: the evaluated metrics and what the round cost. Field order = history column order."""

    round: int
    metrics: Dict[str, float]
    train_loss: float = cost(default=float("nan"))
    cached_clients: bool = cost(default=False)
    uplink_bytes: int = cost("communication", 0)
    downlink_bytes: int = cost("communication", 0)
    client_train_s: float = cost("timing")
    client_train_compute_s: float = cost("timing")   # what training these clients cost when it ran (also when
                                                     # loaded from the cache)
    client_post_s: float = cost("timing")            # client work after training (curvature, compression)
    client_post_compute_s: float = cost("timing")    # client_post_s plus what the per-client products served from
                                                     # the cache (curvature, Gram matrices, ...) cost when computed
    server_s: float = cost("timing")
    eval_s: float = cost("timing")

    def row(self) -> Dict[str, Any]:
        """The round's history row: round, its metrics, then every cost field."""
        return {"round": self.round, **self.metrics, **{f.name: getattr(self, f.name) for f in cost_fields(type(self))}}


def cost_fields(schema: Type[RoundLog] = RoundLog) -> List:
    return [f for f in fields(schema) if f.name not in ("round", "metrics")]


def history_columns(schema: Type[RoundLog] = RoundLog) -> Tuple[str, ...]:
    """The fixed leading columns of history.csv (a method's extra metrics are appended after them)."""
    return ("round",) + STANDARD_METRICS + tuple(f.name for f in cost_fields(schema))


def non_metrics(schema: Type[RoundLog] = RoundLog) -> frozenset:
    """History columns that are not metrics (kept out of a record's ``metrics``)."""
    return frozenset(("round",) + tuple(f.name for f in cost_fields(schema)))


def totals(history: Sequence[Mapping[str, Any]], schema: Type[RoundLog] = RoundLog) -> Dict[str, Dict[str, Any]]:
    """``{"communication": {...}, "timing": {...}}``: every summed cost field over the rows of ``history``."""
    out: Dict[str, Dict[str, Any]] = {}
    for f in cost_fields(schema):
        section = f.metadata.get("total")
        if section is not None:
            out.setdefault(section, {})[f.name] = sum(h[f.name] for h in history)
    return out


def final_metrics(history: Sequence[Mapping[str, Any]], schema: Type[RoundLog] = RoundLog) -> Dict[str, Any]:
    """The last row's metrics: a record's ``metrics``."""
    final = history[-1] if history else {}
    skip = non_metrics(schema)
    return {k: v for k, v in final.items() if k not in skip}


HISTORY_COLUMNS = history_columns()
