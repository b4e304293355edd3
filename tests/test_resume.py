"""Round checkpoints (fedbench/fl/resume.py): a run killed after round 2 of 4 and started again must give the
same history and final weights as the same run in one go, for every method that says it is resumable."""
import csv
import json

import pytest
import torch

import fedbench.fl.loop as loop
from fedbench.algorithms import ALGORITHMS
from fedbench.config.compose import compose_config
from fedbench.results.records import compute_run_id
from fedbench.runner import execute

SMALL = ["dataset=synthetic", "dataset.kwargs.like=fmnist", "dataset.kwargs.train_size=300",
         "dataset.kwargs.test_size=100", "model=mlp_200_100", "num_clients=4", "rounds=4", "local.epochs=1",
         "local.batch_size=32", "hardware=cpu", "progress=false", "save_model=true", "cache=false",
         "partition=size_class_dirichlet"]
EXTRA = {"fedlap_func": ["algorithm.server_iters=15"], "fedlap_cov": ["algorithm.mc_samples=1"],
         "fedlpa": ["algorithm.gd_steps=20"], "fedlpa_then_fedavg": ["algorithm.gd_steps=20"]}
RESUMABLE = sorted(n for n in set(ALGORITHMS.names()) if getattr(ALGORITHMS.get(n), "resumable", False))


def _cfg(name, *more):
    return compose_config([*SMALL, f"algorithm={name}", *EXTRA.get(name, []), *more])


def _run(cfg, tmp_path, sub):
    out = tmp_path / sub / compute_run_id(cfg)
    execute(cfg, out)
    return out


def _history(out):
    rows = list(csv.DictReader(open(out / "history.csv")))
    return [{k: r[k] for k in ("round", "accuracy", "nll", "train_loss")} for r in rows]


def _kill_at(monkeypatch, round_idx):
    real = loop.run_round

    def dying(setup, algo, state, r, *a, **k):
        if r == round_idx:
            raise KeyboardInterrupt   # the session's end
        return real(setup, algo, state, r, *a, **k)
    monkeypatch.setattr(loop, "run_round", dying)


def test_the_resumable_methods_are_the_expected_ones():
    # a new resumable method must come with its state in the state dict; this list says which are checked below
    assert RESUMABLE == ["fedavg", "feddyn", "fedlap", "fedlap_cov", "fedlap_func", "fedlpa", "fedlpa_then_fedavg",
                         "fednova", "fedprox", "fola", "scaffold"]


# FOLA also as fola/figure5 runs it (the code's squared minibatch gradient with the live prior removed, clipping)
# and as FOLA-offline (its Fisher from one pass after training)
FOLA_VARIANTS = {"fola_figure5": ["algorithm.lambda_prior=100.0", "algorithm.round_scaling=code",
                                  "algorithm.fisher.grad=minibatch_sq", "algorithm.fisher.normalize=none",
                                  "local.clip_grad_norm=0.5"],
                 "fola_offline": ["algorithm.fisher.mode=offline", "algorithm.lambda_prior=10.0"]}
CASES = [pytest.param(n, [], id=n) for n in RESUMABLE] + [pytest.param("fola", v, id=k) for k, v in FOLA_VARIANTS.items()]


@pytest.mark.parametrize("name,more", CASES)
def test_killed_run_resumes_to_the_same_result(name, more, tmp_path, monkeypatch):
    cfg = _cfg(name, "checkpoint_every_s=1e-9", *more)
    whole = _run(cfg, tmp_path, "whole")
    assert not (whole / "resume.pt").exists()

    _kill_at(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        _run(cfg, tmp_path, "split")
    split = tmp_path / "split" / compute_run_id(cfg)
    assert (split / "resume.pt").exists()
    assert json.loads((split / "metrics.json").read_text())["status"] == "failed"   # "interrupted", not ok
    first_started = json.loads((split / "metrics.json").read_text())["started"]
    monkeypatch.undo()
    torch.manual_seed(12345)   # the resumed run must not depend on the new process's generators
    _run(cfg, tmp_path, "split")

    assert _history(split) == _history(whole)
    a, b = torch.load(whole / "model.pt"), torch.load(split / "model.pt")
    for n in a["params"]:
        assert torch.equal(a["params"][n], b["params"][n]), n
    rec = json.loads((split / "metrics.json").read_text())
    assert rec["status"] == "ok" and rec["rounds_completed"] == 4 and rec["resumed_after_rounds"] == [2]
    assert rec["started"] == first_started   # the run began at its first start
    assert not (split / "resume.pt").exists()   # a finished run leaves no resume file
    assert "resumed_after_rounds" not in json.loads((whole / "metrics.json").read_text())


def test_no_checkpoint_when_off_or_not_resumable(tmp_path, monkeypatch):
    _kill_at(monkeypatch, 2)
    for sub, cfg in (("off", _cfg("fedavg", "checkpoint_every_s=0")), ("nores", _cfg("fedcurv", "checkpoint_every_s=1e-9"))):
        with pytest.raises(KeyboardInterrupt):
            _run(cfg, tmp_path, sub)
        assert not (tmp_path / sub / compute_run_id(cfg) / "resume.pt").exists()


def test_a_foreign_or_broken_resume_file_is_set_aside(tmp_path, capsys):
    cfg = _cfg("fedavg", "checkpoint_every_s=1e-9")
    out = tmp_path / "r" / compute_run_id(cfg)
    out.mkdir(parents=True)
    (out / "resume.pt").write_bytes(b"not a checkpoint")
    execute(cfg, out)
    assert "set aside as resume.pt.bad" in capsys.readouterr().err
    assert (out / "resume.pt.bad").exists() and json.loads((out / "metrics.json").read_text())["rounds_completed"] == 4


def test_checkpoint_every_s_is_validated_and_not_part_of_the_run_id():
    from fedbench.config.validate import validate_config
    from fedbench.errors import FedbenchError
    assert compute_run_id(_cfg("fedavg", "checkpoint_every_s=5")) == compute_run_id(_cfg("fedavg"))
    with pytest.raises(FedbenchError, match="checkpoint_every_s"):
        validate_config(_cfg("fedavg", "checkpoint_every_s=-1"))


def test_a_resume_file_of_other_numerics_is_not_used(tmp_path, monkeypatch, capsys):
    # a method whose arithmetic changed (fedbench/numerics.py bumped) must not go on from the old state
    import fedbench.runner as runner
    cfg = _cfg("fedlap", "checkpoint_every_s=1e-9")
    _kill_at(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        _run(cfg, tmp_path, "n")
    monkeypatch.undo()
    real = runner.numerics.current
    monkeypatch.setattr(runner.numerics, "current", lambda name: {**real(name), "method": -1})
    out = _run(cfg, tmp_path, "n")
    assert "numerics version; set aside" in capsys.readouterr().err
    rec = json.loads((out / "metrics.json").read_text())
    assert rec["status"] == "ok" and "resumed_after_rounds" not in rec and (out / "resume.pt.bad").exists()


def test_a_parked_checkpoint_takes_a_run_on_to_a_fresh_machine(tmp_path, monkeypatch, capsys):
    """A session ends after round 2 of 4: park_checkpoints copies the run's resume file into the committed store;
    on a fresh machine (an empty output folder) the run goes on from it and ends as the run in one go would. Parking
    again drops the parked file of the finished run; a later round is never replaced by an earlier one."""
    from fedbench.fl.resume import park_checkpoints
    store = tmp_path / "checkpoints"
    monkeypatch.setenv("FEDBENCH_CHECKPOINTS", str(store))
    cfg = _cfg("fedavg", "checkpoint_every_s=1e-9")
    rid = compute_run_id(cfg)
    whole = _run(cfg, tmp_path / "one_go", "runs")
    _kill_at(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        _run(cfg, tmp_path / "old_machine", "runs")
    monkeypatch.undo()
    monkeypatch.setenv("FEDBENCH_CHECKPOINTS", str(store))
    assert park_checkpoints(tmp_path / "old_machine", store) == {"parked": [f"{rid} (round 2)"], "kept": [], "removed": []}
    assert park_checkpoints(tmp_path / "old_machine", store)["kept"] == [rid]   # the same round: kept
    fresh = _run(cfg, tmp_path / "new_machine", "runs")
    assert "goes on from its parked checkpoint" in capsys.readouterr().err
    rec = json.loads((fresh / "metrics.json").read_text())
    assert rec["status"] == "ok" and rec["resumed_after_rounds"] == [2]
    assert _history(fresh) == _history(whole)
    a, b = torch.load(whole / "model.pt"), torch.load(fresh / "model.pt")
    assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
    assert (store / f"{rid}.pt").exists()   # the store is only changed by parking
    assert park_checkpoints(tmp_path / "new_machine", store, finished={rid})["removed"] == [rid]
    assert not (store / f"{rid}.pt").exists()


def test_the_finished_stage_of_a_run_killed_in_its_solve_is_parked_for_a_fresh_machine(tmp_path, monkeypatch, capsys):
    """A one-shot FedLPA run is killed after its clients and their curvature are in the cache (as a run in its
    server solves at a session's end): parking copies the entries it used into the store with its run id; on a fresh
    machine (empty outputs and cache) the run loads them from there, trains no client, and ends as the run in one go
    would; once it has its record, parking there removes them. A finished run's entries are not parked."""
    from fedbench.fl.cache import park_stages
    from fedbench.results.records import is_complete
    store = tmp_path / "checkpoints"
    monkeypatch.setenv("FEDBENCH_CHECKPOINTS", str(store))

    def cfg_on(machine):
        return _cfg("fedlpa", "rounds=1", "cache=true", f"paths.cache_dir={tmp_path / machine / 'cache'}")

    def has_record(machine):
        return lambda r: is_complete(tmp_path / machine / "runs" / r / "metrics.json", r)

    rid = compute_run_id(cfg_on("old"))
    assert compute_run_id(cfg_on("new")) == rid
    whole = _run(cfg_on("one_go"), tmp_path / "one_go", "runs")
    assert park_stages(tmp_path / "one_go" / "cache", tmp_path / "other_store", has_record("one_go"))["entries"] == []

    def dying(*a, **k):
        raise KeyboardInterrupt   # the session's end, after the aggregation's solve
    monkeypatch.setattr(loop, "evaluate_round", dying)
    with pytest.raises(KeyboardInterrupt):
        _run(cfg_on("old"), tmp_path / "old", "runs")
    monkeypatch.undo()
    monkeypatch.setenv("FEDBENCH_CHECKPOINTS", str(store))
    done = park_stages(tmp_path / "old" / "cache", store, has_record("old"))
    entries = sorted((tmp_path / "old" / "cache").glob("*/*.pt"))
    assert len(entries) >= 2   # the clients' training and their curvature
    assert done == {"parked": [], "removed": [], "entries": [f"{e.stem} (for run(s) {rid})" for e in entries]}
    parked = sorted((store / "stages").glob("*.pt"))
    assert [p.name for p in parked] == sorted(e.name for e in entries)
    assert all(p.with_suffix(".users").read_text() == f"{rid}\n" for p in parked)

    fresh = _run(cfg_on("new"), tmp_path / "new", "runs")
    assert capsys.readouterr().err.count("comes from its parked copy") == len(parked)
    rec = json.loads((fresh / "metrics.json").read_text())
    assert rec["status"] == "ok" and rec["cache"]["misses"] == 0
    assert _history(fresh) == _history(whole)
    a, b = torch.load(whole / "model.pt"), torch.load(fresh / "model.pt")
    assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
    done = park_stages(tmp_path / "new" / "cache", store, has_record("new"))
    assert done["entries"] == [] and done["removed"] == [p.stem for p in parked]
    assert not list((store / "stages").iterdir())
