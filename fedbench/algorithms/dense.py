"""DENSE (Zhang et al., NeurIPS 2022): data-free one-shot distillation of the client ensemble.

Notes: ../shared/reference/notes/fedlpa.md §2 (DENSE configuration, FedLPA's port),
fedfisher.md §2 ("DENSE details"), fedbens.md §2, reference-code.md §7 (zj-jayzhang/DENSE).

Server, after plain local training (the cached client stage; uplink = the client models):
  teacher(x) = Σ_k w_k f_k(x)   (logit ensemble; w_k = 1/K (FedLPA/DENSE) or n_k/n (FedFisher/FedBEns))
  for each of ``epochs`` epochs:
    1. re-initialise a DCGAN-style generator G (N(0, 0.02)) and draw z ~ N(0, I), random labels y;
       for ``g_steps`` Adam steps (lr_g, betas (0.5, 0.999)) on (G, z) minimise
         bn·Σ_BN (‖μ_batch − μ_run‖₂ + ‖σ²_batch − σ²_run‖₂)   (teacher BatchNorm inputs; 0 without BN)
       + oh·CE(teacher(x̃), y)
       − adv·mean_i[ 1[argmax s_i ≠ argmax t_i] · KL(t_i ‖ s_i) ]   (x̃ = augmented G(z))
       and add the lowest-loss batch G(z) to the image pool;
    2. one pass of KL distillation at temperature T (× T²) over the whole pool (shuffled, augmented),
       SGD with momentum into the student (one optimiser for the whole run, as the code).
  The student returned is the last one or the best by server-validation accuracy (``select``).
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from fedbench.algorithms.base import ALGORITHMS, Algorithm, weighted_average
from fedbench.algorithms.common import client_weights, distill_epoch, method_generator
from fedbench.algorithms.options import option, read_options
from fedbench.data.transforms import Augment
from fedbench.errors import FedbenchError
from fedbench.eval.metrics import evaluate   # test_accuracy_as_released: see the warning in __init__

Params = Dict[str, Tensor]
SELECTS = ("last", "val_accuracy", "test_accuracy_as_released")
AUGMENTS = ("none", "flip", "crop_flip", "auto")


def extrapolate_cost(trace: Sequence[Dict[str, float]], epochs: int) -> Dict[str, float]:
    """Seconds a DENSE run of ``epochs`` epochs would take, from a shorter run's per-epoch trace.

    Synthesis costs the same every epoch (g_steps generator steps on one batch): its mean is used. The KD
    pass runs over the whole pool, which grows by one synthesis batch per epoch, so KD seconds are fitted
    as c · pool size (least squares through 0) and summed over the full run's pool sizes."""
    rows = list(trace)
    if not rows or epochs < 1:
        raise ValueError("extrapolate_cost needs a non-empty trace and epochs >= 1")
    synth = sum(float(r["synthesis_s"]) for r in rows) / len(rows)
    pools = [float(r["pool"]) for r in rows]
    growth = pools[0]                                  # images added per epoch (the first epoch's pool)
    c = sum(float(r["kd_s"]) * p for r, p in zip(rows, pools)) / max(sum(p * p for p in pools), 1e-12)
    kd = c * growth * epochs * (epochs + 1) / 2        # Σ_e c · growth · e
    measured = sum(float(r["synthesis_s"]) + float(r["kd_s"]) for r in rows)
    return {"epochs_measured": float(len(rows)), "measured_s": measured, "synthesis_s_per_epoch": synth,
            "kd_s_per_image": c, "epochs": float(epochs), "synthesis_s": synth * epochs, "kd_s": kd,
            "total_s": synth * epochs + kd}


# ------------------------------------------------------------------------------------------------
# loss terms (module level so tests can check them by hand)
# ------------------------------------------------------------------------------------------------
def kd_loss(student_logits: Tensor, teacher_logits: Tensor, T: float) -> Tensor:
    """KL(softmax(t/T) ‖ softmax(s/T)), batch mean, × T² (DENSE's KLDiv; reference-code.md §7)."""
    logq = F.log_softmax(student_logits / T, dim=1)
    p = F.softmax(teacher_logits / T, dim=1)
    return F.kl_div(logq, p, reduction="batchmean") * (T * T)


def adv_loss(student_logits: Tensor, teacher_logits: Tensor) -> Tensor:
    """−mean_i mask_i KL(t_i ‖ s_i), mask = student and teacher argmax disagree (DENSE's synthesizer:
    the generator seeks samples the student still gets wrong; the mean runs over the whole batch)."""
    mask = (student_logits.argmax(1) != teacher_logits.argmax(1)).to(student_logits.dtype)
    kl = F.kl_div(F.log_softmax(student_logits, dim=1), F.softmax(teacher_logits, dim=1),
                  reduction="none").sum(1)
    return -(kl * mask).mean()


def oh_loss(teacher_logits: Tensor, targets: Tensor) -> Tensor:
    """Cross-entropy of the teacher against the synthesis labels (random or the teacher's argmax)."""
    return F.cross_entropy(teacher_logits, targets)


class BNStatHook:
    """DeepInversion feature-statistics term on every BatchNorm layer of a model (forward hooks):
    Σ_layers ‖running_var − var_batch‖₂ + ‖running_mean − mean_batch‖₂ (biased variance, the code's).

    Reads the running statistics the module holds at call time, so it also works under
    ``torch.func.functional_call`` with per-member buffers. Fedbench's models have no BatchNorm:
    the term is then identically 0 (as in FedLPA's port, fedlpa.md §2 [I])."""

    def __init__(self, model: nn.Module):
        self.terms: List[Tensor] = []
        self.enabled = True          # off during distillation: only synthesis uses the term
        self.handles = [m.register_forward_hook(self._hook) for m in model.modules()
                        if isinstance(m, nn.modules.batchnorm._BatchNorm)]

    @property
    def active(self) -> bool:
        return bool(self.handles)

    def _hook(self, module, inputs, output):
        if not self.enabled:
            return
        x = inputs[0]
        dims = [0] + list(range(2, x.dim()))
        mean = x.mean(dims)
        var = x.transpose(0, 1).reshape(x.shape[1], -1).var(1, unbiased=False)
        self.terms.append(torch.norm(module.running_var - var, 2) + torch.norm(module.running_mean - mean, 2))

    def pop(self, like: Tensor) -> Tensor:
        out = sum(self.terms) if self.terms else like.new_zeros(())
        self.terms = []
        return out

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []


class Generator(nn.Module):
    """DCGAN-style generator of DENSE (reference-code.md §7): Linear(nz → 2·ngf·(H/4)(W/4)) → BN →
    up×2 → conv3(2ngf) → BN → LReLU(0.2) → up×2 → conv3(ngf) → BN → LReLU(0.2) → conv3(C) → Sigmoid."""

    def __init__(self, nz: int, ngf: int, shape: Sequence[int]):
        super().__init__()
        c, h, w = shape
        self.init_hw = (h // 4, w // 4)
        self.l1 = nn.Linear(nz, 2 * ngf * self.init_hw[0] * self.init_hw[1])
        self.blocks = nn.Sequential(
            nn.BatchNorm2d(2 * ngf), nn.Upsample(scale_factor=2),
            nn.Conv2d(2 * ngf, 2 * ngf, 3, 1, 1, bias=False), nn.BatchNorm2d(2 * ngf), nn.LeakyReLU(0.2),
            nn.Upsample(scale_factor=2),
            nn.Conv2d(2 * ngf, ngf, 3, 1, 1, bias=False), nn.BatchNorm2d(ngf), nn.LeakyReLU(0.2),
            nn.Conv2d(ngf, c, 3, 1, 1), nn.Sigmoid())

    def forward(self, z: Tensor) -> Tensor:
        return self.blocks(self.l1(z).view(z.shape[0], -1, *self.init_hw))

    @torch.no_grad()
    def reset(self, gen: torch.Generator) -> None:
        """The code's reset_model: conv/linear weights N(0, 0.02), biases 0, BN weights N(1, 0.02);
        drawn on the CPU from ``gen`` so runs are reproducible on any device."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Conv2d, nn.BatchNorm2d)):
                mean = 1.0 if isinstance(m, nn.BatchNorm2d) else 0.0
                m.weight.copy_(mean + 0.02 * torch.randn(m.weight.shape, generator=gen))
                if m.bias is not None:
                    m.bias.zero_()
            if isinstance(m, nn.BatchNorm2d):
                m.reset_running_stats()


class ImagePool:
    """Synthetic images kept in memory (the code writes PNGs). With ``quantize`` the images are stored
    as uint8 = ⌊255·clamp(x, 0, 1)⌋ (the code's ``(x*255).astype('uint8')`` truncation) and read back
    as /255, i.e. exactly what reading the PNG back gives."""

    def __init__(self, quantize: bool):
        self.quantize = quantize
        self.batches: List[Tensor] = []

    def add(self, x: Tensor) -> None:
        x = x.detach()
        self.batches.append((x.clamp(0, 1) * 255).to(torch.uint8) if self.quantize else x.clone())

    def __len__(self) -> int:
        return sum(b.shape[0] for b in self.batches)

    def images(self) -> Tensor:
        x = torch.cat(self.batches)
        return x.float().div_(255.0) if self.quantize else x


def teacher_logits(model: nn.Module, members: Sequence[Params], weights: Sequence[float], x: Tensor) -> Tensor:
    """Σ_k w_k f_k(x) with one template model (no per-client copies)."""
    out = None
    for p, w in zip(members, weights):
        z = torch.func.functional_call(model, p, (x,)) * w
        out = z if out is None else out + z
    return out


# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DenseOptions:
    teacher_weighting: str = option(choices=("uniform", "num_samples"))
    student_init: str = option(choices=("fresh", "fedavg"))
    epochs: int = option(minimum=1)
    g_steps: int = option(minimum=1)
    lr_g: float = option(positive=True)
    synthesis_batch_size: int = option(minimum=1)
    kd_batch_size: int = option(minimum=1)
    nz: int = option(minimum=1)
    ngf: int = option(minimum=1)
    bn: float = option(nonneg=True)
    oh: float = option(nonneg=True)
    adv: float = option(nonneg=True)
    oh_targets: str = option(choices=("random", "teacher_argmax"))
    T: float = option(positive=True)
    lr: float = option(positive=True)
    momentum: float = option(nonneg=True)
    weight_decay: float = option(nonneg=True)
    augment_synthesis: str = option(choices=AUGMENTS)
    augment_kd: str = option(choices=AUGMENTS)
    normalize_synthetic: bool = option()
    pool_quantize: bool = option()
    select: str = option(choices=SELECTS)


@ALGORITHMS.register("dense")
class Dense(Algorithm):
    name = "dense"
    Options = DenseOptions
    def __init__(self, cfg, setup):
        super().__init__(cfg, setup)
        o = read_options(self.Options, cfg, self.name)
        self.weighting, self.student_init = o.teacher_weighting, o.student_init
        self.epochs, self.g_steps, self.lr_g = o.epochs, o.g_steps, o.lr_g
        self.syn_bs, self.kd_bs, self.nz, self.ngf = o.synthesis_batch_size, o.kd_batch_size, o.nz, o.ngf
        self.w_bn, self.w_oh, self.w_adv, self.oh_targets, self.T = o.bn, o.oh, o.adv, o.oh_targets, o.T
        self.lr, self.momentum, self.weight_decay = o.lr, o.momentum, o.weight_decay
        self.aug_syn, self.aug_kd = o.augment_synthesis, o.augment_kd
        self.normalize_synthetic, self.pool_quantize, self.select = o.normalize_synthetic, o.pool_quantize, o.select
        if setup.task != "classification":
            raise FedbenchError(f"dense needs a classification task, got {setup.task!r}")
        probe = setup.train.raw(torch.zeros(1, dtype=torch.long, device=setup.train.x.device))
        if probe.dim() != 4 or probe.shape[-1] % 4 or probe.shape[-2] % 4:
            raise FedbenchError(f"dense needs image inputs [C,H,W] with H and W divisible by 4 (its generator "
                                f"upsamples twice), got {tuple(probe.shape[1:])}")
        self.shape = tuple(probe.shape[1:])
        with torch.no_grad():
            out = setup.model(setup.train.normalize(probe.to(setup.device)))
        self.num_classes = int(out.shape[-1])
        if self.num_classes < 2:
            raise FedbenchError("dense needs a model with >= 2 output logits (softmax classification)")
        if self.select == "val_accuracy":
            setup.require_server_val(self.name)
        # !!! select: test_accuracy_as_released picks the epoch with the best TEST accuracy, as DENSE's
        # !!! and FedLPA's released code report (fedlpa.md §2 "Reported", reference-code.md §7). It leaks the
        # !!! test set into model selection: use it only to match the published numbers, never by default.
        self._init: Optional[Params] = None

    # --- hooks ------------------------------------------------------------------------------
    def init_state(self, params):
        self._init = {n: t.detach().clone() for n, t in params.items()}
        return {"params": params}

    def client_stage_key(self, round_idx):
        return {} if round_idx == 1 else None   # plain local training: the shared cached clients

    def aggregate(self, messages, state, round_idx):
        members = [m.payload["params"] for m in messages]
        sizes = [m.num_samples for m in messages]
        w = client_weights(sizes, self.weighting)   # uniform 1/K (DENSE's Ensemble) or n_k/n
        if self.student_init == "fedavg":
            start = weighted_average(members, sizes)
        else:   # a fresh random initialisation: the run's initial weights (drawn from the run seed)
            start = self._init if self._init is not None else state["params"]
        best, trace, last = self.distill(members, w, start, round_idx)
        out = {**state, "params": best, "trace": trace}
        if self.select != "last":
            out["extra_eval"] = {"dense_last": last}
        return out

    # --- the server computation ----------------------------------------------------------------
    def _augment(self, kind: str) -> Optional[Augment]:
        if kind == "auto":   # the code: crop+flip for CIFAR-like sets (those trained with crops), flip otherwise
            aug = self.setup.train.augment
            kind = "crop_flip" if aug is not None and getattr(aug, "crop_padding", 0) > 0 else "flip"
        if kind == "none":
            return None
        return Augment(crop_padding=4 if kind == "crop_flip" else 0, pad_mode="zero", flip=True, per="sample")

    def _model_input(self, x: Tensor) -> Tensor:
        return self.setup.train.normalize(x) if self.normalize_synthetic else x

    def distill(self, members: List[Params], weights: List[float], start: Params, round_idx: int
                ) -> Tuple[Params, List[Dict[str, float]], Params]:
        setup, dev = self.setup, self.setup.device
        members = [{n: t.detach().to(dev) for n, t in p.items()} for p in members]
        teacher = copy.deepcopy(setup.model).to(dev).eval()
        student = copy.deepcopy(setup.model).to(dev)
        with torch.no_grad():
            for n, p in student.named_parameters():
                p.copy_(start[n].to(dev))
        opt = torch.optim.SGD([p for p in student.parameters() if p.requires_grad], lr=self.lr,
                              momentum=self.momentum, weight_decay=self.weight_decay)
        gen_cpu = method_generator("dense", setup.seed, round_idx, tag=0)
        generator = Generator(self.nz, self.ngf, self.shape).to(dev)
        pool = ImagePool(self.pool_quantize)
        hook = BNStatHook(teacher)
        hook.enabled = self.w_bn > 0
        aug_s, aug_k = self._augment(self.aug_syn), self._augment(self.aug_kd)
        best, best_score, trace = None, -float("inf"), []
        try:
            for ep in range(self.epochs):
                t0 = time.perf_counter()
                x_best = self.synthesize(generator, teacher, student, members, weights, hook, aug_s, gen_cpu)
                pool.add(x_best)
                t1 = time.perf_counter()
                loss = self.kd_epoch(student, teacher, members, weights, opt, pool, aug_k, gen_cpu, hook)
                params = {n: p.detach().clone() for n, p in student.named_parameters()}
                # per-epoch cost: synthesis is constant, the KD pass grows with the pool (extrapolating a reduced run)
                row = {"epoch": ep + 1, "kd_loss": loss, "pool": len(pool), "synthesis_s": t1 - t0,
                       "kd_s": time.perf_counter() - t1}
                if self.select != "last":
                    row["score"] = self._score(params)
                    if row["score"] > best_score:   # strictly better wins (the code's acc > bst_acc)
                        best, best_score = params, row["score"]
                trace.append(row)
        finally:
            hook.remove()
        last = {n: p.detach().clone() for n, p in student.named_parameters()}
        if best is None:
            best = last
        ref = start
        cast = lambda p: {n: t.to(ref[n].dtype) for n, t in p.items()}   # noqa: E731
        return cast(best), trace, cast(last)

    def _score(self, params: Params) -> float:
        if self.select == "val_accuracy":
            return float(self.setup.val_metrics(params)["accuracy"])
        s = self.setup
        return float(evaluate(s.model, params, s.test_inputs, s.test_y, task=s.task,
                              batch_size=s.eval_batch_size)["accuracy"])

    def synthesize(self, generator: Generator, teacher: nn.Module, student: nn.Module, members, weights,
                   hook: BNStatHook, aug: Optional[Augment], gen_cpu: torch.Generator) -> Tensor:
        """One epoch's generator optimisation; returns the lowest-loss batch G(z) (in [0, 1])."""
        dev = self.setup.device
        generator.reset(gen_cpu)
        generator.train()
        z = torch.randn(self.syn_bs, self.nz, generator=gen_cpu).to(dev).requires_grad_(True)
        targets = torch.randint(0, self.num_classes, (self.syn_bs,), generator=gen_cpu).sort()[0].to(dev)
        opt = torch.optim.Adam([{"params": generator.parameters()}, {"params": [z]}], lr=self.lr_g,
                               betas=(0.5, 0.999))
        was = student.training
        student.eval()
        req = [p.requires_grad for p in student.parameters()]
        for p in student.parameters():
            p.requires_grad_(False)
        best_cost, best_x = float("inf"), None
        try:
            for _ in range(self.g_steps):
                opt.zero_grad(set_to_none=True)
                x = generator(z)
                xa = aug(x, gen_cpu) if aug is not None else x
                xin = self._model_input(xa)
                hook.terms = []
                t_out = teacher_logits(teacher, members, weights, xin)
                l_bn = hook.pop(t_out)
                y = t_out.detach().argmax(1) if self.oh_targets == "teacher_argmax" else targets
                loss = self.w_oh * oh_loss(t_out, y)
                if self.w_bn > 0:
                    loss = loss + self.w_bn * l_bn
                if self.w_adv > 0:
                    loss = loss + self.w_adv * adv_loss(student(xin), t_out)
                val = float(loss.detach())
                if best_x is None or val < best_cost:   # the code keeps the batch of the lowest loss
                    best_cost, best_x = val, x.detach().clone()
                loss.backward()
                opt.step()
        finally:
            for p, r in zip(student.parameters(), req):
                p.requires_grad_(r)
            student.train(was)
        return best_x

    def kd_epoch(self, student: nn.Module, teacher: nn.Module, members, weights, opt, pool: ImagePool,
                 aug: Optional[Augment], gen_cpu: torch.Generator, hook: Optional[BNStatHook] = None) -> float:
        """One shuffled pass over the whole pool: KL at temperature T into the student."""
        images = pool.images()
        student.train()

        def batch_loss(idx: Tensor) -> Tensor:
            x = images[idx]
            if aug is not None:
                x = aug(x, gen_cpu)
            xin = self._model_input(x)
            with torch.no_grad():
                t_out = teacher_logits(teacher, members, weights, xin)
            if hook is not None:
                hook.terms = []
            return kd_loss(student(xin), t_out, self.T)

        return distill_epoch(images.shape[0], self.kd_bs, gen_cpu, images.device, batch_loss, opt)
