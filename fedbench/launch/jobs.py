"""What a job of a sweep executes: one composed run (every aggregator of a list) through the runner, alone
(a submitit array task) or as one of a local parallel sweep. Kept apart from sweep.py and parallel.py, which
run.py and the preflight import before anything needs torch."""
from __future__ import annotations

import os
import sys
from typing import Callable, Dict, Iterator, List, Sequence

from fedbench.config import CONF_DIR
from fedbench.config.aggregators import expand_runs
from fedbench.errors import FedbenchError
from fedbench.launch.parallel import failed_outcome, merge_outcomes, run_isolated, summary_line
from fedbench.launch.sweep import compose_run, run_dir
from fedbench.results.claims import is_held
from fedbench.runner import execute_all


def run_job_records(overrides: List[str], launch_dir: str) -> List[Dict]:
    """Compose one run's config and execute it (every aggregator of a list); returns the records."""
    os.chdir(launch_dir)
    cfg = compose_run(overrides)
    return execute_all(cfg, run_dir(cfg, launch_dir), CONF_DIR, launch_dir=launch_dir)


def run_job(overrides: List[str], launch_dir: str) -> Dict:
    """What one array task executes (also importable for local debugging)."""
    recs = run_job_records(overrides, launch_dir)
    return {"run_ids": [r["run_id"] for r in recs], "status": [r["status"] for r in recs]}


def local_job(overrides: Sequence[str], launch_dir: str, env: Dict[str, str] | None = None) -> Dict:
    """One run of a local parallel sweep: its own threads, its own failure. ``env``: the launcher's
    FEDBENCH_* variables (a reused joblib worker may have started under other ones)."""
    if env is not None:
        for key in [k for k in os.environ if k.startswith("FEDBENCH_") and k not in env]:
            del os.environ[key]
        os.environ.update(env)
    label = " ".join(overrides)
    try:
        cfg = compose_run(overrides)
        threads = cfg.hardware.get("num_threads") or "auto"
        out = run_dir(cfg, launch_dir)
    except FedbenchError as e:
        return failed_outcome(label, str(e))
    except Exception as e:   # e.g. Hydra's composition error: one line, this job only
        return failed_outcome(label, f"{type(e).__name__}: {e}")
    return run_isolated(lambda: run_job_records(overrides, launch_dir), label, threads, out)


def local_slice(todo: Sequence[Sequence[str]], launch_dir: str) -> Dict:
    """One local submitit task: its share of the sweep, one run after another. Returns the merged outcome
    with the run ids and statuses of every record (as ``run_job``)."""
    order = busy_last(todo, lambda ovs: claimed_elsewhere(ovs, launch_dir))
    total = merge_outcomes(local_job(list(ovs), launch_dir) for ovs in order)
    print(summary_line(total), flush=True)   # the last line of this task's log
    return {**total, "status": ["ok"] * total["ok"] + ["skipped"] * total["skipped"] + ["failed"] * total["failed"]}


def run_local(todo: Sequence[Sequence[str]], launch_dir: str, jobs: int) -> Dict:
    """Run ``todo`` with ``jobs`` processes at once (joblib's loky workers; in-process when jobs == 1)."""
    from joblib import Parallel, delayed

    n = max(1, min(jobs, len(todo)))
    env = {k: v for k, v in os.environ.items() if k.startswith("FEDBENCH_")}
    order = busy_last(todo, lambda ovs: claimed_elsewhere(ovs, launch_dir))
    outcomes = Parallel(n_jobs=n, backend="loky")(delayed(local_job)(list(ovs), launch_dir, env) for ovs in order)
    return merge_outcomes(outcomes)


def busy_last(todo: Sequence[Sequence[str]], busy: Callable[[Sequence[str]], bool]) -> Iterator[Sequence[str]]:
    """``todo`` in order, except that a run ``busy`` says another process is training when its turn comes
    is put off to the end: two launchers on one sweep (two terminals, a second queue) then split it instead
    of one waiting out the other's claim. A put-off run is tried last and then waits for the claim as before
    (usually to find the other's ok record and skip). Lazy: joblib asks for a run when a worker is free."""
    later = []
    for ovs in todo:
        if busy(ovs):
            print(f"fedbench: {' '.join(ovs)} is being run by another process; left for the end of this sweep",
                  file=sys.stderr, flush=True)
            later.append(ovs)
        else:
            yield ovs
    yield from later


def claimed_elsewhere(overrides: Sequence[str], launch_dir: str) -> bool:
    """Whether a live holder claims the run (or one run of its aggregator list) now; a run that does not
    compose is not busy (its job reports the error)."""
    try:
        cfg = compose_run(list(overrides))
        subs = expand_runs(cfg, CONF_DIR)
        return any(is_held(run_dir(sub, launch_dir) / ".claim") for sub in subs)
    except Exception:
        return False
