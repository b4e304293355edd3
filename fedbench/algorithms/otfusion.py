"""OTFusion (Singh & Jaggi, NeurIPS 2020) as the FedFisher / FedBEns one-shot baseline
(notes/fedfisher.md §2 "OTFusion", fedbens.md §2, reference-code.md §3).

Weight-based alignment ("wts"), layer by layer, of every client i ≠ pivot to the pivot (client 0),
then the p-weighted sum Σ_i p_i·aligned_i (p_i = n_i / n; the pivot enters unaligned). Per layer,
with W the client's layer in row form (out × in_units × block; block = kh·kw for a conv, the
spatial positions per channel for the first Linear after the flatten, 1 otherwise):

    aligned = W with its input units mixed by the previous layer's T   (first layer: W itself)
    M[a, b] = ‖aligned_a − pivot_b‖²  (``ground_metric: sq_euclidean``; rows + bias if any)
    T       = ot.emd(1/n, 1/n, M)                     exact OT, uniform marginals
    correction:       T ← T / (1/n + 1e-7)            (≈ n·T, a permutation matrix)
    layer_out = Tᵀ · (aligned if past_correction else W)

``correction`` and ``past_correction`` ∈ {T, F}² are picked on the server validation set in the
code's order (T,T), (T,F), (F,T), (F,F), strictly better wins, best starts at 0 (so with zero
accuracy everywhere the code's (F, F) is returned). Every other setting is the code's default.

Ground metric: the FedBEns note reads the released dict ('not_squared': True) as "not squared", but
the released GroundMetric overrides it (``self.squared = True``) and FedFisher's note says squared;
``sq_euclidean`` is what ran, ``euclidean`` is the dict's stated intent.
Output layer: the released code transports it too (``align_last_layer: true``, what the FedFisher/FedBEns presets
run); the default keeps the class rows in place, since a plan that swaps two classes' rows (it does under label
skew, for classes a client never saw) makes the fused model predict permuted labels.
Biases (absent in the papers' models) are one more coordinate of a neuron in M and are moved by T [I].

Residual networks (the BN-free ResNet-18s of FedFisher Table 3 / FedBEns Table 9, run with ``handle_skips``):
every tensor summed into one residual stream shares one transport. The stem's transport is carried through each
identity shortcut (the block's last conv takes the block input's T, so ``out + x`` stays aligned); a block with a
1x1 shortcut conv starts a new stream whose T is solved once on the rows of its last conv and its shortcut conv
together [I], the shortcut's inputs aligned by the block input's T like any conv's. There is no BatchNorm in these
models (models/__init__.py contract); a model with one is refused in one line. PFNM stays chain-only (pfnm.py).
Supported: chains of Linear / Conv2d with element-wise or per-channel modules in between (the MLPs, LeNet, the FedMA
CNN, SimpleCNN) and resnet18_nobn / resnet18_mod / resnet18_tiny.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn as nn
from torch import Tensor

from fedbench.algorithms.base import ALGORITHMS, Algorithm, Message
from fedbench.algorithms.common import NO_CLIENT_DATA, client_weights
from fedbench.algorithms.options import option, read_options
from fedbench.errors import FedbenchError
from fedbench.models.resnet import BasicBlock, ResNet18NoBN

Params = Dict[str, Tensor]

# modules that commute with a permutation of units / channels (so neurons can be matched across them)
_PERM_SAFE = (nn.ReLU, nn.MaxPool2d, nn.AvgPool2d, nn.Flatten, nn.Dropout, nn.Dropout2d, nn.Identity,
              nn.LeakyReLU, nn.Tanh, nn.Sigmoid, nn.GELU,
              nn.Sequential)   # an empty Sequential (a leaf) is the identity: ResNet's identity shortcut
CORRECTION_ORDER = ((True, True), (True, False), (False, True), (False, False))   # the code's loop order


@dataclass
class Layer:
    """One Linear / Conv2d layer in row form (out, in_units, block), with the transport spaces of its units.

    A space is a set of units that must be moved by one transport: a layer's outputs, or, across a skip
    connection, every tensor summed into one residual stream. ``in_space`` None = the model input (never moved).
    ``solves`` False: the layer's output space is fixed by earlier layers (a residual block's last conv on an
    identity shortcut takes the block input's transport), so its rows do not enter that space's OT cost."""
    module: str
    weight: str
    bias: Optional[str]
    shape: Tuple[int, ...]     # the weight's own shape
    out_units: int
    in_units: int
    block: int                 # columns per input unit
    in_space: Optional[int] = None
    out_space: int = 0
    solves: bool = True


def _layer(name: str, m: nn.Module, in_units: int, block: int, in_space: Optional[int], out_space: int,
           solves: bool = True) -> Layer:
    bias = f"{name}.bias" if getattr(m, "bias", None) is not None else None
    return Layer(name, f"{name}.weight", bias, tuple(m.weight.shape), m.weight.shape[0], in_units, block,
                 in_space, out_space, solves)


def _unsupported(method: str, model_name: Optional[str], what: str) -> FedbenchError:
    named = f" on model '{model_name}'" if model_name else ""
    return FedbenchError(f"{method}{named}: {what}; supported: chains of Linear/Conv2d layers (MLPs, lenet, fedma_cnn, "
                         f"simple_cnn)" + (" and the BN-free ResNet-18s (resnet18_nobn, resnet18_mod, resnet18_tiny)"
                                           if method == "otfusion" else ""))


def _check_covered(model: nn.Module, layers: Sequence[Layer], method: str, model_name: Optional[str]) -> None:
    names = {n for n, _ in model.named_parameters()}
    covered = {l.weight for l in layers} | {l.bias for l in layers if l.bias}
    if names - covered:
        raise _unsupported(method, model_name, f"parameters outside Linear/Conv2d layers: {sorted(names - covered)}")


def _check_leaves(model: nn.Module, method: str, model_name: Optional[str]) -> None:
    """Every leaf is a Linear / Conv2d or parameter-free and permutation-safe (no BatchNorm: see the docstring)."""
    for n, m in model.named_modules():
        if n and not list(m.children()) and not isinstance(m, (nn.Linear, nn.Conv2d)) and (
                list(m.parameters(recurse=False)) or not isinstance(m, _PERM_SAFE)):
            raise _unsupported(method, model_name, f"module '{n}' ({type(m).__name__}) is not supported")


def layer_chain(model: nn.Module, method: str, model_name: Optional[str] = None) -> List[Layer]:
    """The model as a chain of Linear / Conv2d layers (layer k: spaces k-1 -> k); anything else is a one-line
    FedbenchError naming the model."""

    if isinstance(model, ResNet18NoBN):
        raise _unsupported(method, model_name, "the model has skip connections")
    _check_leaves(model, method, model_name)
    leaves = [(n, m) for n, m in model.named_modules() if n and not list(m.children())]
    layers: List[Layer] = []
    prev_out = None
    prev_conv = False
    for n, m in leaves:
        if not isinstance(m, (nn.Linear, nn.Conv2d)):
            continue
        w = m.weight
        if isinstance(m, nn.Conv2d):
            if m.groups != 1 or (prev_out is not None and not prev_conv):
                raise _unsupported(method, model_name, f"conv layer '{n}' must be ungrouped and follow the input or "
                                                       f"a conv")
            in_units, block = w.shape[1], int(np.prod(w.shape[2:]))
        elif prev_out is not None and prev_conv:
            if w.shape[1] % prev_out:
                raise _unsupported(method, model_name, f"Linear '{n}' input {w.shape[1]} is not channels x positions")
            in_units, block = prev_out, w.shape[1] // prev_out
        else:
            in_units, block = w.shape[1], 1
        if prev_out is not None and in_units != prev_out:
            raise _unsupported(method, model_name, f"layer '{n}' does not take the previous layer's output")
        k = len(layers)
        layers.append(_layer(n, m, in_units, block, k - 1 if k else None, k))
        prev_out, prev_conv = w.shape[0], isinstance(m, nn.Conv2d)
    if not isinstance(model, nn.Sequential) or len(layers) < 2:
        raise _unsupported(method, model_name, "not a sequential model with at least two Linear/Conv2d layers")
    _check_covered(model, layers, method, model_name)
    return layers


def resnet_layers(model: nn.Module, method: str, model_name: Optional[str] = None) -> List[Layer]:
    """fedbench's BN-free ResNet-18s (models/resnet.py) in forward order, with the residual streams' spaces.

    Stem -> stream space s. A block on an identity shortcut: conv1 s -> own space, conv2 -> s (inherits s's
    transport, so ``out + x`` stays aligned). A block with a 1x1 shortcut conv: conv2 and the shortcut conv both
    write the new stream space, whose one transport is solved on their rows together (the neuron of a residual sum
    is its conv2 filter and its shortcut filter); the shortcut's inputs take the block input's transport. Head:
    Linear layers after AvgPool + Flatten (one position per channel at 32x32 inputs)."""

    _check_leaves(model, method, model_name)
    layers: List[Layer] = []

    def add(name: str, m: nn.Module, in_space: Optional[int], out_space: int, solves: bool = True) -> None:
        w = m.weight
        if isinstance(m, nn.Conv2d):
            if m.groups != 1:
                raise _unsupported(method, model_name, f"conv layer '{name}' is grouped")
            in_units, block = w.shape[1], int(np.prod(w.shape[2:]))
        else:   # the first head Linear reads channels x positions of the last stream
            prev = layers[-1].out_units
            if w.shape[1] % prev:
                raise _unsupported(method, model_name, f"Linear '{name}' input {w.shape[1]} is not channels x positions")
            in_units, block = prev, w.shape[1] // prev
        layers.append(_layer(name, m, in_units, block, in_space, out_space, solves))

    stream = 0
    add("conv1", model.conv1, None, stream)
    spaces = 1
    for stage in ("layer1", "layer2", "layer3", "layer4"):
        for j, blk in enumerate(getattr(model, stage)):
            if not isinstance(blk, BasicBlock):
                raise _unsupported(method, model_name, f"'{stage}.{j}' is not a BasicBlock")
            pre = f"{stage}.{j}"
            mid, spaces = spaces, spaces + 1
            add(f"{pre}.conv1", blk.conv1, stream, mid)
            short = [m for m in blk.shortcut if isinstance(m, nn.Conv2d)]
            if short:   # a downsampling block starts a new stream
                out, spaces = spaces, spaces + 1
                add(f"{pre}.conv2", blk.conv2, mid, out)
                add(f"{pre}.shortcut.0", short[0], stream, out)
                stream = out
            else:
                add(f"{pre}.conv2", blk.conv2, mid, stream, solves=False)
    for name in model.head_names:
        add(name, getattr(model, name), layers[-1].out_space, spaces)
        spaces += 1
    _check_covered(model, layers, method, model_name)
    return layers


def fusion_layers(model: nn.Module, method: str, model_name: Optional[str] = None) -> List[Layer]:
    """OTFusion's layer list: the residual layout for fedbench's ResNets, a chain otherwise."""

    if isinstance(model, ResNet18NoBN):
        return resnet_layers(model, method, model_name)
    return layer_chain(model, method, model_name)


def model_name(setup) -> str:
    """The run's model name (its registry name when the runner built the setup) for error messages."""
    name = ((getattr(setup, "stage_parts", None) or {}).get("model") or {}).get("name")
    return str(name) if name else type(setup.model).__name__


def rows(W: Tensor, layer: Layer, in_units: Optional[int] = None) -> Tensor:
    """(out, in_units, block) view of a weight (``in_units`` for a wider / patched layer)."""
    return W.reshape(W.shape[0], in_units if in_units is not None else layer.in_units, layer.block)


def pairwise_cost(X: Tensor, Y: Tensor, squared: bool) -> Tensor:
    d2 = ((X[:, None, :] - Y[None, :, :]) ** 2).sum(-1) if X.shape[0] * Y.shape[0] * X.shape[1] <= 2 ** 24 else \
        ((X * X).sum(1)[:, None] + (Y * Y).sum(1)[None, :] - 2.0 * X @ Y.t()).clamp_min(0.0)
    return d2 if squared else d2.sqrt()


def _solve(rows_model: List[Tensor], rows_pivot: List[Tensor], squared: bool) -> Tensor:
    """Exact OT plan (uniform marginals) between neurons given as the concatenated rows of every layer writing them."""
    import ot

    X, Y = torch.cat(rows_model, 1), torch.cat(rows_pivot, 1)
    n = X.shape[0]
    mu = np.full(n, 1.0 / n)
    return torch.from_numpy(np.asarray(ot.emd(mu, mu, pairwise_cost(X, Y, squared).cpu().numpy()))).to(X.device)


class Transport:
    """One space's transport T (n x n). Exact OT between uniform marginals returns a vertex of the Birkhoff
    polytope, c·P with P a permutation; then it is applied as a gather (ResNet-18's 512-channel layers: a copy
    instead of two 1-GFLOP products), else as the dense matrix."""

    def __init__(self, T: Tensor):
        self.T = T
        nz = T != 0
        self.inv: Optional[Tensor] = None      # inv[v] = the u with T[u, v] != 0
        if bool((nz.sum(0) == 1).all()) and bool((nz.sum(1) == 1).all()):
            vals = T[nz]
            if bool((vals == vals[0]).all()):
                self.inv, self.scale = nz.double().argmax(0), float(vals[0])

    def mix_inputs(self, W: Tensor) -> Tensor:
        """W (out, in_units, block) with its input units mixed: einsum('oub,uv->ovb', W, T)."""
        if self.inv is not None:
            return self.scale * W[:, self.inv]
        return torch.einsum("oub,uv->ovb", W, self.T)

    def move_outputs(self, X: Tensor) -> Tensor:
        """Tᵀ · X for X (out_units, ...)."""
        if self.inv is not None:
            return self.scale * X[self.inv]
        return (self.T.t() @ X.reshape(X.shape[0], -1)).reshape(X.shape)


def align_to(model: Params, pivot: Params, layers: Sequence[Layer], *, correction: bool, past_correction: bool,
             squared: bool = True, align_last: bool = True, eps: float = 1e-7,
             stats: Optional[Dict[str, int]] = None) -> Params:
    """``model`` aligned to ``pivot`` (the code's get_wassersteinized_layers_modularized, eval_aligned), layer by
    layer in forward order; a space's transport is solved once its last solving layer is reached (a chain: at every
    layer). ``stats``: adds ``units`` (units transported) and ``moved`` (units the plan sends to another index) —
    clients trained from one shared initialisation often keep their units in place, and then OTFusion is FedAvg."""
    out: Params = {}
    T: Dict[int, Transport] = {}              # space -> transport (corrected if ``correction``)
    waiting: Dict[int, list] = {}             # space -> layers input-aligned, waiting for the space's transport
    left: Dict[int, int] = {}                 # space -> solving layers not reached yet
    for L in layers:
        left[L.out_space] = left.get(L.out_space, 0) + int(L.solves)
    last_space = layers[-1].out_space

    def finish(L: Layer, W: Tensor, aligned: Tensor, bias: Optional[Tensor]) -> None:
        Tv = T[L.out_space]
        out[L.weight] = Tv.move_outputs(aligned if past_correction else W).reshape(L.shape).to(model[L.weight].dtype)
        if L.bias:
            out[L.bias] = Tv.move_outputs(bias).to(model[L.bias].dtype)

    for L in layers:
        W = rows(model[L.weight].double(), L)
        aligned = W if L.in_space is None else T[L.in_space].mix_inputs(W)
        bias = model[L.bias].double() if L.bias else None
        if not L.solves:
            if L.out_space not in T:
                raise FedbenchError(f"otfusion: layer '{L.module}' inherits a transport that is not solved yet")
            finish(L, W, aligned, bias)
            continue
        waiting.setdefault(L.out_space, []).append((L, W, aligned, bias))
        left[L.out_space] -= 1
        if left[L.out_space]:
            continue
        group = waiting.pop(L.out_space)
        n_out = L.out_units
        if L.out_space == last_space and not align_last:
            T[L.out_space] = Transport(torch.eye(n_out, dtype=torch.float64, device=W.device))
        else:
            xs, ys = [], []
            for G, _, a, b in group:
                xs.append(a.reshape(n_out, -1))
                ys.append(pivot[G.weight].double().reshape(n_out, -1))
                if G.bias:
                    xs.append(b[:, None])
                    ys.append(pivot[G.bias].double()[:, None])
            plan = _solve(xs, ys, squared)
            T[L.out_space] = Transport(plan * (1.0 / (1.0 / n_out + eps)) if correction else plan)
            if stats is not None:
                stats["units"] = stats.get("units", 0) + n_out
                stats["moved"] = stats.get("moved", 0) + int((plan.argmax(1).cpu() != torch.arange(n_out)).sum())
        for item in group:
            finish(*item)
    return out


def otfusion(clients: Sequence[Params], p: Sequence[float], layers: Sequence[Layer], *, pivot: int = 0,
             stats: Optional[Dict[str, int]] = None, **kw) -> Params:
    """Σ_i p_i · (client i aligned to the pivot); the pivot itself enters unaligned (one_shot_otfusion)."""
    out = {n: float(p[pivot]) * t.double() for n, t in clients[pivot].items()}
    for i, c in enumerate(clients):
        if i == pivot:
            continue
        a = align_to(c, clients[pivot], layers, stats=stats, **kw)
        for n in out:
            out[n] += float(p[i]) * a[n].double()
    return {n: t.to(clients[pivot][n].dtype) for n, t in out.items()}


def _flag(key: str, v: Any):
    if v == "select" or isinstance(v, bool):
        return v
    raise FedbenchError(f"algorithm.{key} must be select, true or false, got {v!r}")


@dataclass(frozen=True)
class OTFusionOptions:
    correction: Any = option(check=_flag)
    past_correction: Any = option(check=_flag)
    ground_metric: str = option(choices=("sq_euclidean", "euclidean"))
    pivot: int = option(minimum=0)
    align_last_layer: bool = option()
    weighting: str = option(choices=("num_samples", "uniform"))


@ALGORITHMS.register("otfusion")
class OTFusion(Algorithm):
    name = "otfusion"
    Options = OTFusionOptions

    def __init__(self, cfg, setup):
        super().__init__(cfg, setup)
        o = read_options(self.Options, cfg, self.name)
        self.correction, self.past_correction = o.correction, o.past_correction
        self.squared = o.ground_metric == "sq_euclidean"
        self.pivot = o.pivot
        if self.pivot >= setup.num_clients:
            raise FedbenchError(f"algorithm.pivot must be < num_clients ({setup.num_clients}), got {self.pivot}")
        self.align_last, self.weighting = o.align_last_layer, o.weighting
        self.layers = fusion_layers(setup.model, self.name, model_name(setup))
        try:    # imported here (it takes seconds) so that it is not counted as server time
            import ot  # noqa: F401
        except ImportError:
            raise FedbenchError("otfusion needs the POT package (pip install pot==0.9.7.post1)") from None
        self.grid = [(a, b) for a, b in CORRECTION_ORDER
                     if self.correction in ("select", a) and self.past_correction in ("select", b)]
        if len(self.grid) > 1:
            setup.require_server_val(self.name)

    def client_stage_key(self, round_idx):
        return {} if round_idx == 1 else None

    def aggregate(self, messages: List[Message], state, round_idx):
        p = client_weights([m.num_samples for m in messages], self.weighting, empty_error=NO_CLIENT_DATA)
        clients = [m.payload["params"] for m in messages]
        best, best_acc, trace = None, 0.0, []
        best_flags = self.grid[-1]   # the code's fallback (F, F) when no setting beats 0 % accuracy
        cands, moved = {}, {}
        for corr, past in self.grid:
            stats: Dict[str, int] = {}
            cand = otfusion(clients, p, self.layers, pivot=self.pivot, correction=corr, past_correction=past,
                            squared=self.squared, align_last=self.align_last, stats=stats)
            cands[(corr, past)] = cand
            moved[(corr, past)] = stats.get("moved", 0) / max(stats.get("units", 0), 1)
            if len(self.grid) == 1:
                best, best_flags = cand, (corr, past)
                break
            acc = float(self.setup.val_metrics(cand)["accuracy"])
            trace.append({"correction": corr, "past_correction": past, "val_accuracy": acc})
            if acc > best_acc:      # strict, best starts at 0 (run_one_shot_algs.get_otfusion_model)
                best, best_acc, best_flags = cand, acc, (corr, past)
        if best is None:
            best = cands[best_flags]
        # recorded: the chosen flags and the share of transported units the plans moved (0 = every plan is the
        # identity, so with correction the result is FedAvg up to the 1e-7 marginal guard)
        return {**state, "params": best, "otfusion_trace": trace,
                "otfusion_choice": {"correction": best_flags[0], "past_correction": best_flags[1]},
                "extra_metrics": {"correction": float(best_flags[0]), "past_correction": float(best_flags[1]),
                                  "units_moved_fraction": moved[best_flags]}}
