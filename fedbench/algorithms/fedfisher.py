"""FedFisher(Diag) and FedFisher(K-FAC) (Jhunjhunwala, Wang & Joshi, AISTATS 2024; notes/fedfisher.md).

Clients train plainly (sharing the cached FedAvg clients), then compute the TRUE Fisher at their
trained weights over their whole local set, averaged over samples (§1.3: nngeometry
``classif_logits`` = exact expectation over the predicted classes; K-FAC in nngeometry's conv
convention), cached beside the client stage so every aggregator reuses it.

Server (§1.4–1.5), with p_i = n_i / n:
    minimise  ½ Σ_i p_i (w − W_i)ᵀ F_i (w − W_i)        gradient g(w) = Σ_i p_i F_i w − b,  b = Σ_i p_i F_i W_i
    from w⁰ = Σ_i p_i W_i, ``steps`` iterations of
      adam_code   m ← g + β1 m;  v ← g² + β2 v;  w ← w − lr·m/(√v + ε)  (Diag)  or  m/√(v + ε)  (K-FAC)
                  (the released code: no bias correction, no (1 − β) factors; ε placement per variant)
      adam_torch  torch.optim.Adam(lr, (β1, β2), ε)  (the paper's literal "Adam")
      gd          w ← w − lr·g, lr = 1/λ_max(Σ p_i F_i) by default (Lemma 1: converges to the
                  minimum-distance solution w⁰ + F⁺(b − F w⁰))
    Validation accuracy after every step k with k % eval_every == 0 (k = 0, 100, ..., as the code);
    the best (strictly better) iterate is the answer (``select: val_accuracy``), or the last iterate.
K-FAC products are per layer G·M·A on the layer matrix M (never a dense Kronecker product).

Compression (§1.6, App. C; ``compression: true`` as the code): weights and the diagonal Fisher are
16-bit quantised per tensor; K-FAC factors are SVD-truncated to one global rank (the code's
⌊2d/Σ(2a+2g+2)⌋ = the paper's 16d-bit budget at 8 bits) with U, S, Vh quantised (255 levels as the
code, counted as 9 bits; ``factor_levels: paper`` = 127 levels, exactly 8 bits). The message carries
the encoded tensors (so the uplink bytes are the compressed sizes) and the server decodes them;
b is built from the decoded factors and weights, so the system is self-consistent (§1.6 [C]).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

from fedbench.algorithms import compression as C
from fedbench.algorithms.base import ALGORITHMS, Algorithm, ClientProduct, Message
from fedbench.algorithms.common import NO_CLIENT_DATA, client_weights, method_generator
from fedbench.algorithms.options import choice as cfg_choice, option, read_options
from fedbench.errors import FedbenchError
from fedbench.curvature import compute_curvature, CONV_CONVENTIONS
from fedbench.curvature.structures import KronBlock
from fedbench.curvature.engine import find_layers
from fedbench.curvature.layout import ParamLayout

Params = Dict[str, Tensor]

OPTIMIZERS = ("adam_code", "adam_torch", "gd")
SELECTS = ("val_accuracy", "last")
FISHERS = ("true", "mc", "empirical")
WEIGHTINGS = ("num_samples", "uniform")


# --------------------------------------------------------------------------------------------------
# config validation (one-line FedbenchError from __init__)
# --------------------------------------------------------------------------------------------------
def fisher_name(val):
    """YAML / Hydra read a bare ``true`` as a boolean: it means the true Fisher."""
    return "true" if val is True else val


def fisher_option(key: str, val: Any) -> str:
    """The ``fisher`` option (a bare YAML ``true`` = the true Fisher)."""
    return cfg_choice({key: fisher_name(val)}, key, None, FISHERS)


def bits_option(key: str, val: Any) -> int:
    """A quantisation bit width, 2..32."""
    return C.check_bits(key, val)


def rank_option(key: str, val: Any):
    """``budget`` (the rank the bit budget allows, computed from the model) or an integer >= 1."""
    if val == "budget":
        return val
    if isinstance(val, int) and not isinstance(val, bool) and val >= 1:
        return int(val)
    raise FedbenchError(f"algorithm.{key} must be 'budget' or a positive integer, got {val!r}")


def levels_option(key: str, val: Any) -> str:
    if val not in ("code", "paper"):
        raise FedbenchError(f"algorithm.{key} must be code or paper, got {val!r}")
    return val


# --------------------------------------------------------------------------------------------------
# client-side Fisher (cached with the client stage)
# --------------------------------------------------------------------------------------------------
class FisherClient:
    """Declares a client's Fisher at its trained weights on its whole local set (no augmentation), mean over
    samples (§1.3), as a client product: the loop computes it and caches it so all aggregators share it."""

    def __init__(self, setup, fisher: str = "true", batch_size: int = 64, conv_convention: str = "nngeometry"):
        self.setup = setup
        self.fisher = fisher
        self.batch_size = batch_size
        self.conv_convention = conv_convention

    def _data(self, client_id):
        idx = self.setup.client_indices[client_id]
        return self.setup.train.inputs(idx), self.setup.train.targets(idx)

    def _gen(self, client_id, round_idx):
        if self.fisher != "mc":
            return None
        dev = self.setup.device if isinstance(self.setup.device, torch.device) else torch.device(self.setup.device)
        return method_generator("fedfisher", self.setup.seed, round_idx, client_id, device=dev)

    def parts(self, structure):
        p = {"structure": structure, "fisher": self.fisher, "scale": "mean"}
        if structure == "kfac":
            p["conv_convention"] = self.conv_convention
        return p

    def diag(self, client_id: int, params: Params, round_idx: int = 1) -> ClientProduct:
        """Product ``fisher``: {"F": diagonal Fisher per parameter}."""
        def compute(worker):
            if len(self.setup.client_indices[client_id]) == 0:
                return {"F": {n: torch.zeros_like(t) for n, t in params.items()}}
            x, y = self._data(client_id)
            curv = compute_curvature(worker, x, y, structure="diag", fisher=self.fisher, scale="mean",
                                     batch_size=self.batch_size, generator=self._gen(client_id, round_idx))
            return {"F": {n: curv.diag[n].detach().to(params[n].dtype) for n in params}}
        return ClientProduct("fedfisher_fisher_diag", self.parts("diag"), params, compute, label="fisher")

    def kfac(self, client_id: int, params: Params, round_idx: int = 1) -> ClientProduct:
        """Product ``fisher``: {"blocks": {layer: {"A", "G"}}} K-FAC factors."""
        def compute(worker):
            if len(self.setup.client_indices[client_id]) == 0:
                return {"blocks": {s.module: {"A": torch.zeros(s.d_in, s.d_in), "G": torch.zeros(s.d_out, s.d_out)}
                                   for s in kfac_specs(self.setup.model)}}
            x, y = self._data(client_id)
            curv = compute_curvature(worker, x, y, structure="kfac", fisher=self.fisher, scale="mean",
                                     conv_convention=self.conv_convention, bias_augment=True,
                                     batch_size=self.batch_size, generator=self._gen(client_id, round_idx))
            return {"blocks": {m: {"A": b.A.detach(), "G": b.G.detach()} for m, b in curv.blocks.items()}}
        return ClientProduct("fedfisher_fisher_kfac", self.parts("kfac"), params, compute, label="fisher")


class _Spec:
    """One K-FAC layer of the template: module name, parameter names/shapes, factor sides."""

    def __init__(self, module, names, shapes, d_in, d_out):
        self.module, self.names, self.shapes, self.d_in, self.d_out = module, names, shapes, d_in, d_out

    def block(self, A: Tensor, G: Tensor):
        return KronBlock(self.module, self.names, self.shapes, A, G)


def kfac_specs(model) -> List[_Spec]:
    """Layer specs for K-FAC with the bias folded into A ([W | b], §1.3); raises a one-line error if
    some trainable parameter is outside nn.Linear / nn.Conv2d."""
    layout = ParamLayout.from_module(model)
    layers, problems = find_layers(model, layout)
    if problems:
        raise FedbenchError(f"K-FAC needs every trainable parameter in nn.Linear / nn.Conv2d: {problems[0]}")
    specs = []
    for l in layers:
        shapes = tuple(layout.shape(n) for n in l.names)
        d_out = shapes[0][0]
        d_in = int(torch.Size(shapes[0]).numel()) // d_out + (1 if l.bias is not None else 0)
        specs.append(_Spec(l.name, l.names, shapes, d_in, d_out))
    return specs


# --------------------------------------------------------------------------------------------------
# encoding helpers (uplink payloads)
# --------------------------------------------------------------------------------------------------
def encode_params(params: Params, levels: Optional[int]) -> Dict[str, Any]:
    """Per-tensor quantisation (the code's quantize_layer), or float32 when ``levels`` is None."""
    if levels is None:
        return {n: t.detach().float() for n, t in params.items()}
    return {n: C.encode(t.detach(), levels) for n, t in params.items()}


def decode_any(x, dtype=torch.float32) -> Tensor:
    if isinstance(x, Tensor):
        return x.to(dtype)
    if "q" in x:
        return C.decode(x, dtype)
    return C.decode_lowrank(x, dtype)


def decode_params(enc: Mapping[str, Any], dtype=torch.float32) -> Params:
    return {n: decode_any(v, dtype) for n, v in enc.items()}


def weighted_sum(dicts: Sequence[Params], weights: Sequence[float]) -> Params:
    return {n: sum(w * d[n] for w, d in zip(weights, dicts)) for n in dicts[0]}


# --------------------------------------------------------------------------------------------------
# server solver
# --------------------------------------------------------------------------------------------------
def adam_code_step(w: Params, g: Params, m: Params, v: Params, *, lr: float, beta1: float, beta2: float,
                   eps: float, eps_inside_sqrt: bool) -> None:
    """The released code's update, in place: m ← g + β1 m; v ← g² + β2 v; w ← w − lr m/(√v + ε)
    (Diag) or w − lr m/√(v + ε) (K-FAC) (§1.5 [C])."""
    for n in w:
        m[n].mul_(beta1).add_(g[n])
        v[n].mul_(beta2).addcmul_(g[n], g[n])
        denom = (v[n] + eps).sqrt() if eps_inside_sqrt else v[n].sqrt().add_(eps)
        w[n].addcdiv_(m[n], denom, value=-lr)


def power_lambda_max(mv: Callable[[Params], Params], like: Params, iters: int = 100, seed: int = 0) -> float:
    """Largest eigenvalue of the PSD operator ``mv`` (power iteration)."""
    g = torch.Generator().manual_seed(seed)
    x = {n: torch.randn(t.shape, generator=g, dtype=torch.float64).to(t) for n, t in like.items()}
    lam = 0.0
    for _ in range(iters):
        nrm = math.sqrt(sum(float((t * t).sum()) for t in x.values())) or 1.0
        x = {n: t / nrm for n, t in x.items()}
        y = mv(x)
        lam = math.sqrt(sum(float((t * t).sum()) for t in y.values()))
        x = y
        if lam == 0.0:
            break
    return lam


def solve(grad: Callable[[Params], Params], w0: Params, *, optimizer: str, steps: int, lr: float,
          beta1: float = 0.9, beta2: float = 0.99, eps: float = 0.01, eps_inside_sqrt: bool = False,
          eval_every: int = 100, evaluate: Optional[Callable[[Params], float]] = None
          ) -> Tuple[Params, Params, List[Tuple[int, float]]]:
    """Minimise the quadratic with gradient ``grad`` from ``w0``. Returns (selected, last, trace):
    with ``evaluate`` the iterate of the best (strictly higher) score among steps k % eval_every == 0
    (evaluated after step k, k from 0 as the code), else the last iterate."""
    w = {n: t.detach().clone() for n, t in w0.items()}
    trace: List[Tuple[int, float]] = []
    m = v = opt = None
    if optimizer == "adam_code":
        m = {n: torch.zeros_like(t) for n, t in w.items()}
        v = {n: torch.zeros_like(t) for n, t in w.items()}
    elif optimizer == "adam_torch":
        leaves = [w[n].requires_grad_(False) for n in w]
        opt = torch.optim.Adam(leaves, lr=lr, betas=(beta1, beta2), eps=eps)
    elif optimizer != "gd":
        raise FedbenchError(f"server_optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    # v accumulates g² of tiny Fisher entries: CPU denormals slow every op ~10×; flushing them to
    # zero changes values below 1e-38 only (restored afterwards)
    best_box: list = [None, -math.inf]
    prev_flush = _flush_denormal_on()
    torch.set_flush_denormal(True)
    try:
        _run_steps(grad, w, optimizer, steps, lr, beta1, beta2, eps, eps_inside_sqrt, eval_every, evaluate,
                   trace, best_box, m, v, opt)
    finally:
        torch.set_flush_denormal(bool(prev_flush))
    best = best_box[0]
    last = {n: t.detach().clone() for n, t in w.items()}
    if best is None:
        best = last
    return best, last, trace


def _flush_denormal_on() -> bool:
    return float(torch.tensor([1e-38], dtype=torch.float32).mul(0.01)) == 0.0


def _run_steps(grad, w, optimizer, steps, lr, beta1, beta2, eps, eps_inside_sqrt, eval_every, evaluate, trace,
               best_box, m, v, opt):
    for k in range(steps):
        with torch.no_grad():
            g = grad(w)
            if optimizer == "adam_code":
                adam_code_step(w, g, m, v, lr=lr, beta1=beta1, beta2=beta2, eps=eps, eps_inside_sqrt=eps_inside_sqrt)
            elif optimizer == "gd":
                for n in w:
                    w[n].add_(g[n], alpha=-lr)
        if optimizer == "adam_torch":
            for n in w:
                w[n].grad = g[n]
            opt.step()
        if evaluate is not None and k % eval_every == 0:
            score = float(evaluate(w))
            trace.append((k, score))
            if score > best_box[1]:
                best_box[1] = score
                best_box[0] = {n: t.detach().clone() for n, t in w.items()}


# --------------------------------------------------------------------------------------------------
# FedFisher
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FedFisherOptions:
    fisher: str = option(check=fisher_option)
    weighting: str = option(choices=WEIGHTINGS)
    server_optimizer: str = option(choices=OPTIMIZERS)
    steps: int = option(minimum=0)
    lr: float = option(positive=True)
    beta1: float = option(nonneg=True)
    beta2: float = option(nonneg=True)
    eps: float = option(positive=True)
    eps_inside_sqrt: bool = option()
    eval_every: int = option(minimum=1)
    select: str = option(choices=SELECTS)
    gd_lr: Optional[float] = option(positive=True)
    compression: bool = option()
    weight_bits: int = option(check=bits_option)
    curvature_batch_size: int = option(minimum=1)


@dataclass(frozen=True)
class FedFisherDiagOptions(FedFisherOptions):
    fisher_bits: int = option(check=bits_option)


@dataclass(frozen=True)
class FedFisherKFACOptions(FedFisherOptions):
    factor_bits: int = option(check=bits_option)
    factor_levels: str = option(check=levels_option)
    kfac_rank: Any = option(check=rank_option)
    conv_convention: str = option(choices=CONV_CONVENTIONS)


class _FedFisher(Algorithm):
    STRUCTURE = ""
    Options = None   # each concrete class: its options dataclass

    def __init__(self, cfg, setup):
        super().__init__(cfg, setup)
        o = self.opts = read_options(self.Options, cfg, self.name)
        self.fisher, self.weighting, self.optimizer = o.fisher, o.weighting, o.server_optimizer
        self.steps, self.lr, self.beta1, self.beta2 = o.steps, o.lr, o.beta1, o.beta2
        if self.optimizer == "adam_torch" and not (self.beta1 < 1 and self.beta2 < 1):
            raise FedbenchError("algorithm.beta1 and beta2 must be < 1 for server_optimizer adam_torch")
        self.eps, self.eps_inside_sqrt, self.eval_every = o.eps, o.eps_inside_sqrt, o.eval_every
        self.select, self.gd_lr, self.compression = o.select, o.gd_lr, o.compression
        self.weight_bits, self.curv_bs = o.weight_bits, o.curvature_batch_size
        if self.select == "val_accuracy":
            setup.require_server_val(self.name)
        self.fisher_client = FisherClient(setup, self.fisher, self.curv_bs)

    def client_stage_key(self, round_idx):
        return {} if round_idx == 1 else None   # plain local training: shares FedAvg's cached clients

    @property
    def weight_levels(self) -> Optional[int]:
        return C.levels_for_bits(self.weight_bits) if self.compression else None

    # subclass hooks ------------------------------------------------------------------------------
    def client_products(self, client_id, params, state, round_idx):
        return [getattr(self.fisher_client, self.STRUCTURE)(client_id, params, round_idx)]

    def _curvature_payload(self, fisher: Dict[str, Any]) -> Dict[str, Any]:
        raise NotImplementedError

    def _operators(self, messages, weights, Ws) -> Tuple[Callable[[Params], Params], Params]:
        """(mv of Σ p_i F_i, b = Σ p_i F_i W_i) from the decoded messages."""
        raise NotImplementedError

    # ---------------------------------------------------------------------------------------------
    def client_message(self, client_id, params, result, pos, state, round_idx, products):
        payload = {"params": encode_params(params, self.weight_levels),
                   **self._curvature_payload(products["fisher"])}
        return Message(client_id, len(self.setup.client_indices[client_id]), payload,
                       {"steps": result.steps[pos], "train_loss": result.mean_loss[pos]})

    def _val_accuracy(self, dtypes):
        def ev(w):
            return self.setup.val_metrics({n: t.to(dtypes[n]) for n, t in w.items()})["accuracy"]
        return ev

    def aggregate(self, messages, state, round_idx):
        ref = state["params"]
        dev = next(iter(ref.values())).device
        p = client_weights([m.num_samples for m in messages], self.weighting, empty_error=NO_CLIENT_DATA)
        Ws = [{n: t.to(dev) for n, t in decode_params(m.payload["params"]).items()} for m in messages]
        w0 = weighted_sum(Ws, p)
        mv, b = self._operators(messages, p, Ws)

        def grad(w):
            Fw = mv(w)
            return {n: Fw[n] - b[n] for n in w}

        lr = self.lr
        if self.optimizer == "gd":
            lr = self.gd_lr
            if lr is None:
                lam = power_lambda_max(mv, w0)
                lr = 1.0 / lam if lam > 0 else 0.0
        evaluate = self._val_accuracy({n: t.dtype for n, t in ref.items()}) if self.select == "val_accuracy" else None
        best, last, trace = solve(grad, w0, optimizer=self.optimizer, steps=self.steps, lr=lr, beta1=self.beta1,
                                  beta2=self.beta2, eps=self.eps, eps_inside_sqrt=self.eps_inside_sqrt,
                                  eval_every=self.eval_every, evaluate=evaluate)
        out = {n: best[n].to(ref[n].dtype) for n in ref}
        new = {**state, "params": out, "server_trace": trace}
        if self.select == "val_accuracy":
            new["extra_eval"] = {"last_iterate": {n: last[n].to(ref[n].dtype) for n in ref}}
        return new


@ALGORITHMS.register("fedfisher_diag")
class FedFisherDiag(_FedFisher):
    """FedFisher(Diag): g = (Σ p_i F_i) ⊙ w − Σ p_i F_i ⊙ W_i, F_i 16-bit quantised per tensor."""

    name = "fedfisher_diag"
    STRUCTURE = "diag"
    Options = FedFisherDiagOptions

    def __init__(self, cfg, setup):
        super().__init__(cfg, setup)
        self.fisher_bits = self.opts.fisher_bits

    def _curvature_payload(self, fisher):
        F = fisher["F"]
        levels = C.levels_for_bits(self.fisher_bits) if self.compression else None
        return {"fisher": encode_params(F, levels)}

    def _operators(self, messages, p, Ws):
        dev = Ws[0][next(iter(Ws[0]))].device
        Fs = [{n: t.to(dev) for n, t in decode_params(m.payload["fisher"]).items()} for m in messages]
        Fsum = weighted_sum(Fs, p)
        b = {n: sum(pi * F[n] * W[n] for pi, F, W in zip(p, Fs, Ws)) for n in Fsum}
        return (lambda w: {n: Fsum[n] * w[n] for n in w}), b


@ALGORITHMS.register("fedfisher_kfac")
class FedFisherKFAC(_FedFisher):
    """FedFisher(K-FAC): g = Σ_i p_i G_i M A_i − b per layer (M the layer matrix [W | b])."""

    name = "fedfisher_kfac"
    STRUCTURE = "kfac"
    Options = FedFisherKFACOptions

    def __init__(self, cfg, setup):
        super().__init__(cfg, setup)
        o = self.opts
        self.factor_bits, fl = o.factor_bits, o.factor_levels
        # code: quantize(·, bits) = 2^bits − 1 levels (sent with bits + 1 bits); paper: l_q = 2^(bits−1) − 1
        self.factor_levels = 2 ** self.factor_bits - 1 if fl == "code" else C.levels_for_bits(self.factor_bits)
        self.conv_convention = o.conv_convention
        self.fisher_client.conv_convention = self.conv_convention
        self.specs = kfac_specs(setup.model)     # one-line error here (before training) for BN etc.
        d = sum(p.numel() for p in setup.model.parameters() if p.requires_grad)
        if o.kfac_rank == "budget":
            sides = [s for sp in self.specs for s in (sp.d_in, sp.d_out)]
            self.rank = C.budget_rank(d, sides, self.factor_bits)
        else:
            self.rank = o.kfac_rank

    def _curvature_payload(self, fisher):
        blocks = fisher["blocks"]
        if not self.compression:
            return {"factors": {m: {"A": f["A"].float(), "G": f["G"].float()} for m, f in blocks.items()}}
        return {"factors": {m: {"A": C.encode_lowrank(f["A"], self.rank, self.factor_levels),
                                "G": C.encode_lowrank(f["G"], self.rank, self.factor_levels)}
                            for m, f in blocks.items()}}

    def _operators(self, messages, p, Ws):
        dev = Ws[0][next(iter(Ws[0]))].device
        per_client = []
        for m in messages:
            fac = m.payload["factors"]
            per_client.append([sp.block(decode_any(fac[sp.module]["A"]).to(dev), decode_any(fac[sp.module]["G"]).to(dev))
                               for sp in self.specs])
        return make_kfac_mv(per_client, p), kfac_b(per_client, p, Ws)


def make_kfac_mv(per_client, p):
    """w ↦ Σ_i p_i F_i w, per layer Σ_i p_i G_i M A_i."""
    def mv(w: Params) -> Params:
        out: Params = {}
        for j, blk in enumerate(per_client[0]):
            M = blk.to_matrix(w)
            acc = sum(pi * (blocks[j].G @ M @ blocks[j].A) for pi, blocks in zip(p, per_client))
            out.update(blk.from_matrix(acc))
        return out
    return mv


def kfac_b(per_client, p, Ws) -> Params:
    """b = Σ_i p_i F_i W_i (with the decoded factors and weights, §1.6 [C])."""
    out: Params = {}
    for j, blk in enumerate(per_client[0]):
        acc = sum(pi * (blocks[j].G @ blocks[j].to_matrix(W) @ blocks[j].A) for pi, blocks, W in zip(p, per_client, Ws))
        out.update(blk.from_matrix(acc))
    return out
