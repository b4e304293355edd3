"""Per-client products as a round stage: declared by the method, computed by the loop on its one worker,
cached with the client stage, handed to client_message."""
import time

import torch

from fedbench.algorithms.base import ClientProduct
from fedbench.algorithms.fedavg import FedAvg
from fedbench.fl.cache import ClientStageCache
from fedbench.fl.loop import run_rounds
from fedbench.fl.products import ProductStage
from tests.test_baselines import _setup


class WeightNorm(FedAvg):
    """FedAvg that declares one product per client: the squared norm of the weights its worker holds."""

    def __init__(self, cfg, setup, cacheable=True):
        super().__init__(cfg, setup)
        self.cacheable = cacheable
        self.calls, self.workers, self.received = [], set(), {}

    def client_stage_key(self, round_idx):
        return super().client_stage_key(round_idx) if self.cacheable else None

    def client_products(self, client_id, params, state, round_idx):
        def compute(worker):
            self.calls.append((round_idx, client_id))
            self.workers.add(id(worker))
            held = {n: p.detach() for n, p in worker.named_parameters()}
            assert all(torch.equal(held[n], params[n]) for n in params)   # the client's trained weights
            assert all(p.requires_grad for p in worker.parameters())
            return {"norm2": sum((t.double() ** 2).sum() for t in held.values())}
        return [ClientProduct("weight_norm", {"power": 2}, params, compute, label="norm")]

    def client_message(self, client_id, params, result, pos, state, round_idx, products):
        self.received[(round_idx, client_id)] = products
        return super().client_message(client_id, params, result, pos, state, round_idx, products)


class Recorder(FedAvg):
    """FedAvg (no products) that records what client_message receives."""

    def __init__(self, cfg, setup):
        super().__init__(cfg, setup)
        self.received = []

    def client_message(self, client_id, params, result, pos, state, round_idx, products):
        self.received.append(products)
        return super().client_message(client_id, params, result, pos, state, round_idx, products)


def _init(setup):
    torch.manual_seed(0)
    return {n: p.detach().clone() for n, p in setup.model.named_parameters()}


def _cached_setup(tmp_path):
    s = _setup()
    s.cache = ClientStageCache(tmp_path / "cache")
    s.stage_parts = {"test": "products", "seed": 0}
    return s


def _norm2(params):
    return sum((t.double() ** 2).sum() for t in params.values())


def test_products_computed_once_per_client_per_round_on_one_worker():
    setup = _setup()
    algo = WeightNorm({}, setup)
    seen = {}
    run_rounds(setup, algo, _init(setup), 2, progress=False, on_clients=lambda r, ps: seen.update({r: ps}))
    assert algo.calls == [(r, c) for r in (1, 2) for c in range(3)]
    assert len(algo.workers) == 1                                  # one shared worker for all clients and rounds
    for (r, c), products in algo.received.items():
        assert set(products) == {"norm"}
        assert float(products["norm"]["norm2"]) == float(_norm2(seen[r][c]))


def test_two_aggregators_sharing_a_stage_compute_each_product_once(tmp_path):
    setup = _cached_setup(tmp_path)
    first, second = WeightNorm({}, setup), WeightNorm({"weighting": "uniform"}, setup)
    run_rounds(setup, first, _init(setup), 1, progress=False)
    misses = setup.cache.misses
    _, logs = run_rounds(setup, second, _init(setup), 1, progress=False)
    assert first.calls == [(1, 0), (1, 1), (1, 2)] and second.calls == []     # served from the cache
    assert setup.cache.misses == misses and logs[0].cached_clients
    for c in range(3):
        assert torch.equal(second.received[(1, c)]["norm"]["norm2"], first.received[(1, c)]["norm"]["norm2"])
    # the product key is the stage's key plus the product's own name, client and parts
    key = {**setup.stage_parts, "round": 1, "local_objective": {}, "product": "weight_norm", "client": 2,
           "params": {"power": 2}}
    assert torch.equal(setup.cache.load(key)["norm2"], first.received[(1, 2)]["norm"]["norm2"])


def test_a_method_without_products_gets_none_and_caches_none(tmp_path):
    setup = _cached_setup(tmp_path)
    algo = Recorder({}, setup)
    run_rounds(setup, algo, _init(setup), 1, progress=False)
    assert algo.received == [{}, {}, {}]
    assert setup.cache.misses == 1 and setup.cache.hits == 0       # the local training only
    assert len(list((tmp_path / "cache").rglob("*.pt"))) == 1


def test_a_stage_that_is_not_cacheable_still_computes_its_products(tmp_path):
    setup = _cached_setup(tmp_path)
    for _ in range(2):
        algo = WeightNorm({}, setup, cacheable=False)
        run_rounds(setup, algo, _init(setup), 1, progress=False)
        assert algo.calls == [(1, 0), (1, 1), (1, 2)] and set(algo.received[(1, 0)]) == {"norm"}
    assert setup.cache.misses == 0 and setup.cache.hits == 0


def test_a_product_in_float64_gets_its_own_float64_worker():
    setup = _setup()
    stage = ProductStage(setup)
    params = _init(setup)
    seen = []
    product = ClientProduct("p", None, params, lambda w: seen.append(w) or {}, dtype=torch.float64)

    class Double(FedAvg):
        def client_products(self, client_id, params, state, round_idx):
            return [product]

    stage.compute(Double({}, setup), 0, params, {}, 1)
    assert next(seen[0].parameters()).dtype == torch.float64 and seen[0] is not stage.worker()
    assert next(setup.model.parameters()).dtype == torch.float32    # the template is left alone


def test_products_cached_time_is_served(tmp_path):
    class Slow(FedAvg):
        def client_products(self, client_id, params, state, round_idx):
            return [ClientProduct("slow", {}, params, lambda w: time.sleep(0.05) or {"x": torch.ones(1)})]

    setup = _cached_setup(tmp_path)
    params = _init(setup)
    ProductStage(setup).compute(Slow({}, setup), 0, params, {}, 1, {"stage": 1})
    assert setup.cache.served_s == 0.0
    ProductStage(setup).compute(Slow({}, setup), 0, params, {}, 1, {"stage": 1})
    assert setup.cache.served_s >= 0.05
