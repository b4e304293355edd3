"""Round checkpoints: a long run that is killed mid-way (a session's end, a Slurm time limit, a reboot) resumes
after its last saved round instead of starting again.

``checkpoint_every_s`` (config.yaml; not part of run_id) sets how often, at most, the run writes
``<run folder>/resume.pt``: the round it finished, the method's state, the history so far, the time spent and the
random number generators' states. The next start of the same run_id loads it and goes on with the next round;
a run that finishes deletes it (records never carry it: RECORD_FILES). Resuming is opt-in per method
(``Algorithm.resumable``), for methods whose whole memory across rounds is the state dict passed from
``aggregate`` to the next round; tests/test_resume.py checks, for each of them, that a run split in two gives the
same history and weights as the same run in one go.

A session that ends on one machine and goes on on a fresh one (``outputs/`` empty) can take its unfinished runs with
it: ``park_checkpoints`` copies each run folder's resume file into the committed store
``results/checkpoints/<run_id>.pt`` (``$FEDBENCH_CHECKPOINTS``; ``bash scripts/campaign.sh --park``), and a run that finds no resume file of its own
starts from its parked one. Parking again drops the parked files of runs that have since finished.
"""
from __future__ import annotations

import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from fedbench.results.records import write_torch_atomic

FORMAT = 1
FILE_NAME = "resume.pt"


@dataclass
class Resumed:
    round: int                          # the last round the saved run finished
    state: Dict[str, Any]
    rows: List[Dict[str, Any]]          # its history rows, rounds 1..round
    elapsed_s: float                    # wall and CPU seconds spent before (all earlier starts together)
    cpu_s: float
    resumed_after: List[int] = field(default_factory=list)   # every round a start resumed after, this one last
    started: Optional[str] = None       # when the first start began


def _rng_states() -> Dict[str, Any]:
    states = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: Dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    np.random.set_state(states["numpy"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


class RoundCheckpoint:
    """The resume file of one run folder."""

    def __init__(self, run_dir: Path, run_id: str, every_s: float, numerics: Any = None):
        self.path = Path(run_dir) / FILE_NAME
        self.run_id = run_id
        self.numerics = numerics   # fedbench/numerics.py's version of the method: a file of other arithmetic is not used
        self.every_s = float(every_s)
        self._last = time.perf_counter()

    def load(self, device) -> Optional[Resumed]:
        """The saved point of this run (and the generators set to theirs), or None: no file, or one that is
        unreadable, of another run or format, or of other numerics (then it is set aside as ``resume.pt.bad`` and the run starts
        over, with one warning)."""
        if not self.path.exists():
            parked = parked_store() / f"{self.run_id}.pt"
            if not parked.is_file():
                return None
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(FILE_NAME + ".part")
            shutil.copyfile(parked, tmp)
            tmp.replace(self.path)
            print(f"fedbench: {self.run_id} goes on from its parked checkpoint {parked}", file=sys.stderr)
        try:
            obj = torch.load(self.path, map_location=str(device), weights_only=False)
            ok = (isinstance(obj, dict) and obj.get("format") == FORMAT and obj.get("run_id") == self.run_id
                  and obj.get("numerics") == self.numerics)
            why = "of another run, format or numerics version"
        except Exception as e:   # a file cut short by a kill during the write cannot happen (atomic), but disks fail
            ok, why = False, f"unreadable ({type(e).__name__})"
        if not ok:
            self.path.replace(self.path.with_name(FILE_NAME + ".bad"))
            print(f"fedbench: WARNING: {self.path} is {why}; set aside as {FILE_NAME}.bad, the run starts over",
                  file=sys.stderr)
            return None
        _set_rng_states(obj["rng"])
        return Resumed(obj["round"], obj["state"], obj["rows"], obj["elapsed_s"], obj["cpu_s"],
                       list(obj.get("resumed_after", [])) + [obj["round"]], obj.get("started"))

    def due(self) -> bool:
        return time.perf_counter() - self._last >= self.every_s

    def save(self, round_idx: int, state: Dict[str, Any], rows: List[Dict[str, Any]], elapsed_s: float,
             cpu_s: float, resumed_after: List[int], started: Optional[str] = None) -> None:
        write_torch_atomic(self.path, {"format": FORMAT, "run_id": self.run_id, "numerics": self.numerics,
                                       "started": started, "round": round_idx, "state": state,
                                       "rows": list(rows), "elapsed_s": elapsed_s, "cpu_s": cpu_s,
                                       "resumed_after": list(resumed_after), "rng": _rng_states()})
        self._last = time.perf_counter()

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)


def parked_store() -> Path:
    """The committed store of unfinished runs' resume files: ``$FEDBENCH_CHECKPOINTS``, default
    ``results/checkpoints`` (relative to the cwd)."""
    return Path(os.environ.get("FEDBENCH_CHECKPOINTS", "results/checkpoints"))


def park_checkpoints(output_root: Path, store: Optional[Path] = None,
                     finished: Optional[set] = None) -> Dict[str, List[str]]:
    """Copy every run folder's resume file under ``output_root/runs`` into ``store`` as ``<run_id>.pt`` (a parked
    file of a later round is kept), and remove the parked files of ``finished`` run ids. Returns the run ids
    {"parked": [...], "kept": [...], "removed": [...]}."""
    store = Path(store or parked_store())
    done: Dict[str, List[str]] = {"parked": [], "kept": [], "removed": []}
    for path in sorted(Path(output_root).glob(f"runs/*/{FILE_NAME}")):
        run_id = path.parent.name
        if finished and run_id in finished:
            continue
        target = store / f"{run_id}.pt"
        if target.is_file() and _round_of(target) >= _round_of(path):
            done["kept"].append(run_id)
            continue
        store.mkdir(parents=True, exist_ok=True)
        copy_atomic(path, target)
        done["parked"].append(f"{run_id} (round {_round_of(target)})")
    for target in sorted(store.glob("*.pt")) if store.is_dir() else []:
        if finished and target.stem in finished:
            target.unlink()
            done["removed"].append(target.stem)
    return done


def copy_atomic(src: Path, dst: Path) -> None:
    """Copy through a hidden temp file and a rename: a reader never sees half a file."""
    tmp = dst.with_name(f".{dst.name}.part")
    shutil.copyfile(src, tmp)
    tmp.replace(dst)


def _round_of(path: Path) -> int:
    try:
        return int(torch.load(path, map_location="cpu", weights_only=False).get("round", -1))
    except Exception:   # an unreadable file is replaced
        return -1
