"""Methods, registered by name (one module per method)."""
from fedbench.algorithms.base import ALGORITHMS, Algorithm, Message  # noqa: F401
from fedbench.algorithms import centralized, dense, fedavg, fedbe, fedbens, fedcurv, feddyn, fedfisher, fedfisher_full, fedlap, fedlpa, fednova, fedov, fedprox, fisher_merge, fola, otfusion, pfnm, regmean, scaffold  # noqa: F401  (register)


def build_algorithm(cfg, setup) -> Algorithm:
    params = {k: v for k, v in dict(cfg).items() if k != "name"}
    return ALGORITHMS.get(cfg["name"])(params, setup)
