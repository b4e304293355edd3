"""fedbench entry point: `python run.py [group=option ...] [key=value ...]` (Hydra; -m for sweeps)."""
from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from fedbench.errors import FedbenchError
from fedbench.results.records import compute_run_id


def _run_id(*, _root_):
    return compute_run_id(_root_)


OmegaConf.register_new_resolver("fedbench_run_id", _run_id, replace=True)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    from fedbench.runner import execute

    hc = HydraConfig.get()
    try:
        rec = execute(cfg, hc.runtime.output_dir, launch_dir=hc.runtime.cwd)
    except FedbenchError as e:
        print(f"fedbench: error: {e}", file=sys.stderr)
        sys.exit(2)
    return (rec.get("metrics") or {}).get("accuracy")


if __name__ == "__main__":
    main()
