"""SHA-256 of a cache payload (nested dicts / lists of tensors and plain values), for the caches'
integrity checks (client-stage entries, data-set tensor caches).

Hashed over what the payload *means*, in a fixed order: every tensor's dtype, shape and element bytes
(row-major), every plain value's type and repr, dict keys sorted. So the digest is computed on the
loaded objects themselves (no second copy of the file in memory), does not depend on torch's file
layout, and covers every value a loader hands on; a flipped byte in a tensor changes it, and one in
the pickle or zip structure either changes a value (caught) or makes the file unreadable (torn).
SHA-256 runs at about 1 GB/s here (0.17 s for a CIFAR-10-sized 184 MB cache on a busy 2-core machine).
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch


def payload_sha256(obj: Any) -> str:
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()


def _feed(h, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}|".encode())
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    elif isinstance(obj, dict):
        h.update(f"D{len(obj)}|".encode())
        for k in sorted(obj, key=repr):
            h.update(f"{k!r}:".encode())
            _feed(h, obj[k])
    elif isinstance(obj, (list, tuple)):
        h.update(f"L{len(obj)}|".encode())
        for v in obj:
            _feed(h, v)
    else:
        h.update(f"S{type(obj).__name__}:{obj!r}|".encode())
