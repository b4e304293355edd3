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

# Keys that say where/how a run executes, not what it computes: excluded from run_id.
NON_IDENTITY_KEYS = ("hardware", "logger", "paths", "hydra", "force", "progress", "tags", "cache", "table",
                     "save_model")


# Optional blocks that enter the identity only when switched on (size > 0), so that adding such a feature
# leaves the run ids of every existing record unchanged.
OFF_WHEN_EMPTY = ("server_unlabeled",)


def identity_config(cfg: Any) -> Dict[str, Any]:
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        keys = [k for k in cfg.keys() if k not in NON_IDENTITY_KEYS]
        out = {k: OmegaConf.to_container(cfg[k], resolve=True) if isinstance(cfg[k], (DictConfig,))
               or OmegaConf.is_list(cfg[k]) else cfg[k] for k in keys}
    else:
        out = {k: v for k, v in dict(cfg).items() if k not in NON_IDENTITY_KEYS}
    for k in OFF_WHEN_EMPTY:
        if isinstance(out.get(k), Mapping) and not out[k].get("size"):
            del out[k]
    return out


def compute_run_id(cfg: Any) -> str:
    """Stable 12-hex hash of the resolved config without hardware, logger and path keys."""
    blob = json.dumps(identity_config(cfg), sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def _atomic_write_bytes(path: Path, data: bytes) -> None:
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
    _atomic_write_bytes(path, buf.getvalue())


def write_json_atomic(path: Path, obj: Any) -> None:
    _atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n").encode())


def write_csv_atomic(path: Path, rows: List[Mapping[str, Any]], columns: Optional[Iterable[str]] = None) -> None:
    columns = list(columns) if columns is not None else _columns(rows)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow(r)
    _atomic_write_bytes(path, buf.getvalue().encode())


def _columns(rows):
    cols: List[str] = []
    for r in rows:
        for k in r:
            if k not in cols:
                cols.append(k)
    return cols


def _json_default(o):
    try:
        import numpy as np

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


def is_complete(path: Path, run_id: Optional[str] = None, need_model: bool = False) -> bool:
    """An ok record of ``run_id``; with ``need_model`` (a ``save_model=true`` run) also its saved weights
    (``record['saved']``: file names beside the record), so that an older record without them is rerun."""
    rec = read_record(path)
    ok = bool(rec) and rec.get("status") == "ok" and (run_id is None or rec.get("run_id") == run_id)
    if ok and need_model:
        saved = rec.get("saved") or {}
        ok = "model" in saved and all((Path(path).parent / f).is_file() for f in saved.values() if f is not None)
    return ok
