"""A preset's tuning protocol (``table.tuning``), run instead of its fixed picks when ``tuning=on``
(``scripts/reproduce.py experiment=<paper>/<table> tuning=on``). Parsed and validated here, without torch.

    table:
      tuning:
        val_fraction: 0.2     # seeded hold-out of the training data that the selection runs are scored on
        val_seed: 0
        metric: accuracy      # accuracy (higher wins) | nll (lower wins), read at `at_round`
        at_round: null        # null = the selection run's last round
        select: {rounds: 20}  # overrides of the selection runs only (optional), e.g. FOLA's 20-round search
        grids:                # the first block whose `when` matches the cell; per method: override -> values
          - when: {dataset: uci_credit}
            methods:
              fedavg: {local.epochs: [5, 10, 20]}
              fedlap: {local.epochs: [5, 10, 20], hp.delta: [10.0, 1.0, 0.1]}

A grid key ``algorithm.<option>`` sets the method's own option after its aggregator entry is expanded (an entry's
literal value wins over any other override). A method without a grid in the matching block keeps the preset's fixed picks. Ties are broken by the other
metric (NLL for accuracy, accuracy for NLL), then by grid order (the first point wins).
"""
from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

from omegaconf import OmegaConf

from fedbench.config import CONF_DIR
from fedbench.errors import FedbenchError

SWITCH = ("off", "on")
METRICS = ("accuracy", "nll")   # accuracy: higher wins; nll: lower wins
SPEC_KEYS = ("val_fraction", "val_seed", "metric", "at_round", "select", "grids", "note")


@dataclass(frozen=True)
class TuningSpec:
    val_fraction: float
    val_seed: int
    metric: str
    at_round: Optional[int]
    grids: List[Dict[str, Any]]
    select: Dict[str, Any] = field(default_factory=dict)
    note: str = ""

    def protocol(self) -> Dict[str, Any]:
        """What a selection depends on besides its grid (written into records and selection files)."""
        return {"val_fraction": self.val_fraction, "val_seed": self.val_seed, "metric": self.metric,
                "at_round": self.at_round, "select": dict(self.select)}


def _bad(what: str) -> None:
    raise FedbenchError(f"table.tuning: {what}")


def _scalar(v) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def tuned_presets() -> list:
    """The experiment presets that declare a ``table.tuning`` block (named as ``experiment=`` takes them)."""
    root = CONF_DIR / "experiment"
    return sorted(str(f.relative_to(root).with_suffix("")) for f in root.rglob("*.yaml")
                  if "tuning" in (OmegaConf.load(f).get("table") or {}))


def parse_tuning(table: Optional[Mapping]) -> TuningSpec:
    """The preset's ``table.tuning`` as a ``TuningSpec``; any malformed part is one ``FedbenchError`` line."""
    node = (table or {}).get("tuning")
    where = f"{(table or {}).get('paper', '?')}/{(table or {}).get('id', '?')}"
    if node is None:
        raise FedbenchError(f"tuning=on needs a preset with a table.tuning block; {where if table else 'no preset'} "
                            f"has none (presets with one: {', '.join(tuned_presets())})")
    if not isinstance(node, Mapping):
        _bad(f"must be a mapping, got {node!r}")
    unknown = sorted(set(node) - set(SPEC_KEYS))
    if unknown:
        _bad(f"unknown key(s) {', '.join(unknown)}; known: {', '.join(SPEC_KEYS)}")
    frac = node.get("val_fraction", 0.2)
    if not isinstance(frac, (int, float)) or isinstance(frac, bool) or not 0 < frac < 1:
        _bad(f"val_fraction must be a number in (0, 1), got {frac!r}")
    seed = node.get("val_seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        _bad(f"val_seed must be an integer >= 0, got {seed!r}")
    metric = node.get("metric", "accuracy")
    if metric not in METRICS:
        _bad(f"metric must be one of {', '.join(METRICS)}, got {metric!r}")
    at_round = node.get("at_round")
    if at_round is not None and (not isinstance(at_round, int) or isinstance(at_round, bool) or at_round < 1):
        _bad(f"at_round must be null (the last round) or an integer >= 1, got {at_round!r}")
    select = node.get("select") or {}
    if not isinstance(select, Mapping) or not all(isinstance(k, str) and _scalar(v) for k, v in select.items()):
        _bad(f"select must map config keys to single values (overrides of the selection runs), got {select!r}")
    if "tuning_val" in select or any(k.startswith("tuning_val.") for k in select):
        _bad("select must not set tuning_val (use val_fraction / val_seed)")
    return TuningSpec(float(frac), seed, metric, at_round, _parse_grids(node.get("grids")), dict(select),
                      str(node.get("note") or ""))


def _parse_grids(grids) -> List[Dict[str, Any]]:
    if not isinstance(grids, list) or not grids:
        _bad(f"grids must be a non-empty list of {{when: {{...}}, methods: {{<method>: {{<key>: [values]}}}}}}, got {grids!r}")
    out = []
    for i, block in enumerate(grids):
        if not isinstance(block, Mapping) or set(block) - {"when", "methods"} or "methods" not in block:
            _bad(f"grids[{i}] must have 'methods' (and optionally 'when'), got {block!r}")
        when = block.get("when") or {}
        if not isinstance(when, Mapping) or not all(_scalar(v) for v in when.values()):
            _bad(f"grids[{i}].when must map config keys to single values, got {when!r}")
        methods = block["methods"]
        if not isinstance(methods, Mapping) or not methods:
            _bad(f"grids[{i}].methods must map method names to grids, got {methods!r}")
        for name, grid in methods.items():
            _check_grid(f"grids[{i}].methods.{name}", grid)
        out.append({"when": dict(when), "methods": {str(k): dict(v) for k, v in methods.items()}})
    return out


def _check_grid(where: str, grid) -> None:
    if not isinstance(grid, Mapping) or not grid:
        _bad(f"{where} must map config keys to lists of values, got {grid!r}")
    for key, values in grid.items():
        if not isinstance(key, str) or key.split(".", 1)[0] in ("seed", "tuning", "tuning_val", "table"):
            _bad(f"{where}: {key!r} cannot be tuned")
        if not isinstance(values, list) or not values or not all(_scalar(v) for v in values):
            _bad(f"{where}.{key} must be a non-empty list of values, got {values!r}")
        if len({json.dumps(v) for v in values}) != len(values):
            _bad(f"{where}.{key} repeats a value: {values!r}")


def check_switch(c: Mapping) -> None:
    """The top-level ``tuning`` switch and ``tuning_val`` block of a composed config; with ``tuning=on`` the
    preset's spec must parse."""
    sw = c.get("tuning", "off")
    if sw not in SWITCH:
        raise FedbenchError(f"tuning={sw!r} is not allowed: tuning must be one of {', '.join(SWITCH)} "
                            "(on: the preset's table.tuning protocol)")
    tv = c.get("tuning_val")
    if tv is not None:
        frac, seed = (tv or {}).get("fraction"), (tv or {}).get("seed")
        if not isinstance(frac, (int, float)) or isinstance(frac, bool) or not 0 <= frac < 1:
            raise FedbenchError(f"tuning_val.fraction={frac!r} is not allowed: it must be a number in [0, 1)")
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise FedbenchError(f"tuning_val.seed={seed!r} is not allowed: it must be an integer >= 0")
    if sw == "on":
        parse_tuning(c.get("table"))


def tuning_on(overrides) -> bool:
    """Whether the command line switches tuning on (``tuning=on``)."""
    return any(o.lstrip("+").replace(" ", "") == "tuning=on" for o in overrides)


def _cell_value(cell: Mapping, key: str):
    node: Any = cell
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node.get("name") if isinstance(node, Mapping) else node   # a group (dataset: uci_credit) by its name


def _same(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return str(a) == str(b)


def method_grids(spec: TuningSpec, cell: Mapping) -> Dict[str, Dict[str, list]]:
    """The per-method grids of the first block whose ``when`` matches the cell's resolved config ({} if none)."""
    for block in spec.grids:
        if all(_same(_cell_value(cell, k), v) for k, v in block["when"].items()):
            return block["methods"]
    return {}


def grid_points(grid: Mapping[str, list]) -> List[Dict[str, Any]]:
    """The cartesian product of a grid, in declaration order (the last key varies fastest)."""
    keys = list(grid)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


def selection_key(fixed_run_id: str, spec: TuningSpec, grid: Mapping[str, list]) -> str:
    """The name of one selection (one preset cell and method, one protocol and grid)."""
    blob = json.dumps({"protocol": spec.protocol(), "grid": grid}, sort_keys=True, default=str)
    return f"{fixed_run_id}-{hashlib.sha1(blob.encode()).hexdigest()[:8]}"


def _rank(scores: Mapping[str, Optional[float]], metric: str) -> tuple:
    """(metric, the other metric), both signed so that larger is better; a missing or NaN score ranks last."""
    def signed(m):
        v = scores.get(m)
        return float("-inf") if v is None or v != v else (v if m == "accuracy" else -v)
    return signed(metric), signed("nll" if metric == "accuracy" else "accuracy")


def better(a: Mapping[str, Optional[float]], b: Optional[Mapping[str, Optional[float]]], metric: str) -> bool:
    """Whether scores ``a`` ({accuracy, nll}) strictly beat ``b``: the metric first, the other one breaks ties."""
    if _rank(a, metric)[0] == float("-inf"):
        return False
    return b is None or _rank(a, metric) > _rank(b, metric)

