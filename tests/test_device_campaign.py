"""scripts/device_campaign.sh: what one GPU lease hands back (the finished records only, no weights) and when it stops.

reproduce.py is replaced by a stub that writes run directories the way a run does (metrics.json with its status,
history.csv, a weights file), so the script's own logic is what is tested, without torch or a GPU.
"""
import os
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STUB = """#!/usr/bin/env bash
# stub reproduce.py: ok=<id> writes a finished run, fail=<id> an interrupted one and exits 1, sleep=<s> waits
shift   # scripts/reproduce.py
echo "stub $*" >> stub_calls.txt
for a in "$@"; do
    case $a in
        ok=*|fail=*) id=${a#*=}; st=ok; [ "${a%%=*}" = fail ] && st=failed
            mkdir -p outputs/runs/$id
            printf '{\\n  "run_id": "%s",\\n  "status": "%s"\\n}\\n' "$id" "$st" > outputs/runs/$id/metrics.json
            echo "round,accuracy" > outputs/runs/$id/history.csv
            echo weights > outputs/runs/$id/model.pt
            [ $st = failed ] && exit 1 ;;
        sleep=*) sleep "${a#*=}" ;;
    esac
done
exit 0
"""


def _run(tmp_path, *commands, deadline="60"):
    stub = tmp_path / "stub.sh"
    stub.write_text(STUB)
    stub.chmod(0o755)
    out = tmp_path / "out"
    env = {"PATH": os.environ["PATH"], "PYTHON": str(stub), "OUT": str(out), "DEADLINE_S": deadline, "NO_WHEELS": "1"}
    p = subprocess.run(["bash", str(ROOT / "scripts" / "device_campaign.sh"), *commands], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)
    calls = (tmp_path / "stub_calls.txt").read_text().splitlines() if (tmp_path / "stub_calls.txt").exists() else []
    return p, out, calls


def _packed(out):
    with tarfile.open(out / "runs.tar.gz") as tar:
        return sorted(m.name for m in tar.getmembers() if m.isfile())


def test_only_finished_runs_come_back_and_without_weights(tmp_path):
    p, out, calls = _run(tmp_path, "ok=aaa ok=bbb", "fail=ccc")
    assert p.returncode == 0, p.stderr
    assert _packed(out) == ["aaa/history.csv", "aaa/metrics.json", "bbb/history.csv", "bbb/metrics.json"]
    assert "finished runs: 2" in p.stdout
    assert len(calls) == 2 and calls[0].endswith("ok=aaa ok=bbb hardware=cuda")   # every command, on CUDA


def test_a_first_command_that_fails_before_any_run_stops_the_lease(tmp_path):
    p, out, calls = _run(tmp_path, "fail=aaa", "ok=bbb")
    assert p.returncode == 1
    assert "stopping" in p.stdout
    assert len(calls) == 1                       # the second command never ran
    assert not (out / "runs.tar.gz").exists()


def test_commands_past_the_deadline_are_skipped_and_named(tmp_path):
    p, out, calls = _run(tmp_path, "ok=aaa sleep=3", "ok=bbb", deadline="32")
    assert p.returncode == 0, p.stderr
    assert len(calls) == 1                       # 32 s budget, 3 s spent: under the 30 s floor for the next
    assert "deadline: skipped ok=bbb" in (out / "device.log").read_text()
    assert _packed(out) == ["aaa/history.csv", "aaa/metrics.json"]


def test_overrides_with_brackets_reach_reproduce_unglobbed(tmp_path):
    (tmp_path / "aggregators=f").write_text("")   # a file the bracket pattern below would match if it globbed
    p, out, calls = _run(tmp_path, "ok=aaa aggregators=[fedavg]")
    assert p.returncode == 0, p.stderr
    assert calls == ["stub ok=aaa aggregators=[fedavg] hardware=cuda"]
