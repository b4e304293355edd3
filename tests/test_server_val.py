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
