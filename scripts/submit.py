#!/usr/bin/env python
"""Submit a sweep as one submitit job array and return immediately (non-blocking).

    python scripts/submit.py experiment=fedlpa/table6 profile=paper            # Slurm
    python scripts/submit.py seed=0,1,2 partition.beta=0.1,0.5 --cluster local  # local processes, --parallel N at once
    python scripts/submit.py ... --dry-run                                      # list what would run

Runs whose record is already ok are skipped, so resubmitting after preemption runs only what is
missing. Slurm settings come from FEDBENCH_SLURM_PARTITION / _ACCOUNT / _QOS / _TIMEOUT_MIN /
_CPUS / _MEM_GB / _GPUS / _ARRAY_PARALLELISM.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fedbench.errors import FedbenchError  # noqa: E402
from fedbench.config.preflight import check_script_overrides  # noqa: E402
from fedbench.launch.sweep import validate_cluster  # noqa: E402


def slurm_params_from_env() -> dict:
    env = os.environ.get
    p = {"timeout_min": int(env("FEDBENCH_SLURM_TIMEOUT_MIN", "240")),
         "cpus_per_task": int(env("FEDBENCH_SLURM_CPUS", "8")),
         "mem_gb": int(env("FEDBENCH_SLURM_MEM_GB", "32")),
         "gpus_per_node": int(env("FEDBENCH_SLURM_GPUS", "1")),
         "slurm_array_parallelism": int(env("FEDBENCH_SLURM_ARRAY_PARALLELISM", "64"))}
    for key, var in (("slurm_partition", "FEDBENCH_SLURM_PARTITION"), ("slurm_account", "FEDBENCH_SLURM_ACCOUNT"),
                     ("slurm_qos", "FEDBENCH_SLURM_QOS")):
        if env(var):
            p[key] = env(var)
    return p


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], usage="%(prog)s [overrides ...] [options]")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides; comma lists sweep (seed=0,1,2)")
    ap.add_argument("--cluster", default="slurm", help="slurm | local | debug | auto")
    ap.add_argument("--folder", default=None, help="submitit log folder (default outputs/submitit/%%j)")
    ap.add_argument("--force", action="store_true", help="rerun runs that already have an ok record")
    ap.add_argument("--dry-run", action="store_true", help="print the runs that would be submitted")
    ap.add_argument("--parallel", type=int, default=None, metavar="N",
                    help="--cluster local: tasks at once, each running its share of the runs one after another "
                         "(default: hardware.jobs, auto = cores // hardware.num_threads; 1 on CUDA)")
    args = ap.parse_intermixed_args(argv)   # options may follow overrides
    try:
        validate_cluster(args.cluster)
        from fedbench.config.tuning import tuning_on
        if tuning_on(args.overrides):   # selection decides which final runs exist: not one job array
            raise FedbenchError("tuning=on is run by scripts/reproduce.py (selection runs, then the final runs); "
                                "submit does not support it yet")
        if args.dry_run:
            from fedbench.launch.sweep import plan

            todo, done = plan(args.overrides, os.getcwd(), args.force)
            for ovs in todo:
                print("would run:", " ".join(ovs))
            print(f"{len(todo)} to run, {len(done)} already done")
            return 0
        check_script_overrides(args.overrides)   # bad overrides: one line, before torch is imported
        from fedbench.launch.submit import submit   # imports the runner (torch)
        jobs, todo, done = submit(args.overrides, cluster=args.cluster, folder=args.folder, force=args.force,
                                  params=slurm_params_from_env(), parallel=args.parallel)
    except FedbenchError as e:
        print(f"fedbench: error: {e}", file=sys.stderr)
        return 2
    if not jobs:
        print(f"nothing to submit: all {len(done)} run(s) already have ok records")
        return 0
    if args.cluster == "local" or len(jobs) < len(todo):   # local: the runs are dealt into --parallel tasks
        print(f"submitted {len(todo)} run(s) as {len(jobs)} local task(s) running at once ({len(done)} already "
              f"done, skipped); first job id {jobs[0].job_id}; each task's log ends with its runs' statuses")
        return 0
    print(f"submitted {len(jobs)} run(s) as one array ({len(done)} already done, skipped); "
          f"first job id {jobs[0].job_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
