"""The side-by-side scripts under scripts/gaps/ that run a paper's released code reject bad input with one line and
exit status 2 before touching the checkout (they are run by hand against fetched repositories, never in CI)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]
BENS = ROOT / "scripts" / "gaps" / "fedbens_released_baseline.sh"
LPA = ROOT / "scripts" / "gaps" / "fedlpa_released_baseline.sh"


def _run(script, *args, env_extra=None):
    env = {"PATH": "/usr/bin:/bin", **(env_extra or {})}
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, env=env, timeout=60)


@pytest.fixture
def fake_bens(tmp_path):
    (tmp_path / "main_baselines.py").write_text("raise SystemExit('must not run')\n")
    return tmp_path


@pytest.mark.parametrize("script,args,expected", [
    (BENS, [], "usage:"),
    (BENS, ["/no/such/folder", "0", "0.4"], "error: no such folder"),
    (LPA, [], "usage:"),
    (LPA, ["/no/such/folder", "0", "noniid-#label2"], "error: no such folder"),
])
def test_missing_arguments_or_folder(script, args, expected):
    out = _run(script, *args)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [out.stderr.strip()] and out.stderr.startswith(expected)


def test_folder_that_is_not_the_released_code(tmp_path):
    for script, args, name in [(BENS, ["0", "0.4"], "main_baselines.py"), (LPA, ["0", "noniid-#label2"], "experiments.py")]:
        out = _run(script, str(tmp_path), *args)
        assert out.returncode == 2 and f"has no {name}" in out.stderr and len(out.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args,word", [
    (["x", "0.4"], "whole numbers"),
    (["0", "0.4", "fisher_merge", "ten"], "whole numbers"),
    (["0", "0.3", "otfusion", "20", "0"], "whole numbers"),
    (["0", "-1"], "positive number"),
    (["0", "abc"], "positive number"),
])
def test_fedbens_bad_numbers(fake_bens, args, word):
    out = _run(BENS, str(fake_bens), *args, env_extra={"RELEASED_PYTHONPATH": "/x"})
    assert out.returncode == 2 and word in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not (fake_bens / "data").exists()       # rejected before anything is written into the checkout


def test_fedbens_needs_the_released_packages(fake_bens, tmp_path_factory):
    data_root = tmp_path_factory.mktemp("datasets")
    (data_root / "FashionMNIST" / "raw").mkdir(parents=True)
    out = _run(BENS, str(fake_bens), "0", "0.4", env_extra={"FEDBENCH_DATA_ROOT": str(data_root)})
    assert out.returncode == 2 and "RELEASED_PYTHONPATH" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not (fake_bens / "data").exists()


def test_missing_dataset_copy(fake_bens, tmp_path_factory):
    empty_root = tmp_path_factory.mktemp("no_datasets")
    out = _run(BENS, str(fake_bens), "0", "0.4", env_extra={"FEDBENCH_DATA_ROOT": str(empty_root), "RELEASED_PYTHONPATH": "/x"})
    assert out.returncode == 2 and "no Fashion-MNIST copy" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_fedlpa_bad_training_seed(tmp_path):
    (tmp_path / "experiments.py").write_text("raise SystemExit('must not run')\n")
    for bad in (["20", "y"], ["ten", "1"]):
        out = _run(LPA, str(tmp_path), "0", "noniid-#label2", "fedavg", *bad)
        assert out.returncode == 2 and "whole numbers" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "data").exists()


def test_fedlpa_dataset_and_fedlpa_script(tmp_path, tmp_path_factory):
    (tmp_path / "experiments.py").write_text("raise SystemExit('must not run')\n")
    out = _run(LPA, str(tmp_path), "0", "noniid-#label2", env_extra={"DATASET": "cifar10"})
    assert out.returncode == 2 and "DATASET must be fmnist or mnist" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    data_root = tmp_path_factory.mktemp("datasets")
    (data_root / "MNIST" / "raw").mkdir(parents=True)
    # alg 'our' (FedLPA itself) needs the released experiments_our.py
    out = _run(LPA, str(tmp_path), "0", "noniid-#label2", "our",
               env_extra={"DATASET": "mnist", "FEDBENCH_DATA_ROOT": str(data_root)})
    assert out.returncode == 2 and "has no experiments_our.py" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    empty_root = tmp_path_factory.mktemp("no_datasets")
    out = _run(LPA, str(tmp_path), "0", "noniid-#label2", env_extra={"DATASET": "mnist", "FEDBENCH_DATA_ROOT": str(empty_root)})
    assert out.returncode == 2 and "no MNIST copy" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "data").exists()


def test_fedlpa_dump_needs_fedlpa(tmp_path):
    (tmp_path / "experiments.py").write_text("raise SystemExit('must not run')\n")
    out = _run(LPA, str(tmp_path), "0", "noniid-#label2", "fedavg", env_extra={"DUMP": str(tmp_path / "c.pt")})
    assert out.returncode == 2 and "DUMP needs alg 'our'" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "data").exists()


def test_fedlpa_bad_parties(tmp_path):
    (tmp_path / "experiments.py").write_text("raise SystemExit('must not run')\n")
    for bad in ("0", "five", "-5"):
        out = _run(LPA, str(tmp_path), "0", "noniid-#label2", env_extra={"PARTIES": bad})
        assert out.returncode == 2 and "PARTIES must be" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "data").exists()


def _cross():
    return load_script("gaps/fedlpa_cross_server.py")


def test_fedlpa_cross_server_rejects_bad_input(tmp_path, capsys):
    cross = _cross()
    assert cross.main([str(tmp_path), str(tmp_path / "c.pt")]) == 2
    assert "has no experiments_our.py" in capsys.readouterr().err
    (tmp_path / "experiments_our.py").write_text("")
    assert cross.main([str(tmp_path), str(tmp_path / "c.pt")]) == 2
    assert "no such dump" in capsys.readouterr().err


def _fake_dump(shared_factors: bool):
    """Three clients of a 2-layer net (conv 3x2x2x2 with bias, linear 4x12 without), SPD factors."""
    import torch
    g = torch.Generator().manual_seed(0)

    def spd(n):
        X = torch.randn(n, n, generator=g)
        return X @ X.T / n + 0.5 * torch.eye(n)
    sizes = {"conv": (3, 9), "fc": (4, 12)}
    base = {n: (spd(i), spd(o)) for n, (o, i) in sizes.items()}
    clients, factors = [], []
    for _ in range(3):
        clients.append({"conv.weight": torch.randn(3, 2, 2, 2, generator=g), "conv.bias": torch.randn(3, generator=g),
                        "fc.weight": torch.randn(4, 12, generator=g)})
        factors.append(base if shared_factors else {n: (spd(i), spd(o)) for n, (o, i) in sizes.items()})
    model = torch.nn.Sequential()
    model.add_module("conv", torch.nn.Conv2d(2, 3, 2))
    model.add_module("fc", torch.nn.Linear(12, 4, bias=False))
    return {"clients": clients, "factors": factors, "p": [0.5, 0.3, 0.2], "model": model}


def test_fedlpa_cross_server_solvers_on_a_known_system():
    import torch
    cross = _cross()
    # equal factors on every client: the product of Gaussians' mean is the p-weighted average of the M_k
    dump = _fake_dump(shared_factors=True)
    sol = cross.solve_all(dump, torch.float64, gd_lr=0.01, gd_steps=50)   # a stable step: lr < numel / lambda_max^2
    for spec, Ms, _, _ in cross.layer_systems(dump):
        avg = sum(p * M for p, M in zip(dump["p"], Ms.double()))
        for k in ("ea", "gd", "cg"):
            assert torch.allclose(spec.to_matrix(sol[k][0]), avg, atol=1e-8), (k, spec.module)
            assert sol[k][1] < 1e-6
    assert cross.layer_systems(dump).__next__()[1].shape == (3, 3, 9)   # conv [W | b]: 3 x (2*2*2 + 1)
    avg = cross.fedavg_params(dump)   # FedAvg of the clients: the p-weighted average, which equal factors' EA equals
    for k, v in avg.items():
        assert torch.allclose(v, sum(p * c[k].double() for p, c in zip(dump["p"], dump["clients"])))
        assert torch.allclose(v, sol["ea"][0][k].double(), atol=1e-8)
    # different factors: EA is not the solution, CG is (dense check on the Kronecker system)
    dump = _fake_dump(shared_factors=False)
    sol = cross.solve_all(dump, torch.float64, gd_lr=0.01, gd_steps=10)
    for spec, Ms, As, Gs in cross.layer_systems(dump):
        p = torch.tensor(dump["p"], dtype=torch.float64)
        K = sum(pk * torch.kron(A.double(), G.double()) for pk, A, G in zip(p, As, Gs))   # vec(G M A) = (A ⊗ G) vec(M)
        z = sum(pk * torch.kron(A.double(), G.double()) @ M.double().T.reshape(-1) for pk, A, G, M in zip(p, As, Gs, Ms))
        exact = torch.linalg.solve(K, z).reshape(Ms.shape[2], Ms.shape[1]).T
        assert torch.allclose(spec.to_matrix(sol["cg"][0]), exact, atol=1e-6)
        assert not torch.allclose(spec.to_matrix(sol["ea"][0]), exact, atol=1e-3)
    assert sol["cg"][1] < 1e-7 and sol["ea"][1] > 1e-3
    only_gd = cross.solve_all(dump, torch.float32, gd_lr=0.01, gd_steps=10, solvers=("gd",))
    assert set(only_gd) == {"gd"} and set(only_gd["gd"][0]) == {"conv.weight", "conv.bias", "fc.weight"}
    # a step far above the stability limit: GD overflows to non-finite weights (residual NaN) and the worst residual
    # is inf (a plain max() over the layers passes over a NaN that follows a finite residual)
    wild = cross.solve_all(dump, torch.float64, gd_lr=1e6, gd_steps=400, solvers=("gd",))["gd"]
    assert not all(torch.isfinite(v).all() for v in wild[0].values()) and wild[1] == float("inf")


def test_fedlpa_cross_server_pairs_equal_sized_clients_by_their_factors(tmp_path, monkeypatch):
    """A released dump lists its clients in its own shuffled order; on a split whose clients all have one size
    (`#C=k` splits have several 4,500-sample clients) the size cannot pair them, the factors can: a dump built from
    fedbench's own factors in a permuted order is paired back exactly, and sizes that fedbench's split lacks fail."""
    import torch
    from fedbench.algorithms.fedlpa import CURVATURE
    from fedbench.config.compose import compose_config
    from fedbench.curvature.compute import compute_curvature
    from fedbench.curvature.damping import damp_kfac
    from fedbench.run.setup import build_setup
    monkeypatch.setenv("FEDBENCH_DATA", str(tmp_path / "data"))
    cross = _cross()
    overrides = ["dataset=synthetic", "dataset.kwargs.like=fmnist", "dataset.kwargs.train_size=300",
                 "dataset.kwargs.test_size=50", "model=simple_cnn", "num_clients=3", "partition=homo"]
    cfg = compose_config(overrides + ["algorithm=fedlpa", "hardware=cpu", "cache=false"])
    run = build_setup(cfg)
    assert len(set(run.client_sizes)) == 1   # every client has one size: sizes alone cannot pair them
    model, g = run.fl.model, torch.Generator().manual_seed(1)
    perm, clients, factors = [2, 0, 1], [], []
    for k in perm:
        sd = {n: v + 0.1 * torch.randn(v.shape, generator=g) for n, v in model.state_dict().items()}
        model.load_state_dict(sd)
        idx = run.fl.client_indices[k]
        curv = compute_curvature(model, run.fl.train.inputs(idx), run.fl.train.y[idx], batch_size=64, **CURVATURE)
        clients.append(sd)
        factors.append({n: damp_kfac(b.A.detach(), b.G.detach(), float(cfg.algorithm.damping), cfg.algorithm.pi)
                        for n, b in curv.blocks.items()})
    n = sum(run.client_sizes)
    dump = {"clients": clients, "factors": factors, "p": [run.client_sizes[k] / n for k in perm]}
    mine, worst = cross.fedbench_factors(dump, overrides)
    assert worst < 1e-6
    for got, want in zip(mine, factors):
        for name, (A, G) in want.items():
            assert torch.allclose(got[name][0], A) and torch.allclose(got[name][1], G)
    # a client that the split does not have (another size) is rejected, not paired
    with pytest.raises(SystemExit):
        cross.fedbench_factors({**dump, "p": [0.5, 0.25, 0.25]}, overrides)


def test_fedlap_val_vs_test_nll_needs_a_saved_model(tmp_path, capsys):
    mod = load_script("gaps/fedlap_val_vs_test_nll.py")
    (tmp_path / "metrics.json").write_text("{}")
    assert mod.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no metrics.json and model.pt" in err and len(err.strip().splitlines()) == 1


def _client_accuracy():
    return load_script("gaps/client_accuracy.py")


def test_client_accuracy_reads_the_cached_clients(tmp_path, monkeypatch, capsys):
    """The clients read back from a finished run's cache score, size-weighted, the record's own local accuracy (the
    round loop's mean of the same clients' test accuracies); a seed that never ran is reported, not trained."""
    import json
    from tests.test_run import SMALL, records, run
    args = [a for a in SMALL if a != "rounds=2"] + ["rounds=1", "eval.local_accuracy=true"]
    run(args + ["seed=0"], tmp_path)
    (rec_path,) = records(tmp_path)
    rec = json.loads(rec_path.read_text())
    monkeypatch.setenv("FEDBENCH_OUTPUTS", str(tmp_path / "out"))
    monkeypatch.setenv("FEDBENCH_DATA", str(tmp_path / "data"))
    mod = _client_accuracy()
    sizes, accs = mod.fedbench_clients(args, 0)
    assert sizes == rec["partition"]["client_sizes"] and len(accs) == 3
    mean = sum(a * n for a, n in zip(accs, sizes)) / sum(sizes)
    assert abs(mean - rec["metrics"]["local_accuracy"]) < 1e-6
    assert mod.fedbench_clients(args, 1)[1] is None
    assert mod.main(["--seeds", "0", "1", "--", *args]) == 0
    out = capsys.readouterr().out
    assert "seed 1: its client stage is not in the cache" in out and f"| fedbench seed 0 | {accs[0]:.2f} |" in out
    assert mod.main(["--seeds", "0", "--released", str(tmp_path), "--", *args]) == 2
    assert "has no experiments_our.py" in capsys.readouterr().err
    assert mod.main(["--seeds", "0", "--", *args, "model=no_such_model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1
