"""Config code that needs no torch: composition, Hydra error rewriting, validation, profiles.

Nothing here may import torch or ``fedbench.runner``: bad input is rejected in well under two seconds.
"""
from pathlib import Path

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
