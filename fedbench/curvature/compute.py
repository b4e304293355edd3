"""``compute_curvature``: one entry point for every structure, Fisher type, scale and convention."""
from __future__ import annotations

import time
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from fedbench.curvature import likelihood as lik
from fedbench.curvature.engine import (CONV_CONVENTIONS, INPUT_FACTORS, DiagHooks, ForwardTap, GradsHooks, KFACHooks,
                                       Layer, MultiHooks, Patches, consume_forward, execution_order, find_layers,
                                       run_func, run_hooks)
from fedbench.curvature.layout import ParamLayout
from fedbench.curvature.structures import (Curvature, DenseBlock, DenseCurvature, DiagCurvature,
                                           DiagLastLayerFullCurvature, KFACCurvature, KronBlock,
                                           LayerBlocksCurvature)
from fedbench.errors import FedbenchError
from fedbench.curvature.curvlinops_adapter import kfac_curvlinops

STRUCTURES = ("diag", "kfac", "full", "layer_blocks", "diag_lastlayer_full")
FISHER_TYPES = ("empirical", "true", "mc", "ggn", "hessian")
SCALES = ("mean", "sum")
BACKENDS = ("auto", "hooks", "func", "curvlinops")


def _check(kind: str, value, allowed: Sequence[str]) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise FedbenchError(f"unknown curvature {kind} {value!r}; choose one of: {', '.join(allowed)}")


def compute_curvature(model: nn.Module, x: Tensor, y: Tensor, *, structure: str, fisher: str = "empirical",
                      scale: str = "mean", conv_convention: str = "expand", bias_augment: bool = True,
                      batch_size: int = 256, mc_samples: int = 1, generator: Optional[torch.Generator] = None,
                      loss: str = "auto", backend: str = "auto", train_mode: bool = False,
                      kfac_input_factor: str = "patches") -> Curvature:
    """Curvature of the model's negative log-likelihood on (x, y) at the current weights.

    structure: "diag" | "kfac" | "full" | "layer_blocks" | "diag_lastlayer_full".
    fisher: "empirical" (true labels), "true" (exact expectation over the predicted classes,
        nngeometry's ``classif_logits``), "mc" (``mc_samples`` labels drawn from the model per sample,
        from ``generator``), "ggn" (Jᵀ ∇²_f ℓ J), or "hessian" (exact Hessian of the NLL; structures
        "full" and "layer_blocks" only). See ``fedbench.curvature.likelihood`` for the formulas.
    scale: "mean" = (1/N) Σ_n (dataset average, FedLPA / FedFisher / FOLA) or "sum" = Σ_n
        (= N × mean, the Laplace likelihood precision, FedBEns / FedLap); for K-FAC the N goes into G.
    conv_convention (kfac only): "expand" / "reduce" (curvlinops, Eschenhagen et al. 2023),
        "fedlpa_kfc" (alecwangcq KFC as in FedLPA), "nngeometry" (FedFisher); see ``KFACHooks``.
    bias_augment (kfac only): A over [a; 1] so the block covers [W | b]; otherwise the bias gets its
        own block (A = the convention's scalar for a constant input, G shared with the weight).
    batch_size: samples per chunk (memory only; results do not depend on it).
    loss: "auto" | "ce" | "bce" | "mse" (see ``likelihood.resolve_loss``).
    backend: "auto" = "hooks" when every trainable parameter is in Linear/Conv2d, else "func"
        (torch.func; not for kfac); "curvlinops" = K-FAC through curvlinops 3.0.1 (conventions
        expand / reduce; fisher empirical / mc / ggn / true). The hooks K-FAC equals curvlinops' to
        float64 round-off in the tests and is faster (curvlinops builds the type-2 square roots
        sample by sample), so "auto" does not route through curvlinops; MC labels differ between
        the two (each draws its own).

    kfac_input_factor (kfac, hooks backend): "patches" (default; the committed results' bits) or "gram"
        (opt-in, about 2x faster conv A factors on 28x28 inputs, equal to float rounding; see ``KFACHooks``).

    train_mode: evaluate the model in train mode (dropout active) instead of the default eval mode;
        the modules' modes are restored afterwards. (No fedbench model has BatchNorm; only dropout
        differs, and the papers' Fisher passes run on dropout-free models.)

    Computations run in the parameters' dtype and device; ``x``/``y`` are moved there.
    The wall time (synchronised on CUDA) is recorded in ``result.meta["seconds"]`` (for the run
    record's ``timing.curvature_s``).
    """
    t0 = time.perf_counter()
    modes = [(m, m.training) for m in model.modules()]
    model.train(bool(train_mode))
    try:
        out = _compute(model, x, y, structure=structure, fisher=fisher, scale=scale,
                       conv_convention=conv_convention, bias_augment=bias_augment, batch_size=batch_size,
                       mc_samples=mc_samples, generator=generator, loss=loss, backend=backend,
                       kfac_input_factor=kfac_input_factor)
    finally:
        for m, t in modes:
            m.training = t
    if out.device.type == "cuda":
        torch.cuda.synchronize(out.device)
    out.meta["seconds"] = time.perf_counter() - t0
    out.meta.setdefault("backend", backend)
    _SECONDS[0] += out.meta["seconds"]
    return out


_SECONDS = [0.0]


def curvature_seconds() -> float:
    """Wall seconds spent in ``compute_curvature`` by this process so far (the runner records the
    difference over a run as ``timing.curvature_s``; curvature served from the cache costs nothing)."""
    return _SECONDS[0]


# Modules whose forward is torch's own and the same in train and eval mode: a tapped training pass through them
# equals compute_curvature's eval-mode pass (dropout, batch norm and models with their own forward are left out).
_MODE_FREE = {c.forward for c in (nn.Sequential, nn.Linear, nn.Flatten, nn.Identity, nn.ReLU, nn.LeakyReLU, nn.Tanh,
                                  nn.Sigmoid, nn.GELU, nn.Softplus)}
TAP_FISHERS = ("empirical", "true", "ggn")


def tap_forward(model: nn.Module) -> Optional[ForwardTap]:
    """A tap on ``model``'s forward passes for ``diag_from_forward``, or None where a tapped training pass might not
    give compute_curvature's bits: a convolution (a training loop's channels_last layout rounds differently), a
    parameter outside nn.Linear, or a module whose forward depends on train/eval mode or is not torch's own."""
    layout = ParamLayout.from_module(model)
    layers, problems = find_layers(model, layout)
    if problems or not layers or any(l.is_conv for l in layers) \
            or any(type(m).forward not in _MODE_FREE for m in model.modules()):
        return None
    return ForwardTap(model, layers, layout)


def diag_from_forward(tap: ForwardTap, y: Tensor, *, fisher: str = "empirical", scale: str = "mean",
                      loss: str = "auto") -> DiagCurvature:
    """``compute_curvature(model, x, y, structure="diag", ...)`` read off the model's latest forward pass on x, which
    ``tap`` kept (its graph alive: a training loop's ``backward(retain_graph=True)``), instead of a second pass: the
    same bits as compute_curvature's hooks backend in one chunk (x no larger than its ``batch_size``). The pass's
    graph is released. Counts into ``curvature_seconds``."""
    t0 = time.perf_counter()
    _check("tapped fisher type", fisher, TAP_FISHERS)
    _check("scale", scale, SCALES)
    out = tap.output
    if out is None:
        raise FedbenchError("diag_from_forward: the tapped model has not run a forward pass since its last reading")
    y = y.to(out.device)
    if y.shape[0] != out.shape[0]:
        raise FedbenchError(f"diag_from_forward: the tapped forward pass had {out.shape[0]} inputs, got "
                            f"{y.shape[0]} targets")
    kind = lik.resolve_loss(loss, out[:1].detach(), y)
    N = int(out.shape[0])
    acc = DiagHooks(tap.layers)
    consume_forward(out, tap, tap.layers, y, kind, fisher, acc, Patches(tap.layers))
    tap.output = None   # its graph is spent
    norm = 1.0 / N if scale == "mean" else 1.0
    diag = {n: acc.diag[n].mul_(norm) if n in acc.diag else torch.zeros(tap.layout.shape(n), dtype=out.dtype,
                                                                          device=out.device)
            for n in tap.layout.names}
    res = DiagCurvature(tap.layout, diag, fisher=fisher, scale=scale, num_data=N, loss=kind)
    res.meta["seconds"] = time.perf_counter() - t0
    res.meta["backend"] = "tap"
    _SECONDS[0] += res.meta["seconds"]
    return res


def _compute(model, x, y, *, structure, fisher, scale, conv_convention, bias_augment, batch_size, mc_samples,
             generator, loss, backend, kfac_input_factor="patches") -> Curvature:
    _check("structure", structure, STRUCTURES)
    _check("fisher type", fisher, FISHER_TYPES)
    _check("scale", scale, SCALES)
    _check("conv convention", conv_convention, CONV_CONVENTIONS)
    _check("backend", backend, BACKENDS)
    _check("kfac_input_factor", kfac_input_factor, INPUT_FACTORS)
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise FedbenchError(f"curvature batch_size must be a positive integer, got {batch_size!r}")
    if not isinstance(mc_samples, int) or isinstance(mc_samples, bool) or mc_samples < 1:
        raise FedbenchError(f"curvature mc_samples must be a positive integer, got {mc_samples!r}")
    if fisher == "hessian" and structure not in ("full", "layer_blocks"):
        raise FedbenchError(f"fisher 'hessian' is available for structures 'full' and 'layer_blocks', "
                            f"not '{structure}'")
    if x.shape[0] == 0 or x.shape[0] != y.shape[0]:
        raise FedbenchError(f"curvature needs as many targets as inputs (and at least one), got "
                            f"{x.shape[0]} inputs and {y.shape[0]} targets")

    layout = ParamLayout.from_module(model)
    p0 = next(p for p in model.parameters() if p.requires_grad)
    x = x.to(p0.device)
    y = y.to(p0.device)
    with torch.no_grad():
        probe = model(x[:1])
    kind = lik.resolve_loss(loss, probe, y)
    N = int(x.shape[0])
    common = dict(fisher=fisher, scale=scale, num_data=N, loss=kind)
    norm = 1.0 / N if scale == "mean" else 1.0

    layers, problems = find_layers(model, layout)
    if backend == "curvlinops" and structure != "kfac":
        raise FedbenchError("curvature backend 'curvlinops' is used for structure 'kfac' only")
    if backend == "hooks" and problems:
        raise FedbenchError(f"curvature backend 'hooks' cannot handle this model: {problems[0]}")
    if backend == "func" and structure == "kfac":
        raise FedbenchError("structure 'kfac' is computed with backend 'hooks' or 'curvlinops', not 'func'")

    kw = dict(batch_size=batch_size, mc_samples=mc_samples, generator=generator)

    if structure == "kfac":
        if problems:
            raise FedbenchError(f"K-FAC needs every trainable parameter in nn.Linear / nn.Conv2d: {problems[0]}")
        if backend == "curvlinops":
            return kfac_curvlinops(model, x, y, kind=kind, fisher=fisher, scale=scale,
                                   conv_convention=conv_convention, bias_augment=bias_augment, **kw)
        if fisher == "hessian":
            raise FedbenchError("K-FAC of the Hessian is not provided; use fisher 'ggn'")
        acc = KFACHooks(layers, conv_convention, kfac_input_factor)
        run_hooks(model, layers, x, y, kind, fisher, acc, **kw)
        acc.finish()
        blocks = kfac_blocks(acc, layers, layout, N=N, norm=norm, bias_augment=bias_augment)
        return KFACCurvature(layout, blocks, convention=conv_convention, bias_augment=bias_augment, **common)

    if fisher == "hessian":
        return _hessian(model, layout, x, y, kind, structure, batch_size, common, norm)

    use_hooks = backend == "hooks" or (backend == "auto" and not problems)
    dtype, device = p0.dtype, p0.device

    if structure == "diag":
        if use_hooks:
            acc = DiagHooks(layers)
            run_hooks(model, layers, x, y, kind, fisher, acc, **kw)
            diag = {n: acc.diag[n].mul_(norm) if n in acc.diag else torch.zeros(layout.shape(n), dtype=dtype,
                                                                                  device=device)
                    for n in layout.names}
        else:
            sink = _DiagSink(layout)
            run_func(model, layout, x, y, kind, fisher, sink, **kw)
            diag = {n: sink.diag[n].mul_(norm) for n in layout.names}
        return DiagCurvature(layout, diag, **common)

    # dense structures: per-sample gradients into a sink
    if structure == "full":
        groups = {"full": layout.names}
    elif structure == "layer_blocks":
        groups = _layer_groups(model, layout, x[:1])
    else:
        order = execution_order(model, x[:1], layout)
        groups = {"last": order[-1][1]}
    if use_hooks:
        sink = _DenseSink(layout, groups, want_diag=False)
        if structure == "diag_lastlayer_full":
            diag_acc = DiagHooks(layers)
            last_layer = [l.name for l in layers if set(l.names) == set(groups["last"])]
            consumer = MultiHooks(diag_acc, GradsHooks(layers, sink, only=last_layer))
            run_hooks(model, layers, x, y, kind, fisher, consumer, **kw)
            sink.diag = layout.flatten({n: diag_acc.diag[n] for n in layout.names})
        else:
            run_hooks(model, layers, x, y, kind, fisher, GradsHooks(layers, sink), **kw)
    else:
        sink = _DenseSink(layout, groups, want_diag=structure == "diag_lastlayer_full")
        run_func(model, layout, x, y, kind, fisher, sink, **kw)
    return _dense_result(structure, layout, sink, norm, common)


def kfac_blocks(acc: KFACHooks, layers: Sequence[Layer], layout: ParamLayout, *, N: int, norm: float,
                bias_augment: bool) -> Dict[str, KronBlock]:
    blocks: Dict[str, KronBlock] = {}
    for l in layers:
        aa, a1, c1, gg = acc.aa[l.name], acc.a1.get(l.name), acc.c1[l.name], acc.gg[l.name]
        G = gg * norm
        if l.weight is None:
            raise FedbenchError(f"K-FAC needs the weight of layer '{l.name}' to be trainable")
        if l.bias is not None and bias_augment:
            J = aa.shape[0]
            A = aa.new_empty(J + 1, J + 1)
            A[:J, :J] = aa
            A[:J, J] = a1
            A[J, :J] = a1
            A[J, J] = c1
            blocks[l.name] = KronBlock(l.name, (l.weight, l.bias), (layout.shape(l.weight), layout.shape(l.bias)),
                                       A / N, G)
        else:
            blocks[l.name] = KronBlock(l.name, (l.weight,), (layout.shape(l.weight),), aa / N, G)
            if l.bias is not None:
                Ab = aa.new_full((1, 1), c1 / N)
                blocks[l.name + ".bias"] = KronBlock(l.name, (l.bias,), (layout.shape(l.bias),), Ab, G.clone())
    return blocks


class _DiagSink:
    def __init__(self, layout: ParamLayout):
        self.layout = layout
        self.diag: Dict[str, Tensor] = {}

    def __call__(self, g: Dict[str, Tensor]) -> None:
        for n, t in g.items():
            s = (t * t).sum((0, 1))
            self.diag[n] = self.diag[n] + s if n in self.diag else s


class _DenseSink:
    """Σ gᵀg over per-sample gradients for each group of parameters (and optionally Σ g²)."""

    def __init__(self, layout: ParamLayout, groups: Dict[str, Sequence[str]], want_diag: bool):
        self.layout = layout
        self.groups = {k: tuple(v) for k, v in groups.items()}
        self.mats: Dict[str, Tensor] = {}
        self.diag: Optional[Tensor] = None
        self.want_diag = want_diag

    def __call__(self, g: Dict[str, Tensor]) -> None:
        any_t = next(iter(g.values()))
        rows = any_t.shape[0] * any_t.shape[1]
        for key, names in self.groups.items():
            flat = torch.cat([g[n].reshape(rows, -1) for n in names], dim=1)
            m = flat.t() @ flat
            self.mats[key] = self.mats[key] + m if key in self.mats else m
        if self.want_diag:
            flat = torch.cat([g[n].reshape(rows, -1) for n in self.layout.names], dim=1)
            s = (flat * flat).sum(0)
            self.diag = s if self.diag is None else self.diag + s


def _layer_groups(model: nn.Module, layout: ParamLayout, x1: Tensor) -> Dict[str, Tuple[str, ...]]:
    """Module name -> its trainable parameters (layout order), for modules owning parameters."""
    groups: Dict[str, Tuple[str, ...]] = {}
    for mname, own in execution_order(model, x1, layout):
        groups[mname] = tuple(n for n in layout.names if n in own)
    missing = [n for n in layout.names if not any(n in v for v in groups.values())]
    if missing:
        raise FedbenchError(f"parameters {missing[:3]} are not used in the forward pass")
    return groups


def _dense_result(structure, layout, sink, norm, common) -> Curvature:
    if structure == "full":
        return DenseCurvature(layout, sink.mats["full"].mul_(norm), **common)
    if structure == "layer_blocks":
        return LayerBlocksCurvature(layout, {k: DenseBlock(sink.groups[k], m.mul_(norm))
                                             for k, m in sink.mats.items()}, **common)
    diag = layout.unflatten(sink.diag.mul_(norm))
    return DiagLastLayerFullCurvature(layout, diag, DenseBlock(sink.groups["last"], sink.mats["last"].mul_(norm)),
                                      **common)


def _hessian(model, layout, x, y, kind, structure, batch_size, common, norm) -> Curvature:
    """Exact Hessian of Σ_n ℓ_n (times ``norm``) w.r.t. the flat parameters, via torch.func."""
    from torch.func import functional_call, hessian

    params = {n: p.detach() for n, p in model.named_parameters() if n in layout}
    fixed = {n: p.detach() for n, p in model.named_parameters() if n not in layout}
    fixed.update(dict(model.named_buffers()))
    groups = {"full": layout.names} if structure == "full" else _layer_groups(model, layout, x[:1])
    mats: Dict[str, Tensor] = {}
    for key, names in groups.items():
        sub = layout.sub(names)
        others = {n: t for n, t in params.items() if n not in names}

        def total(flat, xb, yb):
            p = sub.unflatten(flat)
            out = functional_call(model, {**p, **others, **fixed}, (xb,))
            return lik.nll(kind, out, lik.prepare_targets(kind, out, yb)).sum()

        flat0 = sub.flatten({n: params[n] for n in names})
        H = None
        for s in range(0, x.shape[0], batch_size):
            h = hessian(total)(flat0, x[s:s + batch_size], y[s:s + batch_size])
            H = h if H is None else H + h
        mats[key] = (0.5 * (H + H.t())) * norm
    if structure == "full":
        return DenseCurvature(layout, mats["full"], **common)
    return LayerBlocksCurvature(layout, {k: DenseBlock(groups[k], m) for k, m in mats.items()}, **common)
