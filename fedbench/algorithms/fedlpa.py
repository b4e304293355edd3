"""FedLPA (Liu et al., NeurIPS 2024): one-shot layer-wise Laplace posterior aggregation.

Everything follows ``notes/fedlpa.md``; section numbers below refer to that note.

Client (§1.3, §1.6): plain local training (shared with FedAvg through the client-stage cache), then
one pass over the local data for the dataset-averaged K-FAC empirical Fisher of every Linear/Conv2d
layer in the alecwangcq KFC convention (conv: A = (1/(N S²)) Σ ā āᵀ, G = (S/N) Σ δ δᵀ; bias as an
appended 1 in A, so a block acts on M = [W | b]). Damped on the client as in the code:
A + π√λ I, G + (√λ/π) I (Eq. 30; π = 1 as released, or the trace rule of §1.7 item 2).
Uplink per layer: the client weights (= M_k), A_k and G_k (upper triangles by default, App. G.8).

Server (§1.2, §1.4), per layer, with p_k = n_k/N (code) or 1/K (paper's unweighted Σ_k):
    𝒜(M) = Σ_k p_k G_k M A_k   (SPD: = Σ_k p_k (A_k ⊗ G_k) on the column-stacked vec(M))
    Z    = Σ_k p_k G_k M_k A_k
    the product-of-Gaussians mean solves 𝒜(M) = Z.
    solver ea: M = Ḡ⁻¹ Z Ā⁻¹ with Ā = Σ p_k A_k, Ḡ = Σ p_k G_k (App. E, the "biased" solution)
    solver gd: the released code: from EA, ``gd_steps`` steps of M -= lr ∇ mean((𝒜(M) − Z)²)
      ``gd_step: fixed`` (released, default): lr = ``gd_lr``, which diverges on a layer where
      gd_lr ≥ n/λ_max(𝒜)² (n = numel(M); results/gaps.md#fedlpa-table6, extreme splits);
      ``gd_step: stable``: per layer lr = min(gd_lr, c/L), L = 2λ_max(𝒜)²/n the gradient's Lipschitz
      constant, c = STABLE_STEP_FACTOR = 1 (half the limit 2/L), λ_max by Lanczos on 𝒜; each layer's
      λ_max and step go to the run's trace.csv, the number of clamped layers to ``gd_clamped_layers``
    solver cg: (preconditioned) conjugate gradients on 𝒜(M) = Z with Kronecker products G M A only
``reference_solve: cg`` also solves every round's system exactly (float64 CG) and evaluates that model beside the
solver's (``reference_accuracy``) without carrying it: a paired test of whether a round's accuracy is the solve's.
Parameters outside Linear/Conv2d would be averaged FedAvg-style (§1.4 step 2); FedLPA here needs a
model whose trainable parameters all sit in Linear/Conv2d (checked in ``__init__``).

Reporting (§1.4 step 7, §0): the code logs max(test acc of GD, test acc of EA). ``report:
best_of_ea_gd_on_test`` reproduces that selection ON THE TEST SET; the default ``solver`` reports the
solver's model. The EA model is always evaluated beside it (``ea_accuracy``).

Checked against the released code (issue 14 item 6): fed the released clients' weights and factors
(FMNIST, β = 0.5, 10 clients, 2 epochs, seed 0), this server gives the released EA (48.05) and GD
(47.18 vs 47.17) accuracies, and ``compute_curvature`` on those clients reproduces their factors to
float32 rounding; fedbench's own clients through the released solver give fedbench's GD (36.15). The
gaps between the two pipelines' EA/GD numbers come from the client stage (training noise), not from
the server. GD is far from converged after 10,000 steps (residual 0.02–0.1), so its accuracy swings.

Multi-round (§1.5): from round 2 the local loss adds
    ½ η Σ_l sum(D_l ⊙ ((Ḡ_l − G_k,l) D_l (Ā_l − A_k,l))),  D_l = M_local,l − M_global,l
with the previous round's p-weighted factor sums and the client's own previous factors (η = 1);
the solver's model (not the best-of-test one) is carried to the next round.
``fedlpa_then_fedavg``: FedLPA in round 1, plain FedAvg afterwards (§1.5, Figure 2).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

from fedbench.algorithms.base import ALGORITHMS, Algorithm, ClientProduct, Message, weighted_average
from fedbench.algorithms.common import client_weights, method_generator, raw_weights
from fedbench.curvature.structures import layer_matrix, layer_params
from fedbench.algorithms.options import option, read_options
from fedbench.errors import FedbenchError
from fedbench.train.engine import LocalObjective
from fedbench.curvature.engine import find_layers
from fedbench.curvature.layout import ParamLayout
from fedbench.curvature import compute_curvature, damp_kfac
from fedbench.eval.metrics import evaluate

Params = Dict[str, Tensor]

SOLVERS = ("ea", "gd", "cg")
REPORTS = ("solver", "best_of_ea_gd_on_test")
WEIGHTINGS = ("num_samples", "uniform")
FACTOR_UPLOADS = ("upper_triangle", "full")
FACTOR_DATA = ("clean", "augmented_as_released")
SERVER_DTYPES = ("float64", "float32")
CG_PRECONDITIONERS = ("ea", "none")
GD_STEPS = ("fixed", "stable")
# a second, diagnostic solve of the same round's system beside the solver's (its model is evaluated, never carried)
REFERENCE_SOLVES = ("none", "cg")
# the round >= 2 posterior term (§1.5): differentiable (the paper's local loss) | detached_as_released (the released
# code evaluates it on net.state_dict(), whose tensors are detached, so it adds no gradient: plain local training)
POSTERIOR_TERMS = ("differentiable", "detached_as_released")
STABLE_STEP_FACTOR = 1.0   # gd_step stable: lr ≤ c/L; GD is stable for c < 2, c = 1 is the classic 1/L step
LANCZOS_STEPS = 30         # matvecs for λ_max(𝒜) (10,000 GD steps make 20,000)
PI_RULES = ("one", "trace")

# the curvature FedLPA's clients compute (§1.3 step 2); part of the cache key of the cached factors
CURVATURE = dict(structure="kfac", fisher="empirical", scale="mean", conv_convention="fedlpa_kfc",
                 bias_augment=True)


# --------------------------------------------------------------------------------------------------
# layer matrices M = [W.reshape(d_out, -1) | b]
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerSpec:
    """One K-FAC layer: its parameter names (weight, bias) and shapes; the same ordering as
    ``fedbench.curvature.structures.KronBlock`` (bias column last)."""

    module: str
    names: Tuple[str, ...]
    shapes: Tuple[torch.Size, ...]

    @property
    def d_out(self) -> int:
        return int(self.shapes[0][0])

    @property
    def d_in(self) -> int:
        """Columns of M: C_in·kh·kw (or d_in), + 1 for the bias."""
        return sum(int(torch.Size(s).numel()) // self.d_out for s in self.shapes)

    def to_matrix(self, tensors: Params) -> Tensor:
        return layer_matrix(self.names, self.shapes, self.d_out, tensors)

    def from_matrix(self, M: Tensor) -> Params:
        return layer_params(self.names, self.shapes, self.d_out, M)


def layer_specs(model: torch.nn.Module) -> Tuple[List[LayerSpec], List[str]]:
    """Linear/Conv2d layers of ``model`` and the reasons K-FAC cannot cover it (empty = fine)."""

    layout = ParamLayout.from_module(model)
    layers, problems = find_layers(model, layout)
    specs = []
    for l in layers:
        names = tuple(n for n in (l.weight, l.bias) if n is not None)
        specs.append(LayerSpec(l.name, names, tuple(layout.shape(n) for n in names)))
    return specs, problems


# --------------------------------------------------------------------------------------------------
# symmetric packing (App. G.8: only upper triangles need to be sent)
# --------------------------------------------------------------------------------------------------
def pack_sym(A: Tensor) -> Tensor:
    iu = torch.triu_indices(A.shape[0], A.shape[0], device=A.device)
    return A[iu[0], iu[1]].contiguous()


def unpack_sym(v: Tensor, n: int) -> Tensor:
    iu = torch.triu_indices(n, n, device=v.device)
    A = v.new_zeros(n, n)
    A[iu[0], iu[1]] = v
    A[iu[1], iu[0]] = v
    return A


def sym_size(numel: int) -> int:
    """n with n(n+1)/2 = numel."""
    n = int((math.isqrt(8 * numel + 1) - 1) // 2)
    if n * (n + 1) // 2 != numel:
        raise ValueError(f"{numel} values are not an upper triangle")
    return n


# --------------------------------------------------------------------------------------------------
# the server's linear system, per layer (pure functions; tested against torch.kron)
# --------------------------------------------------------------------------------------------------
class KronSystem:
    """One layer's operator 𝒜(M) = Σ_k p_k G_k M A_k, laid out once for two GEMMs per apply.

    A_row = [A_1 | … | A_K] (i × K·i) and G_row = [p_1 G_1 | … | p_K G_K] (o × K·o), so
    𝒜(M) = G_row · vstack_k(M A_k) with M·A_row giving every M A_k at once. The GD solver applies
    𝒜 twice per step for 10,000 steps: large GEMMs instead of K small ones (and no per-call
    re-weighting of the factors) are what make it fast on a CPU."""

    def __init__(self, Gs: Tensor, As: Tensor, p: Tensor):
        self.K, self.o, self.i = Gs.shape[0], Gs.shape[1], As.shape[1]
        self.A_row = As.permute(1, 0, 2).reshape(self.i, self.K * self.i).contiguous()
        self.G_row = (p[:, None, None] * Gs).permute(1, 0, 2).reshape(self.o, self.K * self.o).contiguous()

    def __call__(self, M: Tensor) -> Tensor:
        K, o, i = self.K, self.o, self.i
        MA = (M @ self.A_row).view(o, K, i).transpose(0, 1).reshape(K * o, i)   # rows: M A_1; …; M A_K
        return self.G_row @ MA


def ea_solve(Gs: Tensor, As: Tensor, p: Tensor, Ms: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """EA (App. E, §1.4 steps 3–4): Ā = Σ p A_k, Ḡ = Σ p G_k, Z = Σ p G_k M_k A_k, M = Ḡ⁻¹ Z Ā⁻¹.
    Returns (M_ea, Z, Ā, Ḡ). Solves with Cholesky (the code uses torch.inverse; same matrix)."""
    w = p[:, None, None]
    A_bar, G_bar = (w * As).sum(0), (w * Gs).sum(0)
    Z = ((w * Gs) @ Ms @ As).sum(0)
    X = torch.cholesky_solve(Z, torch.linalg.cholesky(G_bar))          # Ḡ⁻¹ Z
    M = torch.cholesky_solve(X.T, torch.linalg.cholesky(A_bar)).T      # (Ā⁻¹ Xᵀ)ᵀ = X Ā⁻¹ (Ā symmetric)
    return M, Z, A_bar, G_bar


def gd_solve(Gs: Tensor, As: Tensor, p: Tensor, Z: Tensor, M0: Tensor, steps: int, lr: float) -> Tensor:
    """The released solver (§1.4 step 5): ``steps`` iterations of M ← M − lr ∇_M mean((𝒜(M) − Z)²),
    with the closed-form gradient (2/numel) 𝒜(𝒜(M) − Z) (𝒜 is self-adjoint); no convergence check."""
    op = KronSystem(Gs, As, p)
    M = M0.clone()
    c = 2.0 * lr / M.numel()
    for _ in range(int(steps)):
        M.sub_(op(op(M).sub_(Z)), alpha=c)
    return M


def lambda_max(op, like: Tensor, steps: int = LANCZOS_STEPS) -> float:
    """Largest eigenvalue of the SPD operator ``op`` on matrices shaped as ``like``: ``steps`` Lanczos steps with
    full reorthogonalisation from a fixed seeded start (deterministic). A Ritz value: ≤ λ_max, from below."""
    n = like.numel()
    start = torch.randn(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    V = like.new_zeros(min(steps, n), n)
    v = start.to(like) / torch.linalg.norm(start)
    alphas, betas = [], []
    for j in range(V.shape[0]):
        V[j] = v
        w = op(v.view(like.shape)).reshape(-1)
        alphas.append(torch.dot(w, v))
        for _ in range(2):                     # twice is enough (Kahan–Parlett)
            w = w - V[: j + 1].T @ (V[: j + 1] @ w)
        b = torch.linalg.norm(w)
        if j + 1 == V.shape[0] or b <= torch.finfo(w.dtype).eps * abs(float(alphas[0])):
            break                              # out of steps, or an invariant subspace: T is exact
        betas.append(b)
        v = w / b
    T = torch.diag(torch.stack(alphas))
    if betas:
        off = torch.stack(betas)
        T = T + torch.diag(off, 1) + torch.diag(off, -1)
    return float(torch.linalg.eigvalsh(T.double())[-1])


def stable_gd_lr(op, like: Tensor, gd_lr: float, factor: float = STABLE_STEP_FACTOR) -> Tuple[float, float]:
    """(step, λ_max): min(gd_lr, factor / L) with L = 2 λ_max(𝒜)² / numel, the Lipschitz constant of the gradient
    of mean((𝒜(M) − Z)²); GD on it is stable iff step < 2/L. gd_lr itself when it is already below the cap."""
    lam = lambda_max(op, like)
    cap = factor * like.numel() / (2.0 * lam ** 2) if lam > 0 else math.inf
    return (gd_lr if gd_lr <= cap else cap), lam


def cg_solve(Gs: Tensor, As: Tensor, p: Tensor, Z: Tensor, M0: Tensor, *, tol: float, max_iters: int,
             precond: Optional[Tuple[Tensor, Tensor]] = None) -> Tuple[Tensor, int, float]:
    """Conjugate gradients on 𝒜(M) = Z in the Frobenius inner product (§1.4 [I] "robust option").

    precond = (Ḡ, Ā): the EA operator R ↦ Ḡ⁻¹ R Ā⁻¹ (SPD; exact when all clients share factors).
    Stops at ‖Z − 𝒜(M)‖_F ≤ tol ‖Z‖_F. Returns (M, iterations, relative residual)."""
    if precond is not None:
        Lg, La = torch.linalg.cholesky(precond[0]), torch.linalg.cholesky(precond[1])

        def apply_p(R):
            return torch.cholesky_solve(torch.cholesky_solve(R, Lg).T, La).T
    else:
        def apply_p(R):
            return R
    zn = float(torch.linalg.norm(Z))
    if zn == 0.0:
        return torch.zeros_like(Z), 0, 0.0
    op = KronSystem(Gs, As, p)
    M = M0.clone()
    R = Z - op(M)
    Y = apply_p(R)
    P = Y.clone()
    rz = (R * Y).sum()
    it = 0
    rel = float(torch.linalg.norm(R)) / zn
    while rel > tol and it < max_iters:
        AP = op(P)
        alpha = rz / (P * AP).sum()
        M = M + alpha * P
        R = R - alpha * AP
        Y = apply_p(R)
        rz_new = (R * Y).sum()
        P = Y + (rz_new / rz) * P
        rz = rz_new
        it += 1
        rel = float(torch.linalg.norm(R)) / zn
    return M, it, rel


def rel_residual(Gs: Tensor, As: Tensor, Ms: Tensor, p: Tensor, M: Tensor) -> float:
    """‖Z − 𝒜(M)‖_F / ‖Z‖_F of the layer system, evaluated in float64 whatever the solve's dtype."""
    d = torch.float64
    Gs, As, Ms, p = Gs.to(d), As.to(d), Ms.to(d), p.to(d)
    op = KronSystem(Gs, As, p)
    Z = ((p[:, None, None] * Gs) @ Ms @ As).sum(0)
    zn = float(torch.linalg.norm(Z)) or 1.0
    return float(torch.linalg.norm(op(M.to(d)) - Z)) / zn


def worst_residual(values) -> float:
    """The max over layers; inf when any layer's solution is not finite (a diverged GD gives NaN, and Python's
    max would silently skip a NaN that is not first)."""
    vals = [float(v) for v in values]
    return math.inf if any(not math.isfinite(v) for v in vals) else max(vals, default=0.0)


# --------------------------------------------------------------------------------------------------
# round ≥ 2 local term (§1.5)
# --------------------------------------------------------------------------------------------------
class PosteriorTerm:
    """½ η Σ_l sum(D ⊙ (dG D dA)), D = M_local − M_global; ctx: 'M_g' {layer: M_global},
    per client 'dG' {layer: Ḡ − G_k}, 'dA' {layer: Ā − A_k} (§1.5, the released code's formula). Ā − A_k and
    Ḡ − G_k are differences of PSD matrices, indefinite in general, so the term is unbounded below in D."""

    def __init__(self, specs: Sequence[LayerSpec], eta: float):
        self.specs = list(specs)
        self.eta = float(eta)

    def __call__(self, params: Params, ctx: dict) -> Tensor:
        total = 0.0
        for s in self.specs:
            D = s.to_matrix(params) - ctx["M_g"][s.module]
            total = total + (D * (ctx["dG"][s.module] @ D @ ctx["dA"][s.module])).sum()
        return 0.5 * self.eta * total


# --------------------------------------------------------------------------------------------------
# config helpers (one-line FedbenchError)
# --------------------------------------------------------------------------------------------------
def _pi(key: str, val: Any):
    if isinstance(val, str):
        if val not in PI_RULES:
            raise FedbenchError(f"algorithm.pi must be one of {', '.join(PI_RULES)} or a positive number, got {val!r}")
        return val
    if isinstance(val, bool) or not isinstance(val, Real) or not (math.isfinite(float(val)) and float(val) > 0):
        raise FedbenchError(f"algorithm.pi must be one of {', '.join(PI_RULES)} or a positive number, got {val!r}")
    return float(val)


@dataclass(frozen=True)
class FedLPARoundOneOptions:
    """The keys of the one-shot aggregation (``fedlpa_then_fedavg`` has only these)."""
    damping: float = option(nonneg=True)
    pi: Any = option(check=_pi)
    weighting: str = option(choices=WEIGHTINGS)
    solver: str = option(choices=SOLVERS)
    gd_steps: int = option(minimum=0)
    gd_lr: float = option(positive=True)
    cg_tol: float = option(positive=True)
    cg_max_iters: int = option(minimum=1)
    cg_precondition: str = option(choices=CG_PRECONDITIONERS)
    gd_step: str = option(choices=GD_STEPS)
    reference_solve: str = option(choices=REFERENCE_SOLVES)
    report: str = option(choices=REPORTS)
    factor_upload: str = option(choices=FACTOR_UPLOADS)
    factor_data: str = option(choices=FACTOR_DATA)
    server_dtype: str = option(choices=SERVER_DTYPES)
    curvature_batch_size: int = option(minimum=1)


@dataclass(frozen=True)
class FedLPAOptions(FedLPARoundOneOptions):
    posterior_eta: float = option(nonneg=True)
    posterior_term: str = option(choices=POSTERIOR_TERMS)


# --------------------------------------------------------------------------------------------------
# FedLPA
# --------------------------------------------------------------------------------------------------
@ALGORITHMS.register("fedlpa")
class FedLPA(Algorithm):
    """FedLPA (§1.3–1.5). Config keys: see conf/algorithm/fedlpa.yaml."""

    name = "fedlpa"
    resumable = True   # all cross-round memory (factor sums, per-client factors) is in the state dict
    Options = FedLPAOptions

    def __init__(self, cfg, setup):
        super().__init__(cfg, setup)
        o = read_options(self.Options, cfg, self.name)
        self.lam, self.pi, self.weighting, self.solver = o.damping, o.pi, o.weighting, o.solver
        self.gd_steps, self.gd_lr, self.cg_tol, self.cg_max_iters = o.gd_steps, o.gd_lr, o.cg_tol, o.cg_max_iters
        self.cg_precondition, self.report, self.factor_upload = o.cg_precondition, o.report, o.factor_upload
        self.gd_step, self.reference_solve = o.gd_step, o.reference_solve
        self.factor_data, self.server_dtype = o.factor_data, getattr(torch, o.server_dtype)
        self.curv_bs = o.curvature_batch_size
        self.eta = getattr(o, "posterior_eta", 0.0)   # fedlpa_then_fedavg: no posterior term, no such option
        self.posterior_term = getattr(o, "posterior_term", "differentiable")
        if self.gd_step == "stable" and self.solver != "gd":
            raise FedbenchError(f"algorithm.gd_step=stable sets the GD solver's step; it needs solver: gd, "
                                f"got solver: {self.solver}")
        if self.reference_solve == "cg" and self.solver == "cg":
            raise FedbenchError("algorithm.reference_solve=cg solves each round's system a second time with CG beside "
                                "the solver's; with solver: cg the two are the same, so it needs solver: gd or ea")
        if self.report == "best_of_ea_gd_on_test":
            if self.solver != "gd":
                raise FedbenchError(f"algorithm.report=best_of_ea_gd_on_test picks between EA and GD; "
                                    f"it needs solver: gd, got solver: {self.solver}")
            if setup.task != "classification":
                raise FedbenchError("algorithm.report=best_of_ea_gd_on_test compares test accuracies; "
                                    "it needs a classification task")
        self.specs, problems = layer_specs(setup.model)
        if problems:
            raise FedbenchError(f"{self.name} needs every trainable parameter in nn.Linear / nn.Conv2d "
                                f"(layer-wise K-FAC): {problems[0]}")
        self.sizes = [len(ix) for ix in setup.client_indices]

    # --- client ----------------------------------------------------------------------------------
    def client_stage_key(self, round_idx):
        return {} if round_idx == 1 else None     # round 1: plain local training, shared with FedAvg

    def _factor_inputs(self, client_id: int, round_idx: int) -> Tuple[Tensor, Tensor]:
        data, idx = self.setup.train, self.setup.client_indices[client_id]
        if self.factor_data == "augmented_as_released" and data.augment is not None:
            gen = method_generator("fedlpa", self.setup.seed, round_idx, client_id)   # own stream, reproducible
            return data.normalize(data.augment(data.raw(idx), gen)), data.targets(idx)
        return data.inputs(idx), data.targets(idx)

    def raw_factors(self, worker, client_id: int, params: Params, round_idx: int) -> Dict[str, Dict[str, Tensor]]:
        """Undamped dataset-average K-FAC factors {'A': {layer: A}, 'G': {layer: G}} at ``params`` (which
        ``worker`` holds, §1.3 step 2)."""

        if len(self.setup.client_indices[client_id]) == 0:      # p_k = 0: contributes nothing
            ref = next(iter(params.values()))
            z = lambda n: torch.zeros(n, n, dtype=ref.dtype, device=ref.device)  # noqa: E731
            return {"A": {s.module: z(s.d_in) for s in self.specs}, "G": {s.module: z(s.d_out) for s in self.specs}}
        x, y = self._factor_inputs(client_id, round_idx)
        x = x.to(next(iter(params.values())).dtype)           # TrainData yields float32; follow the weights
        curv = compute_curvature(worker, x, y, batch_size=self.curv_bs, **CURVATURE)
        return {"A": {s.module: curv.blocks[s.module].A.detach() for s in self.specs},
                "G": {s.module: curv.blocks[s.module].G.detach() for s in self.specs}}

    def client_products(self, client_id, params, state, round_idx):
        """Product ``factors``: the raw factors, cached beside a cached client stage (before damping, §6 item 3)."""
        parts = {**CURVATURE, "factor_data": self.factor_data}
        return [ClientProduct("fedlpa_kfac", parts, params, label="factors",
                              compute=lambda worker: self.raw_factors(worker, client_id, params, round_idx))]

    def damped(self, A: Tensor, G: Tensor) -> Tuple[Tensor, Tensor]:
        return damp_kfac(A, G, self.lam, self.pi)

    def _pack(self, M: Tensor) -> Tensor:
        return pack_sym(M) if self.factor_upload == "upper_triangle" else M

    def _unpack(self, v: Tensor) -> Tensor:
        return unpack_sym(v, sym_size(v.numel())) if self.factor_upload == "upper_triangle" else v

    def client_message(self, client_id, params, result, pos, state, round_idx, products):
        raw = products["factors"]
        A_up, G_up = {}, {}
        for s in self.specs:
            A, G = self.damped(raw["A"][s.module], raw["G"][s.module])
            A_up[s.module], G_up[s.module] = self._pack(A), self._pack(G)
        # uplink (§1.3 step 4): the weights (= M_k = [W | b] per layer) and the damped factors
        return Message(client_id, self.sizes[client_id], {"params": params, "A": A_up, "G": G_up},
                       {"steps": result.steps[pos], "train_loss": result.mean_loss[pos]})

    def local_objective(self, state, client_ids, round_idx):
        if round_idx == 1 or state.get("factor_sums") is None or self.eta == 0.0 \
                or self.posterior_term == "detached_as_released":   # no gradient from it in the released code
            return LocalObjective()
        dt = next(iter(state["params"].values())).dtype
        M_g = {s.module: s.to_matrix(state["params"]) for s in self.specs}
        sums, own = state["factor_sums"], state["factors"]
        per = [{"dA": {m: (sums[m][0] - own[c][m][0]).to(dt) for m in sums},
                "dG": {m: (sums[m][1] - own[c][m][1]).to(dt) for m in sums}} for c in client_ids]
        return LocalObjective(terms=[PosteriorTerm(self.specs, self.eta)], shared_ctx={"M_g": M_g},
                              client_ctx=per)

    # --- server ----------------------------------------------------------------------------------
    def downlink(self, state):
        out = {"params": state["params"]}
        if state.get("factor_sums") is not None and self.eta != 0.0:   # rounds ≥ 2 need Ā, Ḡ (§1.5)
            out["A_bar"] = {m: self._pack(a) for m, (a, g) in state["factor_sums"].items()}
            out["G_bar"] = {m: self._pack(g) for m, (a, g) in state["factor_sums"].items()}
        return out

    def predict_params(self, state):
        return state.get("report_params") or state["params"]

    def _weights(self, messages: List[Message], device) -> Tensor:
        p = client_weights([m.num_samples for m in messages], self.weighting,
                           empty_error="fedlpa: every client is empty; nothing to aggregate")
        return torch.tensor(p, dtype=torch.float64, device=device)

    def solve(self, messages: List[Message]) -> Dict[str, Any]:
        """EA and solver solutions, the p-weighted factor sums and per-client factors."""
        ref = messages[0].payload["params"]
        any_t = next(iter(ref.values()))
        dev, sdt = any_t.device, self.server_dtype
        p64 = self._weights(messages, dev)          # float64: the residuals below judge the exact system
        p = p64.to(sdt)
        covered = {n for s in self.specs for n in s.names}
        rest = [n for n in ref if n not in covered]
        ea, sol, ref_sol = {}, {}, {}
        if rest:    # FedAvg-style for non-K-FAC parameters (§1.4 step 2); none for Linear/Conv-only models
            avg = weighted_average([{n: m.payload["params"][n] for n in rest} for m in messages], p.tolist())
            for d in (ea, sol, ref_sol):
                d.update(avg)
        sums, info = {}, {}
        per_client: List[Dict[str, Tuple[Tensor, Tensor]]] = [dict() for _ in messages]
        for s in self.specs:
            up = [torch.stack(t) for t in zip(*[(self._unpack(m.payload["G"][s.module]),
                                                 self._unpack(m.payload["A"][s.module]),
                                                 s.to_matrix(m.payload["params"])) for m in messages])]
            Gs, As, Ms = (t.to(sdt) for t in up)      # the uploaded values, in the server's precision
            M_ea, Z, A_bar, G_bar = ea_solve(Gs, As, p, Ms)
            layer_info: Dict[str, float] = {}
            if self.solver == "ea":
                M = M_ea
            elif self.solver == "gd":
                M = gd_solve(Gs, As, p, Z, M_ea, self.gd_steps, self._gd_lr(Gs, As, p, Z, layer_info))
            else:
                pre = (G_bar, A_bar) if self.cg_precondition == "ea" else None
                M, iters, _ = cg_solve(Gs, As, p, Z, M_ea, tol=self.cg_tol, max_iters=self.cg_max_iters,
                                       precond=pre)
                layer_info["cg_iters"] = iters
            # residuals always in float64, so a float32 solve is judged on the system it approximates
            layer_info["rel_residual"] = rel_residual(*up, p64, M)
            layer_info["ea_rel_residual"] = rel_residual(*up, p64, M_ea)
            pairs = [(ea, M_ea), (sol, M)]
            if self.reference_solve == "cg":
                M_ref, layer_info["reference_cg_iters"] = self._reference_cg(up, p64)
                layer_info["reference_rel_residual"] = rel_residual(*up, p64, M_ref)
                pairs.append((ref_sol, M_ref))
            info[s.module] = layer_info
            for d, mat in pairs:
                d.update({n: t.to(ref[n].dtype) for n, t in s.from_matrix(mat).items()})
            sums[s.module] = (A_bar, G_bar)
            for i in range(len(messages)):
                per_client[i][s.module] = (As[i], Gs[i])
        ea = {n: ea[n] for n in ref}
        sol = {n: sol[n] for n in ref}
        reference = {n: ref_sol[n] for n in ref} if self.reference_solve == "cg" else None
        return {"ea": ea, "solution": sol, "reference": reference, "factor_sums": sums, "client_factors": per_client,
                "info": info}

    def _reference_cg(self, up: Sequence[Tensor], p64: Tensor) -> Tuple[Tensor, int]:
        """reference_solve cg: the layer system solved in float64 by EA-preconditioned CG to ``cg_tol`` from the EA
        start, whatever the solver and server_dtype: the exact product-of-Gaussians mean of this round's messages, so
        the solver's model can be judged against it round by round on the same clients (results/gaps.md#fedlpa-figure2)."""
        Gs, As, Ms = (t.to(torch.float64) for t in up)
        M_ea, Z, A_bar, G_bar = ea_solve(Gs, As, p64, Ms)
        M, iters, _ = cg_solve(Gs, As, p64, Z, M_ea, tol=self.cg_tol, max_iters=self.cg_max_iters,
                               precond=(G_bar, A_bar))
        return M, iters

    def _gd_lr(self, Gs: Tensor, As: Tensor, p: Tensor, Z: Tensor, layer_info: Dict[str, float]) -> float:
        """GD's step on this layer: ``gd_lr`` (fixed), or clamped below the stability limit (stable; recorded)."""
        if self.gd_step == "fixed":
            return self.gd_lr
        lr, lam = stable_gd_lr(KronSystem(Gs, As, p), Z, self.gd_lr)
        layer_info.update(lambda_max=lam, gd_step=lr, gd_clamped=float(lr < self.gd_lr))
        return lr

    def _check_finite(self, messages: List[Message], round_idx: int,
                      state: Optional[Mapping[str, Any]] = None) -> None:
        """A client whose local training diverged sends NaN/inf weights or factors; say so in one line (the
        solve would fail on a Cholesky factorisation that names no client), with the likeliest cause: a global
        model the previous round's GD left non-finite, or the paper's unbounded posterior term."""
        bad = [m.client_id for m in messages
               if not all(bool(torch.isfinite(t).all()) for part in ("params", "A", "G")
                          for t in m.payload[part].values())]
        if not bad:
            return
        why = ""
        carried = (state or {}).get("params") or {}
        broken = [k for k, v in carried.items() if torch.is_tensor(v) and not bool(torch.isfinite(v).all())]
        if round_idx > 1 and broken:
            # the released fixed-step GD can diverge on a layer in any round (gaps.md#fedlpa-figure2); the clients
            # then train from NaN weights, so blaming their training would mislead
            why = (f"; they started from round {round_idx - 1}'s global model, which the server's GD solve left "
                   f"non-finite ({', '.join(broken)}): algorithm.gd_step=stable keeps each layer's step below GD's "
                   f"stability limit (results/gaps.md#fedlpa-figure2)")
        elif round_idx > 1 and self.eta > 0 and self.posterior_term == "differentiable":
            why = ("; from round 2 the local loss has the posterior term, whose factors Ā − A_k and Ḡ − G_k are "
                   "indefinite, so it is unbounded below: algorithm.posterior_term=detached_as_released trains as "
                   "the released code does (results/gaps.md#fedlpa-figure2), or lower algorithm.posterior_eta")
        raise FedbenchError(f"{self.name} round {round_idx}: client(s) {bad} sent non-finite weights or factors "
                            f"(their local training diverged){why}")

    def _step_diagnostics(self, info: Dict[str, Dict[str, float]]) -> Tuple[Dict[str, float], List[dict]]:
        """gd_step stable: (scalar metrics, one trace row per layer: λ_max, the step used, its residual)."""
        if self.gd_step != "stable":
            return {}, []
        rows = [{"layer": m, "lambda_max": i["lambda_max"], "gd_lr": self.gd_lr, "gd_step": i["gd_step"],
                 "clamped": int(i["gd_clamped"]), "rel_residual": i["rel_residual"]} for m, i in info.items()]
        return {"gd_clamped_layers": float(sum(r["clamped"] for r in rows)),
                "gd_min_step": min(r["gd_step"] for r in rows)}, rows

    def aggregate(self, messages, state, round_idx):
        self._check_finite(messages, round_idx, state)
        out = self.solve(messages)
        ea, sol = out["ea"], out["solution"]
        factors = list(state.get("factors") or [None] * self.setup.num_clients)
        for m, f in zip(messages, out["client_factors"]):
            factors[m.client_id] = f
        info = out["info"].values()
        # how well each solution solves the layer systems (max over layers of ||Z - A(M)||_F / ||Z||_F): says
        # whether GD converged, stalled or diverged, and how far EA is from the exact solution
        residuals = {"solver_rel_residual": worst_residual(i["rel_residual"] for i in info),
                     "ea_rel_residual": worst_residual(i["ea_rel_residual"] for i in info)}
        extra_eval = {"ea": ea}
        if out["reference"] is not None:    # evaluated as reference_accuracy etc.; the solver's model is carried
            extra_eval["reference"] = out["reference"]
            residuals["reference_rel_residual"] = worst_residual(i["reference_rel_residual"] for i in info)
            residuals["reference_cg_iters"] = float(max(i["reference_cg_iters"] for i in info))
        step_metrics, step_rows = self._step_diagnostics(out["info"])
        new = {**state, "params": sol, "extra_eval": extra_eval, "solver_info": out["info"],
               "extra_metrics": {**residuals, **step_metrics},
               "factor_sums": out["factor_sums"], "factors": factors, "report_params": None}
        if step_rows:
            new["trace"] = step_rows
        if self.report == "best_of_ea_gd_on_test":
            # !!! TEST-SET SELECTION, for matching the released numbers only (§0, §1.4 step 7) !!!
            # The released code evaluates the GD and EA models on the TEST set and logs the better
            # accuracy. This picks a model with test labels; never use it for a sound comparison.
            # The carried model (next round) stays the solver's, as in the code.
            ev = dict(task=self.setup.task, batch_size=self.setup.eval_batch_size, n_bins=self.setup.ece_bins)
            acc_gd = evaluate(self.setup.model, sol, self.setup.test_inputs, self.setup.test_y, **ev)["accuracy"]
            acc_ea = evaluate(self.setup.model, ea, self.setup.test_inputs, self.setup.test_y, **ev)["accuracy"]
            new["report_params"] = sol if acc_gd >= acc_ea else ea
            new["extra_eval"] = {**extra_eval, "gd": sol}
            new["report_choice"] = "gd" if acc_gd >= acc_ea else "ea"
        return new


@ALGORITHMS.register("fedlpa_then_fedavg")
class FedLPAThenFedAvg(FedLPA):
    """Figure 2's "ours (one round) then Fedavg" (§1.5): FedLPA aggregation in round 1, then FedAvg
    rounds (plain local training from the global model, p_k-weighted averaging, weights-only uplink)."""

    name = "fedlpa_then_fedavg"
    Options = FedLPARoundOneOptions

    def local_objective(self, state, client_ids, round_idx):
        return LocalObjective()

    def downlink(self, state):
        return {"params": state["params"]}

    def client_products(self, client_id, params, state, round_idx):
        return super().client_products(client_id, params, state, round_idx) if round_idx == 1 else []

    def client_message(self, client_id, params, result, pos, state, round_idx, products):
        if round_idx == 1:
            return super().client_message(client_id, params, result, pos, state, round_idx, products)
        return Message(client_id, self.sizes[client_id], {"params": params},
                       {"steps": result.steps[pos], "train_loss": result.mean_loss[pos]})

    def aggregate(self, messages, state, round_idx):
        if round_idx == 1:
            new = super().aggregate(messages, state, round_idx)
            return {**new, "factor_sums": None, "factors": None}
        w = raw_weights([m.num_samples for m in messages], self.weighting)
        return {**state, "params": weighted_average([m.payload["params"] for m in messages], w),
                "extra_eval": {}, "extra_metrics": {}, "report_params": None}
