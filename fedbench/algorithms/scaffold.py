"""SCAFFOLD (Karimireddy et al. 2020), option II control variates.

Client k trains with its updates corrected by (c - c_k), then sets
c_k+ = c_k - c + (theta_g - theta_k) / (tau_k * lr) and uploads the model and the control-variate
change (twice the model's bytes). Where the correction enters is ``correction``: ``gradient`` (the paper's
y <- y - lr (g - c_k + c), a linear loss term, so with a momentum optimiser it goes through the momentum, weight
decay and clipping like the gradient) or ``after_step`` (NIID-Bench's released code, which FedLPA ran: plain
optimiser steps, each followed by theta <- theta - lr (c - c_k) outside the optimiser; results/gaps.md
#fedlpa-figure2). Server: p-weighted model average (NIID-Bench, no server lr;
fedlpa.md §2) and c += mean_k (c_k+ - c_k) (full participation). In round 1 all control variates
are zero, so one-shot SCAFFOLD trains exactly like FedAvg (fedlpa.md §0).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fedbench.algorithms.base import ALGORITHMS, Algorithm, Message, weighted_average
from fedbench.algorithms.options import option, read_options
from fedbench.train.engine import LocalObjective
from fedbench.train.terms import LinearTerm


CORRECTIONS = ("gradient", "after_step")


@dataclass(frozen=True)
class ScaffoldOptions:
    correction: str = option(choices=CORRECTIONS)


class AfterStepCorrection:
    """Step hook: after each optimiser step, theta_k <- theta_k - lr (c - c_k) (the released code's update)."""

    def __init__(self, shifts: dict):
        self.shifts = shifts   # client id -> {name: -lr (c - c_k)}
        self._stacked: dict = {}   # client ids -> their shifts stacked (the batched engine asks for the same sets)

    def after_step(self, client_ids):
        key = tuple(client_ids)
        if key not in self._stacked:
            names = self.shifts[key[0]]
            self._stacked[key] = {n: torch.stack([self.shifts[k][n] for k in key]) for n in names}
        return self._stacked[key]


@ALGORITHMS.register("scaffold")
class Scaffold(Algorithm):
    name = "scaffold"
    resumable = True   # all cross-round memory is in the state dict (tests/test_resume.py)
    Options = ScaffoldOptions

    def __init__(self, cfg, setup):
        super().__init__(cfg, setup)
        self.correction = read_options(self.Options, cfg, self.name).correction

    def init_state(self, params):
        zeros = {n: torch.zeros_like(t) for n, t in params.items()}
        k = self.setup.num_clients
        return {"params": params, "c": zeros, "c_clients": [dict(zeros) for _ in range(k)]}

    def client_stage_key(self, round_idx):
        return {} if round_idx == 1 else None   # control variates are zero in round 1: plain training

    def downlink(self, state):
        return {"params": state["params"], "c": state["c"]}

    def local_objective(self, state, client_ids, round_idx):
        c = state["c"]
        diff = {k: {n: c[n] - state["c_clients"][k][n] for n in c} for k in client_ids}
        if self.correction == "after_step":
            lr = self.setup.local.lr
            return LocalObjective(step_hooks=[AfterStepCorrection(
                {k: {n: -lr * d for n, d in dk.items()} for k, dk in diff.items()})])
        return LocalObjective(terms=[LinearTerm(1.0)], client_ctx=[{"linear": diff[k]} for k in client_ids])

    def client_message(self, client_id, params, result, pos, state, round_idx, products):
        tau = result.steps[pos]
        lr = self.setup.local.lr
        c, ck = state["c"], state["c_clients"][client_id]
        if tau > 0:
            ck_new = {n: ck[n] - c[n] + (state["params"][n] - params[n]) / (tau * lr) for n in c}
        else:
            ck_new = dict(ck)
        delta_c = {n: ck_new[n] - ck[n] for n in c}
        n = len(self.setup.client_indices[client_id])
        return Message(client_id, n, {"params": params, "delta_c": delta_c},
                       {"steps": tau, "train_loss": result.mean_loss[pos], "c_new": ck_new})

    def aggregate(self, messages, state, round_idx):
        params = weighted_average([m.payload["params"] for m in messages], [m.num_samples for m in messages])
        c_clients = list(state["c_clients"])
        for m in messages:
            c_clients[m.client_id] = m.info["c_new"]
        k = len(messages)
        c = {n: state["c"][n] + sum(m.payload["delta_c"][n] for m in messages) / k for n in state["c"]}
        return {"params": params, "c": c, "c_clients": c_clients}
