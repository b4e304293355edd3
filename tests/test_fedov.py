"""FedOV (fedbench/algorithms/fedov.py; notes/fedlpa.md §2, §4 Table 11): the open-set vote against hand computations,
outlier generation, adversarial enhancement, the C+1-class model, the loop hook, config errors, run.py end to end."""
import math

import pytest
import torch
import torch.nn as nn

from fedbench.algorithms import fedov as V
from fedbench.algorithms.base import ALGORITHMS
from fedbench.errors import FedbenchError
from fedbench.eval.metrics import classification_metrics, evaluate
from fedbench.fl.loop import FLSetup, run_rounds
from fedbench.models import build_model, count_parameters
from fedbench.train.config import LocalTrainConfig
from fedbench.train.engine import TrainData
from tests.test_run import SMALL, records, run

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------------
# the vote
# ------------------------------------------------------------------------------------------------
def _p(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_soft_vote_matches_hand_sum_and_ignores_a_certain_unknown_client():
    # 3 clients, 1 sample, C = 3 (+ unknown): client 2 is certain the sample is unknown
    probs = torch.stack([_p([0.5, 0.2, 0.1, 0.2]), _p([0.1, 0.6, 0.1, 0.2]), _p([0.0, 0.0, 0.0, 1.0])])
    out = V.open_set_vote(probs, "soft")
    score = [0.5 + 0.1, 0.2 + 0.6, 0.1 + 0.1]
    want = [s / sum(score) for s in score]
    assert out.shape == (1, 3)
    assert out[0].tolist() == pytest.approx(want, abs=1e-12)
    # the unknown client changes nothing: same vote without it
    assert torch.allclose(out, V.open_set_vote(probs[:2], "soft"))
    # as a mixture: sum_k w_k q_k with w_k ∝ 1 - p_k(unknown)
    q = [[0.5 / 0.8, 0.2 / 0.8, 0.1 / 0.8], [0.1 / 0.8, 0.6 / 0.8, 0.1 / 0.8]]
    assert out[0].tolist() == pytest.approx([(a + b) / 2 for a, b in zip(*q)], abs=1e-12)


def test_soft_vote_accepted_clients_are_the_least_unknown_with_stable_ties():
    probs = torch.stack([_p([0.7, 0.1, 0.2]), _p([0.1, 0.6, 0.3]), _p([0.2, 0.7, 0.1]), _p([0.6, 0.3, 0.1])])
    # unknown probabilities 0.2, 0.3, 0.1, 0.1 -> the two accepted are clients 2 and 3 (tie: lower index first)
    out = V.open_set_vote(probs, "soft", accepted=2)
    score = [0.2 + 0.6, 0.7 + 0.3]
    assert out[0].tolist() == pytest.approx([s / sum(score) for s in score], abs=1e-12)
    out3 = V.open_set_vote(probs, "soft", accepted=3)   # 2, 3, then client 0 (0.2)
    score3 = [0.2 + 0.6 + 0.7, 0.7 + 0.3 + 0.1]
    assert out3[0].tolist() == pytest.approx([s / sum(score3) for s in score3], abs=1e-12)
    assert torch.allclose(V.open_set_vote(probs, "soft", accepted=4), V.open_set_vote(probs, "soft"))


def test_ignore_unknown_vote_hand_computation_ties_and_all_unknown_fallback():
    a, b, u = _p([0.6, 0.3, 0.1]), _p([0.2, 0.5, 0.3]), _p([0.3, 0.1, 0.6])
    out = V.open_set_vote(torch.stack([a, b, u]), "ignore_unknown")
    qa, qb = [0.6 / 0.9, 0.3 / 0.9], [0.2 / 0.7, 0.5 / 0.7]
    assert out[0].tolist() == pytest.approx([(x + y) / 2 for x, y in zip(qa, qb)], abs=1e-12)
    # a tie between two classes stays a tie; the prediction is the lower class index
    tie = V.open_set_vote(torch.stack([_p([0.4, 0.4, 0.2]), _p([0.1, 0.1, 0.8])]), "ignore_unknown")
    assert tie[0, 0] == tie[0, 1] == 0.5
    assert classification_metrics(tie, torch.tensor([0]))["accuracy"] == 100.0
    # every client says unknown -> the soft rule over all of them (documented fallback)
    all_unk = torch.stack([_p([0.3, 0.1, 0.6]), _p([0.05, 0.15, 0.8])])
    fb = V.open_set_vote(all_unk, "ignore_unknown")
    score = [0.3 + 0.05, 0.1 + 0.15]
    assert fb[0].tolist() == pytest.approx([s / sum(score) for s in score], abs=1e-12)
    assert torch.equal(fb, V.open_set_vote(all_unk, "soft"))


def test_soft_vote_all_certain_unknown_is_uniform_and_rows_are_distributions():
    out = V.open_set_vote(torch.stack([_p([0.0, 0.0, 0.0, 1.0])] * 2), "soft")
    assert out[0].tolist() == pytest.approx([1 / 3] * 3)
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(4, 7, 6, generator=g), -1)
    for rule in V.VOTES:
        o = V.open_set_vote(probs, rule)
        assert o.shape == (7, 5) and torch.allclose(o.sum(1), torch.ones(7, dtype=o.dtype)) and (o >= 0).all()


def test_open_set_vote_predictor_through_evaluate():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))     # C = 2 (+ unknown)
    members = [{n: torch.randn_like(p) for n, p in model.named_parameters()} for _ in range(3)]
    x = torch.randn(10, 1, 2, 2)
    y = torch.randint(0, 2, (10,))
    pred = V.OpenSetVote(model, members)
    probs = torch.stack([torch.softmax(torch.func.functional_call(model, m, (x,)).double(), -1) for m in members])
    want = V.open_set_vote(probs)
    assert torch.allclose(pred(x), want)
    got = evaluate(nn.Identity(), pred, lambda idx: x[idx], y, batch_size=4)   # the template model is unused
    assert got == pytest.approx(classification_metrics(want, y))


# ------------------------------------------------------------------------------------------------
# outliers
# ------------------------------------------------------------------------------------------------
def _images(n=16, c=1, h=28, w=28, seed=0):
    return torch.rand(n, c, h, w, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("op", V.OPS)
def test_each_op_shape_determinism_and_change(op):
    x = _images(12, 3, 32, 32)
    ops = {o: float(o == op) for o in V.OPS}
    out = V.generate_outliers(x, torch.Generator().manual_seed(5), ops)
    assert out.shape == x.shape and out.dtype == x.dtype
    again = V.generate_outliers(x, torch.Generator().manual_seed(5), ops)
    assert torch.equal(out, again)
    assert not torch.equal(out, V.generate_outliers(x, torch.Generator().manual_seed(6), ops))
    diff = (out - x).flatten(1).abs().amax(1)
    assert (diff > 1e-3).all(), f"{op} left some images unchanged"
    assert torch.equal(x, _images(12, 3, 32, 32))     # input untouched


def test_mixture_uses_every_op_and_is_deterministic():
    x = _images(64)
    a = V.generate_outliers(x, torch.Generator().manual_seed(1))
    assert torch.equal(a, V.generate_outliers(x, torch.Generator().manual_seed(1)))
    assert ((a - x).flatten(1).abs().amax(1) > 1e-3).all()
    counts = torch.bincount(torch.multinomial(torch.tensor([1.0, 1, 1, 2, 2], dtype=torch.float64), 64,
                                              replacement=True, generator=torch.Generator().manual_seed(1)), minlength=5)
    assert (counts > 0).all()   # the same draw the generator made: every op is used in this batch


def test_rot_and_cut_maps_against_direct_computation():
    x = _images(1, 2, 8, 8)[0]
    for k in (1, 2, 3):
        r, c = V.rot_map(8, 8, torch.tensor([3]), torch.tensor([k]))
        got = x[:, r[0], c[0]]
        want = x.clone()
        for b in (0, 4):
            want[:, 3:7, b:b + 4] = torch.rot90(x[:, 3:7, b:b + 4], k, dims=(1, 2))
        assert torch.equal(got, want)
    # shift: columns [pl2, pl2+4) copied to [pl, pl+4); swap: halves exchanged
    m = V.cut_map(8, torch.tensor([0, 3]), torch.tensor([3, 1]), torch.tensor([False, False]))
    assert m[0].tolist() == [3, 4, 5, 6, 4, 5, 6, 7] and m[1].tolist() == [0, 1, 2, 1, 2, 3, 4, 7]
    s = V.cut_map(7, torch.tensor([0]), torch.tensor([0]), torch.tensor([True]))
    assert s[0].tolist() == [3, 4, 5, 0, 1, 2, 6]


def test_blur_is_a_normalised_reflect_padded_gaussian():
    x = torch.full((3, 1, 9, 9), 0.7)
    out = V.op_blur(x, torch.Generator().manual_seed(0))
    assert torch.allclose(out, x, atol=1e-6)            # a constant image is a fixed point (weights sum to 1)
    spike = torch.zeros(1, 1, 11, 11)
    spike[0, 0, 5, 5] = 1.0
    out = V.op_blur(spike, torch.Generator().manual_seed(3))
    assert out.sum().item() == pytest.approx(1.0, abs=1e-6) and out.max() < 1.0


def test_adversarial_enhancement_raises_the_unknown_loss_within_the_ball():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 4))
    x = _images(8, 1, 4, 4)
    adv = V.enhance_outliers(model, x, 3, lambda t: t, steps=5, step_size=0.01, epsilon=0.5)
    y = torch.full((8,), 3)
    f = nn.functional.cross_entropy
    assert f(model(adv), y) > f(model(x), y)
    assert (adv - x).abs().max() <= 5 * 0.01 + 1e-6
    tight = V.enhance_outliers(model, x, 3, lambda t: t, steps=5, step_size=0.01, epsilon=0.015)
    assert (tight - x).abs().max() <= 0.015 + 1e-6
    assert torch.equal(V.enhance_outliers(model, x, 3, lambda t: t, 0, 0.01, 0.5), x)


# ------------------------------------------------------------------------------------------------
# the C+1-class model
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,shape", [("simple_cnn", (1, 28, 28)), ("lenet", (1, 28, 28)),
                                        ("simple_cnn", (3, 32, 32))])
def test_open_model_has_one_more_output_row(name, shape):
    base = build_model(name, input_shape=shape, num_classes=10)
    last = [m for m in base.modules() if isinstance(m, nn.Linear)][-1]
    open_model = V.build_open_model({"name": name}, shape, 10, seed=0)
    extra = last.in_features + (1 if last.bias is not None else 0)
    assert count_parameters(open_model) == count_parameters(base) + extra
    assert open_model(torch.zeros(2, *shape)).shape == (2, 11)
    again = V.build_open_model({"name": name}, shape, 10, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(open_model.parameters(), again.parameters()))
    # seeded like the C-class model: every layer but the output layer starts equal
    torch.manual_seed(0)
    ref = build_model(name, input_shape=shape, num_classes=10)
    pairs = list(zip(ref.named_parameters(), open_model.named_parameters()))
    assert all(torch.equal(a, b) for (n, a), (_, b) in pairs[:-2])


def test_open_model_build_leaves_global_rng_alone():
    torch.manual_seed(7)
    want = torch.rand(3)
    torch.manual_seed(7)
    V.build_open_model({"name": "simple_cnn"}, (1, 28, 28), 10, seed=0)
    assert torch.equal(torch.rand(3), want)


# ------------------------------------------------------------------------------------------------
# the algorithm on a hand-made setup
# ------------------------------------------------------------------------------------------------
def _setup(n=96, classes=3, unlabeled=True, epochs=1, **kw):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (n, 1, 28, 28), generator=g, dtype=torch.uint8)
    y = torch.arange(n) % classes
    torch.manual_seed(0)
    model = build_model("simple_cnn", input_shape=(1, 28, 28), num_classes=classes)
    train = TrainData(x, y, mean=(0.5,), std=(0.25,))
    idx = [torch.arange(0, n // 2), torch.arange(n // 2, n)]
    return FLSetup(model=model, train=train, test_inputs=train.inputs, test_y=y, client_indices=idx,
                   local=LocalTrainConfig(lr=0.05, momentum=0.9, batch_size=16, epochs=epochs), seed=0,
                   device=torch.device("cpu"), stage_parts={"model": {"name": "simple_cnn"}},
                   server_unlabeled=train.inputs(torch.arange(20)) if unlabeled else None, **kw)


def _init(setup):
    return {n: p.detach().clone() for n, p in setup.model.named_parameters()}


def test_run_rounds_uses_the_hook_uplink_counts_c_plus_1_models_and_distils():
    setup = _setup()
    algo = ALGORITHMS.get("fedov")({"distill_epochs": 2}, setup)
    state, logs = run_rounds(setup, algo, _init(setup), 1, progress=False)
    open_bytes = 4 * count_parameters(algo.open_model)
    assert logs[0].uplink_bytes == 2 * open_bytes and logs[0].downlink_bytes == 2 * open_bytes
    assert count_parameters(algo.open_model) == count_parameters(setup.model) + 85
    m = logs[0].metrics
    for k in ("accuracy", "nll", "ece", "vote_accuracy", "vote_nll", "vote_ece"):
        assert math.isfinite(m[k]), k
    assert set(state["params"]) == set(_init(setup)) and len(state["trace"]) == 2
    assert state["params"]["fc3.weight"].shape[0] == 3          # the student is the C-class model
    assert not torch.equal(state["params"]["fc3.weight"], _init(setup)["fc3.weight"])
    assert all(math.isfinite(t["kd_loss"]) for t in state["trace"])
    # the clients trained the C+1 model: outputs on the unknown row moved away from the initialisation
    members = state["vote"].members
    assert members[0]["fc3.weight"].shape[0] == 4
    assert not torch.equal(members[0]["fc3.weight"], state["open_init"]["fc3.weight"])
    # no distillation: the vote itself is reported
    setup2 = _setup(unlabeled=False)
    algo2 = ALGORITHMS.get("fedov")({"distill": False}, setup2)
    state2, logs2 = run_rounds(setup2, algo2, _init(setup2), 1, progress=False)
    assert isinstance(algo2.predict_params(state2), V.OpenSetVote) and "vote_accuracy" not in logs2[0].metrics
    # same seed, same clients: the vote of both runs is identical
    assert logs2[0].metrics["accuracy"] == pytest.approx(m["vote_accuracy"])


def test_client_loss_terms_are_finite_and_each_switch_changes_training():
    setup = _setup(n=48, epochs=1)
    base = ALGORITHMS.get("fedov")({"distill": False}, setup)
    init = {n: p.detach().clone() for n, p in base.open_model.named_parameters()}
    p0, steps, loss = base.train_client(init, 0, 1, 0)
    assert steps == 2 and math.isfinite(loss)
    again, _, _ = base.train_client(init, 0, 1, 0)
    assert all(torch.equal(p0[n], again[n]) for n in p0)        # deterministic
    for off in ("outlier_weight", "placeholder_weight", "mixup_weight", "adv_weight"):
        other = ALGORITHMS.get("fedov")({"distill": False, off: 0.0}, setup)
        p, _, l = other.train_client(init, 0, 1, 0)
        assert math.isfinite(l) and not torch.equal(p["fc3.weight"], p0["fc3.weight"]), off
        assert other.client_stage_key(1) != base.client_stage_key(1)
    assert base.client_stage_key(1) != {} and base.client_stage_key(2) is None


def test_fedov_is_one_shot():
    setup = _setup(n=48)
    algo = ALGORITHMS.get("fedov")({"distill": False}, setup)
    with pytest.raises(FedbenchError, match="one-shot"):
        algo.local_train(algo.init_state(_init(setup)), [0, 1], 2, 0)


@pytest.mark.parametrize("cfg,needle", [
    ({"vote": "majority"}, "vote"),
    ({"accepted_votes": 0}, "accepted_votes"),
    ({"accepted_votes": 3}, "exceeds"),
    ({"vote": "ignore_unknown", "accepted_votes": 1}, "soft only"),
    ({"outlier_ops": {"jigsaw": 1.0}}, "outlier_ops"),
    ({"outlier_ops": {"crop": 0.0}}, "at least one"),
    ({"outlier_ops": {"crop": -1.0, "rot": 1.0}}, "outlier_ops"),
    ({"adv_steps": -1}, "adv_steps"),
    ({"adv_step_size": 0}, "adv_step_size"),
    ({"mixup_weight": -0.1}, "mixup_weight"),
    ({"distill_targets": "logits"}, "distill_targets"),
    ({"distill_optimizer": "lbfgs"}, "distill_optimizer"),
    ({"distill": "yes"}, "distill"),
    ({"temperature": 3}, "unknown algorithm key"),
])
def test_bad_config_fails_in_init(cfg, needle):
    with pytest.raises(FedbenchError, match=needle):
        ALGORITHMS.get("fedov")(cfg, _setup())


def test_setup_requirements_fail_in_init():
    with pytest.raises(FedbenchError, match="server_unlabeled"):
        ALGORITHMS.get("fedov")({}, _setup(unlabeled=False))
    with pytest.raises(FedbenchError, match="local_accuracy"):
        ALGORITHMS.get("fedov")({"distill": False}, _setup(local_accuracy=True))
    s = _setup()
    s.stage_parts = None
    with pytest.raises(FedbenchError, match="model config"):
        ALGORITHMS.get("fedov")({"distill": False}, s)
    tab = _setup()
    tab.train = TrainData(torch.randn(96, 5), tab.train.y)
    with pytest.raises(FedbenchError, match="images"):
        ALGORITHMS.get("fedov")({"distill": False}, tab)


# ------------------------------------------------------------------------------------------------
# the real runner end to end (in-process: the same compose + execute_all that run.py and the Slurm jobs use)
# ------------------------------------------------------------------------------------------------
TINY = ["dataset.kwargs.like=mnist", "model=simple_cnn", "rounds=1", "server_unlabeled.size=60"]


def _execute(tmp_path, args):
    from fedbench.launch.sweep import CONF_DIR, compose_run, run_dir
    from fedbench.runner import execute_all

    cfg = compose_run(SMALL + TINY + [f"paths.output_root={tmp_path / 'out'}", f"paths.data_root={tmp_path / 'data'}"]
                      + args)
    return execute_all(cfg, run_dir(cfg, str(tmp_path)), CONF_DIR, launch_dir=str(tmp_path))


def test_runner_fedov_caches_its_own_stage_and_does_not_share_fedavgs(tmp_path):
    recs = {r["algorithm"]: r for r in _execute(tmp_path, ["aggregators=[fedavg,{name:fedov,distill_epochs:2}]"])}
    fedov, fedavg = recs["fedov"], recs["fedavg"]
    assert fedov["status"] == fedavg["status"] == "ok"
    n = fedavg["model"]["num_parameters"]
    assert fedov["communication"]["uplink_bytes"] == 3 * 4 * (n + 85)      # 3 clients x the C+1 model (fp32)
    assert fedavg["communication"]["uplink_bytes"] == 3 * 4 * n
    assert fedov["timing"]["server_s"] > 0 and "vote_accuracy" in fedov["metrics"]
    assert fedov["cache"]["misses"] == 1 and fedavg["cache"]["misses"] == 1   # two separate client stages
    cache = tmp_path / "out" / "cache" / "clients"
    assert len(list(cache.rglob("*.pt"))) == 2
    trace = (tmp_path / "out" / "runs" / fedov["run_id"] / "trace.csv").read_text().splitlines()
    assert trace[0].startswith("epoch") and len(trace) == 3
    # another FedOV run (another distillation setting, so another record) hits FedOV's cached clients
    (second,) = _execute(tmp_path, ["algorithm=fedov", "algorithm.distill_epochs=2", "algorithm.distill_lr=0.002"])
    assert second["run_id"] != fedov["run_id"]
    assert second["cache"]["hits"] == 1 and second["cache"]["misses"] == 0
    assert second["metrics"]["vote_accuracy"] == pytest.approx(fedov["metrics"]["vote_accuracy"])
    assert second["timing"]["client_train_compute_s"] == pytest.approx(fedov["timing"]["client_train_compute_s"])
    # the same run again (forced): cached clients, the same accuracy
    (rerun,) = _execute(tmp_path, ["aggregators=[{name:fedov,distill_epochs:2}]", "force=true"])
    assert rerun["run_id"] == fedov["run_id"] and rerun["cache"]["hits"] == 1
    assert rerun["metrics"]["accuracy"] == pytest.approx(fedov["metrics"]["accuracy"])
    assert len(list(cache.rglob("*.pt"))) == 2
    # a plain FedAvg run still finds its own (plain) stage
    (plain,) = _execute(tmp_path, ["algorithm=fedavg", "algorithm.weighting=uniform"])
    assert plain["cache"]["hits"] == 1 and plain["communication"]["uplink_bytes"] == 3 * 4 * n


def test_runner_refuses_before_training(tmp_path):
    with pytest.raises(FedbenchError, match="server_unlabeled"):
        _execute(tmp_path, ["algorithm=fedov", "server_unlabeled.size=0"])
    assert records(tmp_path) == [] and not (tmp_path / "out" / "cache").exists()


def test_run_py_bad_config_one_line(tmp_path):
    p = run(SMALL + TINY + ["algorithm=fedov", "algorithm.vote=majority"], tmp_path, expect=2)
    lines = [l for l in p.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("fedbench: error:") and "vote" in lines[0]
    assert records(tmp_path) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_runs_on_cuda(tmp_path):
    # outliers are drawn from CPU generators and moved: the same code path on a GPU, end to end
    (rec,) = _execute(tmp_path, ["hardware=cuda", "aggregators=[{name:fedov,distill_epochs:2}]"])
    assert rec["status"] == "ok" and rec["environment"]["device"].startswith("cuda")
    assert 0 <= rec["metrics"]["vote_accuracy"] <= 100 and math.isfinite(rec["metrics"]["nll"])
