"""Bad input is rejected before anything heavy: one `fedbench: error:` line, exit status 2, nothing on disk,
no torch import (fedbench issue 15). The invalid invocations are the table of scripts/check_inputs.py."""
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from fedbench.config.compose import compose_config
from fedbench.config.preflight import preflight
from fedbench.config.validate import validate_config
from fedbench.errors import FedbenchError
from fedbench.results.records import compute_run_id
from tests.script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]
check_inputs = load_script("check_inputs.py")
CASES = check_inputs.CASES


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case once, two at a time."""
    root = tmp_path_factory.mktemp("cases")
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(check_inputs.run_case, script, args, root / f"case{i}")
                   for i, (script, args) in enumerate(CASES)]
        return [f.result() for f in futures]


def test_the_table_is_large_enough():
    assert sum(script == "run.py" for script, _ in CASES) >= 60
    assert {script for script, _ in CASES} >= {"scripts/reproduce.py", "scripts/submit.py", "scripts/collect.py",
                                                "scripts/plot.py"}


@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"{s} {a}" for s, a in CASES])
def test_invalid_invocation_is_one_line_exit_2_nothing_written(results, i):
    r = results[i]
    assert r["rc"] == 2, r
    assert len(r["stderr"]) == 1 and r["stderr"][0].startswith("fedbench: error: "), r["stderr"]
    assert r["stderr"][0] != "fedbench: error: "
    assert r["written"] == [], r["written"]
    # rejected before anything heavy: without importing torch, except a method's own option rules, which the methods
    # check (torch imported, still before Hydra writes a run directory); no wall-time limit, which a busy machine
    # breaks (41 s for the reproduce.py method case in a clone CI beside two training jobs)
    assert r["torch"] is (CASES[i] in check_inputs.METHOD_CASES), r


@pytest.mark.parametrize("args, names", [
    ("local.lr=abc", ["local.lr", "'abc'", "number > 0"]),
    ("local.epochs=1.5", ["local.epochs", "1.5", "integer >= 0"]),
    ("algorithm=fedprox algorithm.mu=abc", ["algorithm.mu", "'abc'", "number", "0.01"]),
    ("foo=1", ["'foo'", "known keys", "num_clients"]),
    ("hardware.device=tpu", ["hardware.device", "'tpu'", "cuda:N"]),
    ("experiment=fedlpa/table6 profile=nonexistent", ["nonexistent", "paper, quick"]),
    ("algorithm=fedlpa algorithm.gd_step=foo", ["algorithm.gd_step", "fixed, stable", "'foo'"]),
    ("aggregators=[fedavg,{name:fedlpa,posterior_term:foo}]",
     ["algorithm.posterior_term", "differentiable, detached_as_released", "'foo'"]),
])
def test_the_line_names_key_value_and_what_is_allowed(results, args, names):
    line = results[CASES.index(("run.py", args))]["stderr"][0]
    for name in names:
        assert name in line, (name, line)


@pytest.mark.parametrize("argv", [["local.lr=abc"], ["-m", "seed=0,abc"]])   # the second: a valid run comes first
def test_rejection_does_not_import_torch(tmp_path, argv):
    code = (f"import sys, runpy; sys.argv = ['run.py', *{argv!r}]\n"
            f"try:\n    runpy.run_path({str(ROOT / 'run.py')!r}, run_name='__main__')\n"
            f"except SystemExit as e:\n    print(e.code, 'torch' in sys.modules)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FEDBENCH_OUTPUTS": str(tmp_path / "out")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.stdout.split() == ["2", "False"], (out.stdout, out.stderr)


# ---- profile= in run.py --------------------------------------------------------------------------------------

def _compose_argv(argv):
    return compose_config([a for a in argv if a not in ("-m", "--multirun")])


def test_run_profile_quick_composes_the_quick_settings():
    paper = _compose_argv(preflight(["experiment=fedlpa/table6"]))
    quick = _compose_argv(preflight(["experiment=fedlpa/table6", "profile=quick"]))
    assert paper.local.epochs == 20 and paper.profile is None
    assert quick.local.epochs == 2 and quick.profile == "quick"
    names = [a if isinstance(a, str) else a["name"] for a in OmegaConf.to_container(quick.aggregators)]
    assert names == ["fedlpa", "fedavg", "fednova", "scaffold", "fedprox", "dense"]
    assert OmegaConf.to_container(quick.aggregators)[0] == {"name": "fedlpa", "solver": "cg"}


def test_run_py_applies_the_profile(tmp_path):
    """The real entry point: run.py's __main__ hands the quick settings to Hydra (shown with --cfg job)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FEDBENCH_OUTPUTS": str(tmp_path / "out")}
    out = subprocess.run([sys.executable, str(ROOT / "run.py"), "experiment=fedlpa/table6", "profile=quick",
                          "--cfg", "job"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    cfg = OmegaConf.create(out.stdout)
    assert cfg.local.epochs == 2 and cfg.profile == "quick" and cfg.aggregators[0] == {"name": "fedlpa", "solver": "cg"}
    assert not (tmp_path / "out").exists()


def test_run_profile_keeps_what_the_command_line_fixes():
    cfg = _compose_argv(preflight(["experiment=fedlpa/table6", "profile=quick", "local.epochs=5", "seed=3"]))
    assert cfg.local.epochs == 5 and cfg.seed == 3


def test_run_profile_single_valued_sweep_axes_are_settings():
    # fedbens quick: {sweep: {seed: [0], local.epochs: [2]}}; paper: {sweep: {seed: [0..4]}} (several seeds: none)
    quick = _compose_argv(preflight(["experiment=fedbens/table1", "profile=quick"]))
    paper = _compose_argv(preflight(["experiment=fedbens/table1", "profile=paper", "seed=4"]))
    assert quick.local.epochs == 2 and quick.seed == 0
    assert paper.seed == 4 and paper.local.epochs == compose_config(["experiment=fedbens/table1"]).local.epochs


def test_run_profile_gives_the_scripts_run_id():
    """run.py experiment=X profile=quick is the run the scripts make for the same preset, profile and seed."""
    from fedbench.launch.sweep import expand_sweep

    runs = expand_sweep(["experiment=fedlpa/table6", "profile=quick", "dataset=fmnist", "partition.spec='beta=0.5'"])
    assert len(runs) == 1
    ours = _compose_argv(preflight(["experiment=fedlpa/table6", "profile=quick", "dataset=fmnist",
                                    "partition.spec='beta=0.5'"]))
    assert compute_run_id(ours) == compute_run_id(compose_config(runs[0]))


@pytest.mark.parametrize("argv", [["profile=nonexistent"], ["profile=quick"],
                                  ["experiment=fedlpa/table6", "profile=nonexistent"]])
def test_unknown_profile_is_an_error(argv):
    with pytest.raises(FedbenchError, match="profile"):
        preflight(argv)


# ---- ok records are left alone -------------------------------------------------------------------------------

def _ok_record(outputs: Path, overrides=()):
    cfg = compose_config(list(overrides))
    rid = compute_run_id(cfg)
    folder = outputs / "runs" / rid
    (folder / ".hydra").mkdir(parents=True)
    from tests.conftest import ok_record
    (folder / "metrics.json").write_text(json.dumps({**ok_record(rid, cfg.algorithm.name), "saved": {}}))
    (folder / ".hydra" / "overrides.yaml").write_text("- hardware=cpu\n")
    (folder / "history.csv").write_text("round,accuracy\n1,0.5\n")
    return folder


def _snapshot(folder: Path):
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("bad", ["hardware.device=tpu", "hardware.num_threads=0"])
def test_bad_override_for_an_ok_run_id_leaves_its_record_untouched(tmp_path, bad):
    outputs = tmp_path / "outputs"   # run_case points FEDBENCH_OUTPUTS here
    folder = _ok_record(outputs)
    before = _snapshot(folder)
    r = check_inputs.run_case("run.py", bad, tmp_path)   # the same run id: hardware is not part of it
    assert r["rc"] == 2 and r["stderr"][0].startswith(f"fedbench: error: {bad.split('=')[0]}")
    assert _snapshot(folder) == before
    assert sorted(p.name for p in (outputs / "runs").iterdir()) == [folder.name]


def test_hydra_saves_no_files_into_a_run_that_will_be_skipped(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDBENCH_OUTPUTS", str(tmp_path / "outputs"))
    assert compose_config([], with_hydra=True).hydra.output_subdir == ".hydra"
    _ok_record(tmp_path / "outputs")
    assert compose_config([], with_hydra=True).hydra.output_subdir is None
    assert compose_config(["force=true"], with_hydra=True).hydra.output_subdir == ".hydra"
    assert compose_config(["seed=1"], with_hydra=True).hydra.output_subdir == ".hydra"   # another run id


def test_validation_runs_before_the_skip_check(tmp_path, monkeypatch):
    """A bad value for the run id of an ok record is an error, not a silent skip (runner.execute)."""
    from fedbench.runner import execute

    monkeypatch.setenv("FEDBENCH_OUTPUTS", str(tmp_path / "outputs"))
    folder = _ok_record(tmp_path / "outputs")
    cfg = compose_config(["hardware.backend=foo"])
    assert compute_run_id(cfg) == folder.name
    with pytest.raises(FedbenchError, match="hardware.backend"):
        execute(cfg, folder, launch_dir=str(tmp_path))


# ---- the generic rules, directly ------------------------------------------------------------------------------

def _check(overrides, **kw):
    validate_config(compose_config(overrides, with_hydra=True), **kw)


def test_null_defaults_accept_any_value():
    _check(["algorithm=fedbe", "algorithm.swa_lr=0.5"])   # swa_lr: null in the YAML
    _check(["hardware.num_threads=null"])


def test_algorithm_keys_follow_the_yaml_default_kind():
    _check(["algorithm=fedprox", "algorithm.mu=1"])   # an int where the default is a float: both numbers
    with pytest.raises(FedbenchError, match="algorithm.scale='1' is not allowed|algorithm.scale=1 is not allowed"):
        _check(["algorithm=fedprox", "algorithm.scale=1"])
    with pytest.raises(FedbenchError, match="unknown key.*algorithm.muu.*its keys: mu, scale, weighting"):
        _check(["algorithm=fedprox", "+algorithm.muu=1"])


def test_model_pretrained_is_accepted_on_every_model(tmp_path):
    ckpt = tmp_path / "w.pt"
    ckpt.write_bytes(b"x")
    for model in ("lenet", "mlp", "resnet18_mod"):
        cfg = compose_config([f"model={model}", f"model.pretrained={ckpt}"], with_hydra=True)
        assert cfg.model.pretrained == str(ckpt)
        validate_config(cfg)


def test_every_preset_validates():
    """The presets' own settings pass the generic rules (no false rejections)."""
    presets = sorted(str(p.relative_to(ROOT / "conf" / "experiment").with_suffix(""))
                     for p in (ROOT / "conf" / "experiment").rglob("*.yaml"))
    assert len(presets) > 40
    for exp in presets:   # fedfisher/table3's checkpoint is made by scripts/pretrain_tiny_imagenet.py
        _check([f"experiment={exp}"], need_checkpoint=False)


def test_hardware_memory_format_choices():
    _check(["hardware=cpu", "hardware.memory_format=channels_last"])
    with pytest.raises(FedbenchError, match="hardware.memory_format"):
        _check(["hardware.memory_format=nhwc"])


def test_every_method_accepts_its_own_defaults_and_rejects_a_bad_choice():
    """run.py's pre-Hydra check of the methods' own option rules: no false rejection of any algorithm YAML, and a
    choice outside a method's list is one line naming the key and the choices."""
    from fedbench.runner import check_methods

    stems = sorted(p.stem for p in (ROOT / "conf" / "algorithm").glob("*.yaml"))
    assert len(stems) > 20
    for stem in stems:
        check_methods(compose_config([f"algorithm={stem}"], with_hydra=True), ROOT / "conf")
    bad = compose_config(["algorithm=fedlap", "algorithm.local_start=foo"], with_hydra=True)
    with pytest.raises(FedbenchError, match=r"algorithm.local_start must be one of .*, got 'foo'"):
        check_methods(bad, ROOT / "conf")
