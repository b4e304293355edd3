"""``run.py``'s check before Hydra starts: compose every run of the command line with the compose API and
validate it, so that bad input ends in one line and leaves nothing on disk (``@hydra.main`` makes the run
directory before the job starts). Also applies ``profile=<name>`` of an experiment preset."""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple
import sys

from omegaconf import DictConfig, OmegaConf

from fedbench.config import CONF_DIR
from fedbench.config.compose import allow_pretrained, compose_config, composition_error, parse_overrides
from fedbench.config.profiles import quote_value, single_run_overrides, table_profile
from fedbench.config.validate import validate_config
from fedbench.errors import FedbenchError

MULTIRUN = ("-m", "--multirun")
MAX_COMBINATIONS = 64   # beyond this, each sweep value is checked once (with the other axes' first values)


def preflight(argv: Sequence[str], conf_dir: Path = CONF_DIR,
              check: Optional[Callable[[DictConfig], None]] = None) -> List[str]:
    """The argv to hand to Hydra: the overrides (``model.pretrained`` made addable) plus the profile's settings.
    Raises ``FedbenchError`` for any bad input. Other Hydra flags (``--help``, ``--cfg job``) pass unchecked.
    ``check(cfg)``: a further check of each composed run once the torch-free pass accepts it (run.py's: the
    methods' own option rules, which need torch); not for ``--cfg``, which only prints the config."""
    argv, flags = _split_flags(list(argv))
    if flags is None:
        return argv
    if "--cfg" in flags or "-c" in flags:
        check = None
    multirun = any(a in MULTIRUN for a in flags)
    overrides = allow_pretrained(argv)
    fixed, sweeps = split_sweeps(overrides)
    if sweeps and not multirun:
        key, values = next(iter(sweeps.items()))
        raise FedbenchError(composition_error(Exception(f"Ambiguous value for argument '{key}={','.join(values)}'"),
                                              overrides))
    cli_keys = {a.lstrip("+~").split("=", 1)[0] for a in overrides}
    checked = [check_run(run, cli_keys, conf_dir) for run in combinations(fixed, sweeps)]
    extras = {tuple(extra) for extra, _ in checked}
    if len(extras) > 1:
        raise FedbenchError("profile= with a swept experiment gives each preset other settings; "
                            "sweep presets with scripts/reproduce.py instead")
    for _, cfg in checked if check is not None else ():   # only once every run passed the torch-free pass
        check(cfg)
    extra = list(extras.pop()) if extras else []
    return flags + overrides + extra


def _split_flags(argv: List[str]) -> Tuple[List[str], Optional[List[str]]]:
    """(overrides, flags) with -m, --resolve and --cfg job|hydra|all taken out; flags None (nothing checked)
    for any other Hydra flag (--help, --config-name ...), whose values could be mistaken for overrides."""
    overrides, flags = [], []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in MULTIRUN or a == "--resolve":
            flags.append(a)
        elif a in ("--cfg", "-c") and i + 1 < len(argv) and argv[i + 1] in ("job", "hydra", "all"):
            flags += [a, argv[i + 1]]
            i += 1
        elif a.startswith("-"):
            return argv, None
        else:
            overrides.append(a)
        i += 1
    return overrides, flags


def split_sweeps(overrides: Sequence[str]) -> Tuple[List[str], Dict[str, List[str]]]:
    fixed, sweeps = [], {}
    for arg, ov in zip(overrides, parse_overrides(overrides)):
        if ov.is_sweep_override():
            try:
                sweeps[arg.split("=", 1)[0]] = list(ov.sweep_string_iterator())
            except Exception:   # range()/interval() sweeps of other sweepers: left to Hydra
                continue
        else:
            fixed.append(arg)
    return fixed, sweeps


def combinations(fixed: List[str], sweeps: Dict[str, List[str]]) -> List[List[str]]:
    keys = list(sweeps)
    total = 1
    for k in keys:
        total *= len(sweeps[k])
    if total <= MAX_COMBINATIONS:
        return [fixed + [f"{k}={quote_value(v)}" for k, v in zip(keys, combo)]
                for combo in itertools.product(*(sweeps[k] for k in keys))]
    first = {k: sweeps[k][0] for k in keys}
    runs = []
    for k in keys:   # one value at a time: a bad value of any axis is still found
        for v in sweeps[k]:
            runs.append(fixed + [f"{kk}={quote_value(v if kk == k else first[kk])}" for kk in keys])
    return runs


def check_run(overrides: List[str], cli_keys, conf_dir: Path) -> Tuple[List[str], DictConfig]:
    """Validate one run; returns the overrides its profile adds (none without profile=) and its composed config."""
    cfg = compose_config(overrides, conf_dir, with_hydra=True)
    extra: List[str] = []
    if cfg.get("profile") is not None:

        table = OmegaConf.to_container(cfg.table, resolve=False) if cfg.get("table") is not None else None
        extra = single_run_overrides(table_profile(table, cfg.profile), cli_keys)
        if extra:
            cfg = compose_config(overrides + extra, conf_dir, with_hydra=True)
    validate_config(cfg, conf_dir)
    if cfg.get("tuning") == "on":   # a grid of selection runs, then final runs: more than one run.py job
        raise FedbenchError("tuning=on runs the preset's grids and final runs: use scripts/reproduce.py "
                            "experiment=<paper>/<table> tuning=on (run.py makes single runs)")
    return extra, cfg


def check_script_overrides(overrides: Sequence[str], conf_dir: Path = CONF_DIR) -> None:
    """The scripts' quick check before they import pandas or torch: the overrides parse, the config composes
    (sweep axes at their first value), the profile fits the preset and the composed config validates."""
    fixed, sweeps = split_sweeps(allow_pretrained(overrides))
    run = combinations(fixed, {k: v[:1] for k, v in sweeps.items()})[0]
    cfg = compose_config(run, conf_dir, with_hydra=True)
    # reproduce --allow-missing names missing methods itself; a checkpoint is looked for when runs are planned
    validate_config(cfg, conf_dir, allow_missing=True, need_checkpoint=False)


def main_guard(argv: Sequence[str], conf_dir: Path = CONF_DIR,
               check: Optional[Callable[[DictConfig], None]] = None) -> Optional[List[str]]:
    """``preflight`` that prints the one error line and exits with status 2."""

    try:
        return preflight(argv, conf_dir, check)
    except FedbenchError as e:
        print(f"fedbench: error: {e}", file=sys.stderr)
        sys.exit(2)
