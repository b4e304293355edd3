"""The round loop shared by every method: broadcast, local training, messages, aggregation, evaluation."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
import torch.nn as nn
from torch import Tensor

from fedbench.algorithms.base import Algorithm, tensor_bytes
from fedbench.eval.metrics import evaluate
from fedbench.train.config import LocalTrainConfig
from fedbench.fl.cache import ClientStageCache
from fedbench.fl.products import ProductStage
from fedbench.results.schema import RoundLog
from fedbench.train.engine import TrainData, TrainResult, train_clients
from fedbench.errors import FedbenchError


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
    memory_format: str = "contiguous"     # serial backend: contiguous | channels_last (hardware.memory_format)
    eval_batch_size: int = 2048
    ece_bins: int = 15
    local_accuracy: bool = False          # also evaluate each client model before aggregation (FOLA's LA)
    cache: Optional[ClientStageCache] = None
    stage_parts: Optional[Dict[str, Any]] = None   # what determines the client stage (data, split, model, local, seed)
    server_val: Optional[tuple] = None    # (normalised inputs, labels) of the server's validation set, or None
    server_unlabeled: Optional[Tensor] = None   # normalised inputs of the server's unlabelled set (no labels), or None
    round_metrics: Optional[Callable[[Any], Dict[str, float]]] = None   # more metrics of the global model per
                                          # evaluated round (eval.map_reference: its distance to the centralised MAP)
    share_epochs: tuple = ()              # config share_epochs: round 1's client stage trained once for all of them

    @property
    def num_clients(self) -> int:
        return len(self.client_indices)

    def require_server_val(self, method: str) -> None:
        """Called from a method's __init__ (before training) when it needs server validation data."""
        if self.server_val is None:
            raise FedbenchError(f"{method} needs a server validation set: set server_val.size (the papers use 500)")

    def require_server_unlabeled(self, method: str) -> None:
        """Called from a method's __init__ (before training) when it distils on unlabelled server data."""
        if self.server_unlabeled is None:
            raise FedbenchError(f"{method} needs unlabelled server data: set server_unlabeled.size "
                                f"(and server_unlabeled.mode: holdout | sampled_from_train)")

    def val_metrics(self, params) -> Dict[str, float]:
        """Metrics of ``params`` (one dict or an ensemble list) on the server validation set."""
        x, y = self.server_val
        return evaluate(self.model, params, lambda idx: x[idx.to(x.device)], y, task=self.task, batch_size=self.eval_batch_size,
                        n_bins=self.ece_bins)

    def client_data(self, client_id: int):
        """(inputs, targets) of one client's training data, normalised, on the device (no augmentation)."""
        idx = self.client_indices[client_id]
        return self.train.inputs(idx), self.train.y[idx]


def run_rounds(setup: FLSetup, algo: Algorithm, init_params: Dict[str, Tensor], rounds: int, *,
               eval_every: int = 1, progress: bool = True,
               on_round: Optional[Callable[[RoundLog], None]] = None,
               on_clients: Optional[Callable[[int, List[Dict[str, Tensor]]], None]] = None,
               resume_after: int = 0, resume_state: Optional[Dict[str, Any]] = None,
               on_state: Optional[Callable[[int, Dict[str, Any]], None]] = None
               ) -> tuple[Dict[str, Any], List[RoundLog]]:
    """``on_clients(round, params)``: the round's trained client weights (member 0), as the server receives
    them (the runner's ``save_model`` keeps round 1's). ``resume_after`` / ``resume_state``: go on after that
    round from that state (fedbench/fl/resume.py; the logs returned are then the new rounds' only).
    ``on_state(round, state)``: after each round's ``on_round``, the state the next round starts from."""
    from tqdm.auto import tqdm

    state = algo.init_state(init_params)   # also on a resume: a method may set itself up here
    if resume_state is not None:
        state = resume_state
    products = ProductStage(setup)   # the run's one worker model for every client's products
    logs: List[RoundLog] = []
    epochs = setup.local.epochs
    bar = tqdm(total=rounds * max(epochs, 0) * setup.num_clients, disable=not progress or epochs == 0,
               initial=resume_after * max(epochs, 0) * setup.num_clients,
               desc=f"{algo.name}", unit="client-epoch", dynamic_ncols=True, leave=False)
    try:
        for r in range(resume_after + 1, rounds + 1):
            bar.set_postfix_str(f"round {r}/{rounds}")
            state, log = run_round(setup, algo, state, r, rounds, eval_every, bar, on_clients, products)
            logs.append(log)
            if on_round is not None:
                on_round(log)
            if on_state is not None:
                on_state(r, state)
    finally:
        bar.close()
    return state, logs


def run_round(setup: FLSetup, algo: Algorithm, state: Dict[str, Any], r: int, rounds: int, eval_every: int, bar,
              on_clients=None, products: Optional[ProductStage] = None) -> tuple[Dict[str, Any], RoundLog]:
    """One round: broadcast, local training (cached), per-client products (cached with it), client messages,
    aggregation, evaluation."""
    ids = list(range(setup.num_clients))
    down = tensor_bytes(algo.downlink(state)) * setup.num_clients
    t0 = time.perf_counter()
    products = products if products is not None else ProductStage(setup)
    results, cached, stage = train_round(setup, algo, state, ids, r, bar)
    result = results[0]
    if on_clients is not None:
        on_clients(r, result.params)
    t1 = time.perf_counter()
    served0 = setup.cache.served_s if setup.cache is not None else 0.0
    trained = list(algo.stage_client_ids(ids))   # every client, or one pooled client (centralized)
    messages = []
    for i, cid in enumerate(trained):
        if len(results) == 1:
            params, res = result.params[i], result
        else:   # a client's M trained weight dicts and results, as lists over members
            params, res = [r_m.params[i] for r_m in results], results
        messages.append(products.message(algo, cid, params, res, i, state, r, stage))
    t2 = time.perf_counter()
    served_post = (setup.cache.served_s if setup.cache is not None else 0.0) - served0
    state = algo.aggregate(messages, state, r)
    t3 = time.perf_counter()
    metrics: Dict[str, float] = {}
    if r % eval_every == 0 or r == rounds:
        metrics = evaluate_round(setup, algo, state, result, trained)
    t4 = time.perf_counter()
    losses = [m.info.get("train_loss", float("nan")) for m in messages]
    sizes = [m.num_samples for m in messages]
    train_loss = sum(l * n for l, n in zip(losses, sizes)) / max(sum(sizes), 1)
    log = RoundLog(r, metrics, client_train_s=t1 - t0, client_post_s=t2 - t1, server_s=t3 - t2, eval_s=t4 - t3,
                   uplink_bytes=sum(m.nbytes for m in messages), downlink_bytes=down,
                   train_loss=train_loss, cached_clients=cached,
                   client_train_compute_s=sum(float(res.seconds) for res in results),
                   client_post_compute_s=(t2 - t1) + served_post)
    return state, log


def train_round(setup: FLSetup, algo: Algorithm, state: Dict[str, Any], ids: List[int], r: int, bar):
    """Every member's local training of round ``r`` (through the client-stage cache when the method allows);
    returns (results per member, whether every member came from the cache, the stage's cache key parts or
    None when it is not cacheable)."""
    epochs = setup.local.epochs
    n_mem = int(algo.num_members(r))

    def train(m: int = 0, local: Optional[LocalTrainConfig] = None, snapshots=(), finished=None):
        # member 0 = the plain training; member m >= 1: the algorithm's m-th start, own shuffling seed
        own = algo.local_train(state, ids, r, setup.seed, bar) if m == 0 else None
        if own is not None:   # the method trains its own clients (e.g. FedOV)
            return own
        start = algo.start_params(state, ids) if m == 0 else algo.member_start_params(state, ids, m, r)
        return train_clients(setup.model, setup.train, setup.client_indices, start,
                             local or setup.local, objective=algo.local_objective(state, ids, r),
                             seed=setup.seed if m == 0 else member_seed(setup.seed, m),
                             round_idx=r, client_ids=ids, backend=setup.backend,
                             conv_strategy=setup.conv_strategy, memory_format=setup.memory_format,
                             progress=bar, snapshot_epochs=snapshots, finished=finished)

    stage_key = algo.client_stage_key(r)
    cacheable = (setup.cache is not None and setup.cache.enabled and setup.stage_parts is not None
                 and stage_key is not None)
    stage = {**setup.stage_parts, "round": r, "local_objective": stage_key} if cacheable else None
    if n_mem > 1:
        bar.total += (n_mem - 1) * max(epochs, 0) * setup.num_clients
    # share_epochs: round 1 of an engine-trained stage (a method with its own local_train, e.g. FedOV, trains alone)
    engine_trained = type(algo).local_train is Algorithm.local_train
    shared = sorted(set(setup.share_epochs)) if cacheable and r == 1 and engine_trained \
        and epochs in setup.share_epochs else [epochs]
    results, cached = [], cacheable
    for m in range(n_mem):
        if cacheable:
            hits = setup.cache.hits
            # a method whose training is plain apart from observing hooks also fills the plain stage (FedAvg's)
            also_plain = m == 0 and stage_key != {} and algo.plain_training(r)

            def key(e: int, objective=stage_key) -> Dict[str, Any]:
                # member 0's key is the plain training's: shared with every other method
                k = {**stage, "local_objective": objective, "product": "local_training"}
                if e != epochs:
                    k["local"] = {**stage["local"], "epochs": e}
                return {**k, "member": algo.member_key(m)} if m > 0 else k

            def compute() -> Dict[str, Any]:
                # the clients finished so far, on disk: a killed stage goes on from them (saving the entry clears it)
                finished = setup.cache.client_progress(key(epochs))
                trained = _train_epochs(setup, train, m, epochs, shared, bar, finished)
                for e, res in trained.items():
                    payload = _result_payload(res)
                    if e != epochs and not setup.cache.contains(key(e)):
                        setup.cache.save(key(e), payload, seconds=res.seconds)
                    if also_plain and not setup.cache.contains(key(e, {})):
                        setup.cache.save(key(e, {}), {k: v for k, v in payload.items() if k != "extras"},
                                         seconds=res.seconds)
                return _result_payload(trained[epochs])

            payload = setup.cache.get_or_compute(key(epochs), compute, setup.device)
            results.append(TrainResult(payload["params"], payload["steps"], payload["mean_loss"],
                                       payload["seconds"], payload.get("extras") or {}))
            cached = cached and setup.cache.hits > hits
        else:
            results.append(train(m))
    return results, cached, stage


def _train_epochs(setup: FLSetup, train, m: int, epochs: int, shared: List[int], bar,
                  finished=None) -> Dict[int, TrainResult]:
    """Member m's training, as {E: result} for every E in ``shared`` (``share_epochs``, else just this run's E):
    max(shared) epochs once, the shorter ones its snapshots (bit for bit their own trainings)."""
    last = max(shared)
    if last == epochs and len(shared) == 1:
        return {epochs: train(m, finished=finished)}
    bar.total += (last - epochs) * setup.num_clients
    res = train(m, dataclasses.replace(setup.local, epochs=last), [e for e in shared if e < last], finished)
    return {e: res if e == last else res.snapshots[e] for e in shared}


def evaluate_round(setup: FLSetup, algo: Algorithm, state: Dict[str, Any], result: TrainResult,
                   trained: List[int]) -> Dict[str, float]:
    """Test metrics of the global state, a method's extra solutions and scalars, and (FOLA's LA) the clients'."""
    ev = dict(task=setup.task, batch_size=setup.eval_batch_size, n_bins=setup.ece_bins)
    metrics = evaluate(setup.model, algo.predict_params(state), setup.test_inputs, setup.test_y, **ev)
    # secondary solutions a method wants reported beside its answer (e.g. FedLPA's EA solution)
    for name, params in (state.get("extra_eval") or {}).items():
        for k, v in evaluate(setup.model, params, setup.test_inputs, setup.test_y, **ev).items():
            metrics[f"{name}_{k}"] = v
    # scalars a method computes itself (e.g. fedfisher_full's global training loss)
    metrics.update({k: float(v) for k, v in (state.get("extra_metrics") or {}).items()})
    if setup.round_metrics is not None:
        metrics.update(setup.round_metrics(algo.predict_params(state)))
    if setup.local_accuracy and setup.task == "classification":
        accs = [evaluate(setup.model, p, setup.test_inputs, setup.test_y, **ev)["accuracy"]
                for p in result.params]
        sizes = [len(setup.client_indices[c]) for c in trained]
        metrics["local_accuracy"] = sum(a * n for a, n in zip(accs, sizes)) / max(sum(sizes), 1)
    return metrics


def member_seed(seed: int, member: int) -> int:
    """Run seed of member m >= 1's local training (data order): a hash of (seed, member)."""
    return int(np.random.SeedSequence([int(seed), 1_000_003, int(member)]).generate_state(1)[0])


def _result_payload(res: TrainResult) -> Dict[str, Any]:
    out = {"params": res.params, "steps": list(res.steps), "mean_loss": list(res.mean_loss), "seconds": res.seconds}
    if res.extras:   # step hooks' outputs (FOLA's online Fisher): part of the stage
        out["extras"] = res.extras
    return out
