"""FOLA: the ``fola_offline`` table label, the per-class contiguous Dirichlet split's label, the figures of
Figs. 3-12 (``figures``) and the §IV-E softmax-regression study (``laplace_study``)."""
from __future__ import annotations

from typing import Any, Dict, Optional

from fedbench.papers.fola import figures, laplace_study
from fedbench.report.registry import (Study, alpha_label, register_method_label, register_partition_label,
                                      register_plot_kind, register_study)

LAPLACE_STUDY = Study(laplace_study.study_settings, laplace_study.run_from_config)


def table_label(a: Dict[str, Any]) -> Optional[str]:
    """FOLA-offline shares ``name: fola``; its tables call it ``fola_offline``."""
    return "fola_offline" if (a.get("fisher") or {}).get("mode") == "offline" else None


def register() -> None:
    register_method_label("fola", table_label)
    register_partition_label("dirichlet_per_class_contiguous", alpha_label)
    for kind, fn in figures.PLOTS.items():
        register_plot_kind(kind, fn)
    register_study("fola_laplace", LAPLACE_STUDY)
