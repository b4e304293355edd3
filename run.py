"""fedbench entry point: `python run.py [group=option ...] [key=value ...]` (Hydra; -m for sweeps)."""
from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from fedbench.errors import FedbenchError
from fedbench.config.compose import register_resolvers
from fedbench.config.preflight import main_guard


register_resolvers()   # fedbench_run_id (the run directory), fedbench_hydra_subdir (Hydra's saved files)
import fedbench.launch.parallel  # noqa: E402,F401  (${fedbench_sweep_jobs:}; also imported in each sweep worker)


CONF_DIR = Path(__file__).resolve().parent / "conf"


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    from fedbench.runner import execute_all

    hc = HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN:   # a sweep job: its failure is its own (fedbench/launch/parallel.py)
        from fedbench.launch import parallel

        outcome = parallel.run_isolated(
            lambda: execute_all(cfg, hc.runtime.output_dir, CONF_DIR, launch_dir=hc.runtime.cwd),
            label=" ".join(hc.overrides.task), num_threads=cfg.hardware.get("num_threads"),
            output_dir=hc.runtime.output_dir)
        parallel.report_outcome(outcome, hc.job.num)
        return None
    try:
        recs = execute_all(cfg, hc.runtime.output_dir, CONF_DIR, launch_dir=hc.runtime.cwd)
    except FedbenchError as e:
        print(f"fedbench: error: {e}", file=sys.stderr)
        sys.exit(2)
    return (recs[-1].get("metrics") or {}).get("accuracy")


def check_with_torch(cfg: DictConfig) -> None:
    """The methods' own option rules (choices, ranges), which live beside their torch code: run only once the
    torch-free pass has accepted a run, so the common mistakes are rejected without importing torch."""
    from fedbench.runner import check_methods

    check_methods(cfg, CONF_DIR)


if __name__ == "__main__":
    # validate (and apply profile=) before @hydra.main makes the run directory: bad input leaves nothing on disk
    sys.argv[1:] = main_guard(sys.argv[1:], CONF_DIR, check=check_with_torch)
    main()
