"""Typed preset specs checked before any training: a preset's ``table.figure`` (drawn by
fedbench.report.figures). One-line FedbenchError for a bad declaration."""
from __future__ import annotations

from typing import Any, Dict

from fedbench.errors import FedbenchError

FIGURE_KINDS = ("rounds", "sweep")
_FIGURE_FIELDS = ("kind", "x", "lines", "metric", "log_x", "log_y", "reference")
_REFERENCE_FIELDS = ("table", "where", "x", "metric")


def figure_spec(meta: Dict[str, Any]) -> Dict[str, Any]:
    """The preset's ``table.figure`` with defaults, checked with one-line errors."""
    fig = meta.get("figure") or {}
    name = f"preset {meta.get('paper')}/{meta.get('id')}: table.figure"
    if not isinstance(fig, dict):
        raise FedbenchError(f"{name} must be a mapping with kind: {' | '.join(FIGURE_KINDS)}")
    extra = set(fig) - set(_FIGURE_FIELDS)
    if extra:
        raise FedbenchError(f"{name}: unknown field(s) {', '.join(sorted(extra))} (allowed: {', '.join(_FIGURE_FIELDS)})")
    spec = {"kind": fig.get("kind", "rounds"), "x": fig.get("x"), "lines": list(fig.get("lines") or []),
            "metric": fig.get("metric"), "log_x": fig.get("log_x", "auto"), "log_y": fig.get("log_y", False),
            "reference": list(fig.get("reference") or [])}
    if spec["kind"] not in FIGURE_KINDS:
        raise FedbenchError(f"{name}.kind must be one of {', '.join(FIGURE_KINDS)}, got {spec['kind']!r}")
    if spec["log_x"] not in ("auto", True, False):
        raise FedbenchError(f"{name}.log_x must be auto, true or false, got {spec['log_x']!r}")
    if spec["log_y"] not in (True, False):
        raise FedbenchError(f"{name}.log_y must be true or false, got {spec['log_y']!r}")
    rows = [k for k in (meta.get("rows") or ["dataset", "partition"]) if k != "rounds"]
    if spec["kind"] == "sweep":
        if spec["x"] not in rows:
            raise FedbenchError(f"{name}.x must be one of the table's row keys ({', '.join(rows)}), got {spec['x']!r}")
        bad = [k for k in spec["lines"] if k not in rows or k == spec["x"]]
        if bad:
            raise FedbenchError(f"{name}.lines must be row keys other than x, got {', '.join(map(str, bad))}")
        if meta.get("columns") or meta.get("at_rounds"):
            raise FedbenchError(f"{name}: a sweep figure reads one metric per run (no table.columns / at_rounds)")
    for ref in spec["reference"]:
        if not isinstance(ref, dict) or "/" not in str(ref.get("table", "")) or set(ref) - set(_REFERENCE_FIELDS):
            raise FedbenchError(f"{name}.reference entries are {{table: <paper>/<table>, where: {{...}}, x: <value>, "
                                f"metric: ...}}, got {ref!r}")
    return spec
