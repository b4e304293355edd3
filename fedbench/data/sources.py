"""Getting files into the data root safely: checksums, atomic copies, mirrors, tensor caches.

Every file the package writes goes to a temporary name in the destination folder first and is
renamed only once it is complete and verified, so an interrupted or failed copy never leaves a
half-written file where a loader would trust it.
"""
from __future__ import annotations

import contextlib
import gzip
import hashlib
import os
import shutil
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from fedbench.checksums import payload_sha256
from fedbench.errors import DataError

CACHE_DIR = "fedbench_cache"
CACHE_VERSION = 2   # 2: every cache carries the SHA-256 of its content (version-1 caches, unchecked, are rebuilt)
_CHUNK = 1 << 20


def one_line(msg: object, limit: int = 160) -> str:
    """Exception text squeezed to a single line of at most ``limit`` characters."""
    text = " ".join(str(msg).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def atomic_path(dst: Path) -> Iterator[Path]:
    """Yield a temporary path next to ``dst``; rename it onto ``dst`` only if the block succeeds."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".part", dir=dst.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        os.replace(tmp, dst)
    finally:
        if tmp.exists():
            tmp.unlink()


@contextlib.contextmanager
def atomic_dir(dst: Path) -> Iterator[Path]:
    """Like :func:`atomic_path` for a folder (the folder must not exist yet)."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".part", dir=dst.parent))
    try:
        yield tmp
        try:
            os.replace(tmp, dst)
        except OSError:
            if not dst.is_dir():  # another process may have put the same folder in place first
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def check_sha256(path: Path, expected: str, what: str, fix: str) -> None:
    got = sha256_file(path)
    if got != expected:
        raise DataError(f"{what}: {path} has SHA-256 {got[:12]}…, expected {expected[:12]}… "
                        f"(corrupt or incomplete file); {fix}")


def copy_verified(src: Path, dst: Path, sha256: Optional[str], *, gunzip: bool = False,
                  what: str = "data file") -> None:
    """Copy (and gunzip) ``src`` to ``dst`` via a temporary file, checking the SHA-256 of the result."""
    h = hashlib.sha256()
    with atomic_path(dst) as tmp:
        try:
            opener = gzip.open if gunzip else open
            with opener(src, "rb") as fin, open(tmp, "wb") as fout:
                for block in iter(lambda: fin.read(_CHUNK), b""):
                    h.update(block)
                    fout.write(block)
        except (OSError, EOFError, zlib.error) as e:  # BadGzipFile is an OSError
            raise DataError(f"{what}: cannot read {src} ({one_line(e)}); the mirror copy is corrupt, "
                            f"replace it with a good copy") from None
        if sha256 is not None and h.hexdigest() != sha256:
            raise DataError(f"{what}: {src} gives SHA-256 {h.hexdigest()[:12]}…, expected {sha256[:12]}… "
                            f"after {'decompression' if gunzip else 'copying'}; the mirror copy is corrupt, "
                            f"replace it with a good copy")


def signature(paths: Sequence[Path]) -> list:
    """Cheap fingerprint of the source files behind a cache (name, size, mtime)."""
    out = []
    for p in paths:
        st = Path(p).stat()
        out.append((Path(p).name, st.st_size, st.st_mtime_ns))
    return out


def cache_path(root: Path, key: str) -> Path:
    return Path(root) / CACHE_DIR / f"{key}.pt"


def load_cache(root: Path, key: str, sig) -> Optional[dict]:
    """The cached tensors for ``key`` if the cache exists, is readable and matches ``sig``."""
    path = cache_path(root, key)
    if not path.exists():
        return None
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # unreadable cache: it is derived data, rebuild it
        return None
    if not isinstance(payload, dict) or payload.get("version") != CACHE_VERSION:
        return None
    if sig is not None and payload.get("signature") != _plain(sig):
        return None
    if payload_sha256(_checked_part(payload)) != payload.get("sha256"):
        print(f"fedbench: WARNING: cache entry {path} checksum mismatch; recomputing", file=sys.stderr)
        with contextlib.suppress(OSError):
            path.unlink()
        return None
    return payload


def save_cache(root: Path, key: str, sig, **tensors) -> None:
    """Write the tensor cache atomically; a read-only root just means no cache."""
    payload = {"version": CACHE_VERSION, "signature": _plain(sig), **tensors}
    payload["sha256"] = payload_sha256(_checked_part(payload))
    try:
        with atomic_path(cache_path(root, key)) as tmp:
            torch.save(payload, tmp)
    except OSError:
        pass


def _checked_part(payload: dict) -> dict:
    """What a tensor cache's checksum covers: everything but the checksum itself."""
    return {k: v for k, v in payload.items() if k != "sha256"}


def _plain(sig):
    """Signatures as nested lists of str/int so they survive torch.load(weights_only=True)."""
    if sig is None:
        return None
    return [[str(a) if not isinstance(a, int) else a for a in item] for item in sig]
