"""FedLPA: Table 3's damping row key ``lambda``, the t-SNE plot kinds of Figs. 1, 4, 5 (``tsne``), Fig. 2's series
against the exact solve of each round (``solver_rounds``) and the Fisher heatmap of Fig. 3 (``fisher_heatmap``, drawn
by scripts/fedlpa_fisher_heatmap.py)."""
from __future__ import annotations

from fedbench.papers.fedlpa import solver_rounds, tsne
from fedbench.report.registry import algorithm_key, register_plot_kind, register_row_key


def damping(c):
    """FedLPA Table 3's lambda."""
    return algorithm_key(c, "fedlpa", lambda a: a.get("damping"))


def register() -> None:
    register_row_key("lambda", damping)
    for kind in tsne.PLOTS:
        register_plot_kind(kind, tsne.plot_kind)
    for kind in solver_rounds.PLOTS:
        register_plot_kind(kind, solver_rounds.plot_kind)
