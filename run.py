"""fedbench entry point: `python run.py [group=option ...] [key=value ...]` (Hydra; -m for sweeps)."""
from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from fedbench.errors import FedbenchError
from fedbench.results.records import compute_run_id


def _run_id(*, _root_):
    return compute_run_id(_root_)


OmegaConf.register_new_resolver("fedbench_run_id", _run_id, replace=True)
import fedbench.launch.parallel  # noqa: E402,F401  (${fedbench_sweep_jobs:}; also imported in each sweep worker)


CONF_DIR = Path(__file__).resolve().parent / "conf"
GROUPS = ("dataset", "partition", "model", "algorithm", "hardware", "logger", "experiment")


def check_group_overrides(argv) -> None:
    """Unknown group options end in one line here, instead of Hydra's multi-line composition error."""
    for arg in argv:
        key, eq, value = arg.lstrip("+~").partition("=")
        if not eq or key not in GROUPS or value in ("null", "") or "(" in value:
            continue
        options = sorted(str(p.relative_to(CONF_DIR / key).with_suffix("")) for p in (CONF_DIR / key).rglob("*.yaml"))
        for v in value.split(","):
            v = v.strip().strip("[]")
            if v and v not in options:
                hint = ", ".join(options) if len(options) <= 40 else f"{len(options)} presets under conf/{key}/"
                print(f"fedbench: error: unknown {key} '{v}'; choose one of: {hint}", file=sys.stderr)
                sys.exit(2)


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


if __name__ == "__main__":
    check_group_overrides(sys.argv[1:])
    main()
