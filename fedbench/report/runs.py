"""A preset's runs as one frame for its figures: every (run, aggregator) of the sweep with its record's status and
final metrics, plus the columns a paper's figures need (``describe``). Also the finished runs of a study preset.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, Sequence

import pandas as pd
from omegaconf import OmegaConf

from fedbench.config.aggregators import expand_runs
from fedbench.errors import FedbenchError
from fedbench.launch.sweep import CONF_DIR, compose_run, expand_sweep, study_runs
from fedbench.numerics import is_current
from fedbench.results.records import compute_run_id, load_record
from fedbench.report.tables import TableMeta

_GROUPS = ("dataset", "partition", "model", "algorithm", "hardware", "logger", "experiment", "local")


def composed_runs(overrides: Sequence[str]):
    """(overrides, config) of every run of the sweep. Hydra's compose costs ~0.1 s a run, too slow for FOLA R1's
    93,750 runs: runs that differ only in plain value overrides reuse one composed template with the values
    set, which is checked against a full compose on the second run of every template (else: full compose)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    templates: Dict[tuple, Any] = {}
    for ovs in expand_sweep(overrides):
        parsed = parser.parse_overrides(list(ovs))
        structural = [o for o, p in zip(ovs, parsed)
                      if p.is_add() or p.is_delete() or p.is_force_add() or p.key_or_group in _GROUPS]
        values = [(p.key_or_group, p.value()) for p in parsed
                  if not (p.is_add() or p.is_delete() or p.is_force_add() or p.key_or_group in _GROUPS)]
        key = (tuple(structural), tuple(sorted(k for k, _ in values)))
        state = templates.get(key)
        if state is None:
            cfg = compose_run(ovs)
            templates[key] = {"cfg": cfg, "checked": False, "fast": True}
            yield ovs, cfg
            continue
        cfg = None
        if state["fast"]:
            cfg = state["cfg"].copy()
            for k, v in values:
                OmegaConf.update(cfg, k, v, merge=False)
            if not state["checked"]:
                slow = compose_run(ovs)
                state["checked"] = True
                if compute_run_id(slow) != compute_run_id(cfg) or OmegaConf.to_container(slow.get("table")) != \
                        OmegaConf.to_container(cfg.get("table")):
                    state["fast"], cfg = False, slow
        yield ovs, cfg if cfg is not None else compose_run(ovs)


def preset_records(overrides: Sequence[str], output_root: Path,
                   describe: Callable[[Any, Dict[str, Any]], Dict[str, Any]]) -> pd.DataFrame:
    """One row per (run, aggregator) of the preset's sweep: run id, status, record folder, the columns
    ``describe(run config, algorithm dict)`` gives (a method label, the swept settings), the record's final
    ``accuracy`` and ``local_accuracy``; ``attrs['table']`` is the preset's table block."""

    rows, meta = [], None
    for ovs, cfg in composed_runs(overrides):
        if meta is None:
            meta = OmegaConf.to_container(cfg.table, resolve=True) if cfg.get("table") else {}
        subs = expand_runs(cfg, CONF_DIR, allow_missing=True)
        for sub in subs:
            a = OmegaConf.to_container(sub.algorithm, resolve=True)
            rid = compute_run_id(sub)
            rec = load_record(Path(output_root), rid)
            ok = rec.get("status") == "ok" and rec.get("run_id") == rid and is_current(rec)
            m = (rec.get("metrics") or {}) if ok else {}
            rows.append({"run_id": rid, "status": "ok" if ok else "missing", "record_dir": rec.get("_dir"),
                         **describe(sub, a), "accuracy": m.get("accuracy"),
                         "local_accuracy": m.get("local_accuracy")})
    df = pd.DataFrame(rows)
    df.attrs["table"] = TableMeta(meta or {})
    return df


def finished_studies(overrides: Sequence[str], output_root: Path):
    """The study preset's finished runs: (meta, [(config, run folder)])."""

    runs = study_runs(overrides, output_root)
    meta = OmegaConf.to_container(runs[0]["config"].table, resolve=True) if runs else {}
    done = [(r["config"], r["dir"]) for r in runs if r["record"] is not None]
    if not done:
        raise FedbenchError("no finished study runs to plot (run `make reproduce` for this preset first)")
    return meta, done
