"""eval.map_reference (FedLap App. D.2): the exact centralised MAP, the per-round distance of a global model's train
NLL to it, the first round within 1 %, and the run-identity / validation rules of the key."""
import math

import pytest
import torch
import torch.nn as nn

from fedbench.algorithms.base import ALGORITHMS
from fedbench.config.validate import check_eval
from fedbench.errors import FedbenchError
from fedbench.fl.map_reference import first_round_within, map_round_metrics, solve_map, train_nll
from fedbench.fl.loop import FLSetup, run_rounds
from fedbench.results.records import compute_run_id
from fedbench.train.config import LocalTrainConfig
from fedbench.train.engine import TrainData

pytestmark = pytest.mark.usefixtures("one_thread")


def _data(n=60, d=3, seed=0):
    """Binary labels drawn from a logistic model: not separable, so the δ = 0 MAP is finite."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    p = torch.sigmoid(x @ torch.tensor([1.0, -0.5, 0.25]) + 0.2)
    return x, (torch.rand(n, generator=g) < p).long()


def _model(d=3):
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(d, 1))


def _newton_map(x, y, delta, iters=50):
    """Independent solve: Newton's method on Σ BCE + (δ/2)||w||² with the explicit Hessian XᵀSX + δI (float64)."""
    X = torch.cat([x.double(), torch.ones(len(x), 1, dtype=torch.float64)], 1)   # [weights..., bias]
    w = torch.zeros(X.shape[1], dtype=torch.float64)
    for _ in range(iters):
        p = torch.sigmoid(X @ w)
        grad = X.T @ (p - y.double()) + delta * w
        hess = X.T @ (X * (p * (1 - p))[:, None]) + delta * torch.eye(X.shape[1], dtype=torch.float64)
        w = w - torch.linalg.solve(hess, grad)
    return w


def _vec(params):
    return torch.cat([params["1.weight"].reshape(-1), params["1.bias"]]).double()


@pytest.mark.parametrize("delta", [0.0, 1.0, 10.0])
def test_solve_map_matches_newton_on_the_sum_scale_objective(delta):
    x, y = _data()
    model = _model()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    got = _vec(solve_map(model, init, x, y, delta))
    want = _newton_map(x, y, delta)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)   # float32 result of a float64 solve
    # the prior precision is on the sum scale: δ = 10 pulls the weights visibly towards 0
    if delta > 0:
        assert float(want.norm()) < float(_newton_map(x, y, 0.0).norm()) - 0.05


def test_round_metrics_are_relative_train_nll_gaps_to_the_map():
    x, y = _data()
    model = _model()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    seen = []
    metrics = map_round_metrics(model, init, x, y, 1.0, "classification",
                                test=lambda p: seen.append(p) or {"nll": 0.5, "accuracy": 70.0})
    w_map = seen[0]
    ref = train_nll(model, w_map, x, y)
    at_map = metrics(w_map)
    assert at_map["train_nll_gap"] == pytest.approx(0.0, abs=1e-12)
    assert at_map["map_train_nll"] == pytest.approx(ref) and at_map["map_test_nll"] == 0.5
    assert at_map["map_accuracy"] == 70.0
    # w = 0 predicts 1/2 everywhere: train NLL = log 2 exactly
    zero = {n: torch.zeros_like(t) for n, t in init.items()}
    m0 = metrics(zero)
    assert m0["train_nll"] == pytest.approx(math.log(2), rel=1e-9)
    assert m0["train_nll_gap"] == pytest.approx(abs(math.log(2) - ref) / ref, rel=1e-9)


def test_first_round_within_one_percent():
    hist = [{"round": 1, "train_nll_gap": 0.3}, {"round": 2, "train_nll_gap": 0.0100001},
            {"round": 3, "train_nll_gap": 0.01}, {"round": 4, "train_nll_gap": 0.02}]
    assert first_round_within(hist) == 3          # the first round at or under 1 %, later rounds do not matter
    assert first_round_within(hist, tol=0.5) == 1
    assert first_round_within(hist[:2]) is None   # never
    assert first_round_within([{"round": 1, "train_nll_gap": float("nan")}]) is None


def test_fedlap_rounds_close_the_gap_to_its_own_map():
    """FedLap's fixed point is the MAP with weight decay δ (fedlap.md §1.4): recorded gaps to that MAP shrink."""
    x, y = _data(n=90)
    model = _model()
    train = TrainData(x, y)
    idx = [torch.arange(0, 30), torch.arange(30, 90)]
    setup = FLSetup(model=model, train=train, test_inputs=train.inputs, test_y=y, client_indices=idx,
                    local=LocalTrainConfig(optimizer="sgd", lr=1.0, batch_size=60, epochs=15), seed=0,
                    device=torch.device("cpu"))
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    setup.round_metrics = map_round_metrics(model, init, x, y, 5.0, "classification",
                                            test=lambda p: {"nll": float("nan")})
    algo = ALGORITHMS.get("fedlap")({"delta": 5.0}, setup)
    _, logs = run_rounds(setup, algo, init, 12, progress=False)
    gaps = [log.metrics["train_nll_gap"] for log in logs]
    assert gaps[-1] < 1e-3 and gaps[-1] < gaps[0] / 10, gaps
    first = first_round_within([{"round": log.round, **log.metrics} for log in logs])
    assert first is not None and gaps[first - 1] <= 0.01 and all(g > 0.01 for g in gaps[:first - 1])


def test_null_map_reference_leaves_run_ids_unchanged_and_bad_values_are_rejected():
    base = {"seed": 0, "eval": {"batch_size": 2048, "last_k": 3}}
    with_null = {"seed": 0, "eval": {"batch_size": 2048, "last_k": 3, "map_reference": None}}
    with_one = {"seed": 0, "eval": {"batch_size": 2048, "last_k": 3, "map_reference": 1.0}}
    assert compute_run_id(with_null) == compute_run_id(base)
    assert compute_run_id(with_one) != compute_run_id(base)
    check_eval({"map_reference": 0.0})
    check_eval({"map_reference": None})
    for bad in (-1.0, "one", float("inf")):
        with pytest.raises(FedbenchError, match="eval.map_reference"):
            check_eval({"map_reference": bad})
