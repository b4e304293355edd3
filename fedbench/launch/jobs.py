"""What a job of a sweep executes: one composed run (every aggregator of a list) through the runner, alone
(a submitit array task) or as one of a local parallel sweep. Kept apart from sweep.py and parallel.py, which
run.py and the preflight import before anything needs torch."""
from __future__ import annotations

import os
import sys
from typing import Callable, Dict, Iterable, Iterator, List, Sequence

from fedbench.config import CONF_DIR
from fedbench.config.aggregators import expand_runs
from fedbench.errors import FedbenchError
from fedbench.launch.parallel import failed_outcome, merge_outcomes, run_isolated, slices, summary_line
from fedbench.launch.sweep import compose_run, run_dir
from fedbench.results.claims import is_held
from fedbench.runner import execute_all


def run_job_records(overrides: List[str], launch_dir: str, wait_for_claim: bool = True) -> List[Dict]:
    """Compose one run's config and execute it (every aggregator of a list); returns the records."""
    os.chdir(launch_dir)
    cfg = compose_run(overrides)
    return execute_all(cfg, run_dir(cfg, launch_dir), CONF_DIR, launch_dir=launch_dir, wait_for_claim=wait_for_claim)


def run_job(overrides: List[str], launch_dir: str) -> Dict:
    """What one array task executes (also importable for local debugging)."""
    recs = run_job_records(overrides, launch_dir)
    return {"run_ids": [r["run_id"] for r in recs], "status": [r["status"] for r in recs]}


def local_job(overrides: Sequence[str], launch_dir: str, env: Dict[str, str] | None = None,
              wait_for_claim: bool = True) -> Dict:
    """One run of a local parallel sweep: its own threads, its own failure. ``env``: the launcher's
    FEDBENCH_* variables (a reused joblib worker may have started under other ones). ``wait_for_claim=False``:
    a run another process holds gives a busy outcome (``parallel.busy_outcome``) instead of a wait."""
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
    return run_isolated(lambda: run_job_records(overrides, launch_dir, wait_for_claim), label, threads, out)


def local_group(group: Sequence[Sequence[str]], launch_dir: str, env: Dict[str, str] | None = None,
                wait_for_claim: bool = True) -> Dict:
    """The runs of one stage group (``stage_groups``), one after another in this worker. A run another process
    holds hands the whole group back (busy) while nothing of it has trained; after that, the rest waits its turn."""
    outcomes = []
    for ovs in group:
        outcome = local_job(list(ovs), launch_dir, env, wait_for_claim)
        if outcome.get("busy"):
            return outcome
        outcomes.append(outcome)
        wait_for_claim = wait_for_claim or outcome["ok"] + outcome["failed"] > 0
    return merge_outcomes(outcomes)


def _epochs_of(ovs: Sequence[str]) -> str | None:
    found = [o.split("=", 1)[1] for o in ovs if o.startswith("local.epochs=")]
    return found[0] if len(found) == 1 else None


def stage_groups(todo: Sequence[Sequence[str]]) -> Iterator[List[Sequence[str]]]:
    """``todo`` as groups of consecutive runs that share one local training: the same overrides but
    ``local.epochs``, every E listed in the config's ``share_epochs`` (whichever runs first trains the longest E and
    caches the others' snapshots). Two workers given two runs of one group would each train it; a group goes to one
    worker, in order. Every other run is a group of its own. Lazy: one composition per candidate group."""
    i = 0
    while i < len(todo):
        key = [o for o in todo[i] if not o.startswith("local.epochs=")]
        j = i + 1
        while j < len(todo) and _epochs_of(todo[i]) is not None and _epochs_of(todo[j]) is not None \
                and [o for o in todo[j] if not o.startswith("local.epochs=")] == key:
            j += 1
        group = list(todo[i:j])
        if len(group) > 1 and not _shares_epochs(group):
            yield from ([ovs] for ovs in group)
        else:
            yield group
        i = j


def stage_slices(todo: Sequence[Sequence[str]], n: int) -> List[List[Sequence[str]]]:
    """``todo`` dealt round-robin into at most ``n`` slices (local submitit tasks) by whole stage groups: two slices
    given runs of one share_epochs setting would each train it."""
    return [[ovs for group in part for ovs in group] for part in slices(list(stage_groups(todo)), n)]


def _shares_epochs(group: Sequence[Sequence[str]]) -> bool:
    try:
        share = compose_run(list(group[0])).get("share_epochs") or []
    except Exception:   # a run that does not compose: its job reports the error
        return False
    shared = {str(int(e)) for e in share}
    return all(str(_epochs_of(ovs)) in shared for ovs in group)


def local_slice(todo: Sequence[Sequence[str]], launch_dir: str) -> Dict:
    """One local submitit task: its share of the sweep (whole stage groups, as ``parallel.slices`` of
    ``stage_groups``), one run after another. Returns the merged outcome with the run ids and statuses of every
    record (as ``run_job``)."""
    order = busy_last(list(stage_groups(todo)), lambda group: _group_claimed(group, launch_dir))
    total = in_two_passes(order, lambda groups, wait: [local_group(g, launch_dir, None, wait) for g in groups])
    print(summary_line(total), flush=True)   # the last line of this task's log
    return {**total, "status": ["ok"] * total["ok"] + ["skipped"] * total["skipped"] + ["failed"] * total["failed"]}


def run_local(todo: Sequence[Sequence[str]], launch_dir: str, jobs: int) -> Dict:
    """Run ``todo`` with ``jobs`` processes at once (joblib's loky workers; in-process when jobs == 1)."""
    from joblib import Parallel, delayed

    n = max(1, min(jobs, len(todo)))
    env = {k: v for k, v in os.environ.items() if k.startswith("FEDBENCH_")}
    # a stage group (share_epochs' runs of one setting) is one task: one worker trains it once
    order = busy_last(stage_groups(todo), lambda group: _group_claimed(group, launch_dir))
    return in_two_passes(order, lambda groups, wait: Parallel(n_jobs=n, backend="loky")(
        delayed(local_group)(g, launch_dir, env, wait) for g in groups))


def in_two_passes(order: Iterable[Sequence], run_groups: Callable[[Iterable[Sequence], bool], List[Dict]]) -> Dict:
    """Run ``order``'s groups (``run_groups(groups, wait_for_claim)``: their outcomes, in order) without waiting on
    a claim, then those another process claimed between ``busy_last``'s check and their start (two launchers
    finishing at one moment pick the same next run), waiting for them now, usually to find the other's ok record
    and skip. Before, the second launcher waited out the first one's whole run while other runs were free."""
    dispatched: List[Sequence] = []

    def tracked() -> Iterator[Sequence]:   # lazy, as busy_last: what was handed out, in order
        for group in order:
            dispatched.append(group)
            yield group

    first = list(run_groups(tracked(), False))
    later = [group for group, outcome in zip(dispatched, first) if outcome.get("busy")]
    second = list(run_groups(later, True)) if later else []
    return merge_outcomes([o for o in first if not o.get("busy")] + second)


def _group_claimed(group: Sequence[Sequence[str]], launch_dir: str) -> bool:
    return any(claimed_elsewhere(ovs, launch_dir) for ovs in group)


def busy_last(todo: Iterable[Sequence], busy: Callable[[Sequence], bool]) -> Iterator[Sequence]:
    """``todo`` (runs, or groups of runs) in order, except that one ``busy`` says another process is training when
    its turn comes is put off to the end: two launchers on one sweep (two terminals, a second queue) then split it
    instead of one waiting out the other's claim. A put-off run is tried last (and, still held, waits in
    ``in_two_passes``' second pass, usually to find the other's ok record and skip). Lazy: joblib asks for a run
    when a worker is free."""
    later = []
    for item in todo:
        if busy(item):
            first = item[0] if item and not isinstance(item[0], str) else item
            more = f" (and {len(item) - 1} run(s) sharing its training)" if first is not item and len(item) > 1 else ""
            print(f"fedbench: {' '.join(first)}{more} is being run by another process; left for the end of this sweep",
                  file=sys.stderr, flush=True)
            later.append(item)
        else:
            yield item
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
