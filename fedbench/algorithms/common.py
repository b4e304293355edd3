"""Helpers several methods share: each method's named random stream, and client aggregation weights.

Random streams. Every method draws its own randomness (MC Fisher labels, Gram subsets, ensemble members,
generator noise, ...) from a stream derived from the run seed. Each method's derivation predates this module and
is kept exactly in ``STREAM_DERIVATIONS`` (one row per method): changing a row changes that method's results.
A new method adds a row, preferably an ``_entropy`` one with its own constant.

Distillation. ``distill_epoch`` is the one pass DENSE, FedBE and FedOV make over their server data per epoch
(a shuffled order from the method's stream, minibatches, one optimiser step each); each method supplies its batch
loss (teacher, targets, augmentation) and keeps its own epochs, schedule and trace.

Client weights. ``client_weights`` is the one normalisation ``n_k / Σ n`` (or ``1/K``) in plain Python floats;
the methods that normalise again inside ``base.weighted_average`` pass ``raw_weights`` instead (normalising
twice would change the last bits).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Union

import numpy as np
import torch

from fedbench.errors import FedbenchError


def _entropy(words: Sequence[int]) -> int:
    """One 32-bit seed from a word sequence (numpy's SeedSequence: nearby words give unrelated seeds)."""
    return int(np.random.SeedSequence([int(w) for w in words]).generate_state(1)[0])


# method -> (seed, round_idx, client_id, tag) -> the integer its torch.Generator is seeded with.
# The constants are what each method used before this table existed (results depend on them).
STREAM_DERIVATIONS: Dict[str, Callable[[int, int, int, int], int]] = {
    # the engine's per-client stream on an offset run seed (client_generator(seed + offset, round, client))
    "fedlpa": lambda s, r, c, t: _entropy([s + 0xF15, r, c]),
    "fedlap": lambda s, r, c, t: _entropy([s + 7_919, r, c]),
    # per round (and per client for FedOV), a method constant, then a tag that names the use within the method
    "fedbe": lambda s, r, c, t: _entropy([s, r, 0xFEDBE, t]),
    "dense": lambda s, r, c, t: _entropy([s, r, 0xDE45E, t]),
    "fedov": lambda s, r, c, t: _entropy([s, r, c, 0xF0E0, t]),
    # plain arithmetic (no hashing); the tag is FedBEns' member index
    "fedfisher": lambda s, r, c, t: s * 1_000_003 + 7919 * c + r,
    "regmean": lambda s, r, c, t: s * 1_000_003 + c,
    "fedbens": lambda s, r, c, t: s * 1000 + t,
}


def method_seed(name: str, seed: int, round_idx: int = 0, client_id: int = 0, tag: int = 0) -> int:
    """The integer seeding method ``name``'s stream for (run seed, round, client, tag)."""
    if name not in STREAM_DERIVATIONS:
        raise KeyError(f"no random stream registered for method '{name}' (add it to STREAM_DERIVATIONS)")
    return STREAM_DERIVATIONS[name](int(seed), int(round_idx), int(client_id), int(tag))


def method_generator(name: str, seed: int, round_idx: int = 0, client_id: int = 0, tag: int = 0,
                     device: Union[str, torch.device] = "cpu") -> torch.Generator:
    """A fresh ``torch.Generator`` on ``device`` seeded with ``method_seed(...)``."""
    return torch.Generator(device=device).manual_seed(method_seed(name, seed, round_idx, client_id, tag))


# ---- client weights ------------------------------------------------------------------------------------
WEIGHTINGS = ("num_samples", "uniform")
NO_CLIENT_DATA = "all clients are empty: no data to aggregate"


def raw_weights(sizes: Sequence[float], weighting: str = "num_samples") -> List[float]:
    """Unnormalised weights: each client's sample count, or 1.0 for every client under ``uniform``."""
    return [float(n) if weighting == "num_samples" else 1.0 for n in sizes]


def client_weights(sizes: Sequence[float], weighting: str = "num_samples", *,
                   empty_error: Optional[str] = None) -> List[float]:
    """π_k = w_k / Σ w over ``raw_weights``. When every client is empty: uniform 1/K, or, with
    ``empty_error``, a ``FedbenchError`` with that message (methods that cannot aggregate nothing)."""
    raw = raw_weights(sizes, weighting)
    total = sum(raw)
    if total > 0:
        return [r / total for r in raw]
    if empty_error is not None:
        raise FedbenchError(empty_error)
    return [1.0 / len(raw)] * len(raw)


# ---- distillation ----------------------------------------------------------------------------------------
def distill_epoch(num_examples: int, batch_size: int, gen: torch.Generator, device: Union[str, torch.device],
                  batch_loss: Callable[[torch.Tensor], torch.Tensor], optimizer: torch.optim.Optimizer,
                  after_step: Optional[Callable[[], None]] = None) -> float:
    """One shuffled pass: ``randperm(num_examples)`` from ``gen`` (drawn first, then moved to ``device``), split into
    batches of indices; per batch ``batch_loss(idx)``, zero_grad, backward, step, then ``after_step()``.
    Returns the mean batch loss (0 without batches). Random draws inside ``batch_loss`` follow the permutation."""
    perm = torch.randperm(num_examples, generator=gen).to(device)
    total, batches = 0.0, 0
    for idx in torch.split(perm, batch_size):
        loss = batch_loss(idx)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if after_step is not None:
            after_step()
        total += float(loss.detach())
        batches += 1
    return total / max(batches, 1)
