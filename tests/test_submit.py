"""scripts/submit.py machinery: sweep expansion, skip-if-done, a real submitit job array (local executor)."""
import os


from fedbench.launch.submit import submit
from fedbench.launch.sweep import expand_sweep, plan

TINY = ["dataset=synthetic", "dataset.kwargs.like=fmnist", "dataset.kwargs.train_size=200",
        "dataset.kwargs.test_size=100", "model=lenet", "num_clients=2", "rounds=1", "local.epochs=0",
        "hardware=cpu", "progress=false"]


def test_expand_sweep_cartesian():
    runs = expand_sweep(TINY + ["seed=0,1,2", "partition.beta=0.1,0.5"])
    assert len(runs) == 6
    assert all(r[: len(TINY)] == TINY for r in runs)
    assert {tuple(r[len(TINY):]) for r in runs} == {(f"seed={s}", f"partition.beta={b}")
                                                   for s in (0, 1, 2) for b in (0.1, 0.5)}


def test_local_array_runs_and_resubmit_skips(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDBENCH_OUTPUTS", str(tmp_path / "out"))
    monkeypatch.setenv("FEDBENCH_DATA", str(tmp_path / "data"))
    sweep = TINY + ["seed=0,1"]
    jobs, todo, done = submit(sweep, cluster="local", folder=str(tmp_path / "submitit" / "%j"),
                              launch_dir=os.getcwd(), params={"timeout_min": 10})
    assert len(jobs) == 2 and done == []
    results = [j.result() for j in jobs]   # the test waits; submit() itself returned at once
    assert all(r["status"] == ["ok"] for r in results)
    assert len(list((tmp_path / "out" / "runs").glob("*/metrics.json"))) == 2
    todo, done = plan(sweep, os.getcwd())
    assert todo == [] and len(done) == 2
    todo, done = plan(sweep + ["force=true"], os.getcwd())   # the run's own force switch reaches the plan
    assert len(todo) == 2 and done == []
    jobs, _, _ = submit(sweep + ["seed=0,1,2"], cluster="local", folder=str(tmp_path / "submitit" / "%j"),
                        launch_dir=os.getcwd())
    assert len(jobs) == 1  # only the missing seed
    assert jobs[0].result()["status"] == ["ok"]
