"""FedFisher Table 6 / Figure 4 (App. E): a GMI model-inversion attack at the server on MNIST.

Notes: ``../shared/reference/notes/fedfisher.md`` §4 "Table 6" / "Figure 4", §1.9 item 13, §6 row "Table 6 / Fig 4".

Setup [P]: 10 clients; client 1 holds every training 3 plus 1000 random other images, the rest is split over
clients 2-10 with Dirichlet alpha = 0.1 (partition ``fedfisher_attack``). The server wants to reconstruct client
1's 3s. It holds 5000 auxiliary samples drawn from clients 2-10 (so no 3s) and trains a GAN on them (GMI,
Zhang et al. 2020, "The Secret Revealer"), then optimises latent codes z so that G(z) is classified as 3 by
the attacked model while the discriminator finds G(z) realistic:

    L(z) = -mean D(G(z)) + lambda_id * CE(f(G(z)), 3) [+ lambda_kfac * sum_l ||A_l(G(z)) - A_l^1||^2 + ||G_l(G(z)) - G_l^1||^2]

Three levels of server access:

* ``local_model_client1`` (i): client 1's trained local model (what OTFusion / PFNM / DENSE receive);
* ``aggregate`` (ii): the FedAvg aggregate of the 10 local models only;
* ``aggregate_plus_client1_kfac`` (iii): the FedFisher(K-FAC) aggregate plus client 1's uploaded K-FAC factors;
  the extra loss is the element-wise squared difference, summed over all entries, between the K-FAC factors of
  the generated batch through the global model and client 1's K-FAC.

Client 1's K-FAC is exactly FedFisher's upload: the factors of the message client 1 sends (true
Fisher, nngeometry conv convention, mean over the client's data; SVD-truncated + quantised when the algorithm's
``compression`` is on), decoded as the server decodes them. The generated batch's factors are computed by
``kfac_factors`` in the same convention, differentiably in the inputs (a test compares it with
``fedbench.curvature.compute_curvature``).

Attack accuracy = the percentage of the reconstructions that an independent evaluation classifier (a different
architecture trained on the full MNIST training set, [I]) labels 3.

Unstated, chosen here [I] (all in the preset's ``study`` block): GAN architecture (a small DCGAN, WGAN-GP
training), GAN steps, attack optimiser / steps / lr / loss weights, the evaluator (an MLP 500-300), the number
of reconstructions, how the 5000 auxiliary samples are drawn (uniformly without replacement from the union of
clients 2-10's data).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple
import copy
import time
import shutil

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from omegaconf import OmegaConf

from fedbench.errors import FedbenchError
from fedbench.curvature.engine import KFAC_ALPHA, find_layers, input_patches, output_locations
from fedbench.curvature.layout import ParamLayout
from fedbench.curvature.likelihood import true_fisher_vectors
from fedbench.models import build_model
from fedbench.run.setup import build_setup
from fedbench.runner import validate
from fedbench.fl.loop import run_rounds
from fedbench.algorithms import build_algorithm
from fedbench.algorithms.base import weighted_average
from fedbench.algorithms.fedfisher import decode_any
from fedbench.eval.metrics import evaluate
from fedbench.report.tables import collection_stem
from fedbench.results.records import write_torch_atomic

AUX_POOLS = ("other_clients", "all_clients")
CASES = ("local_model_client1", "aggregate", "aggregate_plus_client1_kfac")
CASE_LABELS = {"local_model_client1": "(i) client 1's local model",
               "aggregate": "(ii) FedAvg aggregate",
               "aggregate_plus_client1_kfac": "(iii) FedFisher(K-FAC) aggregate + client 1's K-FAC"}

#: the ``study`` block's keys and defaults (the preset documents each; [I] = not stated by the paper)
STUDY_KEYS: Dict[str, Any] = {
    "aux_size": 5000,            # [P] server's auxiliary samples, drawn from clients 2..K
    "aux_pool": "other_clients",  # [P] other_clients = clients 2..K (no 3s); all_clients = a what-if for
                                 # results/gaps.md#fedfisher-table6 (the aux draw may hold client 1's 3s)
    "target_label": 3,           # [P] the class to reconstruct (client 1 holds all of it)
    "z_dim": 100,                # [I]
    "gan_width": 64,             # [I] channels of the GAN's first feature maps (generator and critic)
    "gan_steps": 3000,           # [I] generator updates
    "gan_critic_steps": 5,       # [I] critic updates per generator update (WGAN-GP)
    "gan_batch_size": 64,        # [I]
    "gan_lr": 2.0e-4,            # [I]
    "gan_gp_weight": 10.0,       # [I] gradient-penalty weight
    "attack_steps": 1500,        # [I]
    "attack_lr": 0.02,           # [I]
    "attack_momentum": 0.9,      # [I]
    "lambda_id": 100.0,          # [I] weight of the identity (classification) loss
    "lambda_kfac": 1.0,          # [I] weight of the K-FAC matching loss (case iii)
    "num_reconstructions": 100,  # [I]
    "evaluator_hidden": [500, 300],   # [I] evaluator MLP widths
    "evaluator_epochs": 3,       # [I]
    "evaluator_lr": 1.0e-3,      # [I] Adam
    "evaluator_batch_size": 128,  # [I]
    "cases": list(CASES),
    "grid_per_case": 16,         # reconstructions drawn per case in the Fig. 4 grid
}


# ---- the K-FAC of a batch, differentiable in the inputs -----------------------------------------------------
def kfac_factors(model: nn.Module, x: Tensor, *, conv_convention: str = "nngeometry",
                 bias_augment: bool = True) -> Dict[str, Tuple[Tensor, Tensor]]:
    """{layer: (A, G)} of the true-Fisher K-FAC (exact expectation over the classes, mean over the batch) of
    ``model`` on ``x``, in ``compute_curvature(structure="kfac", fisher="true", scale="mean")``'s conventions, but
    with the graph kept (``create_graph``) so that the factors can be differentiated w.r.t. ``x``."""

    layout = ParamLayout.from_module(model)
    layers, problems = find_layers(model, layout)
    if problems:
        raise FedbenchError(f"K-FAC needs every trainable parameter in nn.Linear / nn.Conv2d: {problems[0]}")
    if conv_convention not in KFAC_ALPHA and conv_convention != "reduce":
        raise FedbenchError(f"conv_convention must be one of {', '.join(list(KFAC_ALPHA) + ['reduce'])}, "
                            f"got {conv_convention!r}")
    ins: Dict[str, Tensor] = {}
    outs: Dict[str, Tensor] = {}
    handles = []
    for l in layers:
        def hook(mod, inp, out, name=l.name):
            ins[name], outs[name] = inp[0], out
        handles.append(l.module.register_forward_hook(hook))
    try:
        f = model(x)
    finally:
        for h in handles:
            h.remove()
    if f.shape[-1] < 2:
        raise FedbenchError("kfac_factors needs a multi-class (softmax) model")
    V = true_fisher_vectors("ce", f)                        # [N, C, K], differentiable in f
    N = x.shape[0]
    louts = [outs[l.name] for l in layers]
    gg = {l.name: 0.0 for l in layers}
    for k in range(V.shape[-1]):
        grads = torch.autograd.grad(f, louts, grad_outputs=V[..., k], create_graph=True, allow_unused=True)
        for l, g in zip(layers, grads):
            if g is None:
                continue
            D = output_locations(l, g)                      # [N, O, S]
            S = D.shape[2]
            if S == 1:
                gk = D[:, :, 0].t() @ D[:, :, 0]
            elif conv_convention == "reduce":
                s = D.sum(2)
                gk = s.t() @ s
            else:
                gk = torch.einsum("nos,nps->op", D, D) * KFAC_ALPHA[conv_convention][1](S)
            gg[l.name] = gg[l.name] + gk
    out: Dict[str, Tuple[Tensor, Tensor]] = {}
    for l in layers:
        P = input_patches(l, ins[l.name])                   # [N, J, S]
        S = P.shape[2]
        if conv_convention == "reduce" or S == 1:
            a = P.mean(2) if S > 1 else P[:, :, 0]
            ones = torch.ones(N, 1, dtype=a.dtype, device=a.device)
            if l.bias is not None and bias_augment:
                a = torch.cat([a, ones], 1)
            A = a.t() @ a / N
        else:
            alpha = KFAC_ALPHA[conv_convention][0](S)
            if l.bias is not None and bias_augment:
                P = torch.cat([P, torch.ones(N, 1, S, dtype=P.dtype, device=P.device)], 1)
            A = torch.einsum("njs,nks->jk", P, P) * (alpha / N)
        G = gg[l.name] / N if torch.is_tensor(gg[l.name]) else \
            f.new_zeros(l.module.weight.shape[0], l.module.weight.shape[0])
        out[l.name] = (A, G)
    return out


def kfac_match_loss(ours: Mapping[str, Tuple[Tensor, Tensor]], target: Mapping[str, Tuple[Tensor, Tensor]]) -> Tensor:
    """Σ over layers and entries of (A − A¹)² + (G − G¹)²: the element-wise squared difference, summed (App. E)."""
    missing = sorted(set(target) - set(ours))
    if missing:
        raise FedbenchError(f"the target K-FAC has layer(s) {', '.join(missing)} that the model does not")
    total = None
    for name, (A1, G1) in target.items():
        A, G = ours[name]
        term = ((A - A1.to(A)) ** 2).sum() + ((G - G1.to(G)) ** 2).sum()
        total = term if total is None else total + term
    return total


# ---- GAN [I]: a small DCGAN for 1x28x28 images in [0, 1], trained with WGAN-GP ------------------------------
class Generator(nn.Module):
    def __init__(self, z_dim: int = 100, width: int = 64):
        super().__init__()
        self.z_dim = z_dim
        self.fc = nn.Sequential(nn.Linear(z_dim, 2 * width * 7 * 7), nn.BatchNorm1d(2 * width * 7 * 7), nn.ReLU())
        self.net = nn.Sequential(
            nn.ConvTranspose2d(2 * width, width, 4, 2, 1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.ConvTranspose2d(width, 1, 4, 2, 1), nn.Sigmoid())
        self.width = width

    def forward(self, z: Tensor) -> Tensor:
        return self.net(self.fc(z).view(z.shape[0], 2 * self.width, 7, 7))


class Critic(nn.Module):
    """WGAN critic (no batch norm, which the gradient penalty forbids)."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, width, 4, 2, 1), nn.LeakyReLU(0.2),
            nn.Conv2d(width, 2 * width, 4, 2, 1), nn.LeakyReLU(0.2),
            nn.Flatten(), nn.Linear(2 * width * 7 * 7, 1))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x).squeeze(-1)


def train_gan(x: Tensor, *, z_dim: int, steps: int, critic_steps: int, batch_size: int, lr: float,
              gp_weight: float, seed: int, width: int = 64, log=None) -> Tuple[Generator, Critic, List[dict]]:
    """WGAN-GP on images ``x`` ([N, 1, 28, 28] in [0, 1]); returns (G in eval mode, D, loss trace)."""
    torch.manual_seed(seed)
    dev = x.device
    G, D = Generator(z_dim, width).to(dev), Critic(width).to(dev)
    opt_g = torch.optim.Adam(G.parameters(), lr=lr, betas=(0.5, 0.9))
    opt_d = torch.optim.Adam(D.parameters(), lr=lr, betas=(0.5, 0.9))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    n = x.shape[0]
    trace = []
    for step in range(1, steps + 1):
        for _ in range(critic_steps):
            real = x[torch.randint(n, (batch_size,), generator=gen).to(dev)]
            z = torch.randn(batch_size, z_dim, generator=gen).to(dev)
            with torch.no_grad():
                fake = G(z)
            eps = torch.rand(batch_size, 1, 1, 1, generator=gen).to(dev)
            mix = (eps * real + (1 - eps) * fake).requires_grad_(True)
            grad = torch.autograd.grad(D(mix).sum(), mix, create_graph=True)[0]
            gp = ((grad.flatten(1).norm(dim=1) - 1) ** 2).mean()
            loss_d = D(fake).mean() - D(real).mean() + gp_weight * gp
            opt_d.zero_grad(set_to_none=True)
            loss_d.backward()
            opt_d.step()
        z = torch.randn(batch_size, z_dim, generator=gen).to(dev)
        loss_g = -D(G(z)).mean()
        opt_g.zero_grad(set_to_none=True)
        loss_g.backward()
        opt_g.step()
        if step % max(1, steps // 10) == 0 or step == steps:
            trace.append({"step": step, "loss_d": float(loss_d.detach()), "loss_g": float(loss_g.detach())})
            if log:
                log(f"  GAN step {step}/{steps}: critic {float(loss_d.detach()):.3f}, generator {float(loss_g.detach()):.3f}")
    G.eval()
    D.eval()
    for p in list(G.parameters()) + list(D.parameters()):
        p.requires_grad_(False)
    return G, D, trace


# ---- the GMI attack -------------------------------------------------------------------------------------------
def invert(G: nn.Module, D: nn.Module, model: nn.Module, *, label: int, num: int, steps: int, lr: float,
           momentum: float, lambda_id: float, normalize=lambda x: x, kfac_target=None, lambda_kfac: float = 0.0,
           conv_convention: str = "nngeometry", seed: int = 0) -> Dict[str, Any]:
    """GMI's second stage: z ∈ [−1, 1]^{num × z_dim} minimising −D(G(z)) + λ_id CE(model(G(z)), label)
    (+ λ_kfac · K-FAC matching through ``model`` when ``kfac_target`` is given), SGD with momentum, z clipped
    to [−1, 1] after every step. Returns the images (in [0, 1]), the final z and a loss trace."""
    model.eval()
    dev = next(G.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    z = torch.randn(num, G.z_dim, generator=gen).clamp_(-1, 1).to(dev).requires_grad_(True)
    opt = torch.optim.SGD([z], lr=lr, momentum=momentum)
    y = torch.full((num,), int(label), dtype=torch.long, device=dev)
    trace = []
    for step in range(steps + 1):
        img = G(z)
        logits = model(normalize(img))
        prior = -D(img).mean()
        iden = F.cross_entropy(logits, y)
        loss = prior + lambda_id * iden
        kl = None
        if kfac_target is not None and lambda_kfac > 0:
            kl = kfac_match_loss(kfac_factors(model, normalize(img), conv_convention=conv_convention), kfac_target)
            loss = loss + lambda_kfac * kl
        if step % max(1, steps // 10) == 0 or step == steps:
            trace.append({"step": step, "prior": float(prior.detach()), "identity": float(iden.detach()),
                          "kfac": None if kl is None else float(kl.detach()),
                          "target_prob": float(logits.detach().softmax(-1)[:, label].mean())})
        if step == steps:
            break
        (z.grad,) = torch.autograd.grad(loss, [z])     # only z is optimised (no parameter gradients)
        opt.step()
        with torch.no_grad():
            z.clamp_(-1, 1)
    with torch.no_grad():
        img = G(z)
    return {"images": img.detach(), "z": z.detach(), "trace": trace}


def train_evaluator(x: Tensor, y: Tensor, *, hidden: Sequence[int], epochs: int, lr: float, batch_size: int,
                    num_classes: int, seed: int, normalize=lambda t: t, arch: str = "mlp") -> nn.Module:
    """The independent evaluation classifier [I]: an MLP (not the attacked LeNet) trained with Adam on the
    full training set (``x`` raw images in [0, 1]). ``arch`` names another fedbench model for the evaluator
    variants of scripts/gaps/fedfisher_table6_attack.py (``hidden`` is then unused)."""

    torch.manual_seed(seed)
    kw = {"hidden": list(hidden)} if arch == "mlp" else {}
    model = build_model(arch, input_shape=tuple(x.shape[1:]), num_classes=num_classes, **kw).to(x.device)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    n = x.shape[0]
    model.train()
    for _ in range(epochs):
        for b in torch.randperm(n, generator=gen).split(batch_size):
            b = b.to(x.device)
            loss = F.cross_entropy(model(normalize(x[b])), y[b])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@torch.no_grad()
def predict(model: nn.Module, x: Tensor, batch_size: int = 2048) -> Tensor:
    return torch.cat([model(x[i: i + batch_size]).argmax(-1) for i in range(0, x.shape[0], batch_size)])


# ---- config --------------------------------------------------------------------------------------------------
def study_settings(cfg) -> Dict[str, Any]:
    """The ``study`` block with defaults, checked (one-line FedbenchError) before any data are loaded."""

    block = OmegaConf.to_container(cfg.get("study") or {}, resolve=True)
    unknown = sorted(set(block) - set(STUDY_KEYS))
    if unknown:
        raise FedbenchError(f"study has no key(s) {', '.join(unknown)}; known: {', '.join(STUDY_KEYS)}")
    st = {**STUDY_KEYS, **block}
    for key in ("aux_size", "z_dim", "gan_width", "gan_steps", "gan_critic_steps", "gan_batch_size", "attack_steps",
                "num_reconstructions", "evaluator_epochs", "evaluator_batch_size"):
        v = st[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise FedbenchError(f"study.{key} must be an integer >= 1, got {v!r}")
    for key in ("grid_per_case", "target_label"):
        v = st[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise FedbenchError(f"study.{key} must be an integer >= 0, got {v!r}")
    for key in ("gan_lr", "attack_lr", "evaluator_lr"):
        if isinstance(st[key], bool) or not isinstance(st[key], (int, float)) or not st[key] > 0:
            raise FedbenchError(f"study.{key} must be a number > 0, got {st[key]!r}")
    for key in ("gan_gp_weight", "attack_momentum", "lambda_id", "lambda_kfac"):
        if isinstance(st[key], bool) or not isinstance(st[key], (int, float)) or not st[key] >= 0:
            raise FedbenchError(f"study.{key} must be a number >= 0, got {st[key]!r}")
    if st["aux_pool"] not in AUX_POOLS:
        raise FedbenchError(f"study.aux_pool must be one of {', '.join(AUX_POOLS)}, got {st['aux_pool']!r}")
    cases = st["cases"]
    if not isinstance(cases, list) or not cases or any(c not in CASES for c in cases):
        raise FedbenchError(f"study.cases must be a non-empty list of {', '.join(CASES)}, got {cases!r}")
    hid = st["evaluator_hidden"]
    if not isinstance(hid, list) or any(isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in hid):
        raise FedbenchError(f"study.evaluator_hidden must be a list of positive integers, got {hid!r}")
    pname = str(cfg.partition.name)
    if pname != "fedfisher_attack":
        raise FedbenchError(f"the GMI study needs partition=fedfisher_attack (client 1 holds the target class), "
                            f"got {pname}")
    if int(cfg.partition.get("target_label", 3)) != st["target_label"]:
        raise FedbenchError(f"study.target_label={st['target_label']} differs from partition.target_label="
                            f"{cfg.partition.target_label}")
    if str(cfg.algorithm.name) != "fedfisher_kfac":
        raise FedbenchError(f"the GMI study attacks FedFisher(K-FAC) in case (iii): set algorithm=fedfisher_kfac, "
                            f"got {cfg.algorithm.name}")
    if int(cfg.num_clients) < 2:
        raise FedbenchError(f"the GMI study needs num_clients >= 2, got {cfg.num_clients}")
    if int(cfg.rounds) != 1:
        raise FedbenchError(f"the GMI study attacks one-shot aggregates: rounds must be 1, got {cfg.rounds}")
    validate(cfg)
    return st


# ---- from a config -------------------------------------------------------------------------------------------
def _setup(cfg, launch_dir: Optional[str]):
    """Data, partition, FLSetup and seeded initialisation, from ``fedbench.run.setup.build_setup`` as every run
    (so the client stage shares the run cache with ordinary runs of the same settings)."""
    if str(cfg.server_val.get("mode")) == "holdout" and int(cfg.server_val.get("size") or 0) > 0:
        raise FedbenchError("the GMI study does not support server_val.mode=holdout")
    run = build_setup(cfg, launch_dir)
    data = run.data
    if data.task != "classification" or tuple(data.input_shape) != (1, 28, 28):
        raise FedbenchError(f"the GMI study's GAN is built for 1x28x28 images, got {cfg.dataset.name} "
                            f"{tuple(data.input_shape)}")
    return data, run.parts, run.fl, run.init_params


def _load(template: nn.Module, params: Mapping[str, Tensor]) -> nn.Module:
    m = copy.deepcopy(template)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(params[n])
    return m.eval()


def save_grid(images: Mapping[str, Tensor], path: Path, title: str = "") -> Path:
    """Fig. 4: one row of reconstructions per case."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(c, im) for c, im in images.items() if im.shape[0]]
    cols = max((im.shape[0] for _, im in rows), default=1)
    fig, axes = plt.subplots(len(rows), cols, figsize=(0.9 * cols + 2.6, 1.0 * len(rows) + 0.5), squeeze=False)
    for r, (case, im) in enumerate(rows):
        for c in range(cols):
            ax = axes[r][c]
            ax.set_xticks([])
            ax.set_yticks([])
            for s in ax.spines.values():
                s.set_visible(False)
            if c < im.shape[0]:
                ax.imshow(im[c, 0].cpu().numpy(), cmap="gray", vmin=0, vmax=1)
        axes[r][0].set_ylabel(CASE_LABELS.get(case, case).replace(" + ", "\n+ ").replace("aggregate", "aggr."),
                              rotation=0, ha="right", va="center", fontsize=7)
    if title:
        fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_from_config(cfg, out_dir: Path, *, launch_dir: Optional[str] = None, log=print) -> Dict[str, Any]:
    """Train the clients, build the three attack targets, train the GAN and the evaluator, attack, evaluate;
    write ``attack.csv``, ``figure4.png`` and ``reconstructions.pt`` into ``out_dir``; return what the run
    record adds (``metrics.attack_accuracy_<case>`` in %, sizes, traces)."""
    log = log or (lambda *_: None)
    st = study_settings(cfg)
    seed, label = int(cfg.seed), int(st["target_label"])
    timing: Dict[str, float] = {}
    t0 = time.perf_counter()
    data, parts, setup, init = _setup(cfg, launch_dir)
    sizes = [int(len(p)) for p in parts]
    log(f"clients: {sizes} (client 1: {int((np.asarray(data.train_y.cpu())[parts[0]] == label).sum())} x {label})")
    tg = _targets(cfg, setup, init, sizes)
    timing["clients_and_aggregates_s"] = time.perf_counter() - t0
    log("test accuracy: " + ", ".join(f"{k} {v:.2f}" for k, v in tg["accuracy"].items()))

    t1 = time.perf_counter()
    aux, aux_labels, (G, D, gan_trace) = _server_gan(st, setup, data, parts, seed, log)
    timing["gan_s"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    evaluator, eval_acc = _evaluator(st, setup, data, seed)
    timing["evaluator_s"] = time.perf_counter() - t2
    log(f"evaluator test accuracy {eval_acc:.2f}")

    # (4) the attack per case
    acc = tg["accuracy"]
    metrics: Dict[str, float] = {"evaluator_test_accuracy": eval_acc, "client1_test_accuracy": acc["client1"],
                                 "fedavg_test_accuracy": acc["fedavg"], "fedfisher_test_accuracy": acc["fedfisher"]}
    rows, images, traces, recon = [], {}, {}, {}
    for case in st["cases"]:
        t3 = time.perf_counter()
        row, recon[case], traces[case] = _attack_case(case, st, setup, tg, G, D, evaluator, seed, data.num_classes)
        images[case] = recon[case][: st["grid_per_case"]]
        metrics[f"attack_accuracy_{case}"] = row["attack_accuracy"]
        metrics[f"target_model_agreement_{case}"] = row["target_model_says_target"]
        rows.append({**row, "seconds": time.perf_counter() - t3})
        timing[f"attack_{case}_s"] = time.perf_counter() - t3
        log(f"case {case}: attack accuracy {row['attack_accuracy']:.1f}% (target model says {label}: "
            f"{row['target_model_says_target']:.1f}%)")
    files = _write_outputs(Path(out_dir), rows, images, metrics, st, label, seed, cfg.get("profile"))
    files["attack_inputs"] = _save_attack_inputs(Path(out_dir), st, G, D, tg, aux, recon)
    return {"files": files, "metrics": metrics, "client_sizes": sizes, "aux_label_counts": aux_labels.tolist(),
            "gan_trace": gan_trace, "attack_traces": traces, "study_timing": timing,
            "uplink_bytes": int(tg["logs"][-1].uplink_bytes) if tg["logs"] else None}


def _save_attack_inputs(out: Path, st, G, D, tg, aux, recon) -> str:
    """What the attack stage needs (GAN, the three targets, client 1's K-FAC, the aux indices, every
    reconstruction), so that attack and evaluator variants run without retraining the GAN
    (scripts/gaps/fedfisher_table6_attack.py). Outputs only: results/records keeps the record, no weights."""
    name = "attack_inputs.pt"
    write_torch_atomic(out / name, {
        "generator": G.state_dict(), "critic": D.state_dict(), "z_dim": int(st["z_dim"]),
        "gan_width": int(st["gan_width"]), "conv": tg["conv"], "aux_indices": torch.as_tensor(aux),
        "targets": {case: {n: t.detach().cpu() for n, t in p.items()} for case, p in tg["models"].items()},
        "kfac1": {m: (a.cpu(), g.cpu()) for m, (a, g) in tg["kfac1"].items()},
        "reconstructions": {case: im.cpu() for case, im in recon.items()}})
    return name


def _targets(cfg, setup, init, sizes: List[int]) -> Dict[str, Any]:
    """(1) clients + FedFisher(K-FAC) (whose clients are the plain FedAvg clients, cached under the same key):
    the three attacked models, client 1's K-FAC as the server decodes it, and their test accuracies."""
    algo = build_algorithm(OmegaConf.to_container(cfg.algorithm, resolve=True), setup)
    captured: Dict[int, Any] = {}
    uploaded: Dict[int, Any] = {}
    upload = algo.client_message

    def keep(client_id, params, *args, **kwargs):   # the trained client weights, and the message FedFisher sends
        captured[int(client_id)] = params
        uploaded[int(client_id)] = upload(client_id, params, *args, **kwargs)
        return uploaded[int(client_id)]

    algo.client_message = keep
    state, logs = run_rounds(setup, algo, init, 1, progress=bool(cfg.get("progress", True)))
    client_params = [captured[i] for i in range(setup.num_clients)]
    fedfisher_params = algo.predict_params(state)
    fedavg_params = weighted_average(client_params, sizes)
    # client 1's K-FAC exactly as uploaded (compressed if the algorithm compresses) and decoded by the server
    dev = setup.device
    payload = uploaded[0].payload["factors"]
    kfac1 = {sp.module: (decode_any(payload[sp.module]["A"]).to(dev), decode_any(payload[sp.module]["G"]).to(dev))
             for sp in algo.specs}
    ev = dict(task=setup.task, batch_size=setup.eval_batch_size, n_bins=setup.ece_bins)
    acc = {name: evaluate(setup.model, p, setup.test_inputs, setup.test_y, **ev)["accuracy"]
           for name, p in (("client1", client_params[0]), ("fedavg", fedavg_params), ("fedfisher", fedfisher_params))}
    models = {"local_model_client1": client_params[0], "aggregate": fedavg_params,
              "aggregate_plus_client1_kfac": fedfisher_params}
    return {"models": models, "kfac1": kfac1, "accuracy": acc, "logs": logs,
            "conv": getattr(algo, "conv_convention", "nngeometry")}


def _server_gan(st, setup, data, parts, seed: int, log):
    """(2) the server's auxiliary data: aux_size samples of clients 2..K [P] (``aux_pool=all_clients``: of every
    client, client 1's 3s included, a what-if), uniformly without replacement [I]; returns (their indices, their
    label counts, the trained (G, D, trace))."""
    first = 0 if st["aux_pool"] == "all_clients" else 1
    pool = np.concatenate([np.asarray(p) for p in parts[first:]])
    if st["aux_size"] > len(pool):
        which = "all clients" if first == 0 else "clients 2..K"
        raise FedbenchError(f"study.aux_size={st['aux_size']} exceeds the {len(pool)} samples of {which}")
    aux = np.sort(np.random.default_rng([seed, 0xA0C5]).choice(pool, size=st["aux_size"], replace=False))
    aux_t = torch.as_tensor(aux, dtype=torch.long, device=setup.device)
    aux_labels = np.bincount(np.asarray(data.train_y.cpu())[aux], minlength=int(data.num_classes))
    gan = train_gan(setup.train.raw(aux_t), z_dim=st["z_dim"], steps=st["gan_steps"],
                    critic_steps=st["gan_critic_steps"], batch_size=st["gan_batch_size"],
                    lr=float(st["gan_lr"]), gp_weight=float(st["gan_gp_weight"]), seed=seed,
                    width=st["gan_width"], log=log)
    return aux, aux_labels, gan


def _evaluator(st, setup, data, seed: int, arch: str = "mlp"):
    """(3) the evaluation classifier [I]: a different architecture on the full training set; (model, test acc %)."""
    dev = setup.device
    all_idx = torch.arange(len(data.train_y), device=dev)
    evaluator = train_evaluator(setup.train.raw(all_idx), data.train_y.long(), hidden=st["evaluator_hidden"],
                                epochs=st["evaluator_epochs"], lr=float(st["evaluator_lr"]),
                                batch_size=st["evaluator_batch_size"], num_classes=int(data.num_classes),
                                seed=seed + 7, normalize=setup.train.normalize, arch=arch)
    test_pred = predict(evaluator, setup.test_inputs(torch.arange(len(data.test_y), device=dev)))
    return evaluator, 100.0 * float((test_pred.cpu() == data.test_y.cpu()).float().mean())


def attack(case: str, st, setup, tg: Mapping[str, Any], G, D, seed: int) -> Tuple[nn.Module, Dict[str, Any]]:
    """GMI against one case's target with the study settings ``st``: (the target model, ``invert``'s result).
    ``tg``: the targets' weights (``models``), client 1's K-FAC (``kfac1``) and its convention (``conv``)."""
    model = _load(setup.model, tg["models"][case])
    res = invert(G, D, model, label=int(st["target_label"]), num=st["num_reconstructions"], steps=st["attack_steps"],
                 lr=float(st["attack_lr"]), momentum=float(st["attack_momentum"]),
                 lambda_id=float(st["lambda_id"]), normalize=setup.train.normalize,
                 kfac_target=tg["kfac1"] if case == "aggregate_plus_client1_kfac" else None,
                 lambda_kfac=float(st["lambda_kfac"]), conv_convention=tg["conv"], seed=seed * 1000 + 17)
    return model, res


def _attack_case(case: str, st, setup, tg: Dict[str, Any], G, D, evaluator, seed: int, num_classes: int):
    """(4) one case's attack: (its attack.csv row, every reconstruction, the optimisation trace)."""
    label = int(st["target_label"])
    model, res = attack(case, st, setup, tg, G, D, seed)
    imgs = res["images"]
    pred = predict(evaluator, setup.train.normalize(imgs))
    with torch.no_grad():
        target_pred = predict(model, setup.train.normalize(imgs))
    row = {"case": case, "attack_accuracy": 100.0 * float((pred == label).float().mean()),
           "target_model_says_target": 100.0 * float((target_pred == label).float().mean()),
           "evaluator_label_counts": np.bincount(pred.cpu().numpy(), minlength=int(num_classes)).tolist(),
           "final_target_prob": res["trace"][-1]["target_prob"]}
    return row, imgs.cpu(), res["trace"]


def _write_outputs(out: Path, rows, images, metrics, st, label: int, seed: int, prof) -> Dict[str, str]:
    import pandas as pd

    out.mkdir(parents=True, exist_ok=True)
    files = {"attack": "attack.csv", "figure4": "figure4.png", "reconstructions": "reconstructions.pt"}
    pd.DataFrame(rows).to_csv(out / files["attack"], index=False)
    torch.save({c: im for c, im in images.items()}, out / files["reconstructions"])
    save_grid(images, out / files["figure4"],
              title=f"GMI reconstructions of digit {label} (seed {seed}, profile {prof}); attack accuracy: "
                    + ", ".join(f"{c.split('_')[0]} {metrics[f'attack_accuracy_{c}']:.0f}%" for c in st["cases"]))
    return files


def publish(runs: Sequence[Mapping[str, Any]], figures_dir: Path, profile: str,
            suffix: Optional[str] = None) -> List[Path]:
    """Copy the first finished run's Fig. 4 grid to ``results/figures/fedfisher_figure4[_<profile>][_<suffix>].png``."""

    for r in runs:
        src = Path(r["dir"]) / "figure4.png"
        if r.get("record") and src.exists():
            dst = Path(figures_dir) / (collection_stem("fedfisher_figure4", profile, suffix) + ".png")
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
            return [dst]
    return []
