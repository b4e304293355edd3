"""Every experiment preset composes, expands to the size its paper's reproduction matrix implies (counted here
independently from the table's axes, notes §6), has a smaller quick profile, names only known methods, and labels
its rows with the columns (and values) of its reference CSV (results/reference/<paper>_<id>.csv)."""
import csv
import re
from functools import lru_cache
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from fedbench.launch.sweep import CONF_DIR, compose_run, expand_sweep
from fedbench.report.tables import row_value
from fedbench.runner import check_methods

ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted(p.relative_to(CONF_DIR / "experiment").with_suffix("").as_posix()
                 for p in (CONF_DIR / "experiment").rglob("*.yaml"))
KNOWN_MISSING: set = set()   # every method a preset names exists
P9, D4 = 9, 4   # FedLPA: 6 Dirichlet betas + #C in {1,2,3}; FMNIST, CIFAR-10, MNIST, SVHN

# paper-profile runs (one run = one setting x seed; aggregators share it)
EXPECTED = {
    "fedlpa/table1": D4 * P9 * 3, "fedlpa/table5": D4 * P9 * 3, "fedlpa/table6": D4 * P9 * 3,
    "fedlpa/table7": D4 * P9 * 3, "fedlpa/table8": D4 * P9 * 3,
    "fedlpa/table2": 1 * (P9 + P9 - 1) * 3,   # FMNIST x P9 x {20, 50} clients x 3 seeds, less 50 clients at beta 0.01
    "fedlpa/table3": 1 * P9 * 3,              # FMNIST x P9 x 3 seeds, 3 lambdas as aggregators
    "fedlpa/table9": 1 * 6 * 3,               # FMNIST x 6 betas x 3 seeds
    "fedlpa/table10": D4 * 1 * 5 * 3,         # D4 x beta=0.001 x 5 epoch counts x 3 seeds
    "fedlpa/table11": 1 * 1 * 5 * 3,          # MNIST x #C=2 x 5 epoch counts x 3 seeds (FedLPA + FedOV)
    "fedlpa/table4": 1, "fedlpa/table12": 1,  # one timed CIFAR-10 run
    "fedlpa/figure1": 1, "fedlpa/figure2": 3,
    "fedfisher/table1": 2 * 1,                # FMNIST + CIFAR-10, one timed run
    "fedfisher/table2": 4 * 3 * 5,
    "fedfisher/table3": 4 * 1 * 3,            # CIFAR-10, CINIC-10, GTSRB, CIFAR-100 x alpha 0.1 x 3 seeds
    "fedfisher/table4": 2 * 5, "fedfisher/table5": 2 * 5,
    "fedfisher/table6": 1 * 3, "fedfisher/figure3": 4 * 3 * 5,
    "fedbens/table1": 3 * 4 * 5, "fedbens/table2": 3 * 3 * 5, "fedbens/table3": 3 * 2 * 3,
    "fedbens/table4": 1 * 5, "fedbens/table5": 2 * (3 * 2 * 3), "fedbens/table6": 2 * (3 * 2 * 3),
    "fedbens/table7": 3 * 2 * 3, "fedbens/table8": 3 * 2 * 3, "fedbens/table9": 1 * 2 * 3,
    "fola/table2": 6 * 3,                     # 6 methods (own E each) x 3 seeds
    "fola/figure5": 5 * 3,                    # N in {5, 10, 20, 50, 100} x 3 seeds
    "fola/figure3": 5 ** 5 * 30,              # R1: alpha x N x E x lr x B (5 each) x 30 repeats, 3 aggregators
    "fola/figure4": 5 ** 5 * 30,              # = figure3's runs
    "fola/figure6ab": 6 * (6 + 5 + 1) * 5,    # R3: E x (FOLA 6 lambdas + FedCurv 5 + FedAvg) x 5 seeds
    "fola/figure8": 6 * (6 + 5 + 1) * 5,      # = figure6ab's runs
    "fola/figure6c": 3 * 5 * 3,               # R4: 3 methods (Table II's E) x 5 alpha x 3 seeds
    "fola/figure7": 3 * 5 * 3,                # = figure6c's runs
    "fola/figure9": 5 * 3,                    # R6: 5 variants x 3 seeds
    "fola/figure10": 1, "fola/figure11": 1,   # R7: one study run (7 methods), shared
    "fola/figure12": 3 * 1,                   # R8: 3 alpha x 1 seed (reference + FOLA + FedAvg, 5 LF epochs)
    "fedlap/table1": 8 * 3,
    "fedlap/table2": (1 + 1 + 2 + 1) * 3,     # MNIST homog/heterog, FMNIST homog/heterog, CIFAR-10
    "fedlap/table3": (1 + 1 + 2 + 1) * 3,
    "fedlap/table4": 1 * 3,
    "fedlap/table5": (1 + 1 + 2 + 1 + 1) * 3,  # + FMNIST 100 clients
    "fedlap/appD2": 3 + 1,                    # FedLap delta in {0.1, 1, 10} + one run of 3 FedDyn alphas, 1 seed
    "fedlap/appE5": 2 * 3,                    # FMNIST 10 % homog / heterog x 3 seeds (FedLap-Func only)
    # figures (one run = one setting x seed; M / T / sigma^2 / the FedDyn and FedLap variants are aggregators)
    "fedbens/figure2": 3 * 4 * 5,             # 3 data sets x 4 alpha x 5 seeds, M = 1..5
    "fedbens/figure3": 3 * 2 * 3, "fedbens/figure4": 3 * 2 * 3, "fedbens/figure5": 3 * 2 * 3,
    "fedlap/figure1": 1 * 3,                  # homogeneous MNIST x 3 seeds, 7 curves
    "fedfisher/figure1a": 9 * 50,             # width m in {16..4096} x 50 seeds (K = 2048)
    "fedfisher/figure1b": 14 * 10,            # K in {1..8192} x 10 seeds (m = 512)
    "fedfisher/figure2": 4 * 1 * 3,           # 4 data sets x alpha 0.1 x 3 seeds, 5 rounds, 6 methods
}
# presets whose rows are the same (dataset x partition) grid: the full row check runs on one of them (table1;
# table6 is checked by tests/test_tables.py), the others only check columns and their first block
SAME_GRID = {"fedlpa/table5", "fedlpa/table7", "fedlpa/table8", "fedlpa/table6"}
# paper rows a preset leaves out on purpose, each with its reason in the preset and in results/gaps.md
LEFT_OUT = {"fedlpa/table2": {("fmnist", "50", "beta=0.01")}}   # no NIID-Bench draw gives 50 clients 10 samples each


@lru_cache(maxsize=None)
def runs(preset, profile):
    return tuple(tuple(r) for r in expand_sweep([f"experiment={preset}", f"profile={profile}"]))


@lru_cache(maxsize=None)
def composed(ovs):
    return compose_run(list(ovs))


def test_every_preset_has_an_expected_size():
    assert set(PRESETS) == set(EXPECTED), set(PRESETS) ^ set(EXPECTED)


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_sizes_and_quick_profile(preset):
    paper, quick = runs(preset, "paper"), runs(preset, "quick")
    assert len(paper) == EXPECTED[preset]
    assert 0 < len(quick) <= len(paper)
    cq, cp = composed(quick[0]), composed(paper[0])
    assert cq.table.paper == preset.split("/")[0] and cq.table.id == preset.split("/")[1]
    # quick must do less work: fewer runs, or fewer epochs x rounds per run
    assert len(quick) < len(paper) or cq.local.epochs * cq.rounds < cp.local.epochs * cp.rounds


@pytest.mark.parametrize("preset", PRESETS)
def test_every_run_composes_with_known_aggregators(preset):
    paper = runs(preset, "paper")
    sample = (paper[0], paper[-1], runs(preset, "quick")[0])   # first and last block, quick
    for ovs in sample:
        cfg = composed(ovs)
        aggs = OmegaConf.to_container(cfg.aggregators, resolve=True) if cfg.get("aggregators") else [cfg.algorithm.name]
        assert isinstance(aggs, list), f"{preset}: aggregators is {type(aggs).__name__} in {ovs}"
        for entry in aggs:
            name = entry if isinstance(entry, str) else entry["name"]
            assert (CONF_DIR / "algorithm" / f"{name}.yaml").exists() or name in KNOWN_MISSING, (preset, name)
        check_methods(cfg, CONF_DIR)   # every method's own option rules accept the preset (run.py checks them first)


def _reference(preset):
    paper, tid = preset.split("/")
    path = ROOT / "results" / "reference" / f"{paper}_{tid}.csv"
    return list(csv.DictReader(path.open())) if path.exists() else None


def _norm(v):
    try:
        return f"{float(v):g}"
    except (TypeError, ValueError):
        return str(v)


@pytest.mark.parametrize("preset", [p for p in PRESETS if _reference(p) is not None])
def test_rows_match_reference_columns_and_values(preset):
    from fedbench.config.aggregators import expand_aggregators

    ref = _reference(preset)
    cfg0 = composed(runs(preset, "paper")[0])
    rows = list(cfg0.table.rows)
    keys = [k for k in rows if k != "rounds" or cfg0.table.get("at_rounds")]
    assert all(k in ref[0] for k in keys), f"{preset}: rows {rows} vs columns {list(ref[0])}"
    ours = set()
    seen = set()
    all_runs = runs(preset, "paper")
    if preset in SAME_GRID:
        return
    for ovs in all_runs:
        key = tuple(o for o in ovs if not o.startswith("seed="))
        if key in seen:
            continue
        seen.add(key)
        cfg = composed(ovs)
        per_method = {"lambda", "s_q", "M"} & set(keys)   # keys read from the aggregator's config
        subs = expand_aggregators(cfg, CONF_DIR, allow_missing=True) if cfg.get("aggregators") and per_method else [cfg]
        for sub in subs:
            c = OmegaConf.to_container(sub, resolve=True)
            base = tuple(_norm(row_value(c, k)) for k in keys if k != "rounds")
            if "rounds" in keys:
                ours |= {base + (_norm(r),) for r in cfg.table.at_rounds if r <= c["rounds"]}
            else:
                ours.add(base)
    order = [k for k in keys if k != "rounds"] + (["rounds"] if "rounds" in keys else [])
    theirs = {tuple(_norm(r[k]) for k in order) for r in ref
              if r.get("dataset") != "average" and all(r[k] != "" for k in order)}
    assert theirs, preset
    left_out = LEFT_OUT.get(preset, set())
    assert left_out <= theirs and not left_out & ours, f"{preset}: stale LEFT_OUT {sorted(left_out)}"
    assert theirs - left_out <= ours, f"{preset}: reference rows without a run: {sorted(theirs - ours)[:5]}"


def test_shared_settings_share_run_ids():
    """Tables reusing another table's runs must compose to the same run ids (FedLap 1/2/5, FedFisher 2/4/5)."""
    from fedbench.results.records import compute_run_id
    from fedbench.config.aggregators import expand_aggregators

    def ids(preset, extra):
        out = set()
        for ovs in expand_sweep([f"experiment={preset}", "profile=paper", "seed=0"] + extra):
            out |= {compute_run_id(s) for s in expand_aggregators(compose_run(ovs), CONF_DIR, allow_missing=True)}
        return out

    assert ids("fedlap/table2", ["dataset=mnist"]) <= ids("fedlap/table1", ["dataset=mnist"])
    assert ids("fedlap/table5", ["dataset=cifar10"]) == ids("fedlap/table1", ["dataset=cifar10"])
    for extra in (["dataset=fmnist", "num_clients=10"], ["dataset=mnist", "partition=size_class_dirichlet"]):
        assert ids("fedlap/table3", extra) == ids("fedlap/table1", extra)   # rounds to accuracy from Table 1's runs
    assert not ids("fedlap/table3", ["dataset=mnist", "partition=homo"]) & ids("fedlap/table1", ["dataset=mnist"])
    t2 = ids("fedfisher/table2", ["dataset=fmnist", "partition.alpha=0.1"])
    assert len(ids("fedfisher/table4", ["dataset=fmnist"]) & t2) == 1      # s_q = 2 = Table 2's FedFisher(Diag)
    assert len(ids("fedfisher/table5", ["dataset=fmnist"]) & t2) == 1      # s_q = 4 = Table 2's FedFisher(K-FAC)
    assert ids("fedbens/table8", ["dataset=svhn"]) <= ids("fedbens/table5", ["dataset=svhn"])
    t1 = ids("fedlpa/table1", ["dataset=fmnist"])
    assert len(ids("fedlpa/table3", []) & t1) == P9                          # lambda = 0.001 column = Table 1


def _readme_presets():
    """The presets named in conf/experiment/README.md's table (its Preset column: `paper/id`, then `id` shorthands
    of the same paper)."""
    import re

    named = set()
    for line in (CONF_DIR / "experiment" / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) < 4 or not cells[2].startswith("`"):
            continue
        paper = None
        for tok in re.findall(r"`([^`]+)`", cells[2]):
            if "/" in tok:
                paper = tok.split("/")[0]
                named.add(tok)
            else:
                assert paper, f"README row names {tok!r} before any paper/id"
                named.add(f"{paper}/{tok}")
    return named


def test_readme_lists_exactly_the_presets():
    named = _readme_presets()
    assert named - set(PRESETS) == set(), f"README names presets that do not exist: {sorted(named - set(PRESETS))}"
    assert set(PRESETS) - named == set(), f"presets missing from README: {sorted(set(PRESETS) - named)}"


def _references_to_hp(node, out: set) -> set:
    """Names K of every ``${hp.K}`` interpolation in an unresolved config container."""
    if isinstance(node, dict):
        for v in node.values():
            _references_to_hp(v, out)
    elif isinstance(node, list):
        for v in node:
            _references_to_hp(v, out)
    elif isinstance(node, str):
        out.update(k for k in re.findall(r"\$\{hp\.([A-Za-z0-9_]+)\}", node))
    return out


@pytest.mark.parametrize("preset", PRESETS)
def test_swept_hp_keys_reach_a_method(preset):
    """A sweep block that sets ``hp.<key>`` must feed it to some run setting: an ``aggregators`` override of bare names
    (FedLap Table 1's FLamby block once) runs the algorithm YAMLs' defaults and silently ignores every hp value."""
    def used(ovs):
        cfg = OmegaConf.to_container(composed(tuple(ovs)), resolve=False)
        return _references_to_hp({k: v for k, v in cfg.items() if k not in ("hp", "table")}, set())

    # keys the preset's own lists read; a block may also set others only to share run ids with another table
    # (hp is part of the run identity: fedlap/figure1 sets Table 1's hp.prox without running FedProx)
    read_by_preset = None   # composed only for a preset whose blocks set hp keys
    seen = set()
    for ovs in runs(preset, "paper"):
        keys = tuple(sorted(o.split("=", 1)[0] for o in ovs))
        if keys in seen:
            continue
        seen.add(keys)
        swept = {k[len("hp."):] for k in keys if k.startswith("hp.")}
        if swept and read_by_preset is None:
            read_by_preset = used([f"experiment={preset}"])
        swept &= read_by_preset or set()
        lost = swept - used(ovs) if swept else set()
        assert not lost, f"{preset}: {ovs} sets hp.{', hp.'.join(sorted(lost))} but none of its runs reads it"
        _check_tuning_grids_reach_entries(preset, ovs)


def _check_tuning_grids_reach_entries(preset, ovs):
    """``tuning=on``: an ``hp.<key>`` in a method's grid must be interpolated by that method's aggregator entry in this
    block (the runtime check, fedbench.launch.tuning.check_grid_reaches_runs, composes every task; this is its cheap
    static twin over every preset and block)."""
    from fedbench.config.tuning import method_grids, parse_tuning

    cfg = composed(tuple(ovs))
    table = OmegaConf.to_container(cfg.table, resolve=True) if cfg.get("table") else {}
    if not table.get("tuning") or not cfg.get("aggregators"):
        return
    grids = method_grids(parse_tuning(table), OmegaConf.to_container(cfg, resolve=True))
    for entry in OmegaConf.to_container(cfg.aggregators, resolve=False):
        name = entry if isinstance(entry, str) else entry["name"]
        reads = _references_to_hp(entry, set())
        idle = {k[len("hp."):] for k in grids.get(name, {}) if k.startswith("hp.")} - reads
        assert not idle, (f"{preset}: {ovs}: the tuning grid of {name} sets hp.{', hp.'.join(sorted(idle))}, "
                          f"which its entry {entry!r} does not read")


def test_a_fixed_value_outside_an_axis_is_refused_and_choice_replaces_the_axis():
    """`local.epochs=1` where every FMNIST block sweeps [5] selects no run: one clear line that names the fix;
    `local.epochs=choice(1)` replaces the axis (the same runs, one epoch)."""
    from fedbench.errors import FedbenchError
    from fedbench.report.tables import preset_meta

    base = ["experiment=fedlap/table1", "profile=paper", "dataset=fmnist", "partition=homo", "num_clients=10"]
    with pytest.raises(FedbenchError, match=r"no run matches .*choice\(1\)"):
        preset_meta(base + ["local.epochs=1"])
    five, one = expand_sweep(base), expand_sweep(base + ["local.epochs=choice(1)"])
    assert len(one) == len(five) == 3 and all("local.epochs=1" in r for r in one)


def test_a_preset_without_a_table_sweeps_its_hydra_sweeper_params(tmp_path):
    """expand_sweep reads a preset's table from a composition without the hydra node (the shared base); a preset
    with no table but hydra.sweeper.params (Hydra's own multirun axes) still expands them."""
    import shutil

    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    (conf / "experiment" / "seeds_only.yaml").write_text(
        "# @package _global_\nhydra:\n  sweeper:\n    params:\n      seed: 0,1\n      local.lr: 0.1,0.01\n")
    runs = expand_sweep(["experiment=seeds_only", "algorithm=fedavg"], conf)
    assert runs == [["experiment=seeds_only", "algorithm=fedavg", f"seed={s}", f"local.lr={lr}"]
                    for s in (0, 1) for lr in ("0.1", "0.01")]
    # a fixed value restricts its axis to itself, as for a table: one of the axis' values, or nothing
    assert expand_sweep(["experiment=seeds_only", "algorithm=fedavg", "seed=1"], conf) == [
        ["experiment=seeds_only", "algorithm=fedavg", "seed=1", f"local.lr={lr}"] for lr in ("0.1", "0.01")]
    assert expand_sweep(["experiment=seeds_only", "algorithm=fedavg", "seed=3"], conf) == []
