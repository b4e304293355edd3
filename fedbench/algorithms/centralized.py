"""Centralised reference: one client holding the union of every client's training data.

The pooled-data upper bound a table's federated columns are read against (FedBEns Table 9's "centralised"
58.55 %, FedLap App. D.2's centralised MAP; notes fedbens.md §3.4/Table 9, fedlap.md App. D.2). Same samples
(the union of the clients' index lists, so ``partition.data_fraction`` and server hold-outs apply as for the
clients), same model and initialisation, same ``local.*`` settings: each round trains ``local.epochs`` epochs
on the pooled data from the current weights, so ``rounds`` × ``local.epochs`` epochs in all, with the
optimiser state reset between rounds exactly as a client's is. The number of SGD steps per round equals the
clients' total up to each client's last partial batch.

No communication: the downlink and the message payload are empty (0 bytes); the trained weights travel in the
message's ``info``. With one client it is FedAvg (same data order, same weights; tested).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from fedbench.algorithms.base import ALGORITHMS, Algorithm, Message
from fedbench.algorithms.options import read_options
from fedbench.errors import FedbenchError
from fedbench.train.engine import LocalObjective, train_clients

POOLED_CLIENT = 0   # the pooled client trains with client 0's shuffling stream (= FedAvg with one client)


def pooled_indices(client_indices: Sequence[Tensor]) -> Tensor:
    """The union of the clients' index lists, in client order, each sample once (first occurrence kept)."""
    if not client_indices:
        return torch.zeros(0, dtype=torch.long)
    idx = torch.cat([ix.reshape(-1).long() for ix in client_indices])
    uniq, inverse = torch.unique(idx, return_inverse=True)
    first = torch.full((len(uniq),), len(idx), dtype=torch.long, device=idx.device)
    first = first.scatter_reduce(0, inverse, torch.arange(len(idx), device=idx.device), reduce="amin")
    return idx[torch.sort(first).values]


class _ScaledProgress:
    """Counts one pooled epoch as ``k`` client-epochs on the loop's progress bar (its total counts clients)."""

    def __init__(self, bar, k: int):
        self.bar, self.k = bar, k

    def update(self, n: int = 1) -> None:
        self.bar.update(n * self.k)


@dataclass(frozen=True)
class CentralizedOptions:
    """No options."""


@ALGORITHMS.register("centralized")
class Centralized(Algorithm):
    name = "centralized"
    Options = CentralizedOptions

    def __init__(self, cfg, setup):
        super().__init__(cfg, setup)
        read_options(self.Options, cfg, self.name)
        self.pooled = pooled_indices(setup.client_indices)
        if len(self.pooled) == 0:
            raise FedbenchError("centralized: the clients hold no training data")

    def client_stage_key(self, round_idx):
        # its own cached stage: the pooled training differs from every federated client stage
        return {"method": "centralized"} if round_idx == 1 else None

    def stage_client_ids(self, client_ids):
        return [POOLED_CLIENT]

    def downlink(self, state):
        return {}

    def local_train(self, state, client_ids, round_idx, seed, progress=None):
        s = self.setup
        bar = None if progress is None else _ScaledProgress(progress, s.num_clients)
        return train_clients(s.model, s.train, [self.pooled], state["params"], s.local, objective=LocalObjective(),
                             seed=seed, round_idx=round_idx, client_ids=[POOLED_CLIENT], backend=s.backend,
                             conv_strategy=s.conv_strategy, memory_format=s.memory_format, progress=bar)

    def client_message(self, client_id, params, result, pos, state, round_idx, products):
        info = {"params": params, "steps": result.steps[pos], "train_loss": result.mean_loss[pos]}
        return Message(client_id, len(self.pooled), {}, info)

    def aggregate(self, messages, state, round_idx):
        return {**state, "params": messages[0].info["params"]}
