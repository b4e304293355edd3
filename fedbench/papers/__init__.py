"""Each paper's part of the report: table row keys, labels, figures and studies (fedbench/papers/<paper>/).

Every paper package has ``register()``, which adds its row keys, partition and method labels, plot kinds and
studies to fedbench.report.registry. ``load_papers()`` is the one entry point that calls them all (once); the
scripts and tests/conftest.py call it before using fedbench.report, which never imports this package. The 2-D Gaussian
illustrations (``gaussian_2d``, ``gaussian_2d_figures``) are shared by FedLPA, FOLA and FedBEns.
"""
from __future__ import annotations

from typing import Tuple

from fedbench.papers import fedbens, fedfisher, fedlap, fedlpa, fola
from fedbench.report.registry import LOADED_PAPERS

PAPERS = {"fedlpa": fedlpa, "fola": fola, "fedfisher": fedfisher, "fedbens": fedbens, "fedlap": fedlap}


def load_papers() -> Tuple[str, ...]:
    """Register every paper's row keys, labels, plot kinds and studies (a second call changes nothing)."""
    if not LOADED_PAPERS:
        for paper in PAPERS.values():
            paper.register()
        LOADED_PAPERS.extend(PAPERS)
    return tuple(PAPERS)
