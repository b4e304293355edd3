"""FedFisher: Tables 4-5's ``s_q`` and Fig. 1a's ``width`` row keys, the client-wise Dirichlet split's label and
the GMI attack study of Table 6 / Fig. 4 (``gmi_attack``)."""
from __future__ import annotations

from typing import Any, Dict

from fedbench.papers.fedfisher import gmi_attack
from fedbench.report.registry import (Study, algorithm_key, alpha_label, register_partition_label,
                                      register_row_key, register_study)

GMI_STUDY = Study(gmi_attack.study_settings, gmi_attack.run_from_config, gmi_attack.publish)


def compression_ratio(a: Dict[str, Any]) -> int:
    """FedFisher Tables 4/5's s_q: 1 = uncompressed, else 32 // bits of the curvature upload."""
    if not a.get("compression", True):
        return 1
    return 32 // int(a.get("factor_bits") or a.get("fisher_bits") or 16)


def s_q(c):
    return algorithm_key(c, "fedfisher", compression_ratio)


def width(c):
    """FedFisher Fig. 1a's model width."""
    return (c.get("model") or {}).get("width")


def register() -> None:
    register_row_key("s_q", s_q)
    register_row_key("width", width)
    register_partition_label("dirichlet_clientwise", alpha_label)
    register_study("gmi_attack", GMI_STUDY)
