"""algorithm=centralized: one client on the union of the clients' data (the pooled-data reference)."""
import json

import pytest
import torch
import torch.nn as nn

from fedbench.algorithms import build_algorithm
from fedbench.algorithms.centralized import pooled_indices
from fedbench.errors import FedbenchError
from fedbench.fl.loop import FLSetup, run_rounds
from fedbench.train.config import LocalTrainConfig
from fedbench.train.engine import TrainData, client_generator, epoch_batches


def _data(n=90, d=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    return x, y


def _setup(client_indices, local, model=None, backend="serial"):
    x, y = _data()
    torch.manual_seed(0)   # the same initial weights in every setup
    model = model or nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    train = TrainData(x, y)
    return FLSetup(model=model, train=train, test_inputs=train.inputs, test_y=y, client_indices=client_indices,
                   local=local, seed=3, device=torch.device("cpu"), backend=backend)


def _run(setup, name, rounds):
    init = {n: p.detach().clone() for n, p in setup.model.named_parameters()}
    state, logs = run_rounds(setup, build_algorithm({"name": name}, setup), init, rounds, progress=False)
    return state, logs, init


def _scattered_clients():
    """Three clients with interleaved, unsorted indices covering 0..89 (sizes 30, 35, 25)."""
    perm = torch.randperm(90, generator=torch.Generator().manual_seed(7))
    return [perm[:30], perm[30:65], perm[65:]]


@pytest.mark.parametrize("backend", ["serial", "batched"])
def test_one_client_centralized_equals_fedavg_exactly(backend):
    local = LocalTrainConfig(lr=0.1, momentum=0.9, batch_size=8, epochs=2)
    idx = [torch.randperm(90, generator=torch.Generator().manual_seed(1))[:70]]
    fa, _, _ = _run(_setup(idx, local, backend=backend), "fedavg", rounds=2)
    ce, logs, _ = _run(_setup(idx, local, backend=backend), "centralized", rounds=2)
    for n in fa["params"]:
        assert torch.equal(fa["params"][n], ce["params"][n]), n
    assert [lg.uplink_bytes for lg in logs] == [0, 0] and [lg.downlink_bytes for lg in logs] == [0, 0]


def test_pooled_indices_are_the_union_in_client_order():
    clients = _scattered_clients()
    pooled = pooled_indices(clients)
    assert torch.equal(pooled, torch.cat(clients)) and len(pooled) == 90
    overlapping = [torch.tensor([5, 2, 9]), torch.tensor([2, 7]), torch.tensor([], dtype=torch.long),
                   torch.tensor([9, 1, 5])]
    assert pooled_indices(overlapping).tolist() == [5, 2, 9, 7, 1]   # each sample once, first occurrence kept


def _softmax_regression_step(W, b, x, y, lr):
    """One hand-written SGD step on the mean cross-entropy of softmax(x Wᵀ + b)."""
    p = torch.softmax(x @ W.T + b, dim=1)
    r = (p - nn.functional.one_hot(y, W.shape[0]).to(p.dtype)) / len(y)
    return W - lr * r.T @ x, b - lr * r.sum(0)


@pytest.mark.parametrize("batch_size", [90, 16])
def test_several_clients_train_on_the_union_like_a_hand_written_loop(batch_size):
    clients = _scattered_clients()
    local = LocalTrainConfig(lr=0.5, batch_size=batch_size, epochs=3)
    setup = _setup(clients, local, model=nn.Linear(6, 3))
    rounds = 2
    state, logs, init = _run(setup, "centralized", rounds)
    x, y = _data()
    pooled = torch.cat(clients)                  # the union: every client's samples, client order
    W, b = init["weight"].clone(), init["bias"].clone()
    steps = 0
    for r in range(1, rounds + 1):               # local.epochs per round, rounds × epochs in all
        gen = client_generator(setup.seed, r, 0)
        for _ in range(local.epochs):
            for batch in epoch_batches(len(pooled), batch_size, gen, drop_last=False):
                idx = pooled[batch]
                W, b = _softmax_regression_step(W, b, x[idx], y[idx], local.lr)
                steps += 1
    torch.testing.assert_close(state["params"]["weight"], W, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state["params"]["bias"], b, rtol=1e-5, atol=1e-6)
    assert steps == rounds * local.epochs * -(-90 // batch_size)
    assert len(setup.client_indices) == 3 and all(lg.uplink_bytes == 0 for lg in logs)


def test_centralized_differs_from_fedavg_with_several_clients():
    local = LocalTrainConfig(lr=0.5, batch_size=16, epochs=2)
    fa, _, _ = _run(_setup(_scattered_clients(), local), "fedavg", 1)
    ce, _, _ = _run(_setup(_scattered_clients(), local), "centralized", 1)
    assert not torch.allclose(fa["params"]["0.weight"], ce["params"]["0.weight"])


def test_bad_input():
    local = LocalTrainConfig(epochs=1)
    empty = [torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long)]
    with pytest.raises(FedbenchError, match="no training data"):
        build_algorithm({"name": "centralized"}, _setup(empty, local))
    with pytest.raises(FedbenchError, match="unknown algorithm key"):
        build_algorithm({"name": "centralized", "lr": 0.1}, _setup(_scattered_clients(), local))


def test_centralized_beside_fedavg_in_an_aggregator_list(tmp_path):
    from tests.test_run import SMALL, records, run

    run(SMALL + ["rounds=1", "eval.local_accuracy=true", "aggregators=[fedavg,centralized]"], tmp_path)
    by = {r["algorithm"]: r for r in (json.loads(p.read_text()) for p in records(tmp_path))}
    assert sorted(by) == ["centralized", "fedavg"]
    ce = by["centralized"]
    assert ce["status"] == "ok" and ce["partition"]["client_sizes"] == by["fedavg"]["partition"]["client_sizes"]
    assert ce["metrics"]["local_accuracy"] == ce["metrics"]["accuracy"]   # the pooled model is the only "client"
    assert ce["communication"]["uplink_bytes"] == 0
