#!/usr/bin/env python
"""Sweep throughput: the same small real sweep one job at a time vs several jobs at once (``run.py -m``).

    python scripts/bench_sweep.py                        # 4 FedAvg runs, Fashion-MNIST (all 60k samples), LeNet, 2 epochs
    python scripts/bench_sweep.py --runs 8 --client-samples 12000 --parallel-threads 1

Each run trains long enough (about 8 s on one core) that the sweep's cost is its training, not the seconds every
process spends importing torch and loading the data set, which no number of jobs can hide.

Three configurations of the same sweep, each a fresh ``run.py -m`` process (imports and data loading included, as
a user sees it), ``cache=false``, into a fresh temporary output folder:
  one  - one job at a time, one thread (how a sweep ran before hardware.jobs: one core busy);
  wide - one job at a time with every core as its threads (hardware.jobs=1, hardware.num_threads=cores);
  par  - cores // t jobs at once with t threads each (t = --parallel-threads; the default ``hardware.jobs=auto``).
Prints wall times and the ratios one / par and wide / par, and where the parallel sweep loses against a perfect
``jobs``x: its runs' own seconds (from the records) against one at a time (contention for memory and caches), and
the job-seconds outside the runs (start-up, imports, data loading, idle jobs at the end); never a pass/fail. On a
shared machine other work skews every number: rerun, and compare on the same machine.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedbench.launch.parallel import available_cores  # noqa: E402


def sweep_overrides(args) -> list:
    seeds = ",".join(str(s) for s in range(args.runs))
    return [f"dataset={args.dataset}", f"model={args.model}", "algorithm=fedavg", f"num_clients={args.clients}",
            "rounds=1", f"local.epochs={args.epochs}", "cache=false", "progress=false", "hardware=cpu",
            f"seed={seeds}"] + holdout(args)


def holdout(args) -> list:
    """``--client-samples N``: the clients share N training samples; the rest is held out as (unused)
    unlabelled server data, which FedAvg never reads — a smaller real sweep, not a different one."""
    if args.client_samples is None:
        return []
    return [f"server_unlabeled.size={args.train_size - args.client_samples}", "server_unlabeled.mode=holdout"]


def children_cpu_seconds() -> float:
    """User + system CPU seconds of every finished (reaped) descendant so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def time_sweep(overrides, jobs: int, threads: int) -> dict:
    """One ``run.py -m`` sweep into a fresh output folder: its wall seconds, the CPU seconds of its processes,
    and the seconds its runs spent inside ``execute`` (the records' timing.total_s)."""
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as out:
        env = {**os.environ, "FEDBENCH_OUTPUTS": out, "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, str(ROOT / "run.py"), "-m", *overrides, f"hardware.jobs={jobs}",
               f"hardware.num_threads={threads}"]
        cpu0, t0 = children_cpu_seconds(), time.perf_counter()
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        seconds, cpu = time.perf_counter() - t0, children_cpu_seconds() - cpu0
        if p.returncode != 0:
            sys.exit(f"fedbench: error: the sweep failed (jobs={jobs}, threads={threads}): "
                     f"{(p.stderr.strip().splitlines() or ['?'])[-1]}")
        records = [json.loads(f.read_text()) for f in Path(out, "runs").glob("*/metrics.json")]
    in_runs = sum(float((r.get("timing") or {}).get("total_s") or 0.0) for r in records)
    # in runs: the runs' own wall seconds (training, evaluation), summed over jobs; outside: wall x jobs minus that
    # (interpreter start, imports, data loading, the launcher, and jobs idle at the sweep's end)
    outside = seconds * jobs - in_runs
    print(f"  {jobs} job(s) x {threads} thread(s): {seconds:7.1f} s wall, {cpu:7.1f} CPU s; in runs {in_runs:6.1f} s, "
          f"outside runs {outside:6.1f} job-s  ({len(records)} records)", flush=True)
    return {"wall": seconds, "cpu": cpu, "in_runs": in_runs, "outside": outside}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=4, help="runs in the sweep (seeds 0..runs-1)")
    ap.add_argument("--dataset", default="fmnist")
    ap.add_argument("--model", default="lenet")
    ap.add_argument("--clients", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--client-samples", type=int, default=0,
                    help="training samples the clients share (e.g. 12000 of Fashion-MNIST's 60000; default 0 = all)")
    ap.add_argument("--train-size", type=int, default=60000, help="the data set's training-set size")
    ap.add_argument("--parallel-threads", type=int, default=1, help="threads per job in configuration B")
    ap.add_argument("--serial-threads", type=int, default=None, help="threads of configuration wide (default: cores)")
    ap.add_argument("--parallel-first", action="store_true", help="time par first (load drifts on shared machines)")
    args = ap.parse_args(argv)
    if not args.client_samples or args.client_samples >= args.train_size:
        args.client_samples = None
    cores = available_cores()
    t = max(1, min(args.parallel_threads, cores))
    jobs = max(1, cores // t)
    ovs = sweep_overrides(args)
    print(f"sweep: {args.runs} x FedAvg on {args.dataset} ({args.client_samples or 'all'} client samples), "
          f"{args.model}, {args.clients} clients, 1 round x {args.epochs} epoch(s), cache=false; {cores} core(s) "
          f"(other processes on this machine count too)")
    ts = args.serial_threads or cores
    configs = {"one": (1, 1), "wide": (1, ts), "par": (jobs, t)}
    if ts == 1:
        configs.pop("wide")
    order = ["par", *[k for k in configs if k != "par"]] if args.parallel_first else list(configs)
    res = {k: time_sweep(ovs, *configs[k]) for k in order}
    for k in [k for k in ("one", "wide") if k in res]:
        j, th = configs[k]
        ratio = res[k]["wall"] / res["par"]["wall"]
        print(f"ratio: (1 job x {th} thread(s)) / ({jobs} jobs x {t} thread(s)) = {ratio:.2f}x")
    one, par = res["one"], res["par"]
    if jobs > 1 and one["in_runs"] > 0:
        # where the parallel sweep loses against jobs x: runs slowed by sharing the machine (memory bandwidth,
        # caches, other load), or time outside the runs that one job at a time also pays but cannot overlap
        print(f"where par loses: its runs took {par['in_runs'] / one['in_runs']:.2f}x the run seconds of one at a "
              f"time (contention); outside the runs {par['outside']:.1f} job-s against {one['outside']:.1f} s; "
              f"CPU seconds {par['cpu'] / one['cpu']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
