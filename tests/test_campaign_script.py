"""scripts/campaign.sh: the commands behind the committed records stay runnable as presets change. Each command the
script would run (printed with PYTHON=echo) must pass the scripts' pre-flight, expand to at least one run and name
only known methods; a table it writes must not redefine a committed collection."""
import re
import subprocess
from pathlib import Path

import pytest

from fedbench.config.preflight import check_script_overrides
from fedbench.launch.sweep import expand_sweep, missing_methods

ROOT = Path(__file__).resolve().parents[1]


def campaign_commands(*args, keep_name=False, runs_only=False):
    """The reproduce.py commands a campaign.sh call prints (runs_only: not the table lines a step ends with)."""
    out = subprocess.run(["bash", str(ROOT / "scripts" / "campaign.sh"), *args], env={"PYTHON": "echo", "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    cmds = []
    for line in out.splitlines():
        if not line.startswith("scripts/reproduce.py") or (runs_only and "--collect-only" in line.split()):
            continue
        words = line.split()[1:]   # the shell's words (no override holds a space); quotes inside stay, as Hydra gets them
        if "--name" in words and not keep_name:
            i = words.index("--name")
            del words[i:i + 2]
        cmds.append([w for w in words if w != "--collect-only" and not w.startswith(("hardware", "progress="))])
    return cmds


def test_every_step_prints_commands():
    steps = subprocess.run(["bash", str(ROOT / "scripts" / "campaign.sh"), "--list"], capture_output=True, text=True,
                           check=True, cwd=ROOT).stdout
    names = [line[:-1] for line in steps.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert len(names) >= 10
    for name in names:
        assert campaign_commands(name), f"step {name} runs nothing"
        assert campaign_commands("--collect", name), f"step {name} writes no table"


def test_status_asks_for_a_dry_run_of_every_command():
    out = subprocess.run(["bash", str(ROOT / "scripts" / "campaign.sh"), "--status", "fedlap_table1_mnist"],
                         env={"PYTHON": "echo", "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout.splitlines()
    assert out == [f"experiment=fedlap/table1 profile=paper dataset=mnist partition={p} :: scripts/reproduce.py --dry-run "
                   f"experiment=fedlap/table1 profile=paper dataset=mnist partition={p}" for p in ("homo", "size_class_dirichlet")]


def test_an_unknown_step_is_refused_before_anything_runs():
    p = subprocess.run(["bash", str(ROOT / "scripts" / "campaign.sh"), "fedlap_figure1", "nope"],
                       env={"PYTHON": "echo", "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2 and "unknown step 'nope'" in p.stderr and "reproduce.py" not in p.stdout


def test_a_step_that_loops_over_s_still_gets_its_tables_written():
    """Steps loop with plain names (for s in 0 10 ...); the driver's own loop variable must survive them, or the
    collect pass after a step calls step_40 and writes none of the step's tables (found in session 21)."""
    p = subprocess.run(["bash", str(ROOT / "scripts" / "campaign.sh"), "fedfisher_figure1", "fedlap_figure1"],
                       env={"PYTHON": "echo", "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0 and "command not found" not in p.stderr, p.stderr
    collects = [line for line in p.stdout.splitlines() if "--collect-only" in line]
    assert any("fedfisher/figure1b" in line for line in collects)
    assert any("fedlap/figure1" in line for line in collects)


def distinct_shapes(cmds):
    """One command per shape: commands that differ only in numbers (Fig. 1a's widths and seed ranges, the alphas)
    compose alike, so composing one of each keeps the test short."""
    seen = {}
    for c in cmds:
        seen.setdefault(re.sub(r"\d+(\.\d+)?", "N", " ".join(c)), " ".join(c))
    return sorted(seen.values())


@pytest.mark.parametrize("cmd", distinct_shapes(campaign_commands("all")))
def test_campaign_command_composes(cmd):
    overrides = cmd.split()
    check_script_overrides(overrides)
    assert expand_sweep(overrides)
    assert not missing_methods(overrides)   # reproduce.py refuses a list naming an unknown method


def collection_name(words):
    """results/collections.yaml's name of a collect call: <paper>_<table>, a profile other than paper, then the
    --name or tuned suffix."""
    exp = next(w.split("=", 1)[1] for w in words if w.startswith("experiment="))
    profile = next((w.split("=", 1)[1] for w in words if w.startswith("profile=")), "paper")
    suffix = words[words.index("--name") + 1] if "--name" in words else "tuned" if "tuning=on" in words else None
    return exp.replace("/", "_") + (f"_{profile}" if profile != "paper" else "") + (f"_{suffix}" if suffix else "")


@pytest.mark.parametrize("cmd", sorted({" ".join(c) for c in campaign_commands("--collect", "all", keep_name=True)}))
def test_campaign_tables_keep_the_committed_collections(cmd):
    """--collect rebuilds a committed collection with its own overrides (a new one may be added), never redefines it."""
    import yaml

    words = cmd.split()
    listed = {c["name"]: " ".join(c["overrides"])
              for c in yaml.safe_load((ROOT / "results" / "collections.yaml").read_text())["collections"]}
    name = collection_name(words)
    if "--name" in words:
        i = words.index("--name")
        del words[i:i + 2]
    if name in listed:
        assert " ".join(words) == listed[name], f"{name}: the committed collection is {listed[name]}"


def test_the_split_figure2_steps_run_exactly_the_presets_series():
    """fedlpa_figure2_fedlpa, _scaffold and _baselines (side by side on two cores; the baselines the claims read first)
    together run the preset's 9 series, each once, so their records are the preset's own (a series' id is its composed config)."""
    from fedbench.config import CONF_DIR
    from fedbench.config.aggregators import expand_aggregators
    from fedbench.launch.sweep import compose_run
    from fedbench.results.records import compute_run_id

    def series(cmd):
        return {compute_run_id(sub) for ovs in expand_sweep(cmd)[:1] for sub in expand_aggregators(compose_run(ovs), CONF_DIR)}

    steps = ("fedlpa_figure2_fedlpa", "fedlpa_figure2_scaffold", "fedlpa_figure2_baselines")
    split = [c for step in steps for c in campaign_commands(step, runs_only=True)]
    assert len(split) == 4
    preset = series(["experiment=fedlpa/figure2", "profile=paper"])
    parts = [series(c) for c in split]
    assert len(preset) == 9 and set().union(*parts) == preset
    assert sum(len(p) for p in parts) == 9   # no series twice
