import math

import torch
import torch.nn as nn

from fedbench.eval.metrics import classification_metrics, evaluate, expected_calibration_error


def test_ece_by_hand():
    conf = torch.tensor([0.95, 0.95, 0.55, 0.55, 0.30], dtype=torch.float64)
    correct = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0])
    # bins (15 equal): 0.95 -> bin 14, 0.55 -> bin 8, 0.30 -> bin 4
    want = (2 * abs(0.5 - 0.95) + 2 * abs(1.0 - 0.55) + 1 * abs(0.0 - 0.30)) / 5
    assert math.isclose(expected_calibration_error(conf, correct, 15), want, rel_tol=1e-9)


def test_metrics_by_hand():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6], [0.5, 0.4, 0.1]], dtype=torch.float64)
    labels = torch.tensor([0, 1, 1])
    m = classification_metrics(probs, labels)
    assert math.isclose(m["accuracy"], 100 / 3)
    assert math.isclose(m["nll"], -(math.log(0.7) + math.log(0.3) + math.log(0.4)) / 3)


def test_ensemble_averages_softmax_and_binary_head():
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    x = torch.randn(10, 4)
    y = torch.randint(0, 3, (10,))
    p1 = {n: torch.randn_like(p) for n, p in lin.named_parameters()}
    p2 = {n: torch.randn_like(p) for n, p in lin.named_parameters()}
    got = evaluate(lin, [p1, p2], lambda i: x[i], y, batch_size=3)
    probs = (torch.func.functional_call(lin, p1, (x,)).double().softmax(-1)
             + torch.func.functional_call(lin, p2, (x,)).double().softmax(-1)) / 2
    assert math.isclose(got["nll"], float(-probs[torch.arange(10), y].log().mean()), rel_tol=1e-9)
    # one logit = binary logistic model
    lin1 = nn.Linear(4, 1)
    yb = torch.randint(0, 2, (10,))
    m = evaluate(lin1, dict(lin1.named_parameters()), lambda i: x[i], yb)
    q = torch.sigmoid(lin1(x).squeeze(-1)).detach().double()
    acc = float(((q > 0.5).long() == yb).double().mean()) * 100
    assert math.isclose(m["accuracy"], acc)
