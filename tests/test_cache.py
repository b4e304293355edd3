"""Client-stage cache: reuse across aggregators, atomic entries, corrupt entries recomputed."""
import torch

from fedbench.algorithms import build_algorithm
from fedbench.fl.cache import ClientStageCache, cache_key
from fedbench.fl.loop import run_rounds
from tests.test_baselines import _setup


def _run(setup, cfg):
    torch.manual_seed(0)
    init = {n: p.detach().clone() for n, p in setup.model.named_parameters()}
    return run_rounds(setup, build_algorithm(cfg, setup), init, 1, progress=False)


def _cached_setup(tmp_path):
    s = _setup()
    s.cache = ClientStageCache(tmp_path / "cache")
    s.stage_parts = {"test": "toy", "seed": 0}
    return s


def test_aggregators_share_one_trained_stage(tmp_path):
    s = _cached_setup(tmp_path)
    st_avg, logs = _run(s, {"name": "fedavg"})
    assert not logs[0].cached_clients and s.cache.misses == 1
    trained_s = logs[0].client_train_compute_s
    assert trained_s > 0
    st_nova, logs = _run(s, {"name": "fednova"})
    assert logs[0].cached_clients and s.cache.hits == 1
    # a cache hit still reports what the training cost when it ran
    assert logs[0].client_train_compute_s == trained_s
    _, logs = _run(s, {"name": "scaffold"})
    assert logs[0].cached_clients
    # FedProx with mu > 0 trains differently: its own entry
    _, logs = _run(s, {"name": "fedprox", "mu": 0.5})
    assert not logs[0].cached_clients
    # the cached stage gives exactly the weights a fresh training gives
    other = _setup()
    other.model.load_state_dict(s.model.state_dict())  # same initialisation (the runner seeds it)
    fresh, _ = _run(other, {"name": "fedavg"})
    again, _ = _run(s, {"name": "fedavg"})
    for n in fresh["params"]:
        torch.testing.assert_close(again["params"][n], fresh["params"][n], rtol=0, atol=0)


def test_corrupt_or_mismatched_entry_is_recomputed(tmp_path, capsys):
    cache = ClientStageCache(tmp_path)
    parts = {"a": 1}
    calls = []
    compute = lambda: calls.append(1) or {"x": torch.ones(3)}  # noqa: E731
    cache.get_or_compute(parts, compute)
    path = cache.path(cache_key(parts))
    path.write_bytes(path.read_bytes()[:20])  # torn file
    out = cache.get_or_compute(parts, compute)
    assert len(calls) == 2 and torch.equal(out["x"], torch.ones(3))
    assert "unusable" in capsys.readouterr().err
    # an entry written under another key is never used for this one
    torch.save({"key": cache_key(parts), "parts": '{"a": 2}', "payload": {"x": torch.zeros(3)}}, path)
    assert torch.equal(cache.get_or_compute(parts, compute)["x"], torch.ones(3)) and len(calls) == 3
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp files left behind


def test_products_served_from_the_cache_keep_their_compute_time(tmp_path):
    # through the loop: FedLPA's CG and GD solvers share the cached K-FAC factors; the second run's
    # client_post_s is only the load, but client_post_compute_s still carries the factor pass
    s = _cached_setup(tmp_path / "loop")
    _, first = _run(s, {"name": "fedlpa", "solver": "cg"})
    _, second = _run(s, {"name": "fedlpa", "solver": "ea"})
    assert second[0].cached_clients
    computed = first[0].client_post_compute_s
    assert computed == first[0].client_post_s > 0
    # what the second run adds is the factor passes' own times, which were part of the first run's client_post_s
    served = second[0].client_post_compute_s - second[0].client_post_s
    assert 0 < served <= computed


def test_product_computed_at_other_weights_is_recomputed(tmp_path, capsys):
    """A product entry records the weights it was computed at: one keyed like it but asked for at other weights (the
    FedBEns Table 7 defect: perturbed replicas keyed like reset members) is recomputed, with a warning, not served."""
    from fedbench.algorithms.base import ClientProduct
    from fedbench.fl.cache import weights_fingerprint
    from fedbench.fl.products import ProductStage

    for memory in (False, True):
        s = _cached_setup(tmp_path / f"m{memory}")
        if memory:
            s.cache = ClientStageCache(None, memory={})
        stage = ProductStage(s)
        names = [n for n, _ in s.model.named_parameters()]
        w0 = {n: p.detach().clone() for n, p in s.model.named_parameters()}
        w1 = {n: t + 0.5 for n, t in w0.items()}
        norm = lambda worker: {"norm": sum(p.detach().pow(2).sum() for p in worker.parameters())}  # noqa: E731
        at = lambda w: ClientProduct("toy_norm", {"member": 1}, w, norm)  # noqa: E731
        st = {"test": "toy"}
        a = stage._one(at(w0), 0, st)
        b = stage._one(at(w1), 0, st)   # same key, other weights
        assert s.cache.misses == 2 and not torch.equal(a["norm"], b["norm"])
        assert torch.equal(stage._one(at(w1), 0, st)["norm"], b["norm"]) and s.cache.hits == 1
        if not memory:
            assert "other weights" in capsys.readouterr().err
    assert weights_fingerprint(w0) == weights_fingerprint({n: w0[n].clone() for n in reversed(names)})
    assert weights_fingerprint(w0) != weights_fingerprint(w1)


def test_budget_evicts_least_recently_used_entries(tmp_path, capsys):
    """cache_max_gb: after a save the oldest-used entries go until the cache fits; a load marks an entry used."""
    import os

    payload = {"w": torch.zeros(25_000)}   # about 100 kB an entry
    probe = ClientStageCache(tmp_path / "probe")
    probe.save({"k": 0}, payload)
    size = probe.path(cache_key({"k": 0})).stat().st_size
    c = ClientStageCache(tmp_path / "c", max_bytes=int(3.5 * size))
    for k in range(3):
        c.save({"k": k}, payload)
        os.utime(c.path(cache_key({"k": k})), (1000 + k, 1000 + k))   # distinct, increasing use times
    assert c.load({"k": 0}) is not None          # entry 0 is now the most recently used
    c.save({"k": 3}, payload)                    # 4 entries > 3.5: the least recently used (entry 1) goes
    left = {k for k in range(4) if c.path(cache_key({"k": k})).exists()}
    assert left == {0, 2, 3}
    assert c._bytes == 3 * size   # the running tally is the scanned size after eviction
    assert "removed the 1 least recently used entry" in capsys.readouterr().err
    # without a budget nothing is removed
    c.max_bytes = None
    c.save({"k": 4}, payload)
    assert all(c.path(cache_key({"k": k})).exists() for k in (0, 2, 3, 4))
    # a budget below one entry keeps the entry just written
    c.max_bytes = 1
    c.save({"k": 5}, payload)
    assert [k for k in range(6) if c.path(cache_key({"k": k})).exists()] == [5]


def _die_after_the_first_client(monkeypatch):
    """The process is killed just after the stage's first client is stored (a session's end in a long stage)."""
    from fedbench.fl import cache as cache_mod
    real_save = cache_mod.ClientProgress.save

    def save_then_die(self, i, header, client):
        real_save(self, i, header, client)
        raise KeyboardInterrupt
    monkeypatch.setattr(cache_mod.ClientProgress, "save", save_then_die)
    return lambda: monkeypatch.setattr(cache_mod.ClientProgress, "save", real_save)


def test_a_stage_killed_after_a_client_goes_on_from_it_through_the_cache(tmp_path, monkeypatch, capsys):
    """The process dies after the first client of the stage finished (as at a session's end in a 200-epoch stage):
    the next run of the same stage trains only the others, stores the entry, removes the finished clients' folder,
    and its weights equal an uninterrupted training's bit for bit."""
    import pytest

    s = _cached_setup(tmp_path)
    assert len(s.client_indices) >= 2
    revive = _die_after_the_first_client(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        _run(s, {"name": "fedavg"})
    (folder,) = (tmp_path / "cache").glob("*/*.clients")
    assert [p.name for p in folder.glob("*.pt")] == ["0.pt"]
    revive()
    resumed, logs = _run(s, {"name": "fedavg"})
    assert "client stage resumes" in capsys.readouterr().err and not logs[0].cached_clients
    assert not folder.exists() and len(list((tmp_path / "cache").glob("*/*.pt"))) == 1   # the entry alone
    other = _setup()
    other.model.load_state_dict(s.model.state_dict())
    fresh, _ = _run(other, {"name": "fedavg"})
    for n in fresh["params"]:
        assert torch.equal(resumed["params"][n], fresh["params"][n])


def test_a_parked_stage_goes_on_on_a_fresh_machine(tmp_path, monkeypatch, capsys):
    """The session ends after client 0 of a stage; park_stages copies its finished client into the committed store;
    a fresh machine (an empty cache) takes client 0 from there and trains the rest, bit for bit one training; parking
    there removes the parked stage, whose entry now exists."""
    import pytest
    from fedbench.fl import cache as cache_mod

    store = tmp_path / "checkpoints"
    monkeypatch.setenv("FEDBENCH_CHECKPOINTS", str(store))
    old = _cached_setup(tmp_path / "old")
    revive = _die_after_the_first_client(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        _run(old, {"name": "fedavg"})
    revive()
    done = cache_mod.park_stages(tmp_path / "old" / "cache", store)
    (key,) = [p.name for p in (store / "stages").iterdir()]
    assert done == {"parked": [f"{key} (1 client(s))"], "entries": [], "removed": []}
    new = _cached_setup(tmp_path / "new")
    new.model.load_state_dict(old.model.state_dict())
    resumed, _ = _run(new, {"name": "fedavg"})
    assert "client stage resumes" in capsys.readouterr().err
    fresh_setup = _setup()
    fresh_setup.model.load_state_dict(old.model.state_dict())
    fresh, _ = _run(fresh_setup, {"name": "fedavg"})
    assert all(torch.equal(resumed["params"][n], fresh["params"][n]) for n in fresh["params"])
    assert cache_mod.park_stages(tmp_path / "new" / "cache", store) == {"parked": [], "entries": [], "removed": [key]}
    assert not (store / "stages" / key).exists()
