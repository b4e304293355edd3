"""Client-stage cache: trained local models (and their curvature) stored under a hash of
everything that determines them, so every one-shot aggregator, lambda or solver variant and
every rerun reuses the same clients (DESIGN.md "client-stage cache").

Entries are single files written atomically (temp file + rename), so concurrent jobs sharing
the cache never see torn files; an entry that fails to load, whose recorded key parts do not
match, that has no checksum (written before checksums) or whose SHA-256 does not match its
content (fedbench/checksums.py) is reported, deleted and recomputed, never used; so is an entry computed at other
weights than the caller's (``fingerprint``: a client product's weights, so a key that fails to tell two members or
two trainings apart recomputes, with a warning, instead of serving the wrong curvature). A missing entry
is computed under a claim on its key (fedbench/results/claims.py): a second process needing the
same stage waits for the first one's entry and loads it instead of training the clients again.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import torch

from fedbench.checksums import payload_sha256
from fedbench.fl.resume import copy_atomic, parked_store
from fedbench.results.claims import claim
from fedbench.results.records import write_torch_atomic

CACHE_VERSION = 1   # bump when what a cached stage means changes
STAGES_DIR = "stages"   # in the parked store (results/checkpoints): unfinished stages' clients, scripts/park_checkpoints.py
USERS_SUFFIX = ".users"   # beside an entry: the run ids that used it, one a line (parking keeps what unfinished runs need)


def cache_key(parts: Dict[str, Any]) -> str:
    blob = json.dumps({"v": CACHE_VERSION, **parts}, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha1(blob.encode()).hexdigest()


class ClientStageCache:
    """On disk under ``root``; or, with ``root=None`` and a ``memory`` dict, in memory only (``cache=false`` with an
    aggregator list: the list's methods still share one trained stage, nothing is written)."""

    def __init__(self, root: Optional[str | os.PathLike], memory: Optional[Dict[str, Any]] = None,
                 max_bytes: Optional[int] = None):
        self.root = Path(root) if root else None
        self.memory = memory if self.root is None else None
        self.max_bytes = max_bytes   # on disk: after a save, the least recently used entries go until it fits
        self._bytes: Optional[int] = None   # the cache's size at the last scan plus this process's saves since
        self.hits = 0
        self.misses = 0
        self.served_s = 0.0   # what the entries served from the cache cost when they were computed (seconds)
        self.user: Optional[str] = None   # the run id using the entries (the runner sets it), noted beside each one

    @property
    def enabled(self) -> bool:
        return self.root is not None or self.memory is not None

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.pt"

    def contains(self, parts: Dict[str, Any]) -> bool:
        """Whether an entry exists for ``parts`` (not checked, not counted as a hit)."""
        if not self.enabled:
            return False
        key = cache_key(parts)
        return key in self.memory if self.memory is not None else self.path(key).exists()

    def load(self, parts: Dict[str, Any], fingerprint: Optional[str] = None) -> Optional[Dict[str, Any]]:
        if not self.enabled:
            return None
        key = cache_key(parts)
        if self.memory is not None:
            entry = self.memory.get(key)
            if entry is None or not _same_weights(entry, fingerprint):
                return None
            self.hits += 1
            self.served_s += float(entry.get("seconds") or 0.0)
            return _clone(entry["payload"])   # callers may change what they get; the shared copy stays intact
        path = self.path(key)
        if not path.exists() and not _unpark(key, path):
            return None
        try:
            entry = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(entry, dict) or entry.get("key") != key or \
                    json.loads(entry.get("parts", "null")) != json.loads(json.dumps(parts, default=str)):
                raise ValueError("key mismatch")
            if "sha256" not in entry:
                return self._discard(path, "has no checksum (written by an older fedbench)")
            if payload_sha256(_checked_part(entry)) != entry["sha256"]:
                return self._discard(path, "checksum mismatch")
            if not _same_weights(entry, fingerprint):
                return self._discard(path, "was computed at other weights than this run's (a cache key that does not "
                                           "tell them apart, or retrained clients)")
            self.hits += 1
            self.served_s += float(entry.get("seconds") or 0.0)
            if self.max_bytes is not None:
                _touch(path)   # recently used: evicted last
            self._note_user(path)
            return entry["payload"]
        except Exception as e:  # corrupt / torn / foreign / unchecked file: recompute, never use
            return self._discard(path, f"is unusable ({type(e).__name__})")

    @staticmethod
    def _discard(path: Path, why: str) -> None:
        print(f"fedbench: WARNING: cache entry {path} {why}; recomputing", file=sys.stderr)
        try:
            path.unlink()
        except OSError:
            pass
        return None

    def save(self, parts: Dict[str, Any], payload: Dict[str, Any], seconds: Optional[float] = None,
             fingerprint: Optional[str] = None) -> None:
        """``seconds``: what computing the payload cost, kept so a record served from the cache still reports it;
        ``fingerprint``: the weights it was computed at (``weights_fingerprint``), checked on load."""
        if not self.enabled:
            return
        key = cache_key(parts)
        if self.memory is not None:
            self.memory[key] = {"payload": _clone(payload), "seconds": seconds, "fingerprint": fingerprint}
            return
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        entry = {"key": key, "parts": json.dumps(parts, sort_keys=True, default=str), "payload": payload,
                 "seconds": None if seconds is None else float(seconds)}
        if fingerprint is not None:
            entry["fingerprint"] = str(fingerprint)
        entry["sha256"] = payload_sha256(_checked_part(entry))
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{key}.", suffix=".tmp")
        os.close(fd)
        try:
            torch.save(entry, tmp)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        ClientProgress(path.with_suffix(".clients")).clear()   # the finished clients of its computation, if any
        self._note_user(path)
        if self.max_bytes is not None:   # scan the directory only when the tally says the budget may be exceeded
            size = path.stat().st_size
            if self._bytes is None or self._bytes + size > self.max_bytes:
                self.evict(keep=path)
            else:
                self._bytes += size

    def evict(self, keep: Optional[Path] = None) -> int:
        """Remove the least recently used entries (oldest modification time: a load touches its entry) until the
        cache fits ``max_bytes``; ``keep`` stays. Returns how many went. A sweep of single-use stages (FOLA Fig. 3's
        one-round settings) would otherwise fill the disk. ``save`` calls it on its first save and then only when its
        running tally (last scan + own saves) passes the budget, not on every save (a setting at N = 100 saves
        hundreds of Fisher entries); other processes' saves are counted at the next scan."""
        entries = []
        for path in self.root.glob("*/*.pt"):
            try:
                st = path.stat()
            except OSError:   # removed by another process meanwhile
                continue
            entries.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in entries)
        removed, freed = 0, 0
        for _, size, path in sorted(entries, key=lambda e: e[0]):
            if total - freed <= self.max_bytes:
                break
            if path == keep:
                continue
            try:
                path.unlink()
            except OSError:
                continue
            path.with_suffix(USERS_SUFFIX).unlink(missing_ok=True)
            removed, freed = removed + 1, freed + size
        self._bytes = total - freed
        if removed:
            print(f"fedbench: client-stage cache over its {self.max_bytes / 1e9:g} GB budget (cache_max_gb): removed "
                  f"the {removed} least recently used entr{'y' if removed == 1 else 'ies'} ({freed / 1e9:.2f} GB)",
                  file=sys.stderr)
        return removed

    def _note_user(self, path: Path) -> None:
        """Add this run's id to the entry's users (``<key>.users``): a finished entry whose run has not finished (a
        one-shot run still in its server solves when a session ends) is parked with it (``park_stages``)."""
        if self.user is None:
            return
        users = path.with_suffix(USERS_SUFFIX)
        if self.user not in _read_users(users):
            with open(users, "a") as f:   # one short line: concurrent appends do not tear it
                f.write(self.user + "\n")

    def client_progress(self, parts: Dict[str, Any]) -> Optional["ClientProgress"]:
        """The store of the clients finished so far while the entry for ``parts`` is computed (on disk only; the
        computing process holds the entry's claim); ``save`` of the entry removes it."""
        return None if self.root is None else ClientProgress(self.path(cache_key(parts)).with_suffix(".clients"))

    def get_or_compute(self, parts: Dict[str, Any], compute: Callable[[], Dict[str, Any]],
                       device: Optional[torch.device] = None, fingerprint: Optional[str] = None) -> Dict[str, Any]:
        hit = self.load(parts, fingerprint)
        if hit is None:
            with self._claim(parts):
                hit = self.load(parts, fingerprint)   # another process may have stored it while we waited
                if hit is None:
                    return self._compute_and_save(parts, compute, fingerprint)
        return _to(hit, device) if device is not None else hit

    def _claim(self, parts: Dict[str, Any]):
        """Only one process computes a missing entry; the others wait for it (then load it)."""
        if self.root is None:   # disabled, or in memory (one process)
            return contextlib.nullcontext()
        key = cache_key(parts)
        return claim(self.path(key).with_suffix(".claim"), f"client-stage cache entry {key[:12]}")

    def _compute_and_save(self, parts: Dict[str, Any], compute: Callable[[], Dict[str, Any]],
                          fingerprint: Optional[str] = None) -> Dict[str, Any]:
        self.misses += 1
        t0 = time.perf_counter()
        payload = compute()
        self.save(parts, _to(payload, torch.device("cpu")), seconds=time.perf_counter() - t0, fingerprint=fingerprint)
        return payload


class ClientProgress:
    """A client stage's finished clients while it trains (``<entry>.clients/<i>.pt``), so that a process killed in a
    long stage (200 local epochs of ten clients) leaves its successor only the clients still missing
    (``train_clients(finished=...)``). Each file records what its client was trained with (``header``); one that
    does not match, or does not load, is ignored and trained again."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.resumed = False

    @property
    def key(self) -> str:
        return self.folder.name.removesuffix(".clients")

    def load(self, i: int, header: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        path = self.folder / f"{i}.pt"
        parked = parked_store() / STAGES_DIR / self.key / f"{i}.pt"
        if not path.exists() and parked.is_file():   # parked by a session that ended on another machine
            path = parked
        try:
            entry = torch.load(path, map_location="cpu", weights_only=False)
        except FileNotFoundError:
            return None
        except Exception as e:   # torn or foreign: train the client again
            print(f"fedbench: WARNING: finished client {path} does not load ({type(e).__name__}); training it again",
                  file=sys.stderr)
            return None
        if not isinstance(entry, dict) or entry.get("header") != header or entry.get("sha256") != \
                payload_sha256(entry.get("client")):
            return None
        if not self.resumed:   # once per stage
            print(f"fedbench: client stage resumes: the clients that finished before are taken from {self.folder}",
                  file=sys.stderr, flush=True)
            self.resumed = True
        return entry["client"]

    def save(self, i: int, header: Dict[str, Any], client: Dict[str, Any]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        client = _to(client, torch.device("cpu"))
        write_torch_atomic(self.folder / f"{i}.pt", {"header": header, "client": client, "sha256": payload_sha256(client)})

    def clear(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def park_stages(cache_root: Path, store: Path, finished: Optional[Callable[[str], bool]] = None) -> Dict[str, list]:
    """Park what a fresh machine needs to go on with the unfinished work of this cache, in ``<store>/stages/``:

    - every unfinished stage's finished clients (``<cache_root>/*/<key>.clients/``) go to ``stages/<key>/``, where
      ``ClientProgress`` finds them; a parked stage whose cache entry now exists here (finished) is removed;
    - every finished entry that a run still without its record used (``<key>.users``; ``finished(run_id)`` says
      whether a run has its ok record) goes to ``stages/<key>.pt`` with its users, where ``ClientStageCache.load``
      finds it: a one-shot run killed in its server solves does not train its clients again. A parked entry all
      of whose users have finished is removed. Without ``finished`` no entry is parked or removed.

    Returns {"parked": ["<key> (n clients)", ...], "entries": ["<key> (for run(s) ...)", ...], "removed": [key, ...]}."""
    done: Dict[str, list] = {"parked": [], "entries": [], "removed": []}
    cache_root, parked_root = Path(cache_root), Path(store) / STAGES_DIR
    for folder in sorted(cache_root.glob("*/*.clients")):
        files = sorted(folder.glob("*.pt"))
        if not files:
            continue
        target = parked_root / ClientProgress(folder).key
        target.mkdir(parents=True, exist_ok=True)
        for f in files:
            copy_atomic(f, target / f.name)
        done["parked"].append(f"{target.name} ({len(files)} client(s))")
    for target in sorted(parked_root.iterdir()) if parked_root.is_dir() else []:
        if target.is_dir() and (cache_root / target.name[:2] / f"{target.name}.pt").exists():
            shutil.rmtree(target, ignore_errors=True)
            done["removed"].append(target.name)
    if finished is None:
        return done
    for entry in sorted(cache_root.glob("*/*.pt")):
        parked = parked_root / entry.name
        users = _read_users(entry.with_suffix(USERS_SUFFIX)) | _read_users(parked.with_suffix(USERS_SUFFIX))
        waiting = sorted(u for u in users if not finished(u))
        if not waiting:
            continue
        parked_root.mkdir(parents=True, exist_ok=True)
        tmp = parked.with_name(f".{parked.stem}.users.part")   # the users first: a parked entry always has them
        tmp.write_text("".join(f"{u}\n" for u in sorted(users)))
        tmp.replace(parked.with_suffix(USERS_SUFFIX))
        if not parked.is_file() or parked.stat().st_size != entry.stat().st_size:
            copy_atomic(entry, parked)
        done["entries"].append(f"{entry.stem} (for run(s) {', '.join(waiting)})")
    for parked in sorted(parked_root.glob("*.pt")) if parked_root.is_dir() else []:
        local = cache_root / parked.stem[:2] / parked.with_suffix(USERS_SUFFIX).name
        users = _read_users(parked.with_suffix(USERS_SUFFIX)) | _read_users(local)
        if all(finished(u) for u in users):   # every run that needed it has its record (or nobody is known to)
            parked.unlink()
            parked.with_suffix(USERS_SUFFIX).unlink(missing_ok=True)
            done["removed"].append(parked.stem)
    return done


def _unpark(key: str, path: Path) -> bool:
    """Copy the parked entry ``<store>/stages/<key>.pt`` (``park_stages``) into the cache; whether there was one. It is
    checked like any entry when loaded."""
    parked = parked_store() / STAGES_DIR / f"{key}.pt"
    if not parked.is_file():
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    copy_atomic(parked, path)
    print(f"fedbench: client-stage cache entry {key[:12]} comes from its parked copy {parked}", file=sys.stderr)
    return True


def _read_users(path: Path) -> set:
    try:
        return {line.strip() for line in path.read_text().splitlines() if line.strip()}
    except OSError:
        return set()


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass


def weights_fingerprint(params: Dict[str, torch.Tensor]) -> str:
    """SHA-256 of a weight dict (names, dtypes, shapes, values): what a client product was computed at."""
    return payload_sha256(dict(params))


def _same_weights(entry: Dict[str, Any], fingerprint: Optional[str]) -> bool:
    """An entry written without a fingerprint (or a caller without one) cannot be checked, and passes."""
    have = entry.get("fingerprint")
    return fingerprint is None or have is None or have == fingerprint


def _checked_part(entry: Dict[str, Any]) -> Dict[str, Any]:
    """What an entry's checksum covers: everything but the checksum itself."""
    return {k: v for k, v in entry.items() if k != "sha256"}


def _clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return obj


def _to(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(v, device) for v in obj)
    return obj
