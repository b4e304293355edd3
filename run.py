"""fedbench entry point: `python run.py [group=option ...] [key=value ...]` (Hydra; -m for sweeps)."""
from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from fedbench.errors import FedbenchError
from fedbench.config.compose import register_resolvers
from fedbench.config.preflight import main_guard


register_resolvers()   # fedbench_run_id (the run directory), fedbench_hydra_subdir (Hydra's saved files)


CONF_DIR = Path(__file__).resolve().parent / "conf"


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    from fedbench.runner import execute_all

    hc = HydraConfig.get()
    try:
        recs = execute_all(cfg, hc.runtime.output_dir, CONF_DIR, launch_dir=hc.runtime.cwd)
    except FedbenchError as e:
        print(f"fedbench: error: {e}", file=sys.stderr)
        sys.exit(2)
    return (recs[-1].get("metrics") or {}).get("accuracy")


if __name__ == "__main__":
    # validate (and apply profile=) before @hydra.main makes the run directory: bad input leaves nothing on disk
    sys.argv[1:] = main_guard(sys.argv[1:], CONF_DIR)
    main()
