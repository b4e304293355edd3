"""Local parallel sweeps (fedbench/launch/parallel.py): job counts, isolation of failures, summaries."""
import os
import sys

import pytest
import torch

from fedbench.errors import FedbenchError
from fedbench.launch import jobs, parallel
from fedbench.results.records import read_record
from tests.test_run import records, run

TINY = ["dataset=synthetic", "dataset.kwargs.like=fmnist", "dataset.kwargs.train_size=120",
        "dataset.kwargs.test_size=60", "model=lenet", "rounds=1", "local.epochs=0", "hardware=cpu",
        "progress=false"]


def test_parallel_jobs_and_threads(monkeypatch):
    monkeypatch.setattr(parallel, "available_cores", lambda: 8)
    assert parallel.threads_per_job("auto") == parallel.DEFAULT_THREADS_PER_JOB
    assert parallel.threads_per_job(4) == 4
    assert parallel.parallel_jobs("auto", 2, "cpu") == 4          # 8 cores // 2 threads
    assert parallel.parallel_jobs("auto", 16, "cpu") == 1         # never zero
    assert parallel.parallel_jobs(3, 2, "cpu") == 3               # explicit wins
    assert parallel.parallel_jobs("auto", 1, "cuda") == 1         # one GPU: one job
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert parallel.parallel_jobs("auto", "auto", "auto") == 8 // parallel.DEFAULT_THREADS_PER_JOB
    for bad in (0, -1, "x", True):
        with pytest.raises(FedbenchError, match="hardware.jobs"):
            parallel.parallel_jobs(bad, 1, "cpu")
    with pytest.raises(FedbenchError, match="num_threads"):
        parallel.threads_per_job(0)


def test_slices_deal_round_robin():
    assert parallel.slices(list("abcde"), 2) == [["a", "c", "e"], ["b", "d"]]
    assert parallel.slices(list("ab"), 8) == [["a"], ["b"]]


def test_run_isolated_turns_every_failure_into_one_line(tmp_path, capsys):
    n = torch.get_num_threads()
    try:
        def boom():
            raise RuntimeError("bad\nnumbers")
        out = parallel.run_isolated(boom, "seed=1", num_threads=1, output_dir=tmp_path)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(n)
    assert (out["ok"], out["failed"], out["skipped"]) == (0, 1, 0)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedbench: error: [seed=1] RuntimeError: bad numbers (traceback: ")
    assert "RuntimeError" in (tmp_path / "traceback.txt").read_text()

    def config_error():
        raise FedbenchError("num_clients must be >= 1, got 0")
    out = parallel.run_isolated(config_error, "num_clients=0")
    assert out["errors"] == ["[num_clients=0] num_clients must be >= 1, got 0"]
    recs = [{"run_id": "a", "status": "ok"}, {"run_id": "b", "status": "ok", "skipped": True},
            {"run_id": "c", "status": "failed", "error": "ValueError: x"}]
    out = parallel.run_isolated(lambda: recs, "aggregators=[...]")
    assert (out["ok"], out["failed"], out["skipped"]) == (1, 1, 1)
    total = parallel.merge_outcomes([out, parallel.run_isolated(config_error, "x")])
    assert parallel.summary_line(total) == "fedbench: sweep: 1 ok, 2 failed, 1 skipped"


def test_multirun_one_invalid_combination_does_not_end_the_sweep(tmp_path):
    # a value invalid on its own is rejected before the sweep starts (one line, exit 2, nothing run) ...
    p = run(["-m", *TINY, "num_clients=0,2"], tmp_path, expect=2)
    assert p.stderr.strip() == "fedbench: error: num_clients=0 is not allowed: num_clients must be an integer >= 1"
    assert records(tmp_path) == []
    # ... a combination that fails only on the data (more clients than the 120 samples) fails alone
    p = run(["-m", *TINY, "num_clients=1000,2", "hardware.jobs=2"], tmp_path, expect=1)
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("fedbench: error:")]
    assert len(errors) == 1 and errors[0].endswith("] num_clients=1000 exceeds the 120 samples; use fewer clients")
    assert "fedbench: sweep: 1 ok, 1 failed, 0 skipped" in p.stderr
    (rec,) = [read_record(r) for r in records(tmp_path)]
    assert rec["status"] == "ok" and rec["config"]["num_clients"] == 2


def test_multirun_runs_jobs_in_parallel_processes(tmp_path):
    p = run(["-m", *TINY, "num_clients=2", "seed=0,1,2", "hardware.jobs=2"], tmp_path)
    assert "n_jobs=2" in p.stdout + p.stderr   # Hydra's joblib launcher, two processes
    assert "fedbench: sweep: 3 ok, 0 failed, 0 skipped" in p.stdout
    recs = [read_record(r) for r in records(tmp_path)]
    assert sorted(r["config"]["seed"] for r in recs) == [0, 1, 2] and all(r["status"] == "ok" for r in recs)
    assert not list((tmp_path / "out" / "runs").glob(".sweep-status-*"))   # the status folder is cleaned up


def test_multirun_bad_job_count_is_one_line_before_any_job(tmp_path):
    p = run(["-m", *TINY, "seed=0,1", "hardware.jobs=0"], tmp_path, expect=2)
    assert p.stderr.strip().splitlines()[-1] == ("fedbench: error: hardware.jobs=0 is not allowed: "
                                                  "hardware.jobs must be auto or an integer >= 1 (runs of a sweep at once)")
    assert "Traceback" not in p.stderr and records(tmp_path) == []


def test_run_local_isolates_and_runs_every_job(tmp_path, monkeypatch):
    """reproduce.py's path: joblib workers, one bad run among good ones."""
    monkeypatch.setenv("FEDBENCH_OUTPUTS", str(tmp_path / "out"))
    monkeypatch.setenv("FEDBENCH_DATA", str(tmp_path / "data"))
    todo = [TINY + ["num_clients=2", "seed=0"], TINY + ["num_clients=0"], TINY + ["num_clients=2", "seed=1"]]
    total = jobs.run_local(todo, os.getcwd(), jobs=2)
    assert (total["ok"], total["failed"], total["skipped"]) == (2, 1, 0)
    assert len(total["errors"]) == 1 and "num_clients must be an integer >= 1" in total["errors"][0]
    assert sorted(read_record(r)["config"]["seed"] for r in records(tmp_path)) == [0, 1]
    total = jobs.run_local(todo[:1], os.getcwd(), jobs=2)   # in-process (one job): skipped now
    assert (total["ok"], total["failed"], total["skipped"]) == (0, 0, 1)



def test_busy_last_puts_off_runs_another_process_holds(capsys):
    todo = [["seed=0"], ["seed=1"], ["seed=2"], ["seed=3"]]
    busy = {("seed=1",), ("seed=2",)}
    assert list(jobs.busy_last(todo, lambda ovs: tuple(ovs) in busy)) == [["seed=0"], ["seed=3"], ["seed=1"], ["seed=2"]]
    err = capsys.readouterr().err
    assert "seed=1 is being run by another process; left for the end of this sweep" in err and "seed=0" not in err


def test_claimed_elsewhere_sees_a_live_claim_on_any_aggregator_of_the_run(tmp_path, monkeypatch):
    from fedbench.config import CONF_DIR
    from fedbench.config.aggregators import expand_aggregators
    from fedbench.launch.sweep import compose_run, run_dir
    from fedbench.results.claims import claim
    monkeypatch.setenv("FEDBENCH_OUTPUTS", str(tmp_path / "out"))
    job = TINY + ["num_clients=2", "aggregators=[fedavg,fednova]"]
    second = run_dir(expand_aggregators(compose_run(job), CONF_DIR)[1], os.getcwd())
    assert not jobs.claimed_elsewhere(job, os.getcwd())
    with claim(second / ".claim", "the second aggregator's run"):   # held by a live holder: this process
        assert jobs.claimed_elsewhere(job, os.getcwd())
        assert not jobs.claimed_elsewhere(TINY + ["num_clients=3", "aggregators=[fedavg,fednova]"], os.getcwd())
    assert not jobs.claimed_elsewhere(job, os.getcwd())   # released
    assert not jobs.claimed_elsewhere(TINY + ["model=nosuchmodel"], os.getcwd())   # its job reports the error



def test_stage_groups_keep_a_share_epochs_setting_on_one_worker(capsys):
    """fola/figure3's E values of one setting share one training (share_epochs): they form one group, in order,
    and a group goes to one worker or slice whole; runs outside share_epochs, or differing in more than E, do not
    group. Before, two workers (or two local slices) each trained the same setting's 20 epochs."""
    from fedbench.launch.sweep import expand_sweep
    from fedbench.config import CONF_DIR
    todo = expand_sweep(["experiment=fola/figure3", "profile=quick", "partition.alpha=0.01", "num_clients=5",
                         "local.lr=0.1"], CONF_DIR)
    assert [o for o in todo[0] if o.startswith("local.epochs=")] == ["local.epochs=1"] and len(todo) == 4
    groups = list(jobs.stage_groups(todo))
    assert groups == [todo[0:2], todo[2:4]]   # E = 1, 2 of B = 32, then of B = 128
    # no share_epochs, or an E it does not list: every run alone
    assert list(jobs.stage_groups([ovs + ["share_epochs=[]"] for ovs in todo[:2]])) == \
        [[todo[0] + ["share_epochs=[]"]], [todo[1] + ["share_epochs=[]"]]]
    three = [o if not o.startswith("local.epochs=") else "local.epochs=3" for o in todo[1]]
    assert list(jobs.stage_groups([todo[0], three])) == [[todo[0]], [three]]
    # slices deal whole groups
    assert jobs.stage_slices(todo, 2) == [todo[0:2], todo[2:4]]
    assert jobs.stage_slices(todo, 1) == [todo]
    # a group one of whose runs another process holds is put off whole
    busy = {tuple(todo[1])}
    order = list(jobs.busy_last(groups, lambda g: any(tuple(o) in busy for o in g)))
    assert order == [groups[1], groups[0]]
    assert "(and 1 run(s) sharing its training) is being run by another process" in capsys.readouterr().err


@pytest.mark.parametrize("checked_before_the_claim", [False, True])
def test_a_second_launcher_runs_what_the_first_holds_last(tmp_path, monkeypatch, capsys, checked_before_the_claim):
    """Another process holds seed 0's claim until seed 1 is done: the sweep runs seed 1 first instead of waiting out
    the holder. Either busy_last sees the claim, or (checked_before_the_claim: the race busy_last cannot see, both
    launchers having finished their previous run at one moment, the other claiming just after this one's check) the
    claim itself hands seed 0 to the sweep's second pass. Before, the second case waited out the other's whole run."""
    from fedbench.launch.sweep import compose_run, run_dir
    from tests.test_claims import claimed_in_another_thread
    monkeypatch.setenv("FEDBENCH_OUTPUTS", str(tmp_path / "out"))
    monkeypatch.setenv("FEDBENCH_DATA", str(tmp_path / "data"))
    if checked_before_the_claim:
        monkeypatch.setattr(jobs, "claimed_elsewhere", lambda *a: False)
    todo = [TINY + ["num_clients=2", f"seed={s}"] for s in (0, 1)]
    first, second = (run_dir(compose_run(ovs), os.getcwd()) for ovs in todo)
    with claimed_in_another_thread(first / ".claim", "seed 0 elsewhere",
                                   until=lambda: (second / "metrics.json").exists()) as other:
        total = jobs.run_local(todo, os.getcwd(), jobs=1)
    assert other["until_met"]   # seed 1 finished while seed 0 was held
    assert (total["ok"], total["failed"], total["skipped"]) == (2, 0, 0)   # seed 0 counted once
    err = capsys.readouterr().err
    assert "left for the end of this sweep" in err and ("is claimed by" in err or not checked_before_the_claim)
    assert [read_record(first / "metrics.json")["status"], read_record(second / "metrics.json")["status"]] == ["ok", "ok"]


def test_a_group_goes_back_whole_and_the_second_pass_waits(monkeypatch):
    """local_group: a busy first run hands back its whole share_epochs group; once a run of the group trained, the
    rest waits (wait_for_claim=True). in_two_passes: busy groups rerun last, waiting, and count once."""
    calls, busy = [], {"b1"}

    def fake_job(ovs, launch_dir, env, wait):
        calls.append((ovs[0], wait))
        if ovs[0] in busy and not wait:
            return parallel.busy_outcome()
        return {"ok": 1, "failed": 0, "skipped": 0, "errors": []}
    monkeypatch.setattr(jobs, "local_job", fake_job)
    assert jobs.local_group([["b1"], ["b2"]], ".", None, False)["busy"]
    assert calls == [("b1", False)]   # b2 not started: the group goes back whole
    calls.clear()
    busy = {"a2"}
    assert jobs.local_group([["a1"], ["a2"]], ".", None, False)["ok"] == 2
    assert calls == [("a1", False), ("a2", True)]   # a1 trained: a2 waits its turn
    calls.clear()
    busy = {"b1"}
    groups = [[["a1"]], [["b1"], ["b2"]], [["c1"]]]
    total = jobs.in_two_passes(iter(groups), lambda gs, wait: [jobs.local_group(g, ".", None, wait) for g in gs])
    assert (total["ok"], total["failed"], total["skipped"]) == (4, 0, 0)
    assert calls == [("a1", False), ("b1", False), ("c1", False), ("b1", True), ("b2", True)]


def test_a_list_hands_itself_back_only_while_it_has_trained_nothing(tmp_path, monkeypatch):
    """execute_all without waiting: the first aggregator held elsewhere raises ClaimHeld with nothing written; the
    second held once the first has trained is waited for (a retry would count the first twice)."""
    import time
    from fedbench.config import CONF_DIR
    from fedbench.config.aggregators import expand_aggregators
    from fedbench.launch.sweep import compose_run, run_dir
    from fedbench.results.claims import ClaimHeld
    from fedbench.runner import execute_all
    from tests.test_claims import claimed_in_another_thread
    monkeypatch.setenv("FEDBENCH_OUTPUTS", str(tmp_path / "out"))
    monkeypatch.setenv("FEDBENCH_DATA", str(tmp_path / "data"))
    cfg = compose_run(TINY + ["num_clients=2", "aggregators=[fedavg,fednova]"])
    dirs = [run_dir(sub, os.getcwd()) for sub in expand_aggregators(cfg, CONF_DIR)]
    with claimed_in_another_thread(dirs[0] / ".claim", "fedavg elsewhere"):
        with pytest.raises(ClaimHeld):
            execute_all(cfg, run_dir(cfg, os.getcwd()), CONF_DIR, launch_dir=os.getcwd(), wait_for_claim=False)
    assert not any((d / "metrics.json").exists() for d in dirs)
    with claimed_in_another_thread(dirs[1] / ".claim", "fednova elsewhere",
                                   until=lambda: (dirs[0] / "metrics.json").exists(), linger_s=0.5) as other:
        recs = execute_all(cfg, run_dir(cfg, os.getcwd()), CONF_DIR, launch_dir=os.getcwd(), wait_for_claim=False)
    assert [r["status"] for r in recs] == ["ok", "ok"] and not any(r.get("skipped") for r in recs)
    assert read_record(dirs[1] / "metrics.json")["finished"] >= time.strftime("%Y-%m-%dT%H:%M:%S",
                                                                                time.localtime(other["released_at"] - 1))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
