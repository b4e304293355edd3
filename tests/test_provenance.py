"""Provenance and isolation: numerics versions, committed records, stale records, one failing aggregator."""
import json
import shutil

import torch

from fedbench import numerics
from fedbench.runner import cpu_description
from fedbench.results.records import is_complete, publish_record, read_record, write_json_atomic
from tests.conftest import ok_record
from tests.test_run import SMALL, records, run


def test_record_says_which_code_and_numerics_made_it(tmp_path):
    run(SMALL + ["rounds=1"], tmp_path)
    (path,) = records(tmp_path)
    rec = json.loads(path.read_text())
    assert rec["numerics"] == {"core": numerics.CORE, "method": numerics.method_version("fedavg")}
    assert "git_dirty" in rec["environment"] and rec["environment"]["git_dirty"] in (True, False, None)
    assert rec["environment"]["cpu"].endswith(f"({torch.backends.cpu.get_cpu_capability()})")   # which machine


def test_cpu_description_tells_apart_machines_with_one_model_name():
    """Two virtual machines both called 'AMD EPYC' (a Zen 2 and a Zen 4) trained one FedLPA run id to 89.43 and
    91.42 at round 1: the record must say which generation made it."""
    zen4 = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n\n" \
           "processor\t: 1\ncpu family\t: 99\nmodel\t\t: 1\nmodel name\t: other\n"
    zen2 = zen4.replace(": 25", ": 23").replace(": 17", ": 49")
    assert cpu_description(zen4, "x86_64", "AVX512") == "AMD EPYC, family 25 model 17 (AVX512)"
    assert cpu_description(zen2, "x86_64", "AVX2") == "AMD EPYC, family 23 model 49 (AVX2)"
    assert cpu_description("", "aarch64", "DEFAULT") == "aarch64 (DEFAULT)"     # no /proc/cpuinfo


def test_stale_numerics_are_rerun_not_skipped(tmp_path):
    run(SMALL + ["rounds=1"], tmp_path)
    (path,) = records(tmp_path)
    rec = json.loads(path.read_text())
    write_json_atomic(path, {**rec, "numerics": {"core": numerics.CORE - 1, "method": 1}})
    assert not is_complete(path, rec["run_id"]) and is_complete(path, rec["run_id"], current=False)
    p = run(SMALL + ["rounds=1"], tmp_path)
    assert "skipped" not in p.stdout
    assert json.loads(path.read_text())["numerics"]["core"] == numerics.CORE


def test_committed_record_is_skipped_on_a_fresh_machine(tmp_path, monkeypatch):
    run(SMALL + ["rounds=1"], tmp_path)
    (path,) = records(tmp_path)
    store = tmp_path / "committed"
    target = publish_record(path.parent, store)
    assert sorted(p.name for p in target.iterdir()) == ["history.csv", "metrics.json"]   # no weights
    assert publish_record(target, store) is None                     # the store's own copy is not republished
    committed = (target / "metrics.json").read_bytes()
    rec = json.loads(path.read_text())
    write_json_atomic(path, {**rec, "wall_seconds": 12345.0})         # a rerun of the same run id
    assert publish_record(path.parent, store) == target
    assert (target / "metrics.json").read_bytes() == committed       # never replaces the committed copy
    write_json_atomic(target / "metrics.json", {**rec, "status": "failed"})
    publish_record(path.parent, store)                               # ... but a failed one is replaced
    assert json.loads((target / "metrics.json").read_text())["wall_seconds"] == 12345.0
    forced = {**rec, "wall_seconds": 7.0, "config": {**rec["config"], "force": True}, "finished": "2999-01-01T00:00:00"}
    write_json_atomic(path, forced)                                   # a forced rerun (after a fix) replaces it
    publish_record(path.parent, store)
    assert json.loads((target / "metrics.json").read_text())["wall_seconds"] == 7.0
    write_json_atomic(path, {**forced, "wall_seconds": 8.0, "finished": "2000-01-01T00:00:00"})
    publish_record(path.parent, store)                               # ... but not with an older one
    assert json.loads((target / "metrics.json").read_text())["wall_seconds"] == 7.0
    shutil.rmtree(tmp_path / "out")                                  # a fresh clone: no outputs/
    monkeypatch.setenv("FEDBENCH_RECORDS", str(store))
    p = run(SMALL + ["rounds=1"], tmp_path)
    assert "skipped" in p.stdout and str(store) in p.stdout and records(tmp_path) == []


def test_one_failing_aggregator_does_not_stop_the_others(tmp_path):
    # fedfisher_diag refuses to start without a server validation set; fedavg after it must still run
    p = run(SMALL + ["rounds=1", "aggregators=[fedfisher_diag,fedavg]"], tmp_path, expect=2)
    recs = {r["algorithm"]: r for r in (json.loads(x.read_text()) for x in records(tmp_path))}
    assert recs["fedavg"]["status"] == "ok"
    assert recs["fedfisher_diag"]["status"] == "failed" and "server validation" in recs["fedfisher_diag"]["error"]
    assert "1 ok, 1 failed (fedfisher_diag)" in p.stdout
    assert p.stderr.strip().splitlines()[-1].startswith("fedbench: error: 1 of 2 aggregators failed")


def test_a_failure_never_overwrites_an_ok_record(tmp_path):
    from fedbench.runner import _failure_record
    from fedbench.launch.sweep import compose_run

    cfg = compose_run(SMALL + ["rounds=1"])
    from fedbench.results.records import compute_run_id
    d = tmp_path / compute_run_id(cfg)
    write_json_atomic(d / "metrics.json", ok_record(compute_run_id(cfg), "fedavg"))
    assert _failure_record(cfg, d, "boom")["status"] == "ok"
    assert read_record(d / "metrics.json")["status"] == "ok"


def test_cache_false_still_trains_a_lists_clients_once(tmp_path):
    run(SMALL + ["rounds=1", "cache=false", "aggregators=[fedavg,fednova,scaffold]"], tmp_path)
    recs = {r["algorithm"]: r for r in (json.loads(x.read_text()) for x in records(tmp_path))}
    assert recs["fedavg"]["cache"]["misses"] >= 1 and recs["fedavg"]["cache"]["hits"] == 0
    assert recs["fednova"]["cache"]["hits"] >= 1 and recs["fednova"]["cache"]["misses"] == 0
    assert recs["scaffold"]["metrics"]["accuracy"] == recs["fedavg"]["metrics"]["accuracy"]
    assert not (tmp_path / "out" / "cache").exists()   # nothing written to disk


def test_an_unexpected_exception_leaves_its_traceback_beside_the_failed_record(tmp_path, monkeypatch, capsys):
    """A bug (not bad input) in one aggregator: its failed record names traceback.txt, which holds the frame that
    raised, the printed line points to it, the other aggregator still finishes; a later ok run removes the file."""
    import pytest

    from fedbench.algorithms.fedavg import FedAvg
    from fedbench.errors import FedbenchError
    from fedbench.launch.sweep import CONF_DIR, compose_run, run_dir
    from fedbench.runner import TRACEBACK_FILE, execute_all

    def broken_aggregate(self, messages, state, round_idx):
        raise RuntimeError("leading minor not positive-definite")

    cfg = compose_run(SMALL + ["rounds=1", "aggregators=[fedavg,fednova]", f"paths.output_root={tmp_path / 'out'}",
                               f"paths.data_root={tmp_path / 'data'}"])
    monkeypatch.setattr(FedAvg, "aggregate", broken_aggregate)
    with pytest.raises(FedbenchError, match="1 of 2 aggregators failed: fedavg"):
        execute_all(cfg, run_dir(cfg, str(tmp_path)), CONF_DIR, launch_dir=str(tmp_path))
    recs = {r["algorithm"]: (r, p.parent) for p in records(tmp_path) for r in [json.loads(p.read_text())]}
    (failed, where), (ok, ok_dir) = recs["fedavg"], recs["fednova"]
    assert failed["status"] == "failed" and failed["traceback"] == TRACEBACK_FILE and ok["status"] == "ok"
    text = (where / TRACEBACK_FILE).read_text()
    assert "broken_aggregate" in text and text.rstrip().endswith("RuntimeError: leading minor not positive-definite")
    assert not (ok_dir / TRACEBACK_FILE).exists()
    assert f"(traceback: {where / TRACEBACK_FILE})" in capsys.readouterr().err
    monkeypatch.undo()
    execute_all(cfg, run_dir(cfg, str(tmp_path)), CONF_DIR, launch_dir=str(tmp_path))   # fixed: the rerun is ok
    assert read_record(where / "metrics.json")["status"] == "ok" and not (where / TRACEBACK_FILE).exists()
