"""Accuracy, NLL and ECE of a model or of an ensemble (averaged softmax), on device tensors."""
from __future__ import annotations

import math
from typing import Dict, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

Params = Dict[str, Tensor]


@torch.no_grad()
def predict_proba(model: nn.Module, params: Params | Sequence[Params], inputs, n: int,
                  batch_size: int = 2048, task: str = "classification") -> Tensor:
    """Predictive probabilities [n, C] (or predictions [n] for regression).

    ``params`` may be one weight dict, a list (an ensemble: softmax averaged over members) or a callable
    predictor that maps an input batch to its probabilities [B, C] (a method's own rule, e.g. FedOV's vote).
    ``inputs(idx)`` returns the model input for sample indices ``idx`` (normalised floats).
    """
    if callable(params):
        return torch.cat([params(inputs(torch.arange(s, min(n, s + batch_size)))).double()
                          for s in range(0, n, batch_size)])
    members = [params] if isinstance(params, dict) else list(params)
    was_training = model.training
    model.eval()
    out = []
    try:
        for start in range(0, n, batch_size):
            idx = torch.arange(start, min(n, start + batch_size))
            x = inputs(idx)
            acc = None
            for p in members:
                logits = torch.func.functional_call(model, p, (x,))
                if task == "regression":
                    pr = logits.reshape(len(idx))
                elif logits.shape[-1] == 1:
                    q = torch.sigmoid(logits.squeeze(-1).double())
                    pr = torch.stack([1 - q, q], dim=-1)
                else:
                    pr = F.softmax(logits.double(), dim=-1)
                acc = pr if acc is None else acc + pr
            out.append(acc / len(members))
    finally:
        model.train(was_training)
    return torch.cat(out)


def classification_metrics(probs: Tensor, labels: Tensor, n_bins: int = 15) -> Dict[str, float]:
    """Top-1 accuracy (%), mean NLL (nats) and expected calibration error (%, equal-width bins)."""
    labels = labels.to(probs.device).long()
    conf, pred = probs.max(dim=-1)
    correct = (pred == labels).double()
    p_true = probs.gather(1, labels[:, None]).squeeze(1).clamp_min(1e-12)
    nll = float(-p_true.log().mean())
    return {
        "accuracy": 100.0 * float(correct.mean()),
        "nll": nll,
        "ece": 100.0 * expected_calibration_error(conf, correct, n_bins),
    }


def expected_calibration_error(conf: Tensor, correct: Tensor, n_bins: int = 15) -> float:
    """sum_b |B_b|/n * |acc(B_b) - conf(B_b)| with bins (i/n_bins, (i+1)/n_bins]."""
    conf = conf.double()
    bins = torch.clamp(torch.ceil(conf * n_bins).long() - 1, 0, n_bins - 1)
    n = conf.numel()
    counts = torch.zeros(n_bins, dtype=torch.float64, device=conf.device).index_add_(0, bins, torch.ones_like(conf))
    conf_sum = torch.zeros_like(counts).index_add_(0, bins, conf)
    acc_sum = torch.zeros_like(counts).index_add_(0, bins, correct.double())
    return float((conf_sum - acc_sum).abs().sum() / n)


def regression_metrics(pred: Tensor, target: Tensor) -> Dict[str, float]:
    err = pred.double() - target.to(pred.device).double()
    mse = float((err ** 2).mean())
    # Gaussian NLL with unit noise, matching the 1/2 squared-error training loss
    return {"mse": mse, "nll": 0.5 * mse + 0.5 * math.log(2 * math.pi)}


def evaluate(model: nn.Module, params, inputs, labels: Tensor, *, task: str = "classification",
             batch_size: int = 2048, n_bins: int = 15) -> Dict[str, float]:
    probs = predict_proba(model, params, inputs, len(labels), batch_size, task)
    if task == "regression":
        return regression_metrics(probs, labels)
    return classification_metrics(probs, labels, n_bins)
