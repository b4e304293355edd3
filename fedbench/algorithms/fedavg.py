"""FedAvg (McMahan et al. 2017): data-size weighted average of the client weights."""
from __future__ import annotations

from dataclasses import dataclass

from fedbench.algorithms.base import ALGORITHMS, Algorithm, weighted_average
from fedbench.algorithms.common import WEIGHTINGS, raw_weights
from fedbench.algorithms.options import option, read_options


@dataclass(frozen=True)
class FedAvgOptions:
    weighting: str = option(choices=WEIGHTINGS)


@ALGORITHMS.register("fedavg")
class FedAvg(Algorithm):
    name = "fedavg"
    resumable = True   # all cross-round memory is in the state dict (tests/test_resume.py)
    Options = FedAvgOptions

    def __init__(self, cfg, setup):
        super().__init__(cfg, setup)
        self.opts = read_options(self.Options, cfg, self.name)
        self.weighting = self.opts.weighting

    def client_stage_key(self, round_idx):
        return {} if round_idx == 1 else None   # plain local training from the shared initialisation

    def aggregate(self, messages, state, round_idx):
        weights = raw_weights([m.num_samples for m in messages], self.weighting)
        return {**state, "params": weighted_average([m.payload["params"] for m in messages], weights)}
