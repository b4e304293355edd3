"""Local training of one round's clients: serial (one reused worker) or batched (stacked weights).

Both backends draw the same batches from the same per-client generators and apply the
same updates, so they give the same trained weights up to float rounding (a test checks).
Data stay as tensors on the training device; a batch is an index gather, never a DataLoader.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from fedbench.errors import FedbenchError
from fedbench.train.config import LocalTrainConfig
from fedbench.train.optim import StackedOptimizer, clip_stacked_
from fedbench.train.stacked import StackedModel, choose_conv_strategies
from fedbench.train.terms import LossTerm

Params = Dict[str, Tensor]
BACKENDS = ("serial", "batched")
MEMORY_FORMATS = ("contiguous", "channels_last")


@dataclass
class TrainData:
    """Training tensors on the device plus how a raw batch becomes a model input."""

    x: Tensor                      # uint8 images or float features, on the device
    y: Tensor
    mean: Optional[Sequence[float]] = None
    std: Optional[Sequence[float]] = None
    augment: Optional[Callable] = None   # fedbench.data.transforms.Augment (enabled or None)
    task: str = "classification"

    def __post_init__(self):
        dev, dt = self.x.device, torch.float32
        self._mean = None if self.mean is None else torch.tensor(self.mean, device=dev, dtype=dt)
        self._std = None if self.std is None else torch.tensor(self.std, device=dev, dtype=dt)

    def raw(self, idx: Tensor) -> Tensor:
        """Float batch before normalisation (uint8 -> [0, 1]): augmentation acts here, as torchvision
        transforms do before Normalize, so padding values are pixel values."""
        x = self.x[idx]
        return x.float().div_(255.0) if x.dtype == torch.uint8 else x.float()

    def normalize(self, x: Tensor) -> Tensor:
        if self._mean is None:
            return x
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return (x - self._mean.view(shape)) / self._std.view(shape)

    def inputs(self, idx: Tensor) -> Tensor:
        return self.normalize(self.raw(idx))

    def targets(self, idx: Tensor) -> Tensor:
        return self.y[idx]


@dataclass
class LocalObjective:
    """What a method adds to plain local training.

    terms: extra loss terms (see fedbench.train.terms), each called as term(params, ctx) with
    ctx = {**shared_ctx, **client_ctx[k]}; step_hooks: objects with either or both of
    ``after_backward(client_ids, grads, batch_sizes)``, called once per optimiser step with the (stacked)
    gradients of the data loss plus terms (e.g. FOLA's online Fisher accumulator; the serial engine also passes
    ``params=``, ``x=``, ``y=`` to a hook whose ``wants_batch`` is true, and shows a hook with ``watch(module)`` its
    worker before training: a hook that returns a tap (``remove()``-able) reads the engine's own forward passes, whose
    graphs the backward then keeps for it), and
    ``after_step(client_ids) -> {name: [k, *shape]} | None``, a change added to the clients' weights after each
    optimiser step, outside the optimiser (no momentum, weight decay or clipping: SCAFFOLD's released correction).
    A hook that also has ``outputs(client_id) -> dict`` reports what it computed for a client: read at the end
    of training (and at every snapshot epoch) into ``TrainResult.extras[key][position]``.
    """

    terms: List[LossTerm] = field(default_factory=list)
    shared_ctx: dict = field(default_factory=dict)
    client_ctx: Optional[List[dict]] = None
    step_hooks: list = field(default_factory=list)


@dataclass
class TrainResult:
    params: List[Params]           # trained weights per client (detached, on the device)
    steps: List[int]               # optimiser steps per client (FedNova's tau_k)
    mean_loss: List[float]         # mean training loss over the last epoch per client
    seconds: float
    extras: Dict[str, list] = field(default_factory=dict)   # step hooks' outputs per client (LocalObjective)
    snapshots: Dict[int, "TrainResult"] = field(default_factory=dict)   # epoch e -> the result after e epochs


def data_loss(out: Tensor, y: Tensor, task: str) -> Tensor:
    """Per-sample loss: cross-entropy, BCE for a single logit, or 1/2 squared error."""
    if task == "regression":
        return 0.5 * (out.reshape(y.shape) - y) ** 2
    if out.shape[-1] == 1:
        return F.binary_cross_entropy_with_logits(out.squeeze(-1), y.float(), reduction="none")
    return F.cross_entropy(out, y, reduction="none")


def client_generator(seed: int, round_idx: int, client_id: int) -> torch.Generator:
    """Independent, reproducible stream per (run seed, round, client)."""
    s = int(np.random.SeedSequence([int(seed), int(round_idx), int(client_id)]).generate_state(1)[0])
    return torch.Generator().manual_seed(s)


def epoch_batches(n: int, batch_size: int, gen: torch.Generator, drop_last: bool) -> List[Tensor]:
    perm = torch.randperm(n, generator=gen)
    batches = list(torch.split(perm, batch_size))
    if drop_last and batches and len(batches[-1]) < batch_size and len(batches) > 1:
        batches.pop()
    return batches


def train_clients(model: nn.Module, data: TrainData, client_indices: Sequence[Tensor],
                  start: Params | Sequence[Params], local: LocalTrainConfig, *,
                  objective: Optional[LocalObjective] = None, seed: int = 0, round_idx: int = 0,
                  client_ids: Optional[Sequence[int]] = None, backend: str = "serial",
                  conv_strategy: str | dict = "auto", memory_format: str = "contiguous",
                  progress=None, snapshot_epochs: Sequence[int] = (), finished=None) -> TrainResult:
    """Train each client from ``start`` (one shared dict or one per client) for local.epochs.

    snapshot_epochs: epochs e < local.epochs after which the clients' state is also kept, as
    ``result.snapshots[e]``: bit for bit the result of training e epochs (the batches of epoch e do not
    depend on how many follow, and nothing in local training reads local.epochs); ``seconds`` is what those
    e epochs cost.

    memory_format (serial backend): "channels_last" runs the worker's convolutions on NHWC tensors,
    1.1-1.8x faster LeNet / SimpleCNN steps on one CPU thread of a loaded 2-core machine
    (scripts/bench_throughput.py); other convolution kernels, so weights agree with "contiguous" to float rounding, not bit for bit.

    finished (serial backend, no step hooks): a store of the clients done so far (``fl.cache.ClientProgress``: ``load(i,
    header)``, ``save(i, header, client)``). A client found there is not trained again, so a killed process's successor
    goes on from the last finished client: each client draws from its own generator, so the result is bit for bit that
    of one uninterrupted training. Not used with step hooks or dropout (state the store does not hold).
    """
    if backend not in BACKENDS:
        raise FedbenchError(f"unknown training backend '{backend}'; choose one of {BACKENDS}")
    if memory_format not in MEMORY_FORMATS:
        raise FedbenchError(f"unknown memory format '{memory_format}'; choose one of {MEMORY_FORMATS}")
    objective = objective or LocalObjective()
    k = len(client_indices)
    client_ids = list(range(k)) if client_ids is None else list(client_ids)
    starts = [start] * k if isinstance(start, dict) else list(start)
    if len(starts) != k:
        raise FedbenchError(f"got {len(starts)} start states for {k} clients")
    snaps = sorted({int(e) for e in snapshot_epochs})
    if any(not 1 <= e < local.epochs for e in snaps):
        raise FedbenchError(f"snapshot epochs {snaps} must lie in [1, local.epochs) = [1, {local.epochs})")
    t0 = time.perf_counter()
    if local.epochs == 0 or k == 0:
        params = [{n: t.detach().clone() for n, t in s.items()} for s in starts]
        return TrainResult(params, [0] * k, [float("nan")] * k, time.perf_counter() - t0)
    if backend == "serial":
        out = _train_serial(model, data, client_indices, starts, local, objective, seed, round_idx, client_ids,
                            memory_format == "channels_last", progress, snaps, finished)
    else:
        out = _train_batched(model, data, client_indices, starts, local, objective, seed, round_idx, client_ids,
                             conv_strategy, progress, snaps)
    out.seconds += time.perf_counter() - t0   # plus what the clients taken from ``finished`` cost
    return out


def _hook_outputs(objective: LocalObjective, client_id: int) -> Dict[str, Any]:
    """What the step hooks computed for one client so far (``outputs``), by key."""
    out: Dict[str, Any] = {}
    for h in objective.step_hooks:
        if hasattr(h, "outputs"):
            out.update(h.outputs(client_id))
    return out


def _hooks_with(objective: LocalObjective, method: str) -> list:
    return [h for h in objective.step_hooks if hasattr(h, method)]


@torch.no_grad()
def _shift_weights(hooks: list, client_ids: List[int], params: Params, rows: Optional[Tensor] = None) -> None:
    """Add the hooks' ``after_step`` changes ([len(client_ids), *shape], None: no change) to the clients' stacked
    weights: every row, or ``rows`` of them (the batched engine's active clients)."""
    for h in hooks:
        shift = h.after_step(client_ids)
        for n, p in (params.items() if shift is not None else ()):
            if rows is None:
                p.add_(shift[n])
            else:
                p.index_add_(0, rows, shift[n])


def _active_rows(cache: Dict[Tuple[int, ...], Tensor], active: List[int], dev) -> Tensor:
    """The active clients' rows as a tensor on the device, made once per set of clients."""
    key = tuple(active)
    if key not in cache:
        cache[key] = torch.tensor(active, device=dev)
    return cache[key]


def _extras(per_client: List[Dict[str, Any]]) -> Dict[str, list]:
    """[{key: value} per client] -> {key: [value per client]}."""
    keys = [key for d in per_client for key in d]
    return {key: [d.get(key) for d in per_client] for key in dict.fromkeys(keys)}


def _ctx(objective: LocalObjective, i: int) -> dict:
    if objective.client_ctx is None:
        return objective.shared_ctx
    return {**objective.shared_ctx, **objective.client_ctx[i]}


def _augment(data: TrainData, x: Tensor, gen: torch.Generator) -> Tensor:
    return data.augment(x, gen) if data.augment is not None and x.shape[0] > 0 else x


def _channels_last(x: Tensor) -> Tensor:
    return x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x


def _train_serial(model, data, client_indices, starts, local, objective, seed, round_idx, client_ids,
                  channels_last, progress, snaps=(), finished=None) -> TrainResult:
    worker = copy.deepcopy(model)
    if channels_last:   # copy_ below keeps each parameter's NHWC layout
        worker = worker.to(memory_format=torch.channels_last)
    named = dict(worker.named_parameters())
    backward_hooks, step_hooks = _hooks_with(objective, "after_backward"), _hooks_with(objective, "after_step")
    # a hook that reads the engine's own forward pass (FOLA's per-sample squares) taps the worker: the backward then
    # keeps the pass's graph for it
    taps = [t for t in (h.watch(worker) for h in backward_hooks if hasattr(h, "watch")) if t is not None]
    # hooks keep per-client state the store does not hold; dropout draws from the global generator, which a client
    # taken from the store would not advance for the next ones
    if objective.step_hooks or any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in worker.modules()):
        finished = None
    try:
        return _train_serial_loop(worker, named, backward_hooks, step_hooks, bool(taps), data, client_indices, starts,
                                  local, objective, seed, round_idx, client_ids, channels_last, progress, snaps,
                                  finished)
    finally:
        for t in taps:
            t.remove()


def _train_serial_loop(worker, named, backward_hooks, step_hooks, keep_graph, data, client_indices, starts, local,
                       objective, seed, round_idx, client_ids, channels_last, progress, snaps,
                       finished=None) -> TrainResult:
    results, steps, losses, outputs = [], [], [], []
    # per snapshot epoch: the clients' weights, steps, last-epoch losses, seconds and hook outputs
    at = {e: ([], [], [], [], []) for e in snaps}
    restored_s = 0.0
    for i, (idx_all, st) in enumerate(zip(client_indices, starts)):
        # what a stored client must have been trained with (its start is the stage's, which names the store)
        header = {"client_id": int(client_ids[i]), "seed": int(seed), "round": int(round_idx), "epochs": local.epochs,
                  "snapshots": list(snaps), "channels_last": bool(channels_last)}
        done = finished.load(i, header) if finished is not None else None
        if done is not None:
            results.append(done["params"])
            steps.append(done["steps"])
            losses.append(done["loss"])
            outputs.append({})
            for e in snaps:
                for column, value in zip(at[e], (*done["snapshots"][e], {})):
                    column.append(value)
            restored_s += done["seconds"]
            if progress is not None:
                progress.update(local.epochs)
            continue
        t_client = time.perf_counter()
        with torch.no_grad():
            for n, p in named.items():
                p.copy_(st[n])
        if local.optimizer == "sgd":   # foreach: one C++ call per update instead of a Python loop; same bits
            opt = torch.optim.SGD(worker.parameters(), lr=local.lr, momentum=local.momentum,
                                  dampening=local.dampening, nesterov=local.nesterov,
                                  weight_decay=local.weight_decay, foreach=True)
        else:
            opt = torch.optim.Adam(worker.parameters(), lr=local.lr, betas=local.betas, eps=local.eps,
                                   weight_decay=local.weight_decay)
        gen = client_generator(seed, round_idx, client_ids[i])
        ctx = _ctx(objective, i)
        n_steps, last_epoch_loss = 0, []
        worker.train()
        for epoch in range(local.epochs):
            last_epoch_loss = []
            for b in epoch_batches(len(idx_all), local.batch_size, gen, local.drop_last):
                idx = idx_all[b.to(idx_all.device)]
                x = data.normalize(_augment(data, data.raw(idx), gen))
                if channels_last:
                    x = _channels_last(x)
                loss = data_loss(worker(x), data.targets(idx), data.task).mean()
                last_epoch_loss.append(loss.detach())
                for term in objective.terms:
                    loss = loss + term(named, ctx)
                opt.zero_grad(set_to_none=True)
                loss.backward(retain_graph=keep_graph)
                if backward_hooks:
                    _after_backward_serial(backward_hooks, client_ids[i], named, x, data.targets(idx))
                if local.clip_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(worker.parameters(), local.clip_grad_norm)
                opt.step()
                if step_hooks:   # no per-step work for the methods without one
                    _shift_weights(step_hooks, [client_ids[i]], {n: p.unsqueeze(0) for n, p in named.items()})
                n_steps += 1
            if progress is not None:
                progress.update(1)
            if epoch + 1 in at:
                p_e, s_e, l_e, t_e, o_e = at[epoch + 1]
                p_e.append({n: p.detach().clone(memory_format=torch.contiguous_format) for n, p in named.items()})
                s_e.append(n_steps)
                l_e.append(_mean_loss(last_epoch_loss))
                t_e.append(time.perf_counter() - t_client)
                o_e.append(_hook_outputs(objective, client_ids[i]))
        results.append({n: p.detach().clone(memory_format=torch.contiguous_format) for n, p in named.items()})
        steps.append(n_steps)
        losses.append(_mean_loss(last_epoch_loss))
        outputs.append(_hook_outputs(objective, client_ids[i]))
        if finished is not None:
            finished.save(i, header, {"params": results[-1], "steps": n_steps, "loss": losses[-1],
                                      "seconds": time.perf_counter() - t_client,
                                      "snapshots": {e: tuple(column[-1] for column in at[e][:4]) for e in snaps}})
    snapshots = {e: TrainResult(p_e, s_e, l_e, sum(t_e), _extras(o_e)) for e, (p_e, s_e, l_e, t_e, o_e) in at.items()}
    return TrainResult(results, steps, losses, restored_s, _extras(outputs), snapshots)


def _after_backward_serial(hooks: list, client_id: int, named: Dict[str, nn.Parameter], x: Tensor, y: Tensor) -> None:
    """One client's step to the after_backward hooks (a batch of one client). A hook with ``wants_batch`` also gets
    the pre-step weights and the minibatch (``params=``, ``x=``, ``y=``, each [1, ...]), so that it need not replay
    them (FOLA's per-sample Fisher)."""
    grads = {n: p.grad.unsqueeze(0) for n, p in named.items()}
    size = torch.tensor([len(y)])
    for h in hooks:
        if getattr(h, "wants_batch", False):
            h.after_backward([client_id], grads, size, params={n: p.detach().unsqueeze(0) for n, p in named.items()},
                             x=x.unsqueeze(0), y=y.unsqueeze(0))
        else:
            h.after_backward([client_id], grads, size)


def _mean_loss(epoch_losses: List[Tensor]) -> float:
    return float(torch.stack(epoch_losses).mean()) if epoch_losses else float("nan")


def _train_batched(model, data, client_indices, starts, local, objective, seed, round_idx, client_ids,
                   conv_strategy, progress, snaps=()) -> TrainResult:
    t0, snapshots = time.perf_counter(), {}   # snapshots: epoch -> TrainResult
    k = len(client_indices)
    dev = data.x.device
    bsz = local.batch_size
    if conv_strategy == "auto":
        conv_strategy = choose_conv_strategies(model, tuple(data.x.shape[1:]), k, bsz, dev)
    stacked = StackedModel(model, conv_strategy).to(dev)
    stacked.train()
    names = [n for n, _ in model.named_parameters()]
    params = {n: torch.stack([s[n].detach() for s in starts]).clone() for n in names}
    opt = StackedOptimizer(params, local)
    gens = [client_generator(seed, round_idx, cid) for cid in client_ids]
    sizes = [len(ix) for ix in client_indices]
    n_steps = [0] * k
    loss_sums = torch.zeros(k, device=dev)
    loss_counts = torch.zeros(k, device=dev)
    terms = objective.terms
    backward_hooks, step_hooks = _hooks_with(objective, "after_backward"), _hooks_with(objective, "after_step")
    ctx_stacked, ctx_dims = _stack_ctx(objective, k)
    host_indices = [ix.cpu() for ix in client_indices]
    row_sets: Dict[Tuple[int, ...], Tensor] = {}   # active clients -> their rows on the device, made once
    for epoch in range(local.epochs):
        loss_sums.zero_()
        loss_counts.zero_()
        batches = [epoch_batches(sizes[i], bsz, gens[i], local.drop_last) for i in range(k)]
        n_batches = [len(b) for b in batches]
        idx_all, weight_all = _epoch_layout(batches, host_indices, bsz, dev)
        for s in range(max(n_batches)):
            active = [i for i in range(k) if s < n_batches[i]]
            ka = len(active)
            rows = None if ka == k else _active_rows(row_sets, active, dev)
            idx, weight = idx_all[s, :ka], weight_all[s, :ka]
            x = data.raw(idx.reshape(-1))
            if data.augment is not None:
                x = x.reshape(ka, bsz, *x.shape[1:])
                for j, i in enumerate(active):
                    nb = len(batches[i][s])
                    x[j, :nb] = _augment(data, x[j, :nb], gens[i])
                x = x.reshape(ka * bsz, *x.shape[2:])
            x = data.normalize(x)
            y = data.targets(idx.reshape(-1))
            cur = {n: (p if rows is None else p[rows]).requires_grad_(True) for n, p in params.items()} \
                if rows is not None else {n: p.detach().requires_grad_(True) for n, p in params.items()}
            per_sample = data_loss(stacked(cur, x), y, data.task).reshape(ka, bsz)
            counts = weight.sum(1)
            # a client with no data has one empty batch per epoch (torch.split of nothing), as in the serial
            # engine: its data loss must be 0 with zero gradient there, not 0/0 (NaN weights that reach the server)
            client_loss = (per_sample * weight).sum(1) / counts.clamp_min(1)
            if rows is None:
                loss_sums += client_loss.detach()
                loss_counts += 1
            else:
                loss_sums.index_add_(0, rows, client_loss.detach())
                loss_counts.index_add_(0, rows, torch.ones_like(client_loss))
            total = client_loss.sum()
            for term in terms:
                total = total + _vmapped_term(term, cur, ctx_stacked, ctx_dims, rows).sum()
            grads = torch.autograd.grad(total, list(cur.values()))
            grads = dict(zip(cur.keys(), grads))
            for h in backward_hooks:
                h.after_backward([client_ids[i] for i in active], grads, counts.long())
            if local.clip_grad_norm is not None:
                clip_stacked_(grads, local.clip_grad_norm)
            opt.step(grads, rows)
            if step_hooks:
                _shift_weights(step_hooks, [client_ids[i] for i in active], params, rows)
            for i in active:
                n_steps[i] += 1
        if progress is not None:
            progress.update(k)
        if epoch + 1 in snaps:
            snapshots[epoch + 1] = _batched_result(params, n_steps, loss_sums / loss_counts.clamp_min(1), objective,
                                                   client_ids, time.perf_counter() - t0)
    out = _batched_result(params, n_steps, loss_sums / loss_counts.clamp_min(1), objective, client_ids, 0.0)
    out.snapshots = snapshots
    return out


def _batched_result(params: Params, n_steps, losses: Tensor, objective, client_ids, seconds) -> TrainResult:
    """The clients' state now: weights (unstacked copies), steps, mean losses of this epoch, hooks' outputs."""
    out = [{n: t[i].detach().clone() for n, t in params.items()} for i in range(len(client_ids))]
    return TrainResult(out, list(n_steps), losses.tolist(), seconds,
                       _extras([_hook_outputs(objective, cid) for cid in client_ids]))


def _epoch_layout(batches: List[List[Tensor]], host_indices: List[Tensor], bsz: int, dev) -> Tuple[Tensor, Tensor]:
    """One epoch's sample indices and masks, [steps, clients, bsz]: at step s the rows 0..ka-1 hold the clients
    still training, in order. Built on the host and copied once: per-step copies of small host tensors would make
    every step wait for the device (a copy from pageable memory syncs the stream)."""
    k = len(batches)
    n_batches = [len(b) for b in batches]
    n_s = max(n_batches)
    idx_all = torch.zeros(n_s, k, bsz, dtype=torch.long)
    weight_all = torch.zeros(n_s, k, bsz)
    for s in range(n_s):
        for j, i in enumerate(i for i in range(k) if s < n_batches[i]):
            b = batches[i][s]
            idx_all[s, j, : len(b)] = host_indices[i][b]
            weight_all[s, j, : len(b)] = 1.0
    return idx_all.to(dev), weight_all.to(dev)


def _stack_ctx(objective: LocalObjective, k: int):
    """Shared context is broadcast (vmap in_dim None); per-client context is stacked (in_dim 0)."""
    from torch.utils._pytree import tree_map

    shared = objective.shared_ctx
    per = objective.client_ctx
    stacked = {}
    dims = {}
    for key, val in shared.items():
        stacked[key] = val
        dims[key] = None
    if per is not None:
        for key in per[0]:
            vals = [c[key] for c in per]
            stacked[key] = tree_map(lambda *xs: torch.stack(xs), *vals)
            dims[key] = 0
    return stacked, dims


def _vmapped_term(term, params, ctx, dims, rows):
    from torch.utils._pytree import tree_map

    if rows is not None:
        ctx = {key: (tree_map(lambda t: t[rows], v) if dims[key] == 0 else v) for key, v in ctx.items()}
    return torch.func.vmap(term, in_dims=(0, dims))(params, ctx)
