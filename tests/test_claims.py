"""Claims on work (fedbench/results/claims.py): one holder at a time, waiting, release on exceptions,
takeover of a dead or silent holder; two processes on one run or one client stage train it once."""
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from fedbench.fl.cache import ClientStageCache
from fedbench.results import claims
from fedbench.results.claims import acquire, claim, holder, release

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def claimed_in_another_thread(path: Path, what: str, until=lambda: False, linger_s: float = 0.0,
                              timeout_s: float = 30.0):
    """Another launcher, as a thread of this process (a claim this thread held would be an error, not a wait):
    holds the claim at ``path`` from entry until ``until()`` is true (then ``linger_s`` more), the block ends, or
    ``timeout_s``. Yields a dict: ``until_met`` (whether ``until`` came true while held), ``released_at``."""
    held, done, seen = threading.Event(), threading.Event(), {}

    def hold():
        with claim(path, what):
            held.set()
            deadline = time.time() + timeout_s
            while not until() and not done.is_set() and time.time() < deadline:
                time.sleep(0.05)
            seen["until_met"] = until()
            time.sleep(linger_s if seen["until_met"] else 0.0)
            seen["released_at"] = time.time()

    t = threading.Thread(target=hold)
    t.start()
    held.wait(10)
    try:
        yield seen
    finally:
        done.set()
        t.join()


def _foreign(path: Path, host: str, pid: int, age_s: float = 0.0) -> None:
    """A claim file written by another holder, last refreshed ``age_s`` seconds ago."""
    path.write_text(json.dumps({"host": host, "pid": pid, "started": "2024-01-01T00:00:00", "token": "x" * 32}))
    t = time.time() - age_s
    os.utime(path, (t, t))


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_acquire_second_acquire_release(tmp_path):
    path = tmp_path / "sub" / "job.claim"
    c = acquire(path, "job", timeout_s=60, wait=False)
    info = holder(path)
    assert c is not None and not c.waited and not c.took_over
    assert info["host"] == socket.gethostname() and info["pid"] == os.getpid() and info["token"] == c.token
    assert acquire(path, "job", timeout_s=60, wait=False) is None   # held (by a live holder: us)
    release(c)
    assert not path.exists()
    c2 = acquire(path, "job", timeout_s=60, wait=False)
    assert c2 is not None and c2.token != c.token
    release(c2)


def test_claim_is_released_on_exceptions_and_not_reentrant(tmp_path):
    path = tmp_path / "job.claim"
    with pytest.raises(KeyError):
        with claim(path, "job"):
            assert path.exists()
            raise KeyError("boom")
    assert not path.exists()
    with claim(path, "job"):
        with pytest.raises(RuntimeError, match="already held by this thread"):
            with claim(path, "job"):
                pass
    assert not path.exists()


def test_second_claim_waits_for_the_first(tmp_path, capsys):
    path = tmp_path / "job.claim"
    order, taken = [], threading.Event()

    def first_holder():
        c = acquire(path, "job", timeout_s=60)
        taken.set()
        time.sleep(0.3)
        order.append("released")
        release(c)
    t = threading.Thread(target=first_holder)
    t.start()
    taken.wait(10)
    with claim(path, "job", poll_s=0.05) as c:
        order.append("acquired")
        assert c.waited and not c.took_over
    t.join()
    assert order == ["released", "acquired"]
    assert "fedbench: job is claimed by" in capsys.readouterr().err


def test_claim_without_wait_raises_claim_held_and_leaves_the_holder_alone(tmp_path):
    path = tmp_path / "job.claim"
    _foreign(path, socket.gethostname(), os.getppid())   # a live holder on this host
    with pytest.raises(claims.ClaimHeld, match=rf"run abc is claimed by {socket.gethostname()} pid {os.getppid()} since "):
        with claim(path, "run abc", wait=False):
            pytest.fail("entered a claim another process holds")
    assert holder(path)["token"] == "x" * 32   # untouched
    path.unlink()
    with claim(path, "run abc", wait=False) as c:   # free: taken as with wait
        assert c is not None and holder(path)["token"] == c.token
    assert not path.exists()


def test_dead_pid_on_this_host_is_taken_over(tmp_path, capsys):
    path = tmp_path / "job.claim"
    _foreign(path, socket.gethostname(), _dead_pid())   # fresh heartbeat, but its process is gone
    c = acquire(path, "run abc", timeout_s=600, wait=False)
    assert c is not None and c.took_over and holder(path)["token"] == c.token
    assert "taking over the stale claim on run abc" in capsys.readouterr().err
    release(c)
    # a live pid on this host (our parent) is respected however old its heartbeat is: here it is fresh
    _foreign(path, socket.gethostname(), os.getppid())
    assert acquire(path, "job", timeout_s=600, wait=False) is None


def test_other_host_is_taken_over_only_after_the_timeout(tmp_path):
    path = tmp_path / "job.claim"
    _foreign(path, "some-other-node", 12345, age_s=5)
    assert acquire(path, "job", timeout_s=60, wait=False) is None     # heartbeat 5 s old < 60 s
    c = acquire(path, "job", timeout_s=2, wait=False)                  # 5 s old > 2 s: stale
    assert c is not None and c.took_over
    release(c)


def test_unreadable_claim_file_is_stale_after_a_grace(tmp_path):
    path = tmp_path / "job.claim"
    path.write_text("")   # killed between creating and writing it
    assert acquire(path, "job", timeout_s=600, wait=False) is None
    t = time.time() - claims.UNREADABLE_GRACE_S - 1
    os.utime(path, (t, t))
    c = acquire(path, "job", timeout_s=600, wait=False)
    assert c is not None and c.took_over
    release(c)


def test_heartbeat_keeps_a_held_claim_fresh(tmp_path):
    path = tmp_path / "job.claim"
    with claim(path, "job", timeout_s=0.5):
        old = time.time() - 1000
        os.utime(path, (old, old))
        deadline = time.time() + 20
        while path.stat().st_mtime < old + 1 and time.time() < deadline:
            time.sleep(0.05)
        assert time.time() - path.stat().st_mtime < 10


def test_is_held_only_by_a_live_holder(tmp_path):
    path = tmp_path / "job.claim"
    assert not claims.is_held(path)   # no claim file
    _foreign(path, socket.gethostname(), _dead_pid())
    assert not claims.is_held(path, timeout_s=60)   # its holder is gone
    _foreign(path, "elsewhere", 12345, age_s=5)
    assert claims.is_held(path, timeout_s=60) and not claims.is_held(path, timeout_s=1)   # silent past the timeout
    path.unlink()
    with claim(path, "job"):
        assert claims.is_held(path)
    assert not claims.is_held(path)

def test_claim_timeout_env(monkeypatch):
    from fedbench.errors import FedbenchError

    monkeypatch.setenv(claims.TIMEOUT_ENV, "90")
    assert claims.claim_timeout() == 90.0
    monkeypatch.setenv(claims.TIMEOUT_ENV, "-1")
    with pytest.raises(FedbenchError, match="FEDBENCH_CLAIM_TIMEOUT"):
        claims.claim_timeout()
    monkeypatch.delenv(claims.TIMEOUT_ENV)
    assert claims.claim_timeout() == claims.DEFAULT_TIMEOUT_S


def test_two_workers_on_one_cache_key_compute_it_once(tmp_path):
    """Two workers (threads here; processes below) sharing a cache: the second waits and loads the entry."""
    started, calls, out = threading.Event(), [], {}

    def compute():
        calls.append(1)
        started.set()
        time.sleep(0.3)
        return {"w": torch.arange(4.0)}

    def worker(name):
        cache = ClientStageCache(tmp_path)
        out[name] = (cache.get_or_compute({"stage": 1}, compute), cache)

    a = threading.Thread(target=worker, args=("a",))
    a.start()
    started.wait(10)
    b = threading.Thread(target=worker, args=("b",))
    b.start()
    a.join()
    b.join()
    assert len(calls) == 1
    assert torch.equal(out["a"][0]["w"], out["b"][0]["w"])
    assert (out["a"][1].misses, out["a"][1].hits, out["b"][1].misses, out["b"][1].hits) == (1, 0, 0, 1)
    assert not list(tmp_path.rglob("*.claim"))


# ---- two processes -------------------------------------------------------------------------------
SMALL = ["dataset=synthetic", "dataset.kwargs.like=mnist", "dataset.kwargs.train_size=300",
         "dataset.kwargs.test_size=100", "model=lenet", "num_clients=2", "rounds=1", "local.epochs=1",
         "hardware=cpu", "progress=false"]


def _launch(args, tmp_path, name):
    env = {**os.environ, "FEDBENCH_OUTPUTS": str(tmp_path / "out"), "FEDBENCH_DATA": str(tmp_path / "data"),
           "HYDRA_FULL_ERROR": "0", "PYTHONPATH": str(ROOT)}
    err = open(tmp_path / f"{name}.err", "w")
    return subprocess.Popen([sys.executable, "run.py", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=err, text=True)


def _wait_for(path: Path, text: str, procs, timeout=240):
    deadline = time.time() + timeout
    while text not in path.read_text():
        assert time.time() < deadline, path.read_text()
        assert all(p.poll() is None for p in procs), path.read_text()
        time.sleep(0.2)


def test_two_processes_on_one_run_train_it_once_and_a_third_shares_its_clients(tmp_path):
    """p0 and p1 run the same FedAvg run at once: one trains, the other waits and returns its record as a
    skip. p2 runs FedNova at the same time on the same clients: the client stage is trained once in all."""
    from fedbench.launch.sweep import compose_run
    from fedbench.results.records import compute_run_id

    run_dir = tmp_path / "out" / "runs" / compute_run_id(compose_run(SMALL))
    # hold the FedAvg run's claim while p0 and p1 start, so that both certainly meet it; then let them race
    with claim(run_dir / ".claim", "test"):
        procs = [_launch(SMALL, tmp_path, n) for n in ("p0", "p1")]
        procs.append(_launch(SMALL + ["algorithm=fednova"], tmp_path, "p2"))
        for n in ("p0", "p1"):
            _wait_for(tmp_path / f"{n}.err", "waiting for it", procs)
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    trained = [o for o in outs[:2] if "fedbench: fedavg on synthetic" in o]
    skipped = [o for o in outs[:2] if "already has an ok record" in o and "skipped" in o]
    assert len(trained) == 1 and len(skipped) == 1, outs
    rec = json.loads((run_dir / "metrics.json").read_text())
    assert rec["status"] == "ok" and f"accuracy={rec['metrics']['accuracy']:.4g}" in trained[0]
    assert not (run_dir / ".claim").exists()
    recs = [json.loads(p.read_text()) for p in (tmp_path / "out" / "runs").glob("*/metrics.json")]
    assert sorted(r["algorithm"] for r in recs) == ["fedavg", "fednova"] and all(r["status"] == "ok" for r in recs)
    assert sorted((r["cache"]["misses"], r["cache"]["hits"]) for r in recs) == [(0, 1), (1, 0)]
    assert not list((tmp_path / "out").rglob("*.claim"))
