"""Helpers every figure module shares: matplotlib on the Agg backend, a preset figure's title, and saving a
figure with the data it shows (``<name>_data.csv`` beside the PNG)."""
from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any, Dict

import pandas as pd


def pyplot():
    """matplotlib.pyplot on the Agg backend (imported on first use: matplotlib is only needed for figures)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def figure_title(meta: Dict[str, Any], profile: str) -> str:
    tag = "quick — reduced settings, NOT the paper's protocol" if profile == "quick" else profile
    return f"{meta.get('paper')} {meta.get('id')}: {meta.get('title', '')} [profile: {tag}]"


def save_figure(fig, path: Path, data: pd.DataFrame, title: str) -> Path:
    fig.suptitle("\n".join(textwrap.wrap(title, 110)), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    data.to_csv(path.with_name(path.stem + "_data.csv"), index=False)
    return path
