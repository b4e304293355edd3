"""FedBEns: the ``M``, ``T`` and ``sigma2`` row keys (Tables/Figs. 2-5), its Hessian-column labels and the
client-wise Dirichlet split's label."""
from __future__ import annotations

from typing import Any, Dict, Optional

from fedbench.report.registry import algorithm_key, alpha_label, register_method_label, register_partition_label, \
    register_row_key


def members(c):
    """FedBEns' M: mixture components per client ("custom" for per-client counts)."""
    return algorithm_key(c, "fedbens", lambda a: "custom" if a.get("members_per_client") else a.get("members"))


def temperature(c):
    """FedBEns Fig. 4's T."""
    return algorithm_key(c, "fedbens", lambda a: a.get("temperature"))


def prior_variance(c):
    """FedBEns Fig. 5's sigma^2."""
    return algorithm_key(c, "fedbens", lambda a: a.get("prior_var"))


def table_label(a: Dict[str, Any]) -> Optional[str]:
    """FedBEns' Hessian columns: ``fedbens_diag_full`` and ``fedbens_diag``."""
    if a.get("laplace") not in ("diag_full_last", "diag"):
        return None
    return "fedbens_diag_full" if a.get("laplace") == "diag_full_last" else "fedbens_diag"


def register() -> None:
    register_row_key("M", members)
    register_row_key("T", temperature)
    register_row_key("sigma2", prior_variance)
    register_method_label("fedbens", table_label)
    register_partition_label("dirichlet_clientwise", alpha_label)
