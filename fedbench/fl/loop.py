"""The round loop shared by every method: broadcast, local training, messages, aggregation, evaluation."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.nn as nn
from torch import Tensor

from fedbench.algorithms.base import Algorithm, tensor_bytes
from fedbench.eval.metrics import evaluate
from fedbench.train.config import LocalTrainConfig
from fedbench.train.engine import TrainData, train_clients


@dataclass
class FLSetup:
    """Everything about a run that methods may read: model template, data, clients, device."""

    model: nn.Module                      # template on the device (its weights are not used)
    train: TrainData                      # training tensors on the device
    test_inputs: Callable[[Tensor], Tensor]
    test_y: Tensor
    client_indices: List[Tensor]          # per client, indices into train (on the device)
    local: LocalTrainConfig
    seed: int
    device: torch.device
    task: str = "classification"
    backend: str = "serial"
    conv_strategy: Any = "auto"
    eval_batch_size: int = 2048
    ece_bins: int = 15
    extras: Dict[str, Any] = field(default_factory=dict)

    @property
    def num_clients(self) -> int:
        return len(self.client_indices)


@dataclass
class RoundLog:
    round: int
    metrics: Dict[str, float]
    client_train_s: float
    client_post_s: float      # client work after training (curvature, compression)
    server_s: float
    eval_s: float
    uplink_bytes: int
    downlink_bytes: int
    train_loss: float


def run_rounds(setup: FLSetup, algo: Algorithm, init_params: Dict[str, Tensor], rounds: int, *,
               eval_every: int = 1, progress: bool = True,
               on_round: Optional[Callable[[RoundLog], None]] = None) -> tuple[Dict[str, Any], List[RoundLog]]:
    from tqdm.auto import tqdm

    state = algo.init_state(init_params)
    logs: List[RoundLog] = []
    ids = list(range(setup.num_clients))
    epochs = setup.local.epochs
    bar = tqdm(total=rounds * max(epochs, 0) * setup.num_clients, disable=not progress or epochs == 0,
               desc=f"{algo.name}", unit="client-epoch", dynamic_ncols=True, leave=False)
    try:
        for r in range(1, rounds + 1):
            bar.set_postfix_str(f"round {r}/{rounds}")
            down = tensor_bytes(algo.downlink(state)) * setup.num_clients
            t0 = time.perf_counter()
            result = train_clients(setup.model, setup.train, setup.client_indices, algo.start_params(state, ids),
                                   setup.local, objective=algo.local_objective(state, ids, r), seed=setup.seed,
                                   round_idx=r, client_ids=ids, backend=setup.backend,
                                   conv_strategy=setup.conv_strategy, progress=bar)
            t1 = time.perf_counter()
            messages = [algo.client_message(cid, result.params[i], result, i, state, r) for i, cid in enumerate(ids)]
            t2 = time.perf_counter()
            state = algo.aggregate(messages, state, r)
            t3 = time.perf_counter()
            metrics: Dict[str, float] = {}
            if r % eval_every == 0 or r == rounds:
                metrics = evaluate(setup.model, algo.predict_params(state), setup.test_inputs, setup.test_y,
                                   task=setup.task, batch_size=setup.eval_batch_size, n_bins=setup.ece_bins)
            t4 = time.perf_counter()
            losses = [m.info.get("train_loss", float("nan")) for m in messages]
            sizes = [m.num_samples for m in messages]
            train_loss = sum(l * n for l, n in zip(losses, sizes)) / max(sum(sizes), 1)
            log = RoundLog(r, metrics, client_train_s=t1 - t0, client_post_s=t2 - t1, server_s=t3 - t2, eval_s=t4 - t3,
                           uplink_bytes=sum(m.nbytes for m in messages), downlink_bytes=down,
                           train_loss=train_loss)
            logs.append(log)
            if on_round is not None:
                on_round(log)
    finally:
        bar.close()
    return state, logs
