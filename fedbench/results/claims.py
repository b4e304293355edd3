"""Claims on work: one lock file per run id or client-stage cache key, so that two processes (two
terminals, two Slurm array tasks, two threads of a parallel sweep) never compute the same thing at once.

A claim is a file created with ``O_CREAT | O_EXCL`` (atomic on local file systems and on NFSv3+) holding
the holder's host, pid, start time and a random token. The holder refreshes the file's mtime from a
heartbeat thread and deletes it on exit (context manager, also on exceptions). A claim is taken over
when its holder is gone: its pid is dead on this host, or its heartbeat is older than the timeout
(``FEDBENCH_CLAIM_TIMEOUT`` seconds, default 600; the only test possible for a holder on another host;
the heartbeat runs every tenth of it, so a live holder is never taken over unless it stalls that long).
Everything here is standard library: no torch.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, Optional, Tuple
from fedbench.errors import FedbenchError

TIMEOUT_ENV = "FEDBENCH_CLAIM_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0
UNREADABLE_GRACE_S = 10.0   # a claim file with no readable holder (killed while writing it) is stale after this
TAKEOVER_GRACE_S = 30.0     # the short lock around a takeover is stale after this


class ClaimHeld(Exception):
    """``claim(..., wait=False)`` met a live holder: the caller puts the work off (a sweep hands the run to its end)."""


@dataclass
class Claim:
    path: Path
    token: str
    timeout_s: float
    waited: bool = False       # another process held it when we first asked
    took_over: bool = False    # we removed a dead holder's claim
    thread: int = field(default_factory=threading.get_ident)   # the thread that took it


def claim_timeout() -> float:
    """The stale-heartbeat timeout in seconds (``FEDBENCH_CLAIM_TIMEOUT``)."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw in (None, ""):
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise FedbenchError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {raw!r}")
    return value


@contextlib.contextmanager
def claim(path: str | os.PathLike, what: str, *, timeout_s: Optional[float] = None,
          poll_s: float = 1.0, wait: bool = True) -> Iterator[Optional[Claim]]:
    """Hold the claim at ``path`` for the block; wait while a live holder has it (``wait=False``: raise
    :class:`ClaimHeld` instead). Yields the :class:`Claim`, or None when the folder cannot take a claim file
    (read-only: no one else can write there)."""
    path = Path(path)
    timeout_s = claim_timeout() if timeout_s is None else float(timeout_s)
    if _held_by_this_thread(path):   # waiting on ourselves would never end
        raise RuntimeError(f"claim {path} is already held by this thread")
    try:
        c = acquire(path, what, timeout_s=timeout_s, poll_s=poll_s, wait=wait)
    except OSError as e:   # e.g. a read-only folder: nothing can be written there by anyone
        print(f"fedbench: WARNING: cannot claim {what} at {path} ({type(e).__name__}); going on unclaimed",
              file=sys.stderr)
        c = None
    else:
        if c is None:
            info = holder(path) or {}
            raise ClaimHeld(f"{what} is claimed by {info.get('host', 'another process')} pid {info.get('pid', '?')} "
                            f"since {info.get('started', '?')}")
    try:
        yield c
    finally:
        if c is not None:
            release(c)


def acquire(path: Path, what: str, *, timeout_s: float, poll_s: float = 1.0, wait: bool = True) -> Optional[Claim]:
    """Take the claim (taking a dead holder's over); returns None if it is held and ``wait`` is false."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    waited = took_over = False
    sleep = min(0.05, poll_s)
    while True:
        if _create(path, _holder_text(token)):
            c = Claim(path, token, timeout_s, waited=waited, took_over=took_over)
            _register(c)
            return c
        seen = _read(path)
        if seen is None:   # released between our create and our read
            continue
        if _is_stale(seen, timeout_s):
            took_over |= _take_over(path, seen, what)
            continue
        if not wait:
            return None
        if not waited:
            info = seen[1] or {}
            print(f"fedbench: {what} is claimed by {info.get('host', '?')} pid {info.get('pid', '?')} since "
                  f"{info.get('started', '?')}; waiting for it", file=sys.stderr, flush=True)
            waited = True
        time.sleep(sleep)
        sleep = min(sleep * 2, poll_s)


def is_held(path: str | os.PathLike, timeout_s: Optional[float] = None) -> bool:
    """Whether a live holder has the claim at ``path`` now (a stale one, whose holder is gone, is not held)."""
    seen = _read(Path(path))
    return seen is not None and not _is_stale(seen, claim_timeout() if timeout_s is None else float(timeout_s))


def release(c: Claim) -> None:
    """Give the claim up: delete its file if it is still ours (it is not if we were taken over)."""
    _unregister(c)
    seen = _read(c.path)
    if seen is not None and (seen[1] or {}).get("token") == c.token:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(c.path)


def holder(path: str | os.PathLike) -> Optional[Dict]:
    """The holder recorded in a claim file (host, pid, started, token), or None."""
    seen = _read(Path(path))
    return None if seen is None else seen[1]


# ---- claim files ---------------------------------------------------------------------------------

def _holder_text(token: str) -> str:
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                       "started": _dt.datetime.now().isoformat(timespec="seconds"), "token": token})


def _create(path: Path, text: str) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    return True


def _read(path: Path) -> Optional[Tuple[str, Optional[Dict], int]]:
    """(raw text, parsed holder or None if unreadable, mtime in ns), or None if there is no claim file."""
    try:
        with open(path) as f:
            raw = f.read()
            mtime = os.fstat(f.fileno()).st_mtime_ns
    except FileNotFoundError:
        return None
    try:
        info = json.loads(raw)
        info = info if isinstance(info, dict) and "token" in info else None
    except ValueError:
        info = None
    return raw, info, mtime


def _is_stale(seen: Tuple[str, Optional[Dict], int], timeout_s: float) -> bool:
    _, info, mtime = seen
    age = time.time() - mtime / 1e9
    if info is None:
        return age > UNREADABLE_GRACE_S
    if info.get("host") == socket.gethostname():
        if info.get("pid") == os.getpid():   # our pid but not our token: a dead predecessor's (pid reuse)
            return info.get("token") not in _HELD
        if not _pid_alive(info.get("pid")):
            return True
    return age > timeout_s


def _pid_alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # someone else's live process
        return True
    try:   # a killed child nobody has reaped yet is a zombie: dead for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _take_over(path: Path, seen, what: str) -> bool:
    """Delete the stale claim ``seen`` unless it changed meanwhile; a short second lock makes sure two
    waiters never both delete (the second one would delete the first one's new claim)."""
    guard = path.with_name(path.name + ".takeover")
    if not _create(guard, _holder_text(uuid.uuid4().hex)):
        g = _read(guard)
        if g is not None and time.time() - g[2] / 1e9 > TAKEOVER_GRACE_S:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(guard)
        time.sleep(0.05)
        return False
    try:
        now = _read(path)
        if now is None or now[0] != seen[0] or now[2] != seen[2]:
            return False
        info = seen[1] or {}
        print(f"fedbench: WARNING: taking over the stale claim on {what} (holder {info.get('host', '?')} pid "
              f"{info.get('pid', '?')} since {info.get('started', '?')} is gone)", file=sys.stderr, flush=True)
        os.unlink(path)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(guard)


# ---- held claims and their heartbeat ---------------------------------------------------------------

_HELD: Dict[str, Claim] = {}     # token -> claim, every thread of this process
_LOCK = threading.Lock()
_WAKE = threading.Event()
_heartbeat_thread: Optional[threading.Thread] = None


def _held_by_this_thread(path: Path) -> bool:
    with _LOCK:
        return any(c.path == path and c.thread == threading.get_ident() for c in _HELD.values())


def _register(c: Claim) -> None:
    global _heartbeat_thread
    with _LOCK:
        _HELD[c.token] = c
        if _heartbeat_thread is None or not _heartbeat_thread.is_alive():
            _heartbeat_thread = threading.Thread(target=_heartbeat, name="fedbench-claims", daemon=True)
            _heartbeat_thread.start()
    _WAKE.set()


def _unregister(c: Claim) -> None:
    with _LOCK:
        _HELD.pop(c.token, None)


def _heartbeat() -> None:
    """Touch every held claim every tenth of its timeout, so others see its holder is alive."""
    while True:
        with _LOCK:
            held = list(_HELD.values())
        interval = min([c.timeout_s / 10 for c in held], default=60.0)
        _WAKE.wait(timeout=max(0.05, min(interval, 60.0)))
        _WAKE.clear()
        for c in held:
            seen = _read(c.path)
            if seen is not None and (seen[1] or {}).get("token") == c.token:
                with contextlib.suppress(OSError):
                    os.utime(c.path)
