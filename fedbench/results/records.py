"""Run identity and run records (metrics.json, history.csv), written atomically."""
from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional
from omegaconf import DictConfig, OmegaConf
import numpy as np
from fedbench.numerics import is_current

# Keys that say where/how a run executes, not what it computes: excluded from run_id.
NON_IDENTITY_KEYS = ("hardware", "logger", "paths", "hydra", "force", "progress", "tags", "cache", "table",
                     "save_model", "tuning", "checkpoint_every_s", "share_epochs",
                     "cache_max_gb")   # tuning=on only picks which runs to make (the final run is a plain one); share_epochs only how round 1 is trained


# Optional blocks that enter the identity only when switched on (size > 0), so that adding such a feature
# leaves the run ids of every existing record unchanged.
OFF_WHEN_EMPTY = ("server_unlabeled",)
OFF_WHEN_ZERO_FRACTION = ("tuning_val",)   # a tuning selection run's hold-out (fraction > 0)
# Optional keys (section, key) that enter the identity only when not null, for the same reason.
OFF_WHEN_NULL = (("eval", "map_reference"),)
# Switches (section, key, value) added after records were made: at that value (the old behaviour) they stay out
# of the identity, for the same reason.
OFF_AT_VALUE = (("algorithm", "gd_step", "fixed"),     # FedLPA's GD step (results/gaps.md#fedlpa-table6)
                ("study", "aux_pool", "other_clients"),   # the GMI study's aux data (gaps.md#fedfisher-table6)
                ("algorithm", "variant", "acar"),   # FedDyn's server (gaps.md#fedlap-table3-feddyn)
                ("algorithm", "posterior_term", "differentiable"),   # FedLPA rounds >= 2 (gaps.md#fedlpa-figure2)
                ("study", "efull_reading", "sorted_diagonal"),   # FOLA's e-full (gaps.md#fola-figures10-11)
                ("algorithm", "reference_solve", "none"),   # FedLPA's paired exact solve (gaps.md#fedlpa-figure2)
                ("algorithm", "correction", "gradient"))   # SCAFFOLD's correction (gaps.md#fedlpa-figure2)


def identity_config(cfg: Any) -> Dict[str, Any]:
    if isinstance(cfg, DictConfig):
        keys = [k for k in cfg.keys() if k not in NON_IDENTITY_KEYS]
        out = {k: OmegaConf.to_container(cfg[k], resolve=True) if isinstance(cfg[k], (DictConfig,))
               or OmegaConf.is_list(cfg[k]) else cfg[k] for k in keys}
    else:
        out = {k: v for k, v in dict(cfg).items() if k not in NON_IDENTITY_KEYS}
    for k in OFF_WHEN_EMPTY:
        if isinstance(out.get(k), Mapping) and not out[k].get("size"):
            del out[k]
    for k in OFF_WHEN_ZERO_FRACTION:
        if isinstance(out.get(k), Mapping) and not out[k].get("fraction"):
            del out[k]
    for section, k in OFF_WHEN_NULL:
        if isinstance(out.get(section), Mapping) and k in out[section] and out[section][k] is None:
            out[section] = {kk: v for kk, v in out[section].items() if kk != k}
    for section, k, off in OFF_AT_VALUE:
        if isinstance(out.get(section), Mapping) and k in out[section] and out[section][k] == off:
            out[section] = {kk: v for kk, v in out[section].items() if kk != k}
    return out


def compute_run_id(cfg: Any) -> str:
    """Stable 12-hex hash of the resolved config without hardware, logger and path keys."""
    blob = json.dumps(identity_config(cfg), sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_torch_atomic(path: Path, obj: Any) -> None:
    """``torch.save(obj)`` to ``path`` via a temp file + rename (tensors should be on the CPU)."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(path, buf.getvalue())


def read_history(path: Path) -> List[Dict[str, Any]]:
    """The rows of a record's ``history.csv`` (pandas' types), or [] when it is missing or unreadable."""
    import pandas as pd   # only readers of histories need pandas; writing a record does not

    try:
        return pd.read_csv(path).to_dict("records")
    except (OSError, ValueError):
        return []


def write_json_atomic(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n").encode())


def write_csv_atomic(path: Path, rows: List[Mapping[str, Any]], columns: Optional[Iterable[str]] = None) -> None:
    columns = list(columns) if columns is not None else _columns(rows)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow(r)
    atomic_write_bytes(path, buf.getvalue().encode())


def _columns(rows):
    cols: List[str] = []
    for r in rows:
        for k in r:
            if k not in cols:
                cols.append(k)
    return cols


def _json_default(o):
    try:

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:  # pragma: no cover
        pass
    return str(o)


def read_record(path: Path) -> Optional[Dict[str, Any]]:
    """The record at ``path``, or None if it is missing or unreadable (a torn/corrupt file is not a record)."""
    try:
        with open(path) as f:
            rec = json.load(f)
        return rec if isinstance(rec, dict) else None
    except (OSError, ValueError):
        return None


def is_complete(path: Path, run_id: Optional[str] = None, need_model: bool = False, current: bool = True) -> bool:
    """An ok record of ``run_id`` made by this code's numerics (``current``; see fedbench.numerics — a stale record
    is rerun, not skipped); with ``need_model`` (a ``save_model=true`` run) also its saved weights
    (``record['saved']``: file names beside the record), so that an older record without them is rerun."""

    rec = read_record(path)
    ok = bool(rec) and rec.get("status") == "ok" and (run_id is None or rec.get("run_id") == run_id)
    if ok and current and not is_current(rec):
        return False
    if ok and need_model:
        saved = rec.get("saved") or {}
        ok = "model" in saved and all((Path(path).parent / f).is_file() for f in saved.values() if f is not None)
    return ok


# --- committed records ----------------------------------------------------------------------------------
# A run writes its record under <output_root>/runs/<run_id>/ (git-ignored). The records behind committed tables
# are published, compact (record + round history + server trace, never weights), to results/records/<run_id>/,
# which is committed: a fresh clone regenerates every table from them and a resumed campaign skips them.
RECORD_FILES = ("metrics.json", "history.csv", "trace.csv")


def published_files(rec: Dict[str, Any]) -> List[str]:
    """The files of a record that the committed store keeps: ``RECORD_FILES`` and the tables a study wrote beside
    its record (``rec['files']``, its ``.csv`` ones: FOLA's rounds, sweeps and AE/LF rows); never binaries (weights,
    FOLA's precision heat maps)."""
    study = [f for f in (rec.get("files") or {}).values() if isinstance(f, str) and f.endswith(".csv")
             and Path(f).name == f]
    return list(RECORD_FILES) + [f for f in study if f not in RECORD_FILES]


def records_dir() -> Path:
    """The committed record store: ``$FEDBENCH_RECORDS``, default ``results/records`` (relative to the cwd)."""
    return Path(os.environ.get("FEDBENCH_RECORDS", "results/records"))


def tuning_store() -> Path:
    """The committed tuning selections: ``$FEDBENCH_TUNING``, default ``results/tuning`` (relative to the cwd). A
    ``tuning=on`` table publishes each selection here (choice, validation scores, selection run ids; the selection
    runs' records go to the record store), so a fresh clone regenerates the tuned table."""
    return Path(os.environ.get("FEDBENCH_TUNING", "results/tuning"))


def record_dirs(output_root: Path, run_id: str) -> List[Path]:
    """Where ``run_id``'s record may be, local run first, then the committed store."""
    return [Path(output_root) / "runs" / run_id, records_dir() / run_id]


def find_record_dir(output_root: Path, run_id: str, need_model: bool = False) -> Optional[Path]:
    """The folder of ``run_id``'s complete, current record (local outputs, else the committed store), or None.
    A ``save_model`` run needs its weights, which only local outputs have."""
    for d in record_dirs(output_root, run_id)[: 1 if need_model else None]:
        if is_complete(d / "metrics.json", run_id, need_model=need_model):
            return d
    return None


def load_record(output_root: Path, run_id: str) -> Dict[str, Any]:
    """``run_id``'s record for a table: a complete current one if any (local first, then committed); else the
    local record as it is (failed, stale, ...), else the committed one, else {}. ``_dir`` says where it was."""
    found = find_record_dir(output_root, run_id)
    for d in ([found] if found else []) + record_dirs(output_root, run_id):
        rec = read_record(d / "metrics.json")
        if rec:
            return {**rec, "_dir": str(d)}
    return {}


def _forced_rerun(rec: dict, committed: Optional[dict]) -> bool:
    """Whether ``rec`` is a deliberate rerun of the committed record: made with force=true and finished after it."""
    later = str(rec.get("finished") or "") > str((committed or {}).get("finished") or "")
    return bool((rec.get("config") or {}).get("force")) and later


def publish_record(run_dir: Path, store: Optional[Path] = None) -> Optional[Path]:
    """Copy a complete run record (``published_files``, no weights) into the committed store; returns the target
    folder, or None when ``run_dir`` holds no complete current record or already is the store's copy. A complete
    current record already in the store is kept as it is (only a missing, failed or stale one is replaced), unless
    ``run_dir`` holds a deliberate rerun: made with ``force=true`` (e.g. after a fix) and finished later."""
    store = Path(store) if store is not None else records_dir()
    run_dir = Path(run_dir)
    rec = read_record(run_dir / "metrics.json")
    if not rec or not is_complete(run_dir / "metrics.json", rec.get("run_id")):
        return None
    target = store / str(rec["run_id"])
    if target.resolve() == run_dir.resolve():
        return None
    kept = is_complete(target / "metrics.json", rec["run_id"])
    if kept and not _forced_rerun(rec, read_record(target / "metrics.json")):
        return target           # the committed copy is the provenance of a table: only a forced, later rerun replaces it
    for name in published_files(rec):
        src = run_dir / name
        if src.is_file():
            data = src.read_bytes()
            if not (target / name).is_file() or (target / name).read_bytes() != data:
                atomic_write_bytes(target / name, data)
    return target
