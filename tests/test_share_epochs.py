"""share_epochs: one training of max(E) epochs serves a sweep over local.epochs, bit for bit each E's own training
(weights, steps, losses and FOLA's online Fisher), through the client-stage cache."""
import dataclasses
import json

import pytest
import torch

from fedbench.algorithms.base import ALGORITHMS
from fedbench.config.validate import check_share_epochs, check_top_level
from fedbench.errors import FedbenchError
from fedbench.fl.cache import ClientStageCache
from fedbench.fl.loop import run_rounds
from fedbench.results.records import compute_run_id
from fedbench.train.engine import LocalObjective, train_clients
from tests.test_fola import _init, _setup
from tests.test_run import SMALL, records, run


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def _objective(setup, algo_cfg):
    if algo_cfg is None:
        return lambda: LocalObjective()
    algo = ALGORITHMS.get("fola")(algo_cfg, setup)
    init = _init(setup)
    return lambda: algo.local_objective(algo.init_state(init), [0, 1], 1)


@pytest.mark.parametrize("backend", ["serial", "batched"])
@pytest.mark.parametrize("fola", [None, {"fisher": {"grad": "per_sample_sq", "normalize": "steps"}},
                                  {"fisher": {"grad": "minibatch_sq", "normalize": "none"}}])
def test_snapshots_are_the_shorter_trainings_bit_for_bit(backend, fola):
    setup = _setup(backend=backend, momentum=0.5, clip=0.3, epochs=4)
    init = _init(setup)
    objective = _objective(setup, fola)
    kw = dict(seed=setup.seed, round_idx=1, backend=backend)
    long = train_clients(setup.model, setup.train, setup.client_indices, init, setup.local, objective=objective(),
                         snapshot_epochs=[1, 3], **kw)
    assert sorted(long.snapshots) == [1, 3]
    for e in (1, 3):
        own = train_clients(setup.model, setup.train, setup.client_indices, init,
                            dataclasses.replace(setup.local, epochs=e), objective=objective(), **kw)
        snap = long.snapshots[e]
        assert all(_equal(p, q) for p, q in zip(snap.params, own.params))
        assert snap.steps == own.steps and snap.mean_loss == own.mean_loss
        assert snap.extras.keys() == own.extras.keys() == ({"online_fisher"} if fola else set())
        for key in own.extras:
            assert all(_equal(p, q) for p, q in zip(snap.extras[key], own.extras[key]))
        assert 0 < snap.seconds
        # and the snapshot is not the end of the long training
        assert not all(_equal(p, q) for p, q in zip(snap.params, long.params))


def test_snapshot_epochs_must_lie_below_the_training_length():
    setup = _setup(epochs=2)
    with pytest.raises(FedbenchError, match="snapshot epochs"):
        train_clients(setup.model, setup.train, setup.client_indices, _init(setup), setup.local, snapshot_epochs=[2])


def _run(tmp_path, epochs, algo_cfg, share=(), cache=True):
    setup = _setup(epochs=epochs)
    if cache:
        setup.cache = ClientStageCache(tmp_path / "cache")
        setup.stage_parts = {"test": "share", "seed": setup.seed, "local": dataclasses.asdict(setup.local)}
    setup.share_epochs = tuple(share)
    algo = ALGORITHMS.get(algo_cfg["name"])(algo_cfg, setup)
    state, logs = run_rounds(setup, algo, _init(setup), 1, progress=False)
    return state, logs, setup


@pytest.mark.parametrize("algo_cfg", [{"name": "fedavg"},
                                      {"name": "fola", "fisher": {"grad": "per_sample_sq", "normalize": "steps"}},
                                      {"name": "fola", "fisher": {"mode": "offline", "grad": "per_sample_sq"}}])
def test_a_shared_sweep_gives_each_runs_own_result(tmp_path, algo_cfg):
    share = (1, 2, 3)
    offline = algo_cfg.get("fisher", {}).get("mode") == "offline"   # + one Fisher pass per client, at its own E
    first, logs, setup = _run(tmp_path, 2, algo_cfg, share)   # trains 3 epochs once, stores E = 1, 2, 3
    assert not logs[0].cached_clients and setup.cache.misses == 1 + 2 * offline
    for e in share:
        state, logs, setup = _run(tmp_path, e, algo_cfg, share)
        want, _, _ = _run(tmp_path, e, algo_cfg, cache=False)   # trained alone, no cache
        assert _equal(state["params"], want["params"])
        if "precision" in want:   # FOLA: the Fisher (online: the hook's, from the shared training) agrees too
            assert _equal(state["precision"], want["precision"])
        assert logs[0].cached_clients   # the training (FOLA-offline's Fisher pass at E != 2 is computed then)
        assert setup.cache.misses == (2 if offline and e != 2 else 0)


def test_fola_online_round_one_is_cached_with_its_fisher_and_serves_fedavg(tmp_path):
    cfg = {"name": "fola", "lambda_prior": 10.0, "fisher": {"grad": "per_sample_sq", "normalize": "none"}}
    s1, logs1, setup = _run(tmp_path, 2, cfg, share=(1, 2, 3))
    assert not logs1[0].cached_clients
    s2, logs2, setup = _run(tmp_path, 2, {**cfg, "lambda_prior": 1.0})   # lambda is inactive in round 1
    assert logs2[0].cached_clients and _equal(s1["precision"], s2["precision"]) and _equal(s1["params"], s2["params"])
    # the hook only observed: FOLA's stage is also the plain stage, at every shared E, equal to FedAvg's own training
    for e in (1, 2, 3):
        got, logs3, setup = _run(tmp_path, e, {"name": "fedavg"})
        want, _, _ = _run(tmp_path, e, {"name": "fedavg"}, cache=False)
        assert logs3[0].cached_clients and setup.cache.misses == 0 and _equal(got["params"], want["params"])
    # a live prior in round 1 (prior_init_precision > 0) is not plain training: its own stage, not cached
    live = {**cfg, "prior_init_precision": 1.0}
    _, logs4, setup = _run(tmp_path, 2, live)
    assert not logs4[0].cached_clients and setup.cache.misses == 0
    assert not ALGORITHMS.get("fola")(live, setup).plain_training(1)


def test_a_method_training_its_own_clients_does_not_share(tmp_path):
    """centralized trains its pooled client itself (local_train): share_epochs leaves it alone, same result."""
    got, logs, setup = _run(tmp_path, 2, {"name": "centralized"}, share=(1, 2, 3))
    want, _, _ = _run(tmp_path, 2, {"name": "centralized"}, cache=False)
    assert _equal(got["params"], want["params"]) and not logs[0].cached_clients and setup.cache.misses == 1


def test_share_epochs_validation_and_run_id():
    check_share_epochs({"share_epochs": [1, 5, 20]})
    check_share_epochs({"share_epochs": []})
    for bad in ([0, 5], [5, 5], "5", [1.5], [True]):
        with pytest.raises(FedbenchError, match="share_epochs"):
            check_share_epochs({"share_epochs": bad})
    with pytest.raises(FedbenchError, match="cache=true"):
        check_share_epochs({"share_epochs": [1, 2], "cache": False})
    check_top_level({"seed": 0, "num_clients": 1, "rounds": 1, "cache_max_gb": 20})
    with pytest.raises(FedbenchError, match="cache_max_gb"):
        check_top_level({"seed": 0, "num_clients": 1, "rounds": 1, "cache_max_gb": 0})
    base = {"seed": 0, "local": {"epochs": 5}, "algorithm": {"name": "fedavg"}}
    assert compute_run_id(base) == compute_run_id({**base, "share_epochs": [1, 5, 20], "cache_max_gb": 20})


def test_run_py_sweep_shares_round_one(tmp_path):
    """Through run.py: the E = 1 run trains 2 epochs once; the E = 2 run is served from the cache and its record
    equals the one a run without sharing writes."""
    args = SMALL + ["rounds=1", "share_epochs=[1,2]"]
    run(args + ["local.epochs=1"], tmp_path)
    run(args + ["local.epochs=2"], tmp_path)
    recs = {json.loads(p.read_text())["config"]["local"]["epochs"]: json.loads(p.read_text())
            for p in records(tmp_path)}
    assert recs[1]["cache"]["misses"] >= 1 and recs[2]["cache"]["hits"] >= 1 and recs[2]["cache"]["misses"] == 0
    alone = tmp_path / "alone"
    run(SMALL + ["rounds=1", "local.epochs=2"], alone)
    (rec,) = [json.loads(p.read_text()) for p in records(alone)]
    assert rec["run_id"] == recs[2]["run_id"] and rec["metrics"] == recs[2]["metrics"]
    p = run(SMALL + ["share_epochs=[0,2]"], tmp_path, expect=2)
    assert "share_epochs" in p.stderr and len(p.stderr.strip().splitlines()) == 1
