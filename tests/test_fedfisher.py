"""FedFisher(Diag / K-FAC) (notes/fedfisher.md §1.3–1.6): the server objective against closed forms
and dense Kronecker products, the code's Adam, checkpoint selection, compression round trips and
byte counts, the messages of the registered algorithms, multi-round use and the server-val guard."""
import math

import pytest
import torch
import torch.nn as nn

from fedbench.algorithms import ALGORITHMS
from fedbench.algorithms import compression as C
from fedbench.algorithms.base import tensor_bytes
from fedbench.algorithms.fedfisher import (adam_code_step, decode_params, kfac_b, kfac_specs, make_kfac_mv,
                                           power_lambda_max, solve)
from fedbench.algorithms.fisher_merge import fisher_merge
from fedbench.errors import FedbenchError
from fedbench.fl.loop import FLSetup, run_rounds
from fedbench.fl.products import ProductStage
from fedbench.models import build_model
from fedbench.train.config import LocalTrainConfig
from fedbench.train.engine import TrainData, train_clients
from tests.test_run import SMALL as RUN_SMALL, run



pytestmark = pytest.mark.usefixtures("one_thread")


def _rand_psd(n, rank=None, g=None, basis=None):
    rank = n if rank is None else rank
    U = basis if basis is not None else torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))[0]
    lam = 0.5 + 1.5 * torch.rand(rank, generator=g, dtype=torch.float64)
    return (U[:, :rank] * lam) @ U[:, :rank].t()


def _tiny_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 2, 2, bias=True), nn.ReLU(), nn.Flatten(), nn.Linear(8, 3, bias=False),
                         nn.ReLU(), nn.Linear(3, 3, bias=True))


def _rand_params(model, g):
    return {n: torch.randn(p.shape, generator=g, dtype=torch.float64) for n, p in model.named_parameters()}


# ------------------------------------------------------------------------------------------------
# server objective
# ------------------------------------------------------------------------------------------------
def test_diag_optimum_is_closed_form_and_zero_fisher_keeps_average():
    g = torch.Generator().manual_seed(0)
    Ws = [{"w": torch.randn(30, generator=g, dtype=torch.float64)} for _ in range(3)]
    Fs = [{"w": 0.2 + torch.rand(30, generator=g, dtype=torch.float64)} for _ in range(3)]
    for F in Fs:
        F["w"][:5] = 0.0                       # no curvature anywhere: stays at the average (Lemma 1)
    p = [0.2, 0.5, 0.3]
    Fsum = sum(pi * F["w"] for pi, F in zip(p, Fs))
    b = sum(pi * F["w"] * W["w"] for pi, F, W in zip(p, Fs, Ws))
    w0 = {"w": sum(pi * W["w"] for pi, W in zip(p, Ws))}
    grad = lambda w: {"w": Fsum * w["w"] - b}
    # the gradient is that of ½ Σ p_i (w − W_i)ᵀ F_i (w − W_i)
    w = torch.randn(30, generator=g, dtype=torch.float64, requires_grad=True)
    obj = 0.5 * sum(pi * (F["w"] * (w - W["w"]) ** 2).sum() for pi, F, W in zip(p, Fs, Ws))
    (auto,) = torch.autograd.grad(obj, w)
    assert torch.allclose(grad({"w": w.detach()})["w"], auto, atol=1e-12)
    lr = 1.0 / power_lambda_max(lambda v: {"w": Fsum * v["w"]}, w0)
    best, last, _ = solve(grad, w0, optimizer="gd", steps=400, lr=lr)
    closed = fisher_merge(Ws, Fs, p, floor=1e-12)["w"]
    assert torch.allclose(last["w"], closed, atol=1e-9)
    assert torch.equal(last["w"][:5], w0["w"][:5])
    # the code's Adam reaches the same optimum (not the implicit-bias claim, just the minimiser here)
    _, last_adam, _ = solve(grad, w0, optimizer="adam_code", steps=3000, lr=0.01, eps=0.01)
    assert torch.allclose(last_adam["w"], closed, atol=2e-3)


def _dense_layer(spec, t):
    """Row-major vec of the layer matrix [W.reshape(d_out, -1) | b] built by hand."""
    cols = [t[n].reshape(spec.d_out, -1) for n in spec.names]
    return torch.cat(cols, 1).reshape(-1)


def test_kfac_gradient_equals_dense_kron_and_gd_reaches_min_norm_solution():
    g = torch.Generator().manual_seed(1)
    model = _tiny_model()
    specs = kfac_specs(model)
    assert [(s.d_in, s.d_out) for s in specs] == [(5, 2), (8, 3), (4, 3)]
    p = [0.25, 0.75]
    # shared (rank-deficient) ranges: the system is under-determined, Lemma 1's min-norm point is unique
    bases = {s.module: (torch.linalg.qr(torch.randn(s.d_in, s.d_in, generator=g, dtype=torch.float64))[0],
                        torch.linalg.qr(torch.randn(s.d_out, s.d_out, generator=g, dtype=torch.float64))[0])
             for s in specs}
    per_client = [[s.block(_rand_psd(s.d_in, s.d_in - 1, g, bases[s.module][0]), _rand_psd(s.d_out, None, g,
                                                                                           bases[s.module][1]))
                   for s in specs] for _ in p]
    Ws = [_rand_params(model, g) for _ in p]
    mv, b = make_kfac_mv(per_client, p), kfac_b(per_client, p, Ws)
    w = _rand_params(model, g)
    Fw = mv(w)
    for j, s in enumerate(specs):
        K = [torch.kron(blocks[j].G, blocks[j].A) for blocks in per_client]
        dense_g = sum(pi * Ki @ (_dense_layer(s, w) - _dense_layer(s, W)) for pi, Ki, W in zip(p, K, Ws))
        ours = _dense_layer(s, {n: Fw[n] - b[n] for n in s.names})
        assert torch.allclose(ours, dense_g, atol=1e-10)
    # plain GD from the average converges to w0 + F⁺(b − F w0) (Lemma 1), per layer
    w0 = {n: sum(pi * W[n] for pi, W in zip(p, Ws)) for n in Ws[0]}
    lr = 1.0 / power_lambda_max(mv, w0, iters=300)
    _, last, _ = solve(lambda v: {n: t - b[n] for n, t in mv(v).items()}, w0, optimizer="gd", steps=3000, lr=lr)
    for j, s in enumerate(specs):
        F = sum(pi * torch.kron(blocks[j].G, blocks[j].A) for pi, blocks in zip(p, per_client))
        bb = sum(pi * torch.kron(blocks[j].G, blocks[j].A) @ _dense_layer(s, W) for pi, blocks, W in zip(p, per_client, Ws))
        x0 = _dense_layer(s, w0)
        closed = x0 + torch.linalg.pinv(F) @ (bb - F @ x0)
        assert torch.allclose(_dense_layer(s, last), closed, atol=1e-7)


def test_adam_code_three_steps_match_reference():
    g = torch.Generator().manual_seed(2)
    H = torch.rand(4, generator=g, dtype=torch.float64) + 0.1
    c = torch.randn(4, generator=g, dtype=torch.float64)
    for inside in (False, True):
        w = {"x": torch.zeros(4, dtype=torch.float64)}
        m = {"x": torch.zeros(4, dtype=torch.float64)}
        v = {"x": torch.zeros(4, dtype=torch.float64)}
        ref_w, ref_m, ref_v = [0.0] * 4, [0.0] * 4, [0.0] * 4
        for _ in range(3):
            gr = {"x": H * w["x"] - c}
            adam_code_step(w, gr, m, v, lr=0.01, beta1=0.9, beta2=0.99, eps=0.01, eps_inside_sqrt=inside)
            for i in range(4):
                gi = float(H[i]) * ref_w[i] - float(c[i])
                ref_m[i] = gi + 0.9 * ref_m[i]
                ref_v[i] = gi * gi + 0.99 * ref_v[i]
                den = math.sqrt(ref_v[i] + 0.01) if inside else math.sqrt(ref_v[i]) + 0.01
                ref_w[i] -= 0.01 * ref_m[i] / den
        assert w["x"].tolist() == pytest.approx(ref_w, rel=1e-12, abs=1e-15)
    # torch Adam, one step: lr · g / (|g| + eps) after bias correction
    gvec = torch.tensor([0.5, -2.0], dtype=torch.float64)
    _, last, _ = solve(lambda w: {"x": gvec.clone()}, {"x": torch.zeros(2, dtype=torch.float64)},
                       optimizer="adam_torch", steps=1, lr=0.01, eps=0.01)
    assert torch.allclose(last["x"], -0.01 * gvec / (gvec.abs() + 0.01))


def test_selection_picks_best_validation_iterate():
    # 1-D GD from 0 towards 1 (monotone); the score peaks at 0.5: the selected iterate is the
    # evaluated one (k % 100 == 0, after step k) closest to 0.5, strictly better wins (first on ties)
    grad = lambda w: {"x": w["x"] - 1.0}
    w0 = {"x": torch.zeros(1, dtype=torch.float64)}
    score = lambda w: -abs(float(w["x"]) - 0.5)
    best, last, trace = solve(grad, w0, optimizer="gd", steps=1000, lr=0.003, eval_every=100, evaluate=score)
    assert [k for k, _ in trace] == list(range(0, 1000, 100))
    iterates = {k: 1 - (1 - 0.003) ** (k + 1) for k in range(0, 1000, 100)}
    k_best = max(iterates, key=lambda k: -abs(iterates[k] - 0.5))
    assert 0 < k_best < 900
    assert float(best["x"]) == pytest.approx(iterates[k_best], rel=1e-9)
    assert float(last["x"]) == pytest.approx(1 - (1 - 0.003) ** 1000, rel=1e-9)
    # no evaluation: the last iterate
    best2, _, trace2 = solve(grad, w0, optimizer="gd", steps=50, lr=0.003)
    assert trace2 == [] and float(best2["x"]) == pytest.approx(1 - 0.997 ** 50)


# ------------------------------------------------------------------------------------------------
# compression
# ------------------------------------------------------------------------------------------------
def test_quantisation_round_trip_bounds_and_bytes():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1001, generator=g)
    for bits, levels, nbytes in [(16, 32767, 2 * 1001), (8, 127, 1001)]:
        assert C.levels_for_bits(bits) == levels and C.code_bits(levels) == bits
        enc = C.encode(x, levels)
        err = (C.decode(enc) - x).abs().max()
        assert err <= x.abs().max() / (2 * levels) * (1 + 1e-3)   # half a step (+ float32 round-off)
        assert tensor_bytes(enc) == nbytes + 4
    # the code's quantize(·, 8): 255 levels, 9 bits each, bit-packed
    enc = C.encode(x, 255)
    assert C.code_bits(255) == 9 and tensor_bytes(enc) == math.ceil(1001 * 9 / 8) + 4
    ref = torch.round(255 * x / x.abs().max()) * x.abs().max() / 255
    assert torch.allclose(C.decode(enc), ref, atol=1e-6)
    assert torch.equal(C.quantize_values(x, 255), C.decode(enc))
    # all-zero tensors survive
    assert torch.equal(C.decode(C.encode(torch.zeros(3, 2), 32767)), torch.zeros(3, 2))


def test_lowrank_round_trip_and_code_rank_rule():
    g = torch.Generator().manual_seed(4)
    B = torch.randn(12, 3, generator=g)
    A = B @ B.t()                                   # rank 3
    enc = C.encode_lowrank(A, 3, 255)
    rel = (C.decode_lowrank(enc) - A).norm() / A.norm()
    assert rel < 2e-2
    enc_full = C.encode_lowrank(A, 3, 2 ** 20)      # near-lossless quantisation: only the SVD remains
    assert torch.allclose(C.decode_lowrank(enc_full), A, atol=1e-4 * A.abs().max())
    assert tensor_bytes(enc) == 3 * 4 + math.ceil(12 * 3 * 9 / 8) + math.ceil(3 * 9 / 8) + math.ceil(3 * 12 * 9 / 8)
    # the note's worked ranks (§1.6): LeNet 50, FedMA CNN 243 (bias-free, 10 classes)
    for name, shape, d, rank in [("lenet", (1, 28, 28), 44190, 50), ("fedma_cnn", (3, 32, 32), 939616, 243)]:
        model = build_model(name, input_shape=shape, num_classes=10, bias=False)
        specs = kfac_specs(model)
        assert sum(p.numel() for p in model.parameters()) == d
        assert C.budget_rank(d, [s for sp in specs for s in (sp.d_in, sp.d_out)], 8) == rank


# ------------------------------------------------------------------------------------------------
# the registered algorithms on a tiny problem
# ------------------------------------------------------------------------------------------------
def _setup(server_val=True, epochs=2):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(240, 1, 3, 3, generator=g)
    y = ((x[:, 0, 0, 0] > 0).long() + (x[:, 0, 1, 1] > 0.5).long())
    model = _tiny_model()
    train = TrainData(x, y)
    idx = [torch.arange(0, 60), torch.arange(60, 200), torch.arange(200, 240)]
    return FLSetup(model=model, train=train, test_inputs=train.inputs, test_y=y, client_indices=idx,
                   local=LocalTrainConfig(optimizer="sgd", lr=0.2, batch_size=32, epochs=epochs), seed=0,
                   device=torch.device("cpu"), server_val=(x[:40], y[:40]) if server_val else None)


def _messages(algo, setup):
    init = {n: p.detach().clone() for n, p in setup.model.named_parameters()}
    res = train_clients(setup.model, setup.train, setup.client_indices, init, setup.local, seed=0)
    state = algo.init_state(init)
    return [ProductStage(setup).message(algo, k, res.params[k], res, k, state, 1) for k in range(3)], state, res


def test_diag_messages_bytes_and_server_uses_decoded_values():
    setup = _setup()
    algo = ALGORITHMS.get("fedfisher_diag")({"server_optimizer": "gd", "steps": 600, "select": "last"}, setup)
    msgs, state, res = _messages(algo, setup)
    P, T = sum(p.numel() for p in setup.model.parameters()), len(list(setup.model.parameters()))
    assert all(m.nbytes == 2 * (2 * P + 4 * T) for m in msgs)          # 16-bit weights + 16-bit Fisher
    Ws = [decode_params(m.payload["params"]) for m in msgs]
    Fs = [decode_params(m.payload["fisher"]) for m in msgs]
    assert any(not torch.equal(Ws[k][n], res.params[k][n]) for k in range(3) for n in Ws[k])   # really quantised
    p = [60 / 240, 140 / 240, 40 / 240]
    closed = fisher_merge(Ws, Fs, p, floor=1e-12)
    Fsum = {n: sum(pi * F[n] for pi, F in zip(p, Fs)) for n in Fs[0]}
    w0 = {n: sum(pi * W[n] for pi, W in zip(p, Ws)) for n in Ws[0]}
    lr = 1.0 / max(float(t.max()) for t in Fsum.values())
    algo = ALGORITHMS.get("fedfisher_diag")({"server_optimizer": "gd", "steps": 600, "select": "last", "gd_lr": lr},
                                            setup)
    out = algo.aggregate(msgs, state, 1)["params"]
    for n in out:   # GD's k-th iterate in closed form: w* + (1 − lr F)^k (w0 − w*), w* = Fisher Merge's
        expect = closed[n] + (1 - lr * Fsum[n]) ** 600 * (w0[n] - closed[n])
        assert torch.allclose(out[n], expect, atol=1e-5), n
    # the merge algorithm returns the same closed form from the same messages
    fm = ALGORITHMS.get("fisher_merge")({}, setup)
    merged = fm.aggregate(msgs, state, 1)["params"]
    for n in out:
        keep = Fsum[n] >= 1e-6
        assert torch.allclose(merged[n][keep], closed[n][keep], atol=1e-5)
    # uncompressed: fp32 tensors, 4 bytes per value
    raw = ALGORITHMS.get("fedfisher_diag")({"compression": False, "select": "last"}, setup)
    assert ProductStage(setup).message(raw, 0, res.params[0], res, 0, state, 1).nbytes == 2 * 4 * P


def test_kfac_messages_bytes_and_fixed_point_of_decoded_system():
    setup = _setup()
    algo = ALGORITHMS.get("fedfisher_kfac")({"select": "last", "kfac_rank": 2}, setup)
    msgs, state, _ = _messages(algo, setup)
    P, T = sum(p.numel() for p in setup.model.parameters()), len(list(setup.model.parameters()))
    fac = 0
    for s in algo.specs:
        for side in (s.d_in, s.d_out):
            r = min(side, 2)
            fac += 3 * 4 + 2 * math.ceil(side * r * 9 / 8) + math.ceil(r * 9 / 8)
    assert all(m.nbytes == 2 * P + 4 * T + fac for m in msgs)
    # the server runs on the DECODED factors and weights: replay its GD densely with torch.kron
    from fedbench.algorithms.fedfisher import decode_any
    p = [60 / 240, 140 / 240, 40 / 240]
    Ws = [{n: t.double() for n, t in decode_params(m.payload["params"]).items()} for m in msgs]
    algo = ALGORITHMS.get("fedfisher_kfac")({"server_optimizer": "gd", "steps": 500, "select": "last",
                                             "kfac_rank": 2, "gd_lr": 0.5}, setup)
    new = algo.aggregate(msgs, state, 1)["params"]
    for s in algo.specs:
        K = [torch.kron(decode_any(m.payload["factors"][s.module]["G"]).double(),
                        decode_any(m.payload["factors"][s.module]["A"]).double()) for m in msgs]
        F = sum(pi * Ki for pi, Ki in zip(p, K))
        b = sum(pi * Ki @ _dense_layer(s, W) for pi, Ki, W in zip(p, K, Ws))
        x = sum(pi * _dense_layer(s, W) for pi, W in zip(p, Ws))
        for _ in range(500):
            x = x - 0.5 * (F @ x - b)
        assert torch.allclose(_dense_layer(s, new).double(), x, atol=1e-5), s.module
        assert not torch.allclose(x, sum(pi * _dense_layer(s, W) for pi, W in zip(p, Ws)), atol=1e-3)   # it moved
    raw = ALGORITHMS.get("fedfisher_kfac")({"compression": False, "select": "last"}, setup)
    msgs_raw, _, _ = _messages(raw, setup)
    assert msgs_raw[0].nbytes == 4 * P + 4 * sum(s.d_in ** 2 + s.d_out ** 2 for s in raw.specs)


def test_validation_selection_in_algorithm_and_multi_round():
    setup = _setup()
    algo = ALGORITHMS.get("fedfisher_kfac")({"steps": 300, "eval_every": 100}, setup)
    assert algo.client_stage_key(1) == {} and algo.client_stage_key(2) is None
    init = {n: p.detach().clone() for n, p in setup.model.named_parameters()}
    state, logs = run_rounds(setup, algo, init, 2, progress=False)
    assert len(logs) == 2 and all("accuracy" in l.metrics and "last_iterate_accuracy" in l.metrics for l in logs)
    trace = state["server_trace"]
    assert [k for k, _ in trace] == [0, 100, 200]
    best_acc = max(a for _, a in trace)
    assert setup.val_metrics(state["params"])["accuracy"] == pytest.approx(best_acc)


def test_errors_before_training():
    with pytest.raises(FedbenchError, match="needs a server validation set"):
        ALGORITHMS.get("fedfisher_diag")({}, _setup(server_val=False))
    ALGORITHMS.get("fedfisher_diag")({"select": "last"}, _setup(server_val=False))   # no validation needed
    with pytest.raises(FedbenchError, match="server_optimizer"):
        ALGORITHMS.get("fedfisher_kfac")({"server_optimizer": "sgd"}, _setup())
    with pytest.raises(FedbenchError, match="unknown algorithm key"):
        ALGORITHMS.get("fedfisher_diag")({"stepz": 3}, _setup())
    setup = _setup()
    setup.model = nn.Sequential(nn.Flatten(), nn.Linear(9, 4), nn.LayerNorm(4), nn.Linear(4, 3))
    with pytest.raises(FedbenchError, match="K-FAC needs"):
        ALGORITHMS.get("fedfisher_kfac")({}, setup)
    # YAML's bare `true` means the true Fisher
    assert ALGORITHMS.get("fisher_merge")({"fisher": True}, _setup()).fisher == "true"


# ------------------------------------------------------------------------------------------------
# run.py
# ------------------------------------------------------------------------------------------------
SMALL = [a for a in RUN_SMALL if a != "rounds=2"]


def test_run_without_server_val_fails_with_one_line(tmp_path):
    p = run(SMALL + ["rounds=1", "algorithm=fedfisher_kfac"], tmp_path, expect=2)
    lines = [l for l in p.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("fedbench: error:") and "server validation set" in lines[0]
    assert not list((tmp_path / "out").glob("cache/**/*.pt"))      # failed before training
