"""Collect run records into a paper's table: ours (mean ± std over seeds) beside the paper's number.

A table is defined by its experiment preset: the preset's sweep is expanded into runs, each run's
config gives its row keys (data set, partition label, clients, epochs, ...) and method, and its
run_id finds its record. Records therefore belong to every table whose sweep contains them (FedLPA
Table 3's λ = 0.001 column is Table 1's runs), and cells whose runs are missing are marked.

By default a cell is one metric of the run's final round (``accuracy``, or the preset's ``table.metric``).
A preset can instead declare ``table.columns``: one entry per derived column, each saying what it reads
from a run record (``value``: ``metrics.<key>``, ``summary.<key>``, ``timing|communication.<key>`` or
``min|max|mean|sum(<section>.<glob>)``, see ``fedbench.results.summaries.record_value``; a summary the record lacks,
``first_round_<metric>_ge_<t>`` or ``last<k>_<mean|max>_<metric>@<round>``, is read from the round history), which
reference cells it is compared with (``metric`` and ``keys``, e.g. ``{threshold: 97.5}``), on which rows it
applies (``where``) and whether a null summary means "never reached" (``never``); ``table.layout`` places row
keys, ``method`` and ``column`` on the table's rows or columns as the paper does (FedLap Table 3, FedBEns Table 8,
FOLA Table II). ``table.label_keys`` names algorithm keys that tell variants of one method apart in a figure or
table (FedDyn's weight decay).
"""
from __future__ import annotations

import contextlib
import copy
import json
import math
import re
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import pandas as pd
from omegaconf import OmegaConf

from fedbench.errors import FedbenchError
from fedbench.numerics import is_current
from fedbench.config.specs import figure_spec
from fedbench.config.tuning import tuning_on
from fedbench.report.costs import attach_ratios, check_cost_column, format_cost_cell, header_note, is_cost, to_paper_unit
from fedbench.results.records import (atomic_write_bytes, load_record, publish_record,
                                      is_complete, read_history, records_dir, tuning_store)
from fedbench.results.summaries import history_value, last_k_at, parse_source, record_value
from fedbench.launch.tuning import finished_selection_runs, tuned_config
from fedbench.launch.sweep import compose_run, CONF_DIR, expand_sweep
from fedbench.report.plans import applied, resolved_run, sweep_configs
from fedbench.results.reference import load_reference
from fedbench.report.registry import METHOD_LABELS, PARTITION_LABELS, ROW_KEYS, registered


def partition_label(p: Dict[str, Any]) -> str:
    """The label the papers' tables use for a partition config: NIID-Bench's families here, the others as the
    papers register them (fedbench.report.registry.register_partition_label); a what-if split of IID shards of
    a coarser split's clients says so (``/coarse=M``), since no paper prints such a row."""
    label = _family_label(p)
    return label if p.get("coarse_clients") is None else f"{label}/coarse={p['coarse_clients']}"


def _family_label(p: Dict[str, Any]) -> str:
    name = p.get("name")
    if name == "niid-bench":
        return str(p.get("spec"))
    if name == "noniid-labeldir" or name == "iid-diff-quantity":
        return f"beta={p.get('beta'):g}"
    if str(name).startswith("noniid-#label"):
        return f"#C={p.get('k')}"
    if name == "homo":
        return "homog"
    if name in registered(PARTITION_LABELS):
        return PARTITION_LABELS[name](p)
    return str(name)


def method_label(a: Dict[str, Any]) -> str:
    """A table's name for an algorithm config: ``fedprox(mu=…)``, a variant label a paper registers
    (fedbench.report.registry.register_method_label), else the algorithm's name."""
    name = a.get("name")
    if name == "fedprox":
        return f"fedprox(mu={a.get('mu'):g})"
    variant = METHOD_LABELS[name](a) if name in registered(METHOD_LABELS) else None
    return str(name) if variant is None else variant


KEY_FUNCS: Dict[str, Callable[[Dict[str, Any]], Any]] = {
    "dataset": lambda c: c["dataset"]["name"],
    "partition": lambda c: partition_label(c["partition"]),
    "num_clients": lambda c: c["num_clients"],
    "local_epochs": lambda c: c["local"]["epochs"],
    "rounds": lambda c: c["rounds"],
    "seed": lambda c: c["seed"],
}


def key_funcs() -> Dict[str, Callable[[Dict[str, Any]], Any]]:
    """Every named row key: the generic ones above, then the method-variant axes the papers register
    (results/reference/README.md key columns: FedLPA Table 3's ``lambda``, FedBEns' ``M``, ...)."""
    return {**KEY_FUNCS, **registered(ROW_KEYS)}


def row_value(cfg: Dict[str, Any], key: str):
    funcs = key_funcs()
    if key in funcs:
        return funcs[key](cfg)
    node: Any = cfg
    for part in key.split("."):  # any dotted config path, e.g. algorithm.lam
        node = node.get(part) if isinstance(node, dict) else None
    return node



def norm_key(v) -> str:
    """A key value as text for joins and filters: numbers print the same whatever their type (75, 75.0,
    "75"), missing values (None, NaN, NA) are ""."""
    if v is None or v is pd.NA or isinstance(v, bool):
        return "" if v is None or v is pd.NA else str(v)
    if isinstance(v, float) and math.isnan(v):
        return ""
    try:
        return f"{float(v):g}"
    except (TypeError, ValueError):
        return str(v)


# --- derived columns (table.columns) -------------------------------------------------------------------
_SPEC_FIELDS = ("name", "value", "metric", "keys", "where", "never", "per_client")
_RESERVED = ("method", "algorithm", "seed", "profile", "run_id", "status", "missing_method", "column", "metric",
             "value", "never")


class ColumnSpec:
    """One derived column of a table: what it reads from each run record and how it meets the paper's cells."""

    def __init__(self, name: str, value: str, metric: str = "accuracy", keys: Optional[Dict[str, Any]] = None,
                 where: Optional[Dict[str, Any]] = None, never: bool = False, per_client: bool = False):
        self.name, self.value, self.metric, self.never = str(name), str(value), str(metric), bool(never)
        self.per_client = bool(per_client)   # cost columns: per client, not per run (fedbench.report.costs)
        self.keys = dict(keys or {})
        self.where = {k: [norm_key(x) for x in (v if isinstance(v, (list, tuple)) else [v])]
                      for k, v in (where or {}).items()}

    def applies(self, cfg: Dict[str, Any]) -> bool:
        return all(norm_key(row_value(cfg, k)) in vals for k, vals in self.where.items())


def column_specs(meta: Dict[str, Any]) -> List[ColumnSpec]:
    """The preset's ``table.columns`` (empty: one metric per cell), checked with one-line errors."""
    cols = meta.get("columns") or []
    where = f"preset {meta.get('paper')}/{meta.get('id')}: table.columns"
    if not isinstance(cols, list):
        raise FedbenchError(f"{where} must be a list of {{name, value, ...}} entries")
    if cols and meta.get("at_rounds"):
        raise FedbenchError(f"{where} and table.at_rounds cannot be combined")
    rows = set(meta.get("rows") or ["dataset", "partition"])
    specs, names = [], set()
    for c in cols:
        if not isinstance(c, dict) or "name" not in c or "value" not in c:
            raise FedbenchError(f"{where}: every entry needs a name and a value, got {c!r}")
        extra = set(c) - set(_SPEC_FIELDS)
        if extra:
            raise FedbenchError(f"{where}: unknown field(s) {', '.join(sorted(extra))} in {c['name']!r} "
                                f"(allowed: {', '.join(_SPEC_FIELDS)})")
        if c["name"] in names:
            raise FedbenchError(f"{where}: column name {c['name']!r} is used twice")
        names.add(c["name"])
        parse_source(c["value"])
        check_cost_column(c, where)
        for k in c.get("where") or {}:
            if k not in rows and k not in key_funcs():
                raise FedbenchError(f"{where}: {c['name']!r} filters on {k!r}, which is neither a row key "
                                    f"({', '.join(sorted(rows))}) nor one of {', '.join(key_funcs())}")
        for k in c.get("keys") or {}:
            if k in rows or k in _RESERVED:
                raise FedbenchError(f"{where}: {c['name']!r} key {k!r} clashes with a row key or a reserved column")
        specs.append(ColumnSpec(c["name"], c["value"], c.get("metric", "accuracy"), c.get("keys"), c.get("where"),
                                c.get("never", False), c.get("per_client", False)))
    return specs


def spec_key_names(specs: Sequence[ColumnSpec]) -> List[str]:
    return list(dict.fromkeys(k for s in specs for k in s.keys))


def variant_label(label: str, algo: Dict[str, Any], label_keys: Optional[Dict[str, Any]]) -> str:
    """``feddyn`` -> ``feddyn(weight_decay=1e-05)`` when the preset's ``table.label_keys`` names the key."""
    keys = (label_keys or {}).get(label) or (label_keys or {}).get(algo.get("name"))
    if not keys:
        return label
    return f"{label}({','.join(f'{k}={norm_key(algo.get(k))}' for k in keys)})"


class TableMeta(dict):
    """A table's declaration as ``df.attrs["table"]``. pandas deep-copies ``attrs`` into the result of every
    operation, which took a third of summarising a 2,250-run table; the declaration is read, never changed, so its
    copies are itself."""

    def __deepcopy__(self, memo):
        return self


# (overrides, output root, conf dir, record store) -> table_runs' frame, while a runs_read_once() scope is open
_READ_ONCE: Optional[Dict[tuple, pd.DataFrame]] = None


@contextlib.contextmanager
def runs_read_once() -> Iterator[None]:
    """Within the scope, table_runs reads each table's records once: collecting every committed table and then
    the scoreboard (``make tables``, the committed-tables test) read the same sweeps twice. Only for a scope in
    which no record is written; each call gets its own copy of the frame."""
    global _READ_ONCE
    outer, _READ_ONCE = _READ_ONCE, ({} if _READ_ONCE is None else _READ_ONCE)
    try:
        yield
    finally:
        _READ_ONCE = outer


def table_runs(overrides: Sequence[str], output_root: Path, *, conf_dir: Optional[Path] = None) -> pd.DataFrame:
    """One row per (run of the table's sweep, aggregator): keys, method, run_id, status, metrics.

    With ``table.columns``: one row per (run, aggregator, column that applies) with ``column``, ``metric``,
    the column's keys, ``value`` and ``never`` (a finished run whose summary says the threshold was never reached).
    """
    if _READ_ONCE is None:
        return _read_table_runs(overrides, output_root, conf_dir)
    key = (tuple(overrides), Path(output_root).resolve(), Path(conf_dir or CONF_DIR).resolve(),
           records_dir().resolve(), tuning_store().resolve())
    if key not in _READ_ONCE:
        _READ_ONCE[key] = _read_table_runs(overrides, output_root, conf_dir)
    df = _READ_ONCE[key].copy()
    df.attrs = copy.deepcopy(_READ_ONCE[key].attrs)
    return df


def _read_table_runs(overrides: Sequence[str], output_root: Path, conf_dir: Optional[Path]) -> pd.DataFrame:
    rows = []
    meta = None
    specs: List[ColumnSpec] = []
    for entry in sweep_configs(tuple(overrides), Path(conf_dir or CONF_DIR)):
        with applied(entry) as (cfg, subs):
            if meta is None:
                meta = OmegaConf.to_container(cfg.table, resolve=True) if cfg.get("table") else {}
                specs = column_specs(meta)   # a bad declaration fails before any record is read
            for sub in subs:
                run, chosen, sel_path = tuned_run(sub, cfg, output_root)   # tuning=on: the final run of the selection
                c, rid = resolved_run(run, shared=run is sub)
                rec = load_record(output_root, rid) if chosen != "not tuned yet" else {}
                status = rec.get("status", "missing")
                if status == "ok" and not is_current(rec):   # made by older numerics: never mixed into a cell
                    status = "stale"
                keys = [k for k in (meta.get("rows") or ["dataset", "partition"]) if k != "rounds"]
                row = {k: row_value(c, k) for k in keys}
                row.update({"method": variant_label(method_label(c["algorithm"]), c["algorithm"], meta.get("label_keys")),
                            "algorithm": c["algorithm"]["name"], "_algo": c["algorithm"],
                            "seed": c["seed"], "profile": c.get("profile"), "run_id": rid,
                            "status": status,
                            "missing_method": bool(c["algorithm"].get("_missing")), "record_dir": rec.get("_dir"),
                            "tuning_chosen": chosen, "tuning_selection": sel_path})
                # raw costs (seconds, bytes per run) beside every row: the seed-level CSV, `collect --metric timing.server_s`
                for section in ("timing", "communication"):
                    row.update({f"{section}.{k}": v for k, v in (rec.get(section) or {}).items()})
                if specs:
                    hist = None   # read once, only for a column the record's summary lacks
                    for s in specs:
                        if not s.applies(c):
                            continue
                        val, state = record_value(rec, s.value) if row["status"] == "ok" else (None, "absent")
                        if state == "absent" and row["status"] == "ok":   # a threshold the run did not record
                            if hist is None:
                                hist = read_history(Path(rec["_dir"]) / "history.csv")
                            val, state = history_value(hist, s.value)
                        val = to_paper_unit(val, s.metric, s.per_client, c.get("num_clients"))
                        # table.column_methods (a study measuring several of the paper's methods in one run): the
                        # column is the method, so each joins its own paper row
                        named = {"method": s.name} if meta.get("column_methods") else {}
                        rows.append({**row, **named, "column": s.name, "metric": s.metric, **s.keys, "value": val,
                                     "never": bool(s.never and state == "null")})
                    continue
                at_rounds = meta.get("at_rounds")
                if not at_rounds:
                    row.update(rec.get("metrics") or {})
                    rows.append(row)
                    continue
                # multi-round tables: one row per reported round, summarised from the run's history
                hist = read_history(Path(rec["_dir"]) / "history.csv") if status == "ok" else []
                how = meta.get("summary", "last3_mean")
                k = int(how[4]) if how.startswith("last") else 1
                for r in at_rounds:
                    if r > int(c["rounds"]):
                        continue
                    val = last_k_at(hist, r, "accuracy", k, "max" if how.endswith("max") else "mean")
                    rows.append({**row, "rounds": r, "accuracy": val,
                                 "status": row["status"] if val is not None else "missing"})
    row_keys = [k for k in ((meta or {}).get("rows") or ["dataset", "partition"]) if k != "rounds"]
    df = pd.DataFrame(split_conflated_methods(rows, row_keys))
    df.attrs["table"] = TableMeta(meta or {})
    return df


def tuned_run(sub, cfg, output_root: Path):
    """(run config, its chosen values as text, the selection file) for a table: ``sub``, None, None unless
    ``tuning=on``; then the final run of the selection (fedbench/launch/tuning.py) and e.g. "local.epochs=10,
    hp.delta=1.0" ("fixed picks" for a method without a grid, "not tuned yet" before its selection)."""
    if cfg.get("tuning") != "on" or sub.algorithm.get("_missing"):
        return sub, None, None
    final, sel = tuned_config(sub, cfg, output_root)
    if final is None:
        return sub, "not tuned yet", None
    if not sel:
        return final, "fixed picks", None
    return final, ", ".join(f"{k}={v}" for k, v in sel["chosen"].items()), sel["_path"]


def tuning_footnote(df: pd.DataFrame) -> List[str]:
    """Markdown lines under a ``tuning=on`` table: the chosen values per cell and method (per seed if they differ)."""
    if "tuning_chosen" not in df or df["tuning_chosen"].isna().all():
        return []
    meta = df.attrs.get("table") or {}
    keys = [k for k in (meta.get("rows") or ["dataset", "partition"]) if k != "rounds" and k in df]
    spec = (meta.get("tuning") or {})
    lines = ["", f"**Tuned** (`tuning=on`): per method, the grid point with the best validation {spec.get('metric', 'accuracy')} "
             f"at round {spec.get('at_round') or 'last'} on a {spec.get('val_fraction', 0.2)} hold-out of the training data "
             f"(seed {spec.get('val_seed', 0)}; the test set is never used to choose); the final runs train on all "
             "training data. Chosen values:", ""]
    seen = df.drop_duplicates(subset=keys + ["method", "seed"])
    cells = seen[keys].astype(str).agg(", ".join, axis=1) if keys else pd.Series("", index=seen.index)
    for (cell, method), g in seen.groupby([cells, "method"], sort=False):
        per_seed = "; ".join(f"seed {s}: {v}" for s, v in zip(g["seed"], g["tuning_chosen"]))
        values = set(g["tuning_chosen"])
        lines.append(f"- {cell} — {method}: " + (values.pop() if len(values) == 1 else per_seed))
    return lines


def split_conflated_methods(rows: List[Dict[str, Any]], keys: Sequence[str]) -> List[Dict[str, Any]]:
    """Aggregator entries that share a label and a cell (row keys, seed) but not a configuration, such as
    ``[{name: fedlpa, solver: cg}, fedlpa]``, must not be averaged into one cell: their labels get the keys
    that tell them apart within a cell, ``fedlpa(solver=cg)`` and ``fedlpa(solver=gd)``. Settings that are row
    keys (FedBEns Fig. 4's T) already separate cells and are left alone."""
    def flat(d, prefix=""):
        out = {}
        for k, v in (d or {}).items():
            if str(k).startswith("_"):
                continue
            if isinstance(v, dict):
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = json.dumps(v, sort_keys=True, default=str)
        return out

    cell_keys = [k for k in (*keys, "column", "rounds", "seed") if any(k in r for r in rows)]
    cells: Dict[tuple, Dict[str, Dict[str, str]]] = {}
    for r in rows:
        cell = (r["method"],) + tuple(json.dumps(r.get(k), default=str) for k in cell_keys)
        cells.setdefault(cell, {})[json.dumps(r.get("_algo"), sort_keys=True, default=str)] = flat(r.get("_algo"))
    differ: Dict[str, List[str]] = {}
    for cell, configs in cells.items():
        if len(configs) > 1:
            flats = list(configs.values())
            names = {k for f in flats for k in f}
            found = differ.setdefault(cell[0], [])
            found += [k for k in sorted(names) if len({f.get(k) for f in flats}) > 1 and k not in found]
    for r in rows:
        algo = flat(r.pop("_algo", None))
        label = r["method"]
        if label in differ:
            tag = ",".join(f"{k}={norm_key(json.loads(algo[k])) if k in algo else 'none'}" for k in differ[label])
            r["method"] = f"{label[:-1]},{tag})" if label.endswith(")") else f"{label}({tag})"
    return rows


def complete_seeds(df: pd.DataFrame, group: List[str], cell: List[str]) -> pd.DataFrame:
    """Per ``group``, only the runs of the seeds that ran every ``cell`` of the group (``cell`` includes
    ``group``), while at least one seed has. A best-of selection over a grid must compare means over the same
    seeds: a sweep stopped half-way through a seed would otherwise put two-seed means against one-seed means and
    let a lucky draw win (FOLA Figs. 3-4 pick their best setting so)."""
    if "seed" not in df or df.empty:
        return df
    out = []
    for _, g in df.groupby(group, dropna=False, sort=False):
        n_cells = len(g.drop_duplicates(cell))
        per_seed = g.drop_duplicates(cell + ["seed"]).groupby("seed").size()
        full = per_seed.index[per_seed == n_cells]
        out.append(g[g["seed"].isin(full)] if len(full) else g)
    kept = pd.concat(out, ignore_index=True)
    kept.attrs = dict(df.attrs)
    return kept


def summarise(df: pd.DataFrame, metric: str = "accuracy") -> pd.DataFrame:
    """One row per cell: n (values), finished (ok runs), never (ok runs that never reached a threshold),
    planned (runs of the sweep), mean and sample std over the values."""
    meta = df.attrs.get("table") or {}
    keys = list(meta.get("rows") or ["dataset", "partition"])
    specs = column_specs(meta)
    vcol = "value" if specs else metric
    carry = (["metric"] + spec_key_names(specs)) if specs else []
    group = keys + (["column"] if specs else []) + ["method"]
    groups = []
    if df.empty:
        return pd.DataFrame(groups)
    for key_vals, g in df.groupby(group, sort=False, dropna=False):
        ok = g[g["status"] == "ok"] if "status" in g else g
        vals = pd.to_numeric(ok[vcol], errors="coerce").dropna().astype(float) if vcol in ok else pd.Series(dtype=float)
        never = int(ok["never"].fillna(False).astype(bool).sum()) if "never" in ok else 0
        stale = int((g["status"] == "stale").sum()) if "status" in g else 0
        cell = {**dict(zip(group, key_vals)), **{k: g[k].iloc[0] if k in g else None for k in carry},
                "n": len(vals), "finished": len(ok), "never": never, "planned": len(g), "stale": stale,
                "mean": vals.mean() if len(vals) else math.nan,
                "std": vals.std(ddof=1) if len(vals) > 1 else (0.0 if len(vals) == 1 else math.nan)}
        groups.append(cell)
    return merge_row_variants(pd.DataFrame(groups), keys + (["column"] if specs else []))


def merge_row_variants(summary: pd.DataFrame, keys: List[str]) -> pd.DataFrame:
    """One column per method when a hyperparameter differs only between rows (FedLap Table 1's FedProx μ
    is set per data set): labels ``name(…)`` that never share a row become ``name``, the setting is kept
    in ``variant`` and shown in the cell. Variants that share a row (FedLPA's μ sweep) stay separate columns."""
    if summary.empty:
        return summary
    out = summary.copy()
    out["variant"] = ""
    base = out["method"].str.replace(r"\(.*\)$", "", regex=True)
    for b in base[base != out["method"]].unique():
        sel = base == b
        per_row = out[sel].groupby(keys, sort=False, dropna=False)["method"].nunique()
        if (per_row <= 1).all() and out.loc[sel, "method"].nunique() > 1:
            out.loc[sel, "variant"] = out.loc[sel, "method"].str[len(b):]
            out.loc[sel, "method"] = b
    return out


_NOT_JOINED = ("method", "mean", "std", "n", "finished", "never", "planned", "stale", "variant", "column", "paper")


# a multi-round table's ``table.summary`` -> the reference rows' ``metric_variant`` it is compared with (FedLap App.
# E.5 prints the mean and the max of the last 3 rounds in one table)
SUMMARY_VARIANTS = {"last3_mean": "mean_last3", "last3_max": "max_last3"}


def attach_reference(summary: pd.DataFrame, paper: str, table: str, metric: str = "accuracy",
                     variant: Optional[str] = None) -> pd.DataFrame:
    """The paper's number beside each cell (``paper``, ``paper_std``), joined on every key the cell and the
    reference CSV share (and on ``metric`` for derived columns), method variants on their base name; ``variant``
    keeps only the reference rows of that ``metric_variant`` (and those without one)."""
    try:
        ref = load_reference(paper, table)
    except (ImportError, FedbenchError, FileNotFoundError):
        ref = None
    if ref is None or summary.empty:
        summary = summary.copy()
        summary["paper"] = math.nan
        return summary
    if "metric" in ref and "metric" not in summary:
        ref = ref[ref["metric"] == metric]
    if variant and "metric_variant" in ref:
        ref = ref[ref["metric_variant"].isna() | (ref["metric_variant"] == variant)]
    ref = ref.copy()
    ref["base_method"] = ref["method"]
    summary = summary.copy()
    summary["base_method"] = summary["method"].str.replace(r"\(.*\)$", "", regex=True)
    on = [k for k in summary.columns if k in ref.columns and k not in _NOT_JOINED]
    on = [k for k in on if k != "base_method"] + ["base_method"]
    for k in on:  # compare as text: numeric keys print the same in both
        summary[k + "__j"] = summary[k].map(norm_key)
        ref[k + "__j"] = ref[k].map(norm_key)
    extra = ["scales_with"] if "scales_with" in ref else []   # FedBEns Table 4's per-mixture costs
    merged = summary.merge(ref[[k + "__j" for k in on] + ["mean", "std"] + extra].rename(
        columns={"mean": "paper", "std": "paper_std"}), on=[k + "__j" for k in on], how="left")
    if "metric" in merged:   # derived columns: each row's own metric (App. D.2's MAP test NLL beside its rounds)
        floors = merged["metric"].map(TOLERANCE_FLOOR)
        if floors.notna().any():
            merged["tol_floor"] = floors
    elif metric in TOLERANCE_FLOOR:
        merged["tol_floor"] = tolerance_floor(metric)
    return merged.drop(columns=[k + "__j" for k in on] + ["base_method"])


def _fmt(x, digits=2):
    """Accuracies with 2 decimals; small non-zero values (losses such as FedFisher Fig. 1's) with 3 significant
    digits, which 2 decimals would flatten to 0.01-0.02."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return ""
    return f"{x:.3g}" if 0 < abs(x) < 0.1 else f"{x:.{digits}f}"


def _missing(x) -> bool:
    return x is None or x is pd.NA or (isinstance(x, float) and math.isnan(x))


TOLERANCE_POINTS = 3.0   # |Δ| within max(3 points, 2 × combined standard error) counts as reproduced
# The floor of that rule for metrics not in accuracy points (rounds to a threshold keep 3 rounds). NLL: the papers'
# seed std of an NLL cell is 0.00-0.05 nats and FedLap Table 5 separates methods by 0.04-0.1, so 0.05 nats.
TOLERANCE_FLOOR = {"nll": 0.05, "map_test_nll": 0.05}   # nats: 3 "points" would accept any NLL
LOWER_IS_BETTER = ("nll", "map_test_nll", "ece", "rounds_to_acc", "rounds_to_1pct")   # a row's winner: the lowest mean


def as_printed(values, metric: Optional[str]):
    """Means as the tables print them, for every comparison of who leads (a row's winner, a claim): accuracy in percent
    to two decimals, so 10.004 and 9.996 tie; other metrics (NLL has no fixed printed precision) exactly. Takes a float
    or a pandas Series."""
    if metric != "accuracy":
        return values
    return values.round(2) if isinstance(values, pd.Series) else round(float(values), 2)


def tolerance_floor(metric: Optional[str]) -> float:
    return TOLERANCE_FLOOR.get(str(metric), TOLERANCE_POINTS)


def tolerance(r: Dict[str, Any], paper_n: Optional[int]) -> Optional[float]:
    """The largest |Δ| that still counts as reproduced: max(floor, 2·sqrt(s²/n + s_p²/n_p)) (a missing paper std
    counts as 0; the floor is 3 points, or the cell's ``tol_floor`` from its metric); None when there is nothing to
    compare."""
    n = int(r.get("n") or 0)
    if n == 0 or _missing(r.get("paper")) or _missing(r.get("mean")):
        return None
    s = 0.0 if _missing(r.get("std")) else float(r["std"])
    sp = 0.0 if _missing(r.get("paper_std")) else float(r["paper_std"])
    var = s * s / n + (sp * sp / paper_n if paper_n else 0.0)
    floor = r.get("tol_floor")
    return max(TOLERANCE_POINTS if _missing(floor) else float(floor), 2.0 * math.sqrt(var))


def within_tolerance(r: Dict[str, Any], paper_n: Optional[int]) -> Optional[bool]:
    """None when there is nothing to compare. A rounds-to-threshold cell where some of our runs never reached the
    threshold is outside when the paper prints a number (its runs all reached it), whatever the others' mean."""
    if int(r.get("never", 0) or 0) and not _missing(r.get("paper")):
        return False
    tol = tolerance(r, paper_n)
    return None if tol is None else abs(float(r["mean"]) - float(r["paper"])) <= tol


def format_cell(r: Dict[str, Any], paper_n: Optional[int] = None, show_n: bool = True) -> str:
    """ours / the paper's number / difference and a mark: ✓ within tolerance, ✗ outside. ``never k/m``: k of the
    m finished runs never reached the threshold (no mean is compared then; against a printed number the cell is
    outside, since the papers print a number only when every run reached it). ``show_n=False`` when the table states one n for every cell; ``+k stale`` counts
    records of older numerics left out of the cell."""
    paper = r.get("paper", math.nan)
    ref = "—" if _missing(paper) else _fmt(paper)
    n, never = int(r["n"]), int(r.get("never", 0) or 0)
    finished = int(r.get("finished", n) if not _missing(r.get("finished")) else n)
    stats = f"{_fmt(r['mean'])} ± {_fmt(r['std'])}" + (f" (n={n})" if show_n else "")
    diff = ""
    if finished == 0:
        ours = f"not run (0/{int(r['planned'])})"
    elif never:
        ours = f"never {never}/{never + n}" + (f"; reached: {stats}" if n else "")
        diff = "" if ref == "—" else " ✗"   # the paper's runs reached it (within_tolerance)
    elif n == 0:
        ours = f"no value ({finished} finished)"
    else:
        ours = stats
        if ref != "—":
            ok = within_tolerance(r, paper_n)
            diff = f" / Δ {r['mean'] - paper:+.2f}" + ("" if ok is None else " ✓" if ok else " ✗")
    stale = int(r.get("stale", 0) or 0)
    ours += f" (+{stale} stale)" if stale else ""
    variant = f" {r['variant']}" if isinstance(r.get("variant"), str) and r.get("variant") else ""
    return f"{ours} / {ref}{diff}{variant}"


def _cell_text(r: Dict[str, Any], paper_n: Optional[int], show_n: bool) -> str:
    """A cost cell (seconds, minutes, MB: fedbench.report.costs) or a cell compared with a tolerance."""
    return format_cost_cell(r, show_n) if is_cost(r.get("metric")) else format_cell(r, paper_n, show_n=show_n)


def table_layout(meta: Dict[str, Any], summary: pd.DataFrame) -> tuple:
    """(row keys, column keys) of the markdown table: ``table.layout``, or the row keys × methods
    (× derived columns)."""
    specs = column_specs(meta)
    keys = list(meta.get("rows") or ["dataset", "partition"])
    lay = meta.get("layout") or {}
    rows = list(lay.get("rows") or keys)
    cols = list(lay.get("columns") or (["method", "column"] if specs else ["method"]))
    known = set(keys) | {"method"} | ({"column", "metric"} | set(spec_key_names(specs)) if specs else set())
    bad = [k for k in rows + cols if k not in known]
    if bad or set(rows) & set(cols):
        raise FedbenchError(f"preset {meta.get('paper')}/{meta.get('id')}: table.layout uses "
                            f"{', '.join(bad) or 'a key twice'}; choose each of {', '.join(sorted(known))} at most once")
    return rows, cols


def paper_seeds(meta: Dict[str, Any]) -> Optional[int]:
    """How many seeds the paper's numbers average: the preset's paper profile's seed axis (None if unknown)."""
    seeds = (((meta.get("profiles") or {}).get("paper") or {}).get("sweep") or {}).get("seed")
    return len(seeds) if isinstance(seeds, (list, tuple)) and seeds else None


def score(summary: pd.DataFrame, meta: Dict[str, Any], metric: str = "accuracy") -> Dict[str, Any]:
    """What a table reproduces: cells with a paper number, those run (n > 0) and within / outside tolerance, and
    per row the paper's winner against ours (only for tables whose columns are methods; the lowest wins for a
    metric in LOWER_IS_BETTER)."""
    paper_n = paper_seeds(meta)
    keys = [k for k in (meta.get("rows") or ["dataset", "partition"])] + (["column"] if "column" in summary else [])
    keys = [k for k in keys if k in summary]
    out = {"paper_cells": 0, "run": 0, "within": 0, "outside": [], "rows": 0, "order_held": 0, "order_failed": []}
    if summary.empty:
        return out
    for r in summary.to_dict("records"):
        if _missing(r.get("paper")) or is_cost(r.get("metric")):   # costs: hardware differs, never scored
            continue
        out["paper_cells"] += 1
        ok = within_tolerance(r, paper_n)
        if ok is None:
            continue
        out["run"] += 1
        if ok:
            out["within"] += 1
        else:
            out["outside"].append({**{k: r.get(k) for k in keys}, "method": r["method"], "mean": r["mean"],
                                   "paper": r["paper"]})
    if "column" not in summary:   # per row: does the paper's best method also win here?
        for rv, g in summary.groupby(keys, sort=False, dropna=False):
            both = g[g["paper"].notna() & (g["n"] > 0)] if "paper" in g else g.iloc[0:0]
            if len(both) < 2:
                continue
            out["rows"] += 1
            low = metric in LOWER_IS_BETTER
            top = both["paper"].min() if low else both["paper"].max()
            theirs = list(both.loc[both["paper"] == top, "method"])   # the paper's printed ties all win
            # ours as the tables print them (accuracy: two decimals): a tie for first is no win for either method
            means = as_printed(both["mean"], metric)
            ours = list(both.loc[means == (means.min() if low else means.max()), "method"])
            if set(ours) <= set(theirs):
                out["order_held"] += 1
            else:
                out["order_failed"].append({"row": "/".join(norm_key(v) for v in (rv if isinstance(rv, tuple) else (rv,))),
                                            "paper_winner": "/".join(theirs), "our_winner": "/".join(ours)})
    return out


def _floor_text(metric: str) -> str:
    return f"{TOLERANCE_FLOOR[metric]:g} {metric}" if metric in TOLERANCE_FLOOR else f"{TOLERANCE_POINTS:g} points"


def to_markdown(summary: pd.DataFrame, meta: Dict[str, Any], profile: str, approx_note: str = "",
                metric: str = "accuracy") -> str:
    specs = column_specs(meta)
    row_keys, col_keys = table_layout(meta, summary)
    summary = attach_ratios(summary, meta)
    recs = summary.to_dict("records")
    col_vals = list(dict.fromkeys(tuple(norm_key(r.get(k)) for k in col_keys) for r in recs))
    paper_n = paper_seeds(meta)
    ns = {int(r["n"]) for r in recs if int(r["n"]) > 0}
    one_n = ns.pop() if len(ns) == 1 else None
    lines = [f"# {meta.get('paper', '?')} {meta.get('id', '?')}: {meta.get('title', '')}", "",
             f"Profile: **{profile}**" + (" (reduced settings — NOT the paper's protocol)" if profile == "quick" else "")
             + ". Generated from run records (`results/records/`; `make tables` regenerates it).",
             "Cell: ours mean ± std over " + (f"**n = {one_n}** seed(s) in every cell that ran" if one_n else "n seeds")
             + " (sample std) / the paper's number / difference, ✓ within tolerance, ✗ outside "
             f"(|Δ| ≤ max({_floor_text(metric)}, 2 × the combined standard error; paper n = {paper_n or '?'})). "
             "`not run` = no ok record yet; `—` = no paper number; `+k stale` = k records of older numerics left out."]
    only_costs = bool(specs) and all(is_cost(s.metric) for s in specs)
    if only_costs:   # a cost table is read by its ratios, never scored (fedbench/report/costs.py)
        lines[-1] = header_note(meta, one_n)
    if specs:
        lines.append("Columns: " + "; ".join(f"{s.name} = `{s.value}`" for s in specs) + ".")
        if any(is_cost(s.metric) for s in specs) and not only_costs:
            lines.append(header_note(meta, one_n))
        if any(s.never for s in specs):
            lines.append("`never k/m` = in k of the m finished runs the threshold was never reached "
                         "(the paper prints no number then).")
    elif metric != "accuracy":
        lines.append(f"Metric: `{metric}`.")
    lines.append("")
    if approx_note:
        lines += [f"**Approximate data:** {approx_note}", ""]
    lines.append("| " + " | ".join(row_keys + [": ".join(cv) for cv in col_vals]) + " |")
    lines.append("|" + "---|" * (len(row_keys) + len(col_vals)))
    # each record's (row, column) keys once: the first record of a cell fills it (a lookup per cell, not a scan
    # of every record, which took most of a 2,250-row table's time)
    first: Dict[tuple, Dict[str, Any]] = {}
    for r in recs:
        first.setdefault((tuple(norm_key(r.get(k)) for k in row_keys), tuple(norm_key(r.get(k)) for k in col_keys)), r)
    for rv in dict.fromkeys(rv for rv, _ in first):
        cells = []
        for cv in col_vals:
            hit = first.get((rv, cv))
            cells.append(_cell_text(hit, paper_n, one_n is None) if hit is not None else "")
        lines.append("| " + " | ".join(list(rv) + cells) + " |")
    sc = score(summary, meta, metric)
    if not only_costs:
        lines += ["", f"Within tolerance: **{sc['within']} of {sc['run']}** cells run with a paper number "
                  f"({sc['paper_cells']} paper cells in this collection)."]
    if sc["rows"]:
        failed = "; ".join(f"{f['row']}: paper {f['paper_winner']}, ours {f['our_winner']}" for f in sc["order_failed"])
        lines.append(f"Paper's winner also wins here: **{sc['order_held']} of {sc['rows']}** rows"
                     + (f" (not in: {failed})." if failed else "."))
    return "\n".join(lines) + "\n"


_EMPTY = ("no run matches these overrides: a fixed value outside a preset axis removes every block "
          "(e.g. local.epochs=1 where the block sweeps [5]); replace the axis with a sweep instead, of one value "
          "('local.epochs=choice(1)') or several (local.epochs=1,5), or pick one of its values")


def check_table_suffix(suffix: Optional[str]) -> None:
    """``collect --name``: one file-name part, checked before any training (scripts/reproduce.py)."""
    if suffix is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", suffix):
        raise FedbenchError(f"--name must be letters, digits, '.', '_' or '-', got {suffix!r}")


def collection_stem(base: str, profile: Any, suffix: Optional[str] = None) -> str:
    """``<base>[_<profile>][_<suffix>]``: the file stem of a collection's table and figures (profile "paper" is
    left out; a suffix, ``--name`` or "tuned", keeps a named collection from overwriting the preset's own)."""
    return base + ("" if str(profile) in ("paper", "None") else f"_{profile}") + (f"_{suffix}" if suffix else "")


def table_suffix(overrides: Sequence[str], name: Optional[str] = None) -> Optional[str]:
    """The suffix of a collection's table and figure: ``--name``, else "tuned" for ``tuning=on`` (a tuned collection
    never overwrites the fixed-pick table), else none."""
    return name or ("tuned" if tuning_on(overrides) else None)


def collect(overrides: Sequence[str], output_root: Path, tables_dir: Path, metric: Optional[str] = None,
            suffix: Optional[str] = None, publish: bool = True, unpublished: Optional[list] = None) -> Path:
    """Write ``<tables_dir>/<paper>_<table>[_<profile>][_<suffix>].md`` (+ ``_runs.csv``) from the run records.

    With ``publish`` the finished records behind it are copied (compact, no weights) into the committed store
    (results/records) and the collection is listed in ``<tables_dir>/../collections.yaml``, so that ``make tables``
    regenerates every committed table from a fresh clone. Without it, ``unpublished`` (a list) gets the folders of
    the finished records the table read from outside the committed store: a fresh clone's table would lack them."""
    check_table_suffix(suffix)
    suffix = table_suffix(overrides, suffix)
    df = table_runs(overrides, output_root)
    if df.empty and any(o.startswith("experiment=") for o in overrides):
        raise FedbenchError(_EMPTY)
    meta = df.attrs.get("table") or {}
    if not meta:
        raise FedbenchError("collect needs an experiment preset (experiment=<paper>/<table>)")
    metric = metric or meta.get("metric") or "accuracy"
    check_metric(df, metric, meta.get("rows") or [])   # a misspelt metric fails before anything is written
    profile = str(df["profile"].iloc[0]) if len(df) else "paper"
    name = collection_stem(f"{meta['paper']}_{meta['id']}", profile, suffix)
    tables_dir.mkdir(parents=True, exist_ok=True)
    if publish:
        publish_records(df)
        publish_selections(overrides, df, output_root)
        register_collection(tables_dir.parent / COLLECTIONS, name, overrides, metric, suffix, profile)
    elif unpublished is not None:
        unpublished += [d for d in df.loc[df["status"] == "ok", "record_dir"].dropna().unique()
                        if not is_complete(records_dir() / Path(d).name / "metrics.json", Path(d).name)]
    df.drop(columns=["record_dir", "tuning_selection"]).to_csv(tables_dir / f"{name}_runs.csv", index=False)
    summary = attach_reference(summarise(df, metric), meta["paper"], meta["id"], metric,
                               SUMMARY_VARIANTS.get(meta.get("summary")))
    out = tables_dir / f"{name}.md"
    foot = tuning_footnote(df)
    out.write_text(to_markdown(summary, meta, profile, metric=metric) + ("\n".join(foot) + "\n" if foot else ""))
    return out


def publish_selections(overrides: Sequence[str], df: pd.DataFrame, output_root: Path) -> int:
    """Copy the tuning selections behind a ``tuning=on`` table into the committed store (results/tuning), and every
    finished selection run's record, those of selections still under way included, into results/records: the table
    and its choices then regenerate from a fresh clone, and a fresh machine's tuning resumes where this one stopped."""
    n = 0
    for path in df["tuning_selection"].dropna().unique():
        target = tuning_store() / Path(path).name
        if Path(path).resolve() != target.resolve() and not target.is_file():
            atomic_write_bytes(target, Path(path).read_bytes())
            n += 1
    for d in finished_selection_runs(overrides, output_root) if tuning_on(overrides) else []:
        publish_record(d)
    return n


def publish_records(df: pd.DataFrame) -> int:
    """Copy every finished, current record of a table that lives outside the committed store into it."""
    n = 0
    for d in df.loc[df["status"] == "ok", "record_dir"].dropna().unique():
        n += publish_record(Path(d)) is not None
    return n


# --- the committed collections: what `make tables` regenerates -------------------------------------------
COLLECTIONS = "collections.yaml"
_NOT_COLLECTION_KEYS = ("hardware", "progress", "paths", "logger", "force", "cache", "save_model")


def check_metric(df: pd.DataFrame, metric: str, row_keys: Sequence[str] = ()) -> None:
    """One line when no finished run of the table has ``metric`` (``table.columns`` tables name their own values)."""
    ok = df[df["status"] == "ok"] if "status" in df else df.iloc[0:0]
    if "column" in df or ok.empty or (metric in ok and ok[metric].notna().any()):
        return
    have = [c for c in ok.select_dtypes("number").columns
            if c not in ("seed", "rounds", *row_keys) and ok[c].notna().any()]
    raise FedbenchError(f"metric {metric!r} is in none of the {len(ok)} finished records of this table; they have: "
                        f"{', '.join(sorted(have))}")


def collection_overrides(overrides: Sequence[str]) -> List[str]:
    """The overrides that define a table (those saying where or how runs execute are dropped)."""
    return [o for o in overrides if o.split("=", 1)[0].lstrip("+~").split(".", 1)[0] not in _NOT_COLLECTION_KEYS]


def read_collections(path: Path) -> List[Dict[str, Any]]:
    if not Path(path).is_file():
        return []
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}
    return list(data.get("collections") or [])


def register_collection(path: Path, name: str, overrides: Sequence[str], metric: str, suffix: Optional[str],
                        profile: str = "paper") -> None:
    """Add (or replace, by table file name) one collection in the manifest, kept sorted by name."""
    entry = {"name": name, "overrides": collection_overrides(overrides), "metric": metric, "suffix": suffix,
             "profile": profile}
    entries = [e for e in read_collections(path) if e.get("name") != name] + [entry]
    entries.sort(key=lambda e: e["name"])
    text = ("# Every committed table under results/tables/ and the collect call that makes it (written by collect;\n"
            "# `make tables` regenerates them all from results/records/).\n"
            + OmegaConf.to_yaml(OmegaConf.create({"collections": entries})))
    atomic_write_bytes(Path(path), text.encode())


def preset_meta(overrides: Sequence[str]) -> Dict[str, Any]:
    """The preset's ``table`` block with its column, layout and figure declarations checked (one-line
    FedbenchError), so that a bad declaration fails before any training; {} without a preset."""

    runs = expand_sweep(overrides)
    if not runs:
        raise FedbenchError(_EMPTY)
    cfg = compose_run(runs[0])
    meta = OmegaConf.to_container(cfg.table, resolve=True) if cfg is not None and cfg.get("table") else {}
    if meta:
        column_specs(meta)
        table_layout(meta, pd.DataFrame())
        figure_spec(meta)
    return meta
