"""Two engines that backpropagate the output-space vectors V_n (see ``likelihood``) per sample.

* ``hooks`` (fast path; models whose trainable parameters all live in ``nn.Linear`` /
  ``nn.Conv2d``): one batched forward with forward hooks that keep each layer's input and output,
  then, for each column k of V, one batched ``autograd.grad`` from the logits to all layer outputs.
  With δ = ∂(f·v_k)/∂(layer output) at every location s and the layer's input patches a_s
  (unfolded convolution inputs, from a strided view), the per-sample weight gradient is
  Σ_s δ_s a_sᵀ, so diagonals, K-FAC factors and per-sample gradients are batched matrix products:
  no per-sample Python loop. ``autograd.grad`` w.r.t. the layer outputs skips all weight gradients.
* ``func`` (any model): ``torch.func.functional_call`` + ``vmap(grad)`` per sample and per column,
  or ``vmap(jacrev)`` per-sample Jacobians contracted with the output-space factor (GGN). Slower
  and memory-hungry (materialises [N, K, P] per chunk); the reference the tests compare against.

Both feed *consumers* (diag, K-FAC factors, dense blocks) chunk by chunk, so memory stays bounded
by ``batch_size``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from fedbench.curvature import likelihood as lik
from fedbench.curvature.layout import ParamLayout
from fedbench.errors import FedbenchError

SUPPORTED = (nn.Linear, nn.Conv2d)


# ---------------------------------------------------------------------------------------------
# layers
# ---------------------------------------------------------------------------------------------
@dataclass
class Layer:
    name: str                 # module name
    module: nn.Module
    weight: Optional[str]     # full parameter names (None if absent / frozen)
    bias: Optional[str]

    @property
    def is_conv(self) -> bool:
        return isinstance(self.module, nn.Conv2d)

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(n for n in (self.weight, self.bias) if n is not None)


def find_layers(model: nn.Module, layout: ParamLayout) -> Tuple[List[Layer], List[str]]:
    """Linear/Conv2d layers holding trainable parameters, and the reasons the hooks engine cannot
    be used (parameters elsewhere, unsupported conv options); empty reasons = hooks usable."""
    layers: List[Layer] = []
    covered = set()
    problems: List[str] = []
    for mname, mod in model.named_modules():
        if not isinstance(mod, SUPPORTED):
            continue
        pre = f"{mname}." if mname else ""
        w = pre + "weight" if (pre + "weight") in layout else None
        b = pre + "bias" if mod.bias is not None and (pre + "bias") in layout else None
        if w is None and b is None:
            continue
        if w is None:
            problems.append(f"layer '{mname}' trains its bias but not its weight")
        if isinstance(mod, nn.Conv2d) and (mod.groups != 1 or mod.padding_mode != "zeros"):
            problems.append(f"conv layer '{mname}' has groups={mod.groups}, padding_mode={mod.padding_mode!r}")
        layers.append(Layer(mname, mod, w, b))
        covered.update(n for n in (w, b) if n is not None)
    outside = [n for n in layout.names if n not in covered]
    if outside:
        problems.append(f"parameters outside nn.Linear/nn.Conv2d: {', '.join(outside[:4])}"
                        + (" ..." if len(outside) > 4 else ""))
    return layers, problems


def _conv_pad(mod: nn.Conv2d, x: Tensor) -> Tensor:
    """Input zero-padded as the convolution pads it."""
    if isinstance(mod.padding, str):
        if mod.padding == "valid":
            return x
        pads = []   # 'same' (stride 1): total = d·(k−1), PyTorch puts the extra one on the right
        for d, k in zip(reversed(mod.dilation), reversed(mod.kernel_size)):
            tot = d * (k - 1)
            pads += [tot // 2, tot - tot // 2]
        return F.pad(x, pads)
    ph, pw = mod.padding
    return F.pad(x, (pw, pw, ph, ph)) if (ph or pw) else x


def _patch_view(mod: nn.Conv2d, a: Tensor) -> Tensor:
    """Strided view [N, C_in, kh, kw, H_out, W_out] of the padded input: no copy."""
    return _strided_patches(mod, _conv_pad(mod, a).contiguous())


def _strided_patches(mod: nn.Conv2d, a: Tensor) -> Tensor:
    N, C, H, W = a.shape
    (kh, kw), (sh, sw), (dh, dw) = mod.kernel_size, mod.stride, mod.dilation
    Ho = (H - dh * (kh - 1) - 1) // sh + 1
    Wo = (W - dw * (kw - 1) - 1) // sw + 1
    sN, sC, sH, sW = a.stride()
    return a.as_strided((N, C, kh, kw, Ho, Wo), (sN, sC, sH * dh, sW * dw, sH * sh, sW * sw))


def patch_index(mod: nn.Conv2d, padded_chw: Tuple[int, int, int], device) -> Tensor:
    """[J, S] positions in the flattened padded input (C·H·W) that ``conv_patches`` reads: patch entry
    (j, s) of a sample is ``padded_input.flatten()[index[j, s]]``."""
    pos = torch.arange(int(torch.tensor(padded_chw).prod()), device=device).view(1, *padded_chw)
    view = _strided_patches(mod, pos)
    return view.reshape(view.shape[1] * view.shape[2] * view.shape[3], -1)


def conv_patches(mod: nn.Conv2d, a: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """Unfolded convolution input, [N, J, S] contiguous (J = C_in·kh·kw in the order of
    ``weight.reshape(C_out, -1)``, S = H_out·W_out locations; ``F.unfold``'s layout), built from one
    strided view and one copy (several times faster than ``F.unfold`` on CPU), into ``out`` if given."""
    view = _patch_view(mod, a)
    N, C, kh, kw, Ho, Wo = view.shape
    if out is None:
        return view.reshape(N, C * kh * kw, Ho * Wo)
    out.view(view.shape).copy_(view)
    return out


def conv_patches_flat(mod: nn.Conv2d, a: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """The patches as one matrix [J, N·S] (= ``conv_patches(..).transpose(0, 1).reshape(J, N·S)``, same values
    and layout), copied straight from the strided view (one copy instead of two)."""
    view = _patch_view(mod, a).permute(1, 2, 3, 0, 4, 5)
    C, kh, kw, N, Ho, Wo = view.shape
    if out is None:
        return view.reshape(C * kh * kw, N * Ho * Wo)
    out.view(view.shape).copy_(view)
    return out


def patch_shape(layer: "Layer", a: Tensor) -> Tuple[int, int, int]:
    """(N, J, S) of ``input_patches(layer, a)`` without building them."""
    if layer.is_conv:
        N, C, kh, kw, Ho, Wo = _patch_view(layer.module, a).shape
        return N, C * kh * kw, Ho * Wo
    if a.dim() == 2:
        return a.shape[0], a.shape[1], 1
    return a.shape[0], a.shape[-1], a[0, ..., 0].numel()


def input_patches(layer: Layer, a: Tensor) -> Tensor:
    """Layer input as [N, J, S]: J = C_in·kh·kw (conv) or d_in, S weight-sharing locations
    (1 for a Linear layer on [N, d])."""
    if layer.is_conv:
        return conv_patches(layer.module, a)
    if a.dim() == 2:
        return a.unsqueeze(2)
    return a.reshape(a.shape[0], -1, a.shape[-1]).transpose(1, 2)


def output_locations(layer: Layer, g: Tensor) -> Tensor:
    """Gradient w.r.t. the layer output as [N, O, S] (a view where possible)."""
    if layer.is_conv:
        return g.flatten(2)
    if g.dim() == 2:
        return g.unsqueeze(2)
    return g.reshape(g.shape[0], -1, g.shape[-1]).transpose(1, 2)


class _Capture:
    """Forward hooks keeping each layer's (detached) input and (graph-attached) output."""

    def __init__(self, layers: Sequence[Layer]):
        self.layers = layers
        self.inputs: Dict[str, Tensor] = {}
        self.outputs: Dict[str, Tensor] = {}
        self.versions: Dict[str, int] = {}
        self.order: List[str] = []
        self._handles = []

    def _hook(self, name):
        def hook(mod, inp, out):
            if name in self.inputs:
                raise FedbenchError(f"layer '{name}' is called more than once per forward pass; "
                                    "use curvature backend 'func' (structures diag / full / layer_blocks)")
            self.inputs[name] = inp[0].detach()
            self.outputs[name] = out
            self.versions[name] = out._version
            self.order.append(name)
        return hook

    def __enter__(self):
        self._handles = [l.module.register_forward_hook(self._hook(l.name)) for l in self.layers]
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []

    def check(self):
        for n, o in self.outputs.items():
            if o._version != self.versions[n]:
                raise FedbenchError(f"the output of layer '{n}' is modified in place (e.g. ReLU(inplace=True)); "
                                    "use curvature backend 'func'")


class ForwardTap(_Capture):
    """A ``_Capture`` left on a model across its forward passes (a training loop's): each call of ``model`` starts
    a fresh capture and keeps the model's output, so a curvature consumer can reuse the loop's own forward pass
    (``consume_forward``) instead of running a second one. ``remove()`` takes the hooks off."""

    def __init__(self, model: nn.Module, layers: Sequence[Layer], layout: ParamLayout):
        super().__init__(layers)
        self.layout = layout
        self.output: Optional[Tensor] = None
        self.__enter__()
        self._handles += [model.register_forward_pre_hook(self._reset), model.register_forward_hook(self._keep)]

    def _reset(self, mod, inp) -> None:
        self.inputs, self.outputs, self.versions, self.order, self.output = {}, {}, {}, [], None

    def _keep(self, mod, inp, out) -> None:
        self.output = out

    def remove(self) -> None:
        self.__exit__()


class Patches:
    """Each layer's input as patches for one chunk, built on first use (a consumer that needs only the
    [J, N·S] matrix never pays for the [N, J, S] copy), in buffers reused across chunks: on a CPU a large
    fresh allocation is page-faulted on every chunk, which costs about as much as the copy itself."""

    def __init__(self, layers: Sequence[Layer]):
        self.layers = {l.name: l for l in layers}
        self._inputs: Dict[str, Tensor] = {}
        self._made: Dict[tuple, Tensor] = {}
        self._buffers: Dict[tuple, Tensor] = {}

    def new_chunk(self, inputs: Dict[str, Tensor]) -> None:
        self._inputs = inputs
        self._made = {}

    def shape(self, name: str) -> Tuple[int, int, int]:
        return patch_shape(self.layers[name], self._inputs[name])

    def input(self, name: str) -> Tensor:
        """The layer's (detached) input as captured."""
        return self._inputs[name]

    def __getitem__(self, name: str) -> Tensor:
        """[N, J, S] (contiguous for conv layers; a view of the input for Linear layers)."""
        layer = self.layers[name]
        if not layer.is_conv:
            return input_patches(layer, self._inputs[name])
        return self._make("njs", name, self.shape(name), conv_patches)

    def flat(self, name: str) -> Tensor:
        """[J, N·S] contiguous (conv layers only)."""
        N, J, S = self.shape(name)
        return self._make("flat", name, (J, N * S), conv_patches_flat)

    def _make(self, role: str, name: str, shape: tuple, build) -> Tensor:
        if (role, name) not in self._made:
            a = self._inputs[name]
            key = (role, name, shape, a.dtype, a.device)
            if key not in self._buffers:
                self._buffers[key] = a.new_empty(shape)
            self._made[role, name] = build(self.layers[name].module, a, self._buffers[key])
        return self._made[role, name]


def chunks(n: int, size: int):
    for s in range(0, n, size):
        yield slice(s, min(n, s + size))


# ---------------------------------------------------------------------------------------------
# hooks engine
# ---------------------------------------------------------------------------------------------
class HooksConsumer:
    """Receives, per chunk: the layer inputs as ``Patches`` (``patches[name]`` = P [N, J, S], built on
    first use), then, per column k of V, the output gradients D [N, O, S] of every layer (per-sample weight
    gradient = D Pᵀ)."""

    def start(self, patches: Patches, n: int) -> None: ...
    def grad(self, layer: Layer, k: int, D: Tensor, patches: Patches) -> None: ...
    def column_done(self, k: int) -> None: ...
    def end(self) -> None: ...


def run_hooks(model: nn.Module, layers: Sequence[Layer], x: Tensor, y: Tensor, kind: str, fisher: str,
              consumer: HooksConsumer, *, batch_size: int, mc_samples: int,
              generator: Optional[torch.Generator]) -> List[str]:
    """Drive ``consumer`` over the data; returns the layers' execution order."""
    order: List[str] = []
    patches = Patches(layers)
    for sl in chunks(x.shape[0], batch_size):
        with torch.enable_grad(), _Capture(layers) as cap:
            out = model(x[sl])
        order = list(cap.order)
        consume_forward(out, cap, layers, y[sl], kind, fisher, consumer, patches, mc_samples=mc_samples,
                        generator=generator)
        del out, cap
    return order


def consume_forward(out: Tensor, cap: "_Capture", layers: Sequence[Layer], y: Tensor, kind: str, fisher: str,
                    consumer: HooksConsumer, patches: "Patches", *, mc_samples: int = 1,
                    generator: Optional[torch.Generator] = None, keep_graph: bool = False) -> None:
    """One chunk's backward half of the hooks engine: from a forward pass whose layer inputs and outputs ``cap``
    holds (``out`` its model output), the output vectors V, one ``autograd.grad`` per column to the layer outputs,
    and ``consumer`` fed. ``keep_graph``: leave the forward's graph usable afterwards."""
    cap.check()
    missing = [l.name for l in layers if l.name not in cap.outputs]
    if missing:
        raise FedbenchError(f"layer(s) {', '.join(missing)} hold trainable parameters but are not used "
                            "in the forward pass")
    yb = lik.prepare_targets(kind, out, y)
    V = lik.output_vectors(kind, fisher, out, yb, mc_samples=mc_samples, generator=generator)
    patches.new_chunk({l.name: cap.inputs[l.name] for l in layers})
    consumer.start(patches, out.shape[0])
    outs = [cap.outputs[l.name] for l in layers]
    K = V.shape[-1]
    for k in range(K):
        grads = torch.autograd.grad(out, outs, grad_outputs=V[..., k], retain_graph=keep_graph or k < K - 1,
                                    allow_unused=True)
        for l, g in zip(layers, grads):
            if g is None:
                g = torch.zeros_like(cap.outputs[l.name])
            consumer.grad(l, k, output_locations(l, g), patches)
        consumer.column_done(k)
    consumer.end()


def _acc(d: Dict[str, Tensor], key: str, val: Tensor) -> None:
    if key in d:
        d[key] += val
    else:
        d[key] = val


class DiagHooks(HooksConsumer):
    """Σ_n Σ_k (per-sample gradient)² per parameter (per-sample gradient Σ_s δ_s a_sᵀ).

    Layers with weight sharing (S > 1) square the per-sample gradients of several columns k with one
    batched product [N, g·O, S] @ [N, S, J] (g columns, at most ``group_values`` values per stacked
    tensor) instead of one small product per column: the same dot products, summed over n per column
    in the same order as before. Bit-identical to one product per column for LeNet / SimpleCNN in float32
    (checked); elsewhere the BLAS may choose another kernel for the taller product, so equal to rounding
    (tests/test_curvature.py::test_diag_column_groups_do_not_change_bits). The stacked tensors live in buffers
    reused across chunks: large fresh allocations are page-faulted on every chunk on a CPU, which costs
    more than the products themselves."""

    def __init__(self, layers: Sequence[Layer], group_values: int = 1 << 25):
        self.layers = layers
        self.group_values = group_values
        self.diag: Dict[str, Tensor] = {}
        self._sq: Dict[str, Tensor] = {}
        self._cols: Dict[str, List[Tensor]] = {}
        self._patches: Dict[str, Tensor] = {}
        self._buffers: Dict[tuple, Tensor] = {}

    def start(self, patches, n):
        self._sq = {}
        self._cols = {}
        self._patches = patches

    def grad(self, layer, k, D, patches):
        if D.shape[2] == 1:               # no weight sharing: g = δ aᵀ, so Σ_k g² = (Σ_k δ²)(a²)ᵀ
            d = D[:, :, 0]
            _acc(self._sq, layer.name, d * d)
            return
        if layer.weight is not None:
            cols = self._cols.setdefault(layer.name, [])
            cols.append(D)
            N, O, S = D.shape
            if (len(cols) + 1) * N * O * max(S, patches.shape(layer.name)[1]) > self.group_values:
                self._square_columns(layer, cols)
                cols.clear()
        if layer.bias is not None:
            gb = D.sum(2)
            _acc(self.diag, layer.bias, (gb * gb).sum(0))

    def end(self):
        for l in self.layers:
            if self._cols.get(l.name):
                self._square_columns(l, self._cols[l.name])
            if l.name not in self._sq:
                continue
            d2 = self._sq[l.name]
            if l.weight is not None:
                a = self._patches[l.name][:, :, 0]
                _acc(self.diag, l.weight, (d2.t() @ (a * a)).reshape(l.module.weight.shape))
            if l.bias is not None:
                _acc(self.diag, l.bias, d2.sum(0))
        self._sq = {}
        self._cols = {}
        self._patches = {}

    def _buffer(self, role: str, shape: tuple, like: Tensor) -> Tensor:
        key = (role, shape)
        if key not in self._buffers:
            self._buffers[key] = like.new_empty(shape)
        return self._buffers[key]

    def _square_columns(self, layer: Layer, cols: List[Tensor]) -> None:
        (N, O, S), g = cols[0].shape, len(cols)
        P = self._patches[layer.name]
        J = P.shape[1]
        D = torch.stack(cols, 1, out=self._buffer("D", (N, g, O, S), P))
        gw = torch.bmm(D.view(N, g * O, S), P.transpose(1, 2), out=self._buffer("gw", (N, g * O, J), P))
        gw.mul_(gw)
        sq = self._buffer("sq", (N, O, J), P)
        for k in range(g):   # Σ_n per column on a contiguous copy: the old per-column summation order
            sq.copy_(gw.view(N, g, O, J)[:, k])
            _acc(self.diag, layer.weight, sq.sum(0).reshape(layer.module.weight.shape))


# K-FAC conv conventions: (α_A(S), α_G(S)) multiplying Σ_s ā āᵀ and Σ_s δ δᵀ per sample.
KFAC_ALPHA = {
    "expand": (lambda S: 1.0 / S, lambda S: 1.0),
    "fedlpa_kfc": (lambda S: 1.0 / (S * S), lambda S: float(S)),
    "nngeometry": (lambda S: 1.0, lambda S: 1.0 / S),
}
CONV_CONVENTIONS = ("fedlpa_kfc", "nngeometry", "expand", "reduce")
INPUT_FACTORS = ("patches", "gram")


class KFACHooks(HooksConsumer):
    """Raw K-FAC sums (not yet divided by N); ``compute.kfac_blocks`` finishes them.

    Per sample n with patches ā_s (ones appended when augmenting) and output gradients δ_ks:
      expand     A += (1/S)  Σ_s ā āᵀ        G += Σ_k Σ_s δ δᵀ
      fedlpa_kfc A += (1/S²) Σ_s ā āᵀ        G += S Σ_k Σ_s δ δᵀ      (alecwangcq KFC)
      nngeometry A +=        Σ_s ā āᵀ        G += (1/S) Σ_k Σ_s δ δᵀ
      reduce     A += ā̄ ā̄ᵀ, ā̄ = mean_s ā     G += Σ_k ĝ ĝᵀ, ĝ = Σ_s δ
    (S = 1 for Linear layers on [N, d] inputs, where all four coincide.) The augmented A is
    assembled from Σ a aᵀ, Σ a and Σ 1 (no concatenated copy of the patches). expand, fedlpa_kfc
    and nngeometry give the same A ⊗ G (the S moves between the factors), which matters once
    FedLPA damps the factors separately. nngeometry additionally stores A·√C and G/√C; that
    cosmetic rescaling cancels in A ⊗ G and in FedFisher's use (products, scale-invariant
    quantisation) and is not reproduced.

    ``input_factor="gram"`` (opt-in; changes float rounding): for a conv layer under expand / fedlpa_kfc /
    nngeometry, Σ_n Σ_s ā āᵀ is a sum of entries of the input Gram Σ_n x_n x_nᵀ (x_n = the padded input
    flattened, C·H·W), A[j, j'] = Σ_s Gram[idx(j, s), idx(j', s)]; one GEMM per chunk on the (C·H·W)²
    Gram replaces the J²·S-per-sample patch products and the patch copies. Used where (C·H·W)² ≤ 2 J² S
    (LeNet / SimpleCNN-MNIST: both convs; CIFAR's first conv keeps the patches). The default "patches"
    keeps the committed results' bits.
    """

    gram_max_ratio = 2.0   # Gram FLOPs / patch-product FLOPs up to which "gram" takes the Gram route

    def __init__(self, layers: Sequence[Layer], convention: str, input_factor: str = "patches"):
        if input_factor not in INPUT_FACTORS:
            raise FedbenchError(f"unknown K-FAC input_factor {input_factor!r}; choose one of: "
                                f"{', '.join(INPUT_FACTORS)}")
        self.layers = layers
        self.convention = convention
        self.input_factor = input_factor
        self.gram: Dict[str, Tensor] = {}     # Σ_n x xᵀ of the padded inputs (input_factor "gram")
        self.colsum: Dict[str, Tensor] = {}   # Σ_n x
        self._chw: Dict[str, Tuple[int, int, int]] = {}
        self.aa: Dict[str, Tensor] = {}   # Σ a aᵀ (scaled)
        self.a1: Dict[str, Tensor] = {}   # Σ a (scaled), for the bias augmentation
        self.c1: Dict[str, float] = {}    # Σ 1 (scaled)
        self.gg: Dict[str, Tensor] = {}
        self.S: Dict[str, int] = {}

    def start(self, patches, n):
        for l in self.layers:
            N, J, S = patches.shape(l.name)
            self.S[l.name] = S
            if self._use_gram(l, patches.input(l.name), J, S):
                self._add_gram(l, patches.input(l.name), N, S)
                continue
            # P [N, J, S] is not built when only the [J, N·S] matrix is used; the bias sums keep their
            # P.sum((0, 2)) (no other reduction of the same numbers reproduces its bits)
            need_P = S == 1 or J <= 64 or self.convention == "reduce" or l.bias is not None
            P = patches[l.name] if need_P else None
            if self.convention == "reduce" or S == 1:
                a = P.mean(2) if S > 1 else P[:, :, 0]
                aa = a.t() @ a
                a1 = a.sum(0) if l.bias is not None else None
                c1 = float(N)
            else:
                alpha = KFAC_ALPHA[self.convention][0](S)
                if J <= 64:      # small J: batched Σ_n P_n P_nᵀ beats a copy + one GEMM
                    aa = torch.bmm(P, P.transpose(1, 2)).sum(0)
                else:
                    flat = patches.flat(l.name)
                    aa = flat @ flat.t()
                aa.mul_(alpha)
                a1 = P.sum((0, 2)).mul_(alpha) if l.bias is not None else None
                c1 = alpha * N * S
            _acc(self.aa, l.name, aa)
            if a1 is not None:
                _acc(self.a1, l.name, a1)
            self.c1[l.name] = self.c1.get(l.name, 0.0) + c1

    def _use_gram(self, layer: Layer, a: Tensor, J: int, S: int) -> bool:
        if self.input_factor != "gram" or not layer.is_conv or S == 1 or self.convention == "reduce":
            return False
        chw = _conv_pad(layer.module, a[:1]).numel()
        return chw * chw <= self.gram_max_ratio * J * J * S

    def _add_gram(self, layer: Layer, a: Tensor, N: int, S: int) -> None:
        padded = _conv_pad(layer.module, a)
        self._chw[layer.name] = tuple(padded.shape[1:])
        x = padded.reshape(N, -1)
        _acc(self.gram, layer.name, x.t() @ x)
        if layer.bias is not None:
            _acc(self.colsum, layer.name, x.sum(0))
        alpha = KFAC_ALPHA[self.convention][0](S)
        self.c1[layer.name] = self.c1.get(layer.name, 0.0) + alpha * N * S

    def finish(self) -> None:
        """Turn the accumulated input Grams into A sums (``input_factor="gram"``; a no-op otherwise)."""
        for name, gram in self.gram.items():
            layer = next(l for l in self.layers if l.name == name)
            idx = patch_index(layer.module, self._chw[name], gram.device)         # [J, S]
            alpha = KFAC_ALPHA[self.convention][0](self.S[name])
            rows = idx.t()
            self.aa[name] = gram[rows.unsqueeze(2), rows.unsqueeze(1)].sum(0).mul_(alpha)
            if name in self.colsum:
                self.a1[name] = self.colsum[name][idx].sum(1).mul_(alpha)
        self.gram, self.colsum = {}, {}

    def grad(self, layer, k, D, patches):
        N, O, S = D.shape
        if S == 1:
            d = D[:, :, 0]
            gg = d.t() @ d
        elif self.convention == "reduce":
            g = D.sum(2)
            gg = g.t() @ g
        else:
            gg = torch.bmm(D, D.transpose(1, 2)).sum(0)
            alpha = KFAC_ALPHA[self.convention][1](S)
            if alpha != 1.0:
                gg.mul_(alpha)
        _acc(self.gg, layer.name, gg)

    def end(self):
        pass


class GradsHooks(HooksConsumer):
    """Per-sample gradients of the layers in ``only`` (all when None), handed to ``sink`` one column k
    at a time as {name: [N, 1, *shape]} (memory N·P per column, not N·K·P)."""

    def __init__(self, layers: Sequence[Layer], sink: Callable[[Dict[str, Tensor]], None],
                 only: Optional[Sequence[str]] = None):
        self.layers = layers
        self.sink = sink
        self.only = None if only is None else set(only)
        self._g: Dict[str, Tensor] = {}

    def start(self, patches, n):
        self._g = {}

    def grad(self, layer, k, D, patches):
        if self.only is not None and layer.name not in self.only:
            return
        if layer.weight is not None:
            gw = torch.bmm(D, patches[layer.name].transpose(1, 2))
            self._g[layer.weight] = gw.reshape(-1, 1, *layer.module.weight.shape)
        if layer.bias is not None:
            self._g[layer.bias] = D.sum(2).unsqueeze(1)

    def column_done(self, k):
        if self._g:
            self.sink(self._g)
        self._g = {}


class MultiHooks(HooksConsumer):
    """Several consumers fed by one pass."""

    def __init__(self, *consumers: HooksConsumer):
        self.consumers = consumers

    def start(self, patches, n):
        for c in self.consumers:
            c.start(patches, n)

    def grad(self, layer, k, D, patches):
        for c in self.consumers:
            c.grad(layer, k, D, patches)

    def column_done(self, k):
        for c in self.consumers:
            c.column_done(k)

    def end(self):
        for c in self.consumers:
            c.end()


# ---------------------------------------------------------------------------------------------
# torch.func engine
# ---------------------------------------------------------------------------------------------
def _split_state(model: nn.Module, layout: ParamLayout):
    params = {n: p.detach() for n, p in model.named_parameters() if n in layout}
    fixed = {n: p.detach() for n, p in model.named_parameters() if n not in layout}
    fixed.update(dict(model.named_buffers()))
    return params, fixed


def run_func(model: nn.Module, layout: ParamLayout, x: Tensor, y: Tensor, kind: str, fisher: str,
             sink: Callable[[Dict[str, Tensor]], None], *, batch_size: int, mc_samples: int,
             generator: Optional[torch.Generator], max_values: int = 1 << 25) -> None:
    """Per-sample gradients of the backpropagated vectors via ``torch.func``; ``sink`` receives
    dicts name -> [n, K, *shape] chunk by chunk (chunks sized so that n·K·P ≤ ``max_values``)."""
    from torch.func import functional_call, grad, jacrev, vmap

    params, fixed = _split_state(model, layout)

    def f_single(p, xi):
        return functional_call(model, {**p, **fixed}, (xi.unsqueeze(0),)).squeeze(0)

    with torch.no_grad():
        C = model(x[:1]).shape[-1]
    K = {"empirical": 1, "mc": mc_samples, "true": (2 if kind == "bce" else C), "ggn": C}[fisher]
    if kind == "bce" and fisher == "ggn":
        K = 1
    step = max(1, min(batch_size, max_values // max(1, K * layout.numel)))
    for sl in chunks(x.shape[0], step):
        xb = x[sl]
        with torch.no_grad():
            out = model(xb)
        yb = lik.prepare_targets(kind, out, y[sl])
        if fisher == "ggn" or (fisher == "true" and kind == "mse"):
            # per-sample Jacobians contracted with the output-space Hessian square root
            J = vmap(jacrev(f_single), in_dims=(None, 0))(params, xb)            # name -> [n, C, *shape]
            S = lik.hessian_sqrt(kind, out)                                       # [n, C, K]
            g = {nm: torch.einsum("nck,nc...->nk...", S, J[nm]) for nm in layout.names}
        elif fisher == "true":
            # nngeometry's classif_logits: grad of √p_c (detached) · log p(c | f) for every class c
            w = lik.class_log_probs(kind, out).exp().sqrt()                       # [n, K]
            onehot = torch.eye(w.shape[1], dtype=out.dtype, device=xb.device)

            def weighted_logp(p, xi, e_c, wc):
                return wc * (lik.class_log_probs(kind, f_single(p, xi).unsqueeze(0))[0] * e_c).sum()

            per_c = vmap(grad(weighted_logp), in_dims=(None, None, 0, 0))
            g = vmap(per_c, in_dims=(None, 0, None, 0))(params, xb, onehot, w)
        else:
            V = lik.output_vectors(kind, fisher, out, yb, mc_samples=mc_samples, generator=generator)

            def proj(p, xi, v):
                return (f_single(p, xi) * v).sum()

            per_k = vmap(grad(proj), in_dims=(None, None, 1))                     # v: [C, K] -> K
            g = vmap(per_k, in_dims=(None, 0, 0))(params, xb, V)
        sink({nm: g[nm] for nm in layout.names})


def execution_order(model: nn.Module, x1: Tensor, layout: ParamLayout) -> List[Tuple[str, Tuple[str, ...]]]:
    """(module name, its trainable parameter names) for modules with direct trainable parameters,
    in the order they run on ``x1``."""
    owners = []
    for mname, mod in model.named_modules():
        pre = f"{mname}." if mname else ""
        own = tuple(pre + n for n, _ in mod.named_parameters(recurse=False) if pre + n in layout)
        if own:
            owners.append((mname, mod, own))
    seen: List[Tuple[str, Tuple[str, ...]]] = []
    handles = []
    for mname, mod, own in owners:
        def hook(m, i, o, mname=mname, own=own):
            if all(s[0] != mname for s in seen):
                seen.append((mname, own))
        handles.append(mod.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(x1)
    finally:
        for h in handles:
            h.remove()
    return seen
