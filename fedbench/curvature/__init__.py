"""Curvature engine: diagonal, K-FAC, full / layer-block and online Fisher / GGN / Hessian, and the
Gaussian posteriors built on them (issue #3).

Entry points:

* :func:`compute_curvature` (``compute.py``): structures ``diag | kfac | full | layer_blocks |
  diag_lastlayer_full``; Fisher types ``empirical | true | mc | ggn | hessian``; scale ``mean | sum``;
  K-FAC conv conventions ``fedlpa_kfc | nngeometry | expand | reduce``.
* damping (``damping.py``): :func:`damp_kfac` (FedLPA's π√λ / √λ/π), :func:`damp` (kron / isotropic / none).
* posteriors (``posterior.py``): :class:`DiagGaussian`, :class:`KronGaussian`, :class:`DenseGaussian`,
  :class:`ProductGaussian`, :func:`gaussian_from_curvature`.
* online (``online.py``): :class:`OnlineDiagFisher` (FOLA), :class:`OnlineDiagFisherHook` (engine hook).
* ``curvlinops_adapter.py``: K-FAC expand/reduce through curvlinops 3.0.1 (``backend="curvlinops"``).

Conventions (output-space vectors per Fisher type, conv scalings, orderings) are documented in
``likelihood.py``, ``engine.KFACHooks`` and ``structures.KronBlock``.
"""
from fedbench.curvature.compute import (BACKENDS, FISHER_TYPES, SCALES, STRUCTURES, compute_curvature)
from fedbench.curvature.damping import DAMPING_MODES, PI_RULES, damp, damp_kfac, kron_pi
from fedbench.curvature.engine import CONV_CONVENTIONS
from fedbench.curvature.layout import ParamLayout
from fedbench.curvature.online import ONLINE_MODES, OnlineDiagFisher, OnlineDiagFisherHook
from fedbench.curvature.posterior import (DenseGaussian, DiagGaussian, Gaussian, KronGaussian, ProductGaussian,
                                          gaussian_from_curvature)
from fedbench.curvature.structures import (Curvature, DenseBlock, DenseCurvature, DiagCurvature,
                                           DiagLastLayerFullCurvature, KFACCurvature, KronBlock,
                                           LayerBlocksCurvature)

__all__ = [
    "compute_curvature", "STRUCTURES", "FISHER_TYPES", "SCALES", "BACKENDS", "CONV_CONVENTIONS",
    "damp", "damp_kfac", "kron_pi", "DAMPING_MODES", "PI_RULES",
    "ParamLayout",
    "OnlineDiagFisher", "OnlineDiagFisherHook", "ONLINE_MODES",
    "Gaussian", "DiagGaussian", "KronGaussian", "DenseGaussian", "ProductGaussian", "gaussian_from_curvature",
    "Curvature", "DiagCurvature", "KFACCurvature", "KronBlock", "DenseCurvature", "DenseBlock",
    "LayerBlocksCurvature", "DiagLastLayerFullCurvature",
]
