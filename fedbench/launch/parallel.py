"""Local parallel sweeps: how many jobs at once, how many threads each, and isolation of failures.

Used by ``run.py -m`` (Hydra's joblib launcher, whose ``n_jobs`` comes from the ``fedbench_sweep_jobs``
resolver), ``scripts/reproduce.py`` (joblib) and ``scripts/submit.py --cluster local`` (submitit, one
local task per slice of the sweep). Every run still goes through ``fedbench.runner.execute``.

A sweep job never ends the sweep: it prints one ``fedbench: error: [overrides] reason`` line, and the
sweep ends with ``fedbench: sweep: N ok, M failed, K skipped`` (counted per run record; a job that fails
before writing any record counts as one failed run) and a non-zero exit status if anything failed.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Sequence
import shutil

from omegaconf import OmegaConf

from fedbench.config.hardware import parse_num_threads
from fedbench.errors import FedbenchError
from fedbench.results.claims import ClaimHeld
from fedbench.results.records import compute_run_id
from fedbench.launch.sweep import compose_run

# Threads per sweep job when hardware.num_threads is auto. Measured with scripts/bench_sweep.py on a shared,
# busy 2-core CPU machine (4 FedAvg runs, Fashion-MNIST 12k client samples, LeNet, 1 epoch): two 1-thread jobs
# at once took 76.5 s / 115.5 s against 377.2 s / 386.7 s for one 2-thread job at a time (3.4-4.9x); one
# 1-thread job at a time took 145.1 s against 175.5 s for two (load average ~13 then: no gain measurable).
# Quiet, the same machine (4 runs on all 60k samples, 2 epochs): 1 job x 1 thread 52.0 s, 1 job x 2 threads 36.5 s,
# 2 jobs x 1 thread 29.9 s. Quiet again (session 10): 56.0 / 40.6 / 30.8 s (1.82x); the two jobs' runs took 0.99x the
# run seconds of one at a time (no contention), and all of the loss was outside the runs (13.7 job-s of worker
# start-up, imports and data loading against 7.7 s). Session 11, after a run stopped importing torchvision, scipy and
# pandas: 51.4 / 45.5 / 29.1 s (1.77x); outside the runs 10.1 job-s in parallel against 5.4 s one at a time.
DEFAULT_THREADS_PER_JOB = 1
STATUS_DIR_ENV = "FEDBENCH_SWEEP_STATUS_DIR"


def available_cores() -> int:
    """Cores this process may use (a Slurm/cgroup CPU set, else every core)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        return os.cpu_count() or 1


def threads_per_job(num_threads) -> int:
    """A sweep job's torch threads: ``hardware.num_threads`` when it is a number, else the measured default."""
    n = parse_num_threads(num_threads)
    return DEFAULT_THREADS_PER_JOB if n is None else n


def parallel_jobs(jobs, num_threads, device="auto") -> int:
    """Jobs at once: ``hardware.jobs`` when it is a number, else cores // threads per job on a CPU.
    Runs on a GPU (device cuda, or auto where CUDA exists) share that one device, so auto gives one job."""
    if jobs not in (None, "auto"):
        try:
            n = int(jobs)
        except (TypeError, ValueError):
            n = 0
        if n < 1 or isinstance(jobs, bool):
            raise FedbenchError(f"hardware.jobs (--parallel) must be auto or a positive integer, got {jobs!r}")
        return n
    if _uses_cuda(device):
        return 1
    return max(1, available_cores() // threads_per_job(num_threads))


def _uses_cuda(device) -> bool:
    device = str(device)
    if device.startswith("cuda"):
        return True
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return False


def register_resolvers() -> None:
    """``${fedbench_sweep_jobs:...}`` (the joblib launcher's n_jobs) and ``${fedbench_run_id:}`` (run dirs);
    also in each joblib worker, which resolves the job's run dir before calling run.py's main."""

    if not OmegaConf.has_resolver("fedbench_sweep_jobs"):
        OmegaConf.register_new_resolver("fedbench_sweep_jobs", parallel_jobs)
    if not OmegaConf.has_resolver("fedbench_run_id"):
        OmegaConf.register_new_resolver("fedbench_run_id", lambda *, _root_: compute_run_id(_root_))


register_resolvers()


# ---- one job, isolated ---------------------------------------------------------------------------------

def count_records(records: Iterable[Dict]) -> Dict[str, int]:
    counts = {"ok": 0, "failed": 0, "skipped": 0}
    for rec in records:
        key = "skipped" if rec.get("skipped") else "ok" if rec.get("status") == "ok" else "failed"
        counts[key] += 1
    return counts


def run_isolated(execute: Callable[[], List[Dict]], label: str, num_threads=None,
                 output_dir: str | Path | None = None) -> Dict:
    """Run one sweep job; never raises (except on Ctrl-C). Returns {ok, failed, skipped, errors}.

    ``num_threads``: the job's ``hardware.num_threads`` (auto = DEFAULT_THREADS_PER_JOB; None = leave
    torch's default, as on Slurm, where the task's CPUs are its own). ``execute`` returns run records
    (``execute_all``). A FedbenchError (bad config, before training) and any other exception become one
    ``fedbench: error: [label] ...`` line; the traceback of an unexpected exception goes to
    ``output_dir/traceback.txt`` (the run's own failed record is written by execute). ClaimHeld (a first pass's
    ``wait_for_claim=False``) gives ``busy_outcome()``."""
    try:
        if num_threads is not None:
            import torch

            torch.set_num_threads(threads_per_job(num_threads))
        records = execute()
    except ClaimHeld as e:   # another launcher took the run after our busy check: it goes to the sweep's end
        print(f"fedbench: [{label}] {e}; left for the end of this sweep", file=sys.stderr, flush=True)
        return busy_outcome()
    except FedbenchError as e:
        return failed_outcome(label, str(e))
    except Exception as e:   # a bug or a numerical failure in training: this job only
        where = _save_traceback(output_dir)
        return failed_outcome(label, f"{type(e).__name__}: {e}" + (f" (traceback: {where})" if where else ""))
    outcome = {**count_records(records), "errors": []}
    for rec in records:
        if not rec.get("skipped") and rec.get("status") != "ok":
            reason = " ".join(str(rec.get("error")).split())
            outcome["errors"].append(f"[{label}] run {rec.get('run_id')} {rec.get('status')}: {reason}")
            print(f"fedbench: error: {outcome['errors'][-1]}", file=sys.stderr, flush=True)
    return outcome


def busy_outcome() -> Dict:
    """A job handed back untried (``ClaimHeld``): counts nothing now, the sweep's second pass runs it."""
    return {"ok": 0, "failed": 0, "skipped": 0, "errors": [], "busy": True}


def failed_outcome(label: str, reason: str) -> Dict:
    line = f"[{label}] {' '.join(reason.split())}"   # always one line
    print(f"fedbench: error: {line}", file=sys.stderr, flush=True)
    return {"ok": 0, "failed": 1, "skipped": 0, "errors": [line]}


def _save_traceback(output_dir) -> str | None:
    if output_dir is None:
        return None
    try:
        path = Path(output_dir) / "traceback.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(traceback.format_exc())
        return str(path)
    except OSError:
        return None


def merge_outcomes(outcomes: Iterable[Dict]) -> Dict:
    total = {"ok": 0, "failed": 0, "skipped": 0, "errors": []}
    for o in outcomes:
        for key in ("ok", "failed", "skipped"):
            total[key] += int(o.get(key, 0))
        total["errors"] += list(o.get("errors", []))
    return total


def summary_line(total: Dict) -> str:
    return f"fedbench: sweep: {total['ok']} ok, {total['failed']} failed, {total['skipped']} skipped"


# ---- run.py -m: each joblib job writes its outcome; a Hydra callback sums them up -------------------------

def report_outcome(outcome: Dict, job_num: int) -> None:
    """Leave a job's outcome where the sweep's SweepSummary callback finds it (run.py -m)."""
    status_dir = os.environ.get(STATUS_DIR_ENV)
    if not status_dir:
        return
    try:
        (Path(status_dir) / f"{job_num}.json").write_text(json.dumps(outcome))
    except OSError as e:   # the summary undercounts; the job's own lines and records stand
        print(f"fedbench: WARNING: sweep status not written to {status_dir}: {e}", file=sys.stderr)


def collect_outcomes(status_dir: str | Path) -> Dict:
    return merge_outcomes(json.loads(p.read_text()) for p in sorted(Path(status_dir).glob("*.json")))


try:
    from hydra.experimental.callback import Callback
except ImportError:   # pragma: no cover - hydra-core is a dependency
    Callback = object


def check_launcher(config) -> None:
    """A bad hardware.jobs / num_threads ends the sweep in one line before any job starts (the launcher
    would resolve ``${fedbench_sweep_jobs:...}`` into a multi-line traceback)."""
    if "n_jobs" not in (config.hydra.get("launcher") or {}):   # another launcher (submitit on Slurm)
        return
    hw = config.get("hardware") or {}
    try:
        parallel_jobs(hw.get("jobs", "auto"), hw.get("num_threads"), hw.get("device", "auto"))
    except FedbenchError as e:
        print(f"fedbench: error: {e}", file=sys.stderr)
        sys.exit(2)


class SweepSummary(Callback):
    """``hydra.callbacks``: gives the sweep's jobs a status folder (named in the environment, which the
    launcher's processes inherit; inside the sweep dir, so Slurm jobs on a shared file system reach it too),
    then prints the one-line summary and exits 1 if any run failed."""

    def on_multirun_start(self, config, **kwargs) -> None:
        check_launcher(config)
        sweep_dir = Path(str(config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        self.status_dir = tempfile.mkdtemp(prefix=".sweep-status-", dir=sweep_dir)
        os.environ[STATUS_DIR_ENV] = self.status_dir

    def on_multirun_end(self, config, **kwargs) -> None:
        total = collect_outcomes(self.status_dir)
        shutil.rmtree(self.status_dir, ignore_errors=True)
        os.environ.pop(STATUS_DIR_ENV, None)
        print(summary_line(total), file=sys.stderr if total["failed"] else sys.stdout, flush=True)
        if total["failed"]:
            sys.exit(1)


# ---- reproduce.py / submit.py --cluster local ------------------------------------------------------------

def slices(todo: Sequence, n: int) -> List[List]:
    """``todo`` dealt round-robin into at most ``n`` non-empty slices (one per local task)."""
    n = max(1, min(n, len(todo)))
    return [list(todo[i::n]) for i in range(n)]


def default_jobs(overrides: Sequence[str], parallel) -> int:
    """``--parallel`` if given, else ``hardware.jobs`` / ``hardware.num_threads`` of one run's config (no sweep syntax)."""

    if parallel is not None:
        return parallel_jobs(parallel, None)
    hw = compose_run(list(overrides)).hardware
    return parallel_jobs(hw.get("jobs", "auto"), hw.get("num_threads"), hw.get("device", "auto"))
