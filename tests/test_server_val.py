"""The server validation set: the released code's with-replacement draw, a clean hold-out, bad input."""
import json

import numpy as np
import pytest

from fedbench.errors import FedbenchError
from fedbench.fl.server_data import ServerValConfig, draw_server_val
from tests.test_run import SMALL, records, run


def test_code_draw_is_numpy_seed3_choice_with_replacement():
    val, keep = draw_server_val(ServerValConfig(size=500), 60_000, run_seed=7)
    np.random.seed(3)                         # what both papers' code does (fedfisher.md §1.6)
    assert np.array_equal(val, np.random.choice(60_000, 500)) and keep is None
    same, _ = draw_server_val(ServerValConfig(size=500), 60_000, run_seed=8)
    assert np.array_equal(val, same)          # fixed across run seeds
    per_seed, _ = draw_server_val(ServerValConfig(size=500, seed=None), 60_000, run_seed=8)
    assert not np.array_equal(val, per_seed)


def test_holdout_is_disjoint_and_complete():
    val, keep = draw_server_val(ServerValConfig(size=50, mode="holdout"), 300, run_seed=0)
    assert len(set(val.tolist())) == 50 and len(keep) == 250
    assert sorted(val.tolist() + keep.tolist()) == list(range(300))
    assert draw_server_val(ServerValConfig(size=0), 300, 0) == (None, None)


@pytest.mark.parametrize("cfg, needle", [({"size": -1}, "size"), ({"size": 5, "mode": "test"}, "mode"),
                                         ({"sise": 5}, "unknown"), ({"seed": "x"}, "seed")])
def test_bad_config(cfg, needle):
    with pytest.raises(FedbenchError, match=needle):
        ServerValConfig.from_cfg(cfg)


def test_holdout_removes_samples_from_clients(tmp_path):
    run(SMALL + ["rounds=1", "server_val.size=60", "server_val.mode=holdout"], tmp_path)
    (rec,) = [json.loads(p.read_text()) for p in records(tmp_path)]
    assert sum(rec["partition"]["client_sizes"]) == 600 - 60
    p = run(SMALL + ["rounds=1", "server_val.mode=nope"], tmp_path, expect=2)
    assert "server_val.mode" in p.stderr and len(p.stderr.strip().splitlines()) == 1


# --- the unlabelled server set (FedBE / FedOV distillation data) -------------------------------------------
from fedbench.fl.server_data import ServerUnlabeledConfig, draw_server_unlabeled  # noqa: E402


def test_unlabeled_holdout_is_disjoint_from_validation_and_clients():
    val, keep = draw_server_val(ServerValConfig(size=50, mode="holdout"), 300, run_seed=0)
    unl, keep2 = draw_server_unlabeled(ServerUnlabeledConfig(size=40), 300, keep, run_seed=0)
    assert len(unl) == 40 and len(keep2) == 210
    assert not set(unl) & set(val) and not set(unl) & set(keep2)
    assert sorted(val.tolist() + unl.tolist() + keep2.tolist()) == list(range(300))


def test_unlabeled_sampled_from_train_leaves_the_clients_data_alone():
    unl, keep = draw_server_unlabeled(ServerUnlabeledConfig(size=40, mode="sampled_from_train"), 300, None, 1)
    assert keep is None and len(set(unl.tolist())) == 40      # without replacement
    again, _ = draw_server_unlabeled(ServerUnlabeledConfig(size=40, mode="sampled_from_train"), 300, None, 1)
    other, _ = draw_server_unlabeled(ServerUnlabeledConfig(size=40, mode="sampled_from_train"), 300, None, 2)
    assert np.array_equal(unl, again) and not np.array_equal(unl, other)   # seed null = the run seed
    assert draw_server_unlabeled(ServerUnlabeledConfig(size=0), 300, None, 0) == (None, None)


@pytest.mark.parametrize("cfg, needle", [({"size": -3}, "size"), ({"size": 5, "mode": "with_replacement"}, "mode"),
                                         ({"n": 5}, "unknown"), ({"seed": 1.5}, "seed")])
def test_unlabeled_bad_config(cfg, needle):
    with pytest.raises(FedbenchError, match=needle):
        ServerUnlabeledConfig.from_cfg(cfg)
    with pytest.raises(FedbenchError, match="leaves no training data"):
        draw_server_unlabeled(ServerUnlabeledConfig(size=300), 300, None, 0)


def test_unlabeled_holdout_in_a_run_and_identity(tmp_path):
    from omegaconf import OmegaConf
    from fedbench.results.records import compute_run_id
    run(SMALL + ["rounds=1", "server_unlabeled.size=60"], tmp_path)
    (rec,) = [json.loads(p.read_text()) for p in records(tmp_path)]
    assert sum(rec["partition"]["client_sizes"]) == 600 - 60
    # switched off, the block does not enter the run id (records written before it existed keep their ids)
    base = OmegaConf.create({"seed": 0, "rounds": 1})
    off = OmegaConf.merge(base, {"server_unlabeled": {"size": 0, "mode": "holdout", "seed": None}})
    on = OmegaConf.merge(base, {"server_unlabeled": {"size": 5, "mode": "holdout", "seed": None}})
    assert compute_run_id(off) == compute_run_id(base) != compute_run_id(on)
    p = run(SMALL + ["rounds=1", "server_unlabeled.mode=nope"], tmp_path, expect=2)
    assert "server_unlabeled.mode" in p.stderr and len(p.stderr.strip().splitlines()) == 1
