"""Curvature containers, one per structure.

All of them represent a symmetric PSD matrix ``C`` over the flat parameter vector of a
:class:`~fedbench.curvature.layout.ParamLayout` (``parameters_to_vector`` order), plus an optional
isotropic term ``damping · I`` that is kept symbolic (exact in the Kronecker eigenbasis for K-FAC):

* :class:`DiagCurvature`: ``diag`` name -> tensor shaped like the parameter.
* :class:`KFACCurvature`: per-layer :class:`KronBlock` (A, G); block matrix-vector product ``G M A``.
* :class:`DenseCurvature`: one dense [P, P] matrix.
* :class:`LayerBlocksCurvature`: per-layer dense blocks (:class:`DenseBlock`), zero across layers.
* :class:`DiagLastLayerFullCurvature`: the diagonal of every parameter plus a dense block for the
  last layer (FedBEns "Diag+Full"; the posterior uses the dense block there, the diagonal elsewhere).

``scale`` records whether the matrix is the dataset average ("mean") or N × average ("sum", the
Laplace likelihood precision); :meth:`Curvature.scaled` multiplies by a number (e.g. N).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

from fedbench.curvature.layout import ParamLayout


def _esize(t: Tensor, bytes_per_value: Optional[int]) -> int:
    return int(bytes_per_value) if bytes_per_value is not None else t.element_size()


def sym_count(n: int, symmetric: bool) -> int:
    """Values stored for an n×n symmetric matrix: its upper triangle, or all n² entries."""
    return n * (n + 1) // 2 if symmetric else n * n


class Curvature:
    """Base class: a PSD matrix over ``layout``'s flat parameter vector, plus ``damping · I``."""

    structure: str = ""

    def __init__(self, layout: ParamLayout, *, fisher: str, scale: str, num_data: int, loss: str,
                 damping: float = 0.0, meta: Optional[dict] = None):
        self.layout = layout
        self.fisher = fisher
        self.scale = scale
        self.num_data = int(num_data)
        self.loss = loss
        self.damping = float(damping)
        self.meta = dict(meta or {})

    # --- to implement -------------------------------------------------------------------
    def _mul_(self, c: float) -> None:
        raise NotImplementedError

    def _mv(self, v: Tensor) -> Tensor:          # undamped product, v: [..., P]
        raise NotImplementedError

    def _diag(self) -> Tensor:                   # undamped diagonal, [P]
        raise NotImplementedError

    def _dense(self) -> Tensor:                  # undamped dense matrix, [P, P]
        raise NotImplementedError

    def _values(self, symmetric: bool) -> List[Tuple[int, Tensor]]:   # (count, example tensor)
        raise NotImplementedError

    def _tensors(self) -> List[Tensor]:
        raise NotImplementedError

    # --- shared API ----------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._tensors()[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self._tensors()[0].dtype

    def copy(self) -> "Curvature":
        return copy.deepcopy(self)

    def scaled(self, c: float) -> "Curvature":
        """``c ×`` this curvature (damping included), as a new object."""
        out = self.copy()
        out._mul_(float(c))
        out.damping *= float(c)
        return out

    def with_damping(self, lam: float) -> "Curvature":
        """This curvature plus ``lam · I`` (added to any damping already present)."""
        out = self.copy()
        out.damping += float(lam)
        return out

    def mv(self, v: Tensor) -> Tensor:
        """(C + damping·I) v for flat ``v`` of shape [..., P]."""
        out = self._mv(v)
        return out + self.damping * v if self.damping else out

    def diagonal(self) -> Tensor:
        d = self._diag()
        return d + self.damping if self.damping else d

    def to_dense(self) -> Tensor:
        """The [P, P] matrix (small models only)."""
        m = self._dense()
        if self.damping:
            m = m + self.damping * torch.eye(m.shape[0], dtype=m.dtype, device=m.device)
        return m

    def nbytes(self, symmetric: bool = True, bytes_per_value: Optional[int] = None) -> int:
        """Bytes needed to transmit the curvature (upper triangles of symmetric matrices when
        ``symmetric``); the scalar damping is not counted."""
        return sum(k * _esize(t, bytes_per_value) for k, t in self._values(symmetric))

    def to(self, *args, **kwargs) -> "Curvature":
        out = self.copy()
        out._apply(lambda t: t.to(*args, **kwargs))
        return out

    def _apply(self, fn) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(fisher={self.fisher!r}, scale={self.scale!r}, N={self.num_data}, "
                f"loss={self.loss!r}, damping={self.damping}, P={self.layout.numel})")


class DiagCurvature(Curvature):
    structure = "diag"

    def __init__(self, layout: ParamLayout, diag: Mapping[str, Tensor], **kw):
        super().__init__(layout, **kw)
        self.diag: Dict[str, Tensor] = {n: diag[n] for n in layout.names}

    def vector(self) -> Tensor:
        """The undamped diagonal as a flat [P] vector."""
        return self.layout.flatten(self.diag)

    def _mul_(self, c):
        for t in self.diag.values():
            t.mul_(c)

    def _mv(self, v):
        return self.vector() * v

    def _diag(self):
        return self.vector()

    def _dense(self):
        return torch.diag(self.vector())

    def _values(self, symmetric):
        return [(t.numel(), t) for t in self.diag.values()]

    def _tensors(self):
        return list(self.diag.values())

    def _apply(self, fn):
        self.diag = {n: fn(t) for n, t in self.diag.items()}


def layer_matrix(names: Sequence[str], shapes: Sequence[torch.Size], d_out: int,
                 tensors: Mapping[str, Tensor]) -> Tensor:
    """[..., d_out, d_in] layer matrix ``[W.reshape(d_out, -1) | b]`` from parameter-shaped tensors
    (leading batch dims kept); the ordering every K-FAC block uses (bias column last)."""
    cols = []
    for n, s in zip(names, shapes):
        t = tensors[n]
        batch = t.shape[: t.dim() - len(s)]
        cols.append(t.reshape(*batch, d_out, -1))
    return torch.cat(cols, dim=-1) if len(cols) > 1 else cols[0]


def layer_params(names: Sequence[str], shapes: Sequence[torch.Size], d_out: int, M: Tensor) -> Dict[str, Tensor]:
    """Inverse of :func:`layer_matrix`."""
    batch = M.shape[:-2]
    out, c = {}, 0
    for n, s in zip(names, shapes):
        k = int(torch.Size(s).numel()) // d_out
        out[n] = M[..., c:c + k].reshape(*batch, *s)
        c += k
    return out


@dataclass
class KronBlock:
    """One layer's Kronecker factors.

    Parameter ordering: the block acts on the layer matrix
    ``M = [W.reshape(d_out, -1) | b[:, None]]`` (``names`` = (weight, bias), bias column last when
    the input is augmented with a 1), ``M = W.reshape(d_out, -1)`` (names = (weight,)), or, for a
    bias kept in its own block (``bias_augment=False``), ``M = b[:, None]`` with a 1×1 ``A``.
    Conv weights reshape to (C_out, C_in·kh·kw), the order of ``F.unfold`` patches. The curvature
    of the block is ``M ↦ G M A``; on the row-major ``M.flatten()`` it is ``kron(G, A)`` (= A ⊗ G
    on the column-stacked vec(M)). :meth:`to_dense` returns it in the parameters' flat order
    (``weight.flatten()`` then ``bias``).
    """

    module: str
    names: Tuple[str, ...]
    shapes: Tuple[torch.Size, ...]
    A: Tensor
    G: Tensor

    @property
    def d_out(self) -> int:
        return self.G.shape[0]

    @property
    def d_in(self) -> int:
        return self.A.shape[0]

    @property
    def numel(self) -> int:
        return self.d_out * self.d_in

    def to_matrix(self, tensors: Mapping[str, Tensor]) -> Tensor:
        """[..., d_out, d_in] layer matrix from parameter-shaped tensors (with batch dims)."""
        return layer_matrix(self.names, self.shapes, self.d_out, tensors)

    def from_matrix(self, M: Tensor) -> Dict[str, Tensor]:
        return layer_params(self.names, self.shapes, self.d_out, M)

    def mv_matrix(self, M: Tensor) -> Tensor:
        return self.G @ M @ self.A

    def perm(self) -> Tensor:
        """perm[i] = row-major index in M of the i-th entry of the block's flat parameter order."""
        idx = torch.arange(self.numel).reshape(self.d_out, self.d_in)
        parts = self.from_matrix(idx)
        return torch.cat([parts[n].reshape(-1) for n in self.names])

    def to_dense(self) -> Tensor:
        K = torch.kron(self.G, self.A)
        p = self.perm().to(K.device)
        return K[p][:, p]


def kron_values(blocks: Iterable[KronBlock], symmetric: bool) -> List[Tuple[int, Tensor]]:
    """Stored values of K-FAC factors: A and G per block, G once per module (a bias kept in its own
    block shares the weight's G)."""
    out, seen = [], set()
    for b in blocks:
        out.append((sym_count(b.d_in, symmetric), b.A))
        if b.module not in seen:
            out.append((sym_count(b.d_out, symmetric), b.G))
            seen.add(b.module)
    return out


class KFACCurvature(Curvature):
    """Per-layer Kronecker factors, ``blocks`` keyed by module name (``<module>.bias`` for a bias
    kept in its own block). ``convention`` is the conv scaling the factors follow (for Linear layers
    all conventions coincide); A ⊗ G is the (mean or sum) curvature whatever the convention."""

    structure = "kfac"

    def __init__(self, layout: ParamLayout, blocks: Mapping[str, KronBlock], *, convention: str,
                 bias_augment: bool, **kw):
        super().__init__(layout, **kw)
        self.blocks: Dict[str, KronBlock] = dict(blocks)
        self.convention = convention
        self.bias_augment = bias_augment
        covered = [n for b in self.blocks.values() for n in b.names]
        if sorted(covered) != sorted(layout.names):
            missing = sorted(set(layout.names) - set(covered))
            raise ValueError(f"K-FAC blocks must cover every parameter exactly once; missing {missing}")

    def factors(self) -> Dict[str, Tuple[Tensor, Tensor]]:
        return {k: (b.A, b.G) for k, b in self.blocks.items()}

    def _mul_(self, c):
        for b in self.blocks.values():
            b.G.mul_(c)

    def _mv(self, v):
        parts = self.layout.unflatten(v)
        out = {}
        for b in self.blocks.values():
            out.update(b.from_matrix(b.mv_matrix(b.to_matrix(parts))))
        return self.layout.flatten(out)

    def _diag(self):
        out = {}
        for b in self.blocks.values():
            out.update(b.from_matrix(torch.outer(b.G.diagonal(), b.A.diagonal())))
        return self.layout.flatten(out)

    def _dense(self):
        P = self.layout.numel
        t = self._tensors()[0]
        D = torch.zeros(P, P, dtype=t.dtype, device=t.device)
        for b in self.blocks.values():
            idx = self.layout.index(b.names, device=t.device)
            D[idx.unsqueeze(1), idx.unsqueeze(0)] = b.to_dense()
        return D

    def _values(self, symmetric):
        return kron_values(self.blocks.values(), symmetric)

    def _tensors(self):
        return [t for b in self.blocks.values() for t in (b.A, b.G)]

    def _apply(self, fn):
        for b in self.blocks.values():
            b.A, b.G = fn(b.A), fn(b.G)


@dataclass
class DenseBlock:
    """A dense matrix over the parameters ``names`` (their flat order, as in the layout)."""

    names: Tuple[str, ...]
    matrix: Tensor


class DenseCurvature(Curvature):
    structure = "full"

    def __init__(self, layout: ParamLayout, matrix: Tensor, **kw):
        super().__init__(layout, **kw)
        self.matrix = matrix

    def _mul_(self, c):
        self.matrix.mul_(c)

    def _mv(self, v):
        return v @ self.matrix           # symmetric

    def _diag(self):
        return self.matrix.diagonal().clone()

    def _dense(self):
        return self.matrix.clone()

    def _values(self, symmetric):
        return [(sym_count(self.matrix.shape[0], symmetric), self.matrix)]

    def _tensors(self):
        return [self.matrix]

    def _apply(self, fn):
        self.matrix = fn(self.matrix)


class _BlocksMixin:
    def _block_mv(self, v: Tensor, blocks: Iterable[DenseBlock], out: Tensor) -> Tensor:
        for b in blocks:
            idx = self.layout.index(b.names, device=v.device)
            out[..., idx] = v[..., idx] @ b.matrix
        return out


class LayerBlocksCurvature(_BlocksMixin, Curvature):
    """Dense per-layer blocks keyed by module name (a layer's weight then bias)."""

    structure = "layer_blocks"

    def __init__(self, layout: ParamLayout, blocks: Mapping[str, DenseBlock], **kw):
        super().__init__(layout, **kw)
        self.blocks: Dict[str, DenseBlock] = dict(blocks)

    def _mul_(self, c):
        for b in self.blocks.values():
            b.matrix.mul_(c)

    def _mv(self, v):
        return self._block_mv(v, self.blocks.values(), torch.zeros_like(v))

    def _diag(self):
        t = self._tensors()[0]
        d = torch.zeros(self.layout.numel, dtype=t.dtype, device=t.device)
        for b in self.blocks.values():
            d[self.layout.index(b.names, device=t.device)] = b.matrix.diagonal()
        return d

    def _dense(self):
        t = self._tensors()[0]
        P = self.layout.numel
        D = torch.zeros(P, P, dtype=t.dtype, device=t.device)
        for b in self.blocks.values():
            idx = self.layout.index(b.names, device=t.device)
            D[idx.unsqueeze(1), idx.unsqueeze(0)] = b.matrix
        return D

    def _values(self, symmetric):
        return [(sym_count(b.matrix.shape[0], symmetric), b.matrix) for b in self.blocks.values()]

    def _tensors(self):
        return [b.matrix for b in self.blocks.values()]

    def _apply(self, fn):
        for b in self.blocks.values():
            b.matrix = fn(b.matrix)


class DiagLastLayerFullCurvature(_BlocksMixin, Curvature):
    """Diagonal for every parameter (``diag``) plus a dense block for the last layer (``last``).

    As a matrix it is the diagonal outside the last layer and the dense block on it (the last
    layer's diagonal entries in ``diag`` are kept for reference but superseded by the block, as in
    FedBEns' Diag+Full, which discards them)."""

    structure = "diag_lastlayer_full"

    def __init__(self, layout: ParamLayout, diag: Mapping[str, Tensor], last: DenseBlock, **kw):
        super().__init__(layout, **kw)
        self.diag: Dict[str, Tensor] = {n: diag[n] for n in layout.names}
        self.last = last

    @property
    def diag_names(self) -> Tuple[str, ...]:
        return tuple(n for n in self.layout.names if n not in self.last.names)

    def _mul_(self, c):
        for t in self.diag.values():
            t.mul_(c)
        self.last.matrix.mul_(c)

    def _masked_diag(self) -> Tensor:
        d = self.layout.flatten(self.diag).clone()
        d[self.layout.index(self.last.names, device=d.device)] = 0
        return d

    def _mv(self, v):
        return self._block_mv(v, [self.last], self._masked_diag() * v)

    def _diag(self):
        d = self._masked_diag()
        d[self.layout.index(self.last.names, device=d.device)] = self.last.matrix.diagonal()
        return d

    def _dense(self):
        D = torch.diag(self._masked_diag())
        idx = self.layout.index(self.last.names, device=D.device)
        D[idx.unsqueeze(1), idx.unsqueeze(0)] = self.last.matrix
        return D

    def _values(self, symmetric):
        vals = [(self.diag[n].numel(), self.diag[n]) for n in self.diag_names]
        return vals + [(sym_count(self.last.matrix.shape[0], symmetric), self.last.matrix)]

    def _tensors(self):
        return list(self.diag.values()) + [self.last.matrix]

    def _apply(self, fn):
        self.diag = {n: fn(t) for n, t in self.diag.items()}
        self.last.matrix = fn(self.last.matrix)
