"""Live loggers (none | csv | wandb). Records never depend on them; wandb is imported lazily."""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Dict, Mapping

from fedbench.errors import FedbenchError

LOGGERS = ("none", "csv", "wandb")


class NullLogger:
    def log_round(self, row: Mapping[str, Any]) -> None:
        pass

    def finish(self, status: str) -> None:
        pass


class CsvLogger(NullLogger):
    def __init__(self, out_dir: Path):
        self.path = Path(out_dir) / "progress.csv"
        self.path.unlink(missing_ok=True)
        self._header = None

    def log_round(self, row):
        new = not self.path.exists()
        with open(self.path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(row), extrasaction="ignore")
            if new:
                w.writeheader()
            w.writerow(row)


class WandbLogger(NullLogger):
    def __init__(self, cfg: Mapping[str, Any], run_id: str, config: Dict[str, Any], out_dir: Path):
        try:
            import wandb
        except ImportError:
            raise FedbenchError("logger=wandb needs wandb: pip install '.[wandb]' (or use logger=none)") from None
        self.wandb = wandb
        self.run = wandb.init(project=cfg.get("project", "fedbench"), entity=cfg.get("entity"),
                              mode=cfg.get("mode", "offline"), name=run_id, id=run_id, config=config,
                              dir=str(out_dir), reinit=True, resume="allow")

    def log_round(self, row):
        self.run.log({k: v for k, v in row.items() if k != "round"}, step=int(row["round"]))

    def finish(self, status):
        # always finish, or Hydra multirun reuses the run (ecosystem note D)
        self.run.finish(exit_code=0 if status == "ok" else 1)


def make_logger(cfg: Mapping[str, Any], run_id: str, config: Dict[str, Any], out_dir: Path):
    name = cfg.get("name", "none")
    if name not in LOGGERS:
        raise FedbenchError(f"unknown logger '{name}'; choose one of {LOGGERS}")
    if name == "csv":
        return CsvLogger(out_dir)
    if name == "wandb":
        return WandbLogger(cfg, run_id, config, out_dir)
    return NullLogger()
