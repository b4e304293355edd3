"""Per-client products as a round stage: what a method declares (``Algorithm.client_products``) is computed
after local training on one worker model the loop owns, and cached with the round's client stage."""
from __future__ import annotations

import copy
from typing import Any, Dict, Optional

import torch
import torch.nn as nn

from fedbench.algorithms.base import Algorithm, ClientProduct, Message, Params
from fedbench.fl.cache import weights_fingerprint


class ProductStage:
    """One shared worker model per dtype (a copy of the template, every parameter trainable), reused for
    every client, product and round; ``stage`` is the round's cacheable client-stage key (None: not cached)."""

    def __init__(self, setup):
        self.setup = setup
        self._workers: Dict[Optional[torch.dtype], nn.Module] = {}

    def worker(self, dtype: Optional[torch.dtype] = None) -> nn.Module:
        if dtype not in self._workers:
            model = copy.deepcopy(self.setup.model)
            if dtype is not None:
                model = model.to(dtype)
            for p in model.parameters():
                p.requires_grad_(True)   # products differentiate the loss (curvature) at the client's weights
            self._workers[dtype] = model
        return self._workers[dtype]

    def message(self, algo: Algorithm, client_id: int, params, result, pos: int, state: Dict[str, Any],
                round_idx: int, stage: Optional[Dict[str, Any]] = None) -> Message:
        """One client's products, then its ``client_message`` with them (the round loop's step, and the way to
        call ``client_message`` outside a round)."""
        products = self.compute(algo, client_id, params, state, round_idx, stage)
        return algo.client_message(client_id, params, result, pos, state, round_idx, products)

    def compute(self, algo: Algorithm, client_id: int, params, state: Dict[str, Any], round_idx: int,
                stage: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """Every product ``algo`` declares for this client, by key."""
        return {p.key: self._one(p, client_id, stage)
                for p in algo.client_products(client_id, params, state, round_idx)}

    def _one(self, product: ClientProduct, client_id: int, stage: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        def compute():
            return product.compute(self._load(product.dtype, product.at))

        cache = getattr(self.setup, "cache", None)
        if cache is None or not cache.enabled or stage is None or product.parts is None:
            return compute()
        key = {**stage, "product": product.name, "client": int(client_id), "params": product.parts}
        return cache.get_or_compute(key, compute, self.setup.device, fingerprint=weights_fingerprint(product.at))

    def _load(self, dtype: Optional[torch.dtype], at: Params) -> nn.Module:
        model = self.worker(dtype)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(at[n])
        return model
