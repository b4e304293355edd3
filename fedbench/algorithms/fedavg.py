"""FedAvg (McMahan et al. 2017): data-size weighted average of the client weights."""
from __future__ import annotations

from fedbench.algorithms.base import ALGORITHMS, Algorithm, weighted_average
from fedbench.algorithms.common import raw_weights
from fedbench.errors import FedbenchError


@ALGORITHMS.register("fedavg")
class FedAvg(Algorithm):
    name = "fedavg"
    WEIGHTINGS = ("num_samples", "uniform")

    def __init__(self, cfg, setup):
        super().__init__(cfg, setup)
        self.weighting = self.cfg.get("weighting", "num_samples")
        if self.weighting not in self.WEIGHTINGS:
            raise FedbenchError(f"algorithm.weighting must be one of {self.WEIGHTINGS}, got '{self.weighting}'")

    def client_stage_key(self, round_idx):
        return {} if round_idx == 1 else None   # plain local training from the shared initialisation

    def aggregate(self, messages, state, round_idx):
        weights = raw_weights([m.num_samples for m in messages], self.weighting)
        return {**state, "params": weighted_average([m.payload["params"] for m in messages], weights)}
