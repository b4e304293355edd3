"""Paths in a config: relative ones are taken from the launch directory (Hydra may change the working one)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


def absolute_path(path: str, launch_dir: Optional[str]) -> str:
    p = Path(os.path.expanduser(path))
    return str(p if p.is_absolute() else Path(launch_dir or os.getcwd()) / p)
