"""FedLap: App. D.2's ``map_delta`` row key and the labels of its heterogeneous splits (App. E.1's size/class
Dirichlet, PVI's inhomogeneous UCI split and FLamby's natural hospital split are all "heterog" in its tables)."""
from __future__ import annotations

from fedbench.report.registry import heterogeneous_label, register_partition_label, register_row_key


def map_delta(c):
    """FedLap App. D.2's distance of the MAP reference."""
    return (c.get("eval") or {}).get("map_reference")


def register() -> None:
    register_row_key("map_delta", map_delta)
    for partition in ("size_class_dirichlet", "uci_inhomogeneous", "natural"):
        register_partition_label(partition, heterogeneous_label)
