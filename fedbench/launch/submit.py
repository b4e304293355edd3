"""Queue a sweep's missing runs with submitit (Slurm, or local processes) and return at once."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Sequence

from fedbench.launch.jobs import local_slice, run_job, stage_slices
from fedbench.launch.parallel import default_jobs
from fedbench.launch.sweep import plan
from fedbench.runner import check_methods


def submit(overrides: Sequence[str], *, cluster: str = "slurm", folder: str | None = None,
           launch_dir: str | None = None, force: bool = False, params: Dict | None = None,
           parallel: int | str | None = None):
    """Queue the sweep's missing runs; returns (jobs, todo, done) without waiting.

    ``cluster="local"`` starts at most ``parallel`` local tasks (default: cores // threads per job, see
    ``fedbench.launch.parallel``), each running its round-robin slice of the runs one after another with
    ``hardware.num_threads`` threads and isolated failures; elsewhere each run is one array task."""
    import submitit

    launch_dir = launch_dir or os.getcwd()
    todo, done = plan(overrides, launch_dir, force, check=check_methods)
    if not todo:
        return [], todo, done
    folder = folder or str(Path(launch_dir) / "outputs" / "submitit" / "%j")
    executor = submitit.AutoExecutor(folder=folder, cluster=None if cluster == "auto" else cluster)
    params = dict(params or {})
    if executor.cluster != "slurm":
        params = {k: v for k, v in params.items() if not k.startswith("slurm_")}
    if params:
        executor.update_parameters(**params)
    if force:
        todo = [ovs + ["force=true"] for ovs in todo]
    if executor.cluster == "local":
        parts = stage_slices(todo, default_jobs(todo[0], parallel))
        return executor.map_array(local_slice, parts, [launch_dir] * len(parts)), todo, done
    jobs = executor.map_array(run_job, todo, [launch_dir] * len(todo))
    return jobs, todo, done
