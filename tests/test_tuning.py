"""tuning=on: grids per method, chosen on a hold-out of the training data, final runs on all of it."""
import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from fedbench.config.tuning import better, grid_points, parse_tuning
from fedbench.errors import FedbenchError
from fedbench.results.records import compute_run_id
from tests.script_loader import load_script

# a tiny preset of its own: softmax regression on 300 synthetic points, 2 clients, 2 rounds; lr is the tuned knob
TABLE = ("table={paper:t,id:tune,title:x,rows:[dataset],profiles:{paper:{}},"
         "tuning:{val_fraction:0.25,val_seed:1,metric:accuracy,grids:[{methods:{fedavg:{local.lr:[1.0e-7,0.05]}}}]}}")
TINY = ["dataset=synthetic", "dataset.kwargs.like=mnist", "dataset.kwargs.train_size=300",
        "dataset.kwargs.test_size=100", "model=softmax_regression", "partition=homo", "num_clients=2", "rounds=2",
        "local.epochs=1", "local.batch_size=32", "local.momentum=0.0", "hardware=cpu", "progress=false", TABLE]


def test_grid_points_are_the_product_in_declaration_order():
    assert grid_points({"a": [1, 2], "b": ["x", "y", "z"]}) == [
        {"a": 1, "b": "x"}, {"a": 1, "b": "y"}, {"a": 1, "b": "z"},
        {"a": 2, "b": "x"}, {"a": 2, "b": "y"}, {"a": 2, "b": "z"}]


def test_fedlap_uci_grids_expand_to_the_papers_66_selection_runs():
    from fedbench.launch.tuning import selection_config, tuning_tasks

    spec, tasks = tuning_tasks(["experiment=fedlap/table1", "dataset=uci_credit", "profile=quick", "tuning=on"])
    sizes = {t.method: len(grid_points(t.grid)) for t in tasks}
    assert sizes == {"fedavg": 3, "fedprox": 9, "feddyn": 27, "fedlap": 9, "fedlap_cov": 9, "fedlap_func": 9}
    lap = next(t for t in tasks if t.method == "fedlap")
    sel = selection_config(lap, spec, {"local.epochs": 20, "hp.delta": 10.0})
    assert sel.algorithm.name == "fedlap" and sel.algorithm.delta == 10.0 and sel.local.epochs == 20
    assert sel.tuning_val.fraction == 0.2 and sel.tuning_val.seed == 0 and sel.seed == 0 and sel.tuning == "off"
    dyn = next(t for t in tasks if t.method == "feddyn")
    d = selection_config(dyn, spec, {"local.epochs": 5, "hp.dyn_alpha": 1e-3, "hp.dyn_wd": 1e-6})
    assert (d.algorithm.alpha, d.algorithm.weight_decay, d.local.epochs) == (1e-3, 1e-6, 5)


@pytest.mark.parametrize(("table", "cell", "epochs"), [
    ("fedlpa/table5", "partition.spec='#C=2'", 10),
    ("fedlpa/table6", "partition.spec='#C=2'", 20),
    ("fedlpa/table10", "local.epochs=20", 20),     # Table 10's cells are local-epoch columns at beta = 0.001
])
def test_fedlpa_tunes_fedprox_mu_per_cell_on_seed_0(table, cell, epochs):
    """FedLPA Tables 5, 6 and 10 print one FedProx number per cell for the scripts' four mu: 4 selection runs per
    cell on seed 0 (36 per data set in Tables 5-6), each the fixed-pick FedProx run with the hold-out and that mu."""
    from fedbench.launch.tuning import selection_config, tuning_tasks

    spec, tasks = tuning_tasks([f"experiment={table}", "profile=paper", "dataset=fmnist", cell,
                                "seed=2", "aggregators=[fedavg,fedprox]", "tuning=on"])
    assert [t.method for t in tasks] == ["fedavg", "fedprox"] and not tasks[0].grid
    prox = tasks[1]
    assert prox.grid == {"algorithm.mu": [0.001, 0.01, 0.1, 1.0]} and prox.fixed.seed == 2
    sel = [selection_config(prox, spec, p) for p in grid_points(prox.grid)]
    assert [c.algorithm.mu for c in sel] == [0.001, 0.01, 0.1, 1.0]
    assert all(c.seed == 0 and c.tuning_val.fraction == 0.2 for c in sel)
    assert {c.partition.spec for c in sel} == {prox.fixed.partition.spec}
    assert {c.local.epochs for c in sel} == {prox.fixed.local.epochs} == {epochs}


def test_fola_table2_tunes_each_methods_local_epochs_over_20_rounds():
    from omegaconf import OmegaConf

    from fedbench.config.compose import compose_config
    from fedbench.config.tuning import method_grids
    from fedbench.launch.tuning import selection_config, tuning_tasks

    cfg = compose_config(["experiment=fola/table2"])
    spec = parse_tuning(OmegaConf.to_container(cfg.table, resolve=True))
    grids = method_grids(spec, OmegaConf.to_container(cfg, resolve=True))
    assert grids == {m: {"local.epochs": [1, 10, 20, 40, 80, 160]}
                     for m in ("fola", "fedavg", "fedcurv", "fednova", "scaffold", "fedbe")}
    _, (task,) = tuning_tasks(["experiment=fola/table2", "profile=paper", "seed=1", "local.epochs=1", "tuning=on"])
    sel = selection_config(task, spec, {"local.epochs": 80})
    assert task.method == "scaffold" and task.fixed.rounds == 100 and task.fixed.seed == 1
    assert (sel.rounds, sel.seed, sel.local.epochs, spec.at_round) == (20, 0, 80, 20)


def test_validation_split_is_seeded_and_disjoint_from_what_selection_trains_on():
    from fedbench.data.base import FedDataset
    from fedbench.data.tuning_split import hold_out_validation, validation_indices

    val, keep = validation_indices(100, 0.2, 3)
    assert len(val) == 20 and len(keep) == 80 and not set(val) & set(keep) and set(val) | set(keep) == set(range(100))
    assert np.array_equal(val, validation_indices(100, 0.2, 3)[0])
    assert not np.array_equal(val, validation_indices(100, 0.2, 4)[0])
    x = torch.arange(100.0).reshape(100, 1)
    data = FedDataset("d", x, torch.arange(100) % 2, torch.full((10, 1), -1.0), torch.zeros(10, dtype=torch.long),
                      2, "classification", train_groups=np.arange(100))
    held = hold_out_validation(data, 0.2, 3)
    assert held.test_x[:, 0].tolist() == [float(i) for i in val]           # evaluated on the hold-out ...
    assert held.train_x[:, 0].tolist() == [float(i) for i in keep]         # ... trained on the rest
    assert (held.test_x >= 0).all() and held.train_groups.tolist() == keep.tolist()   # the test set is gone


def test_better_uses_the_other_metric_to_break_ties():
    assert better({"accuracy": 80.0, "nll": 0.5}, None, "accuracy")
    assert better({"accuracy": 81.0, "nll": 9.0}, {"accuracy": 80.0, "nll": 0.1}, "accuracy")
    assert better({"accuracy": 80.0, "nll": 0.4}, {"accuracy": 80.0, "nll": 0.5}, "accuracy")
    assert not better({"accuracy": 80.0, "nll": 0.5}, {"accuracy": 80.0, "nll": 0.5}, "accuracy")   # grid order
    assert better({"accuracy": 70.0, "nll": 0.3}, {"accuracy": 90.0, "nll": 0.4}, "nll")
    assert not better({"accuracy": None, "nll": None}, None, "accuracy")


def _poisoned_loader(monkeypatch):
    """The test set's labels shifted by one class: any use of it in selection would change the scores."""
    import fedbench.run.setup as setup_mod

    real = setup_mod.load_dataset

    def load(*a, **k):
        d = real(*a, **k)
        return replace(d, test_y=(d.test_y + 1) % d.num_classes)
    monkeypatch.setattr(setup_mod, "load_dataset", load)   # the one place a run loads its data


def _tune(tmp_path, name):
    from fedbench.launch.tuning import run_tuning

    (sel,) = run_tuning(TINY + [f"paths.output_root={tmp_path / name}", f"paths.data_root={tmp_path / 'data'}",
                                "tuning=on"], str(tmp_path))
    final = json.loads((tmp_path / name / "runs" / sel["final_run_id"] / "metrics.json").read_text())
    return sel, final


def test_selection_never_sees_the_test_set_and_the_choice_reaches_the_record(tmp_path, monkeypatch, one_thread):
    clean, clean_final = _tune(tmp_path, "clean")
    _poisoned_loader(monkeypatch)
    poisoned, poisoned_final = _tune(tmp_path, "poisoned")
    assert clean["val_metric"] == poisoned["val_metric"]            # same selection runs, same scores, bit for bit
    assert clean["chosen"] == poisoned["chosen"] == {"local.lr": 0.05}
    assert clean_final["metrics"]["accuracy"] != poisoned_final["metrics"]["accuracy"]   # the poison is real
    sel_rec = json.loads((tmp_path / "clean" / "runs" / clean["val_metric"][1]["run_id"] / "metrics.json").read_text())
    assert sel_rec["evaluated_on"].startswith("tuning_val") and sel_rec["config"]["tuning_val"] == {"fraction": 0.25, "seed": 1}
    assert sum(sel_rec["partition"]["client_sizes"]) == 225                       # trained on train minus val
    assert clean_final["evaluated_on"] == "test" and sum(clean_final["partition"]["client_sizes"]) == 300
    assert clean_final["config"]["local"]["lr"] == 0.05
    t = clean_final["tuning"]
    assert t["chosen"] == {"local.lr": 0.05} and t["grid"] == {"local.lr": [1e-7, 0.05]}
    assert [v["values"] for v in t["val_metric"]] == [{"local.lr": 1e-7}, {"local.lr": 0.05}]
    assert t["val_metric"][1]["accuracy"] > t["val_metric"][0]["accuracy"]
    assert t["protocol"] == {"val_fraction": 0.25, "val_seed": 1, "metric": "accuracy", "at_round": None, "select": {}}


def test_tuned_table_uses_the_final_runs_and_names_the_chosen_values(tmp_path, one_thread):
    from fedbench.report.tables import collect

    _, final = _tune(tmp_path, "out")
    ovs = TINY + [f"paths.output_root={tmp_path / 'out'}", "tuning=on"]
    path = collect(ovs, tmp_path / "out", tmp_path / "tables", publish=False)
    text = path.read_text()
    assert path.name == "t_tune_tuned.md"
    assert f"{final['metrics']['accuracy']:.2f}" in text
    assert "**Tuned**" in text and "— fedavg: local.lr=0.05" in text
    fixed = collect(TINY + [f"paths.output_root={tmp_path / 'out'}"], tmp_path / "out", tmp_path / "tables",
                    publish=False)
    assert fixed.name == "t_tune.md" and "not run" in fixed.read_text() and "Tuned" not in fixed.read_text()


def test_an_aggregator_entrys_own_option_is_tuned_through_algorithm_keys(tmp_path):
    from fedbench.launch.tuning import final_config, selection_config, tuning_tasks

    def preset(grid):
        return [o for o in TINY if not o.startswith("table=")] + [
            TABLE.replace("{fedavg:{local.lr:[1.0e-7,0.05]}}", "{fedprox:{%s}}" % grid),
            "aggregators=[fedavg,{name:fedprox,mu:0.5}]", f"paths.output_root={tmp_path}", "tuning=on"]
    spec, tasks = tuning_tasks(preset("algorithm.mu:[0.0,1.0]"))
    (prox,) = [t for t in tasks if t.grid]
    sel = [selection_config(prox, spec, p) for p in grid_points(prox.grid)]
    assert [c.algorithm.mu for c in sel] == [0.0, 1.0] and all(c.tuning_val.fraction == 0.25 for c in sel)
    assert final_config(prox, {"algorithm.mu": 1.0}).algorithm.mu == 1.0 and prox.fixed.algorithm.mu == 0.5
    # a grid that cannot reach the method's runs (here a key outside the run identity) is refused before training
    with pytest.raises(FedbenchError, match="does not change its runs"):
        tuning_tasks(preset("progress:[true,false]"))
    # an hp value that no setting reads (a bare name in the list: the YAML's default mu) has a new run id per value
    # but trains the same run; FedLap Table 1's FLamby block once tuned FedProx that way
    bare = [o.replace("{name:fedprox,mu:0.5}", "fedprox") for o in preset("hp.prox:[0.1,1.0]")] + ["+hp={prox:0.5}"]
    with pytest.raises(FedbenchError, match=r"grid key hp.prox of fedprox does not change its runs .*reads \$\{hp.prox\}"):
        tuning_tasks(bare)
    spec, tasks = tuning_tasks([o.replace("[fedavg,fedprox]", "[fedavg,{name:fedprox,mu:${hp.prox}}]")
                                for o in bare])   # interpolated: the grid reaches mu
    (prox,) = [t for t in tasks if t.grid]
    assert [selection_config(prox, spec, p).algorithm.mu for p in grid_points(prox.grid)] == [0.1, 1.0]
    with pytest.raises(FedbenchError, match="fedprox has no option 'nu'"):
        tuning_tasks(preset("algorithm.nu:[0.0,1.0]"))


def test_a_tuned_table_regenerates_from_the_committed_stores_alone(tmp_path, monkeypatch, one_thread):
    import shutil

    from fedbench.launch.tuning import run_tuning
    from fedbench.report.tables import collect

    monkeypatch.setenv("FEDBENCH_RECORDS", str(tmp_path / "store" / "records"))
    monkeypatch.setenv("FEDBENCH_TUNING", str(tmp_path / "store" / "tuning"))
    sel, final = _tune(tmp_path, "out")
    ovs = TINY + [f"paths.output_root={tmp_path / 'out'}", "tuning=on"]
    first = collect(ovs, tmp_path / "out", tmp_path / "tables").read_text()
    (published,) = (tmp_path / "store" / "tuning").iterdir()             # the selection, with its run ids
    assert json.loads(published.read_text())["chosen"] == {"local.lr": 0.05}
    for trial in sel["val_metric"] + [{"run_id": sel["final_run_id"]}]:  # selection runs and the final run
        assert (tmp_path / "store" / "records" / trial["run_id"] / "metrics.json").is_file()
    shutil.rmtree(tmp_path / "out")                                        # a fresh clone: no outputs/
    again = collect(ovs, tmp_path / "out", tmp_path / "tables2").read_text()
    assert again == first and "— fedavg: local.lr=0.05" in again and f"{final['metrics']['accuracy']:.2f}" in again
    # tuning again on the fresh clone: every run is skipped on its committed record, and no committed record is
    # rewritten, not even a final run published without a tuning section (as a fixed-pick table publishes it)
    fin = tmp_path / "store" / "records" / sel["final_run_id"] / "metrics.json"
    fin.write_text(json.dumps({k: v for k, v in json.loads(fin.read_text()).items() if k != "tuning"}))
    store = {p: p.read_bytes() for p in (tmp_path / "store" / "records").rglob("metrics.json")}
    run_tuning(ovs + [f"paths.data_root={tmp_path / 'data'}"], str(tmp_path))
    assert {p: p.read_bytes() for p in (tmp_path / "store" / "records").rglob("metrics.json")} == store
    assert not list((tmp_path / "out" / "runs").glob("*/metrics.json"))   # nothing trained


def test_collect_publishes_the_runs_of_a_selection_still_under_way(tmp_path, monkeypatch, one_thread):
    """A session cut off mid-selection: collect publishes the selection runs that finished, and a fresh machine's
    tuning skips them (FOLA Fig. 5's 12 selection runs per N take longer than a session)."""
    import shutil

    from fedbench.launch.tuning import run_tuning, selection_config, tuning_tasks
    from fedbench.report.tables import collect
    from fedbench.runner import execute

    monkeypatch.setenv("FEDBENCH_RECORDS", str(tmp_path / "store" / "records"))
    monkeypatch.setenv("FEDBENCH_TUNING", str(tmp_path / "store" / "tuning"))
    ovs = TINY + [f"paths.output_root={tmp_path / 'out'}", f"paths.data_root={tmp_path / 'data'}", "tuning=on"]
    spec, tasks = tuning_tasks(ovs)
    (task,) = [t for t in tasks if t.grid]
    first, second = (selection_config(task, spec, p) for p in grid_points(task.grid))
    execute(first, tmp_path / "out" / "runs" / compute_run_id(first), launch_dir=str(tmp_path))   # then cut off
    text = collect(ovs, tmp_path / "out", tmp_path / "tables").read_text()
    assert "not tuned yet" in text
    store = tmp_path / "store" / "records"
    assert sorted(p.name for p in store.iterdir()) == [compute_run_id(first)]   # only the finished selection run
    assert not (tmp_path / "store" / "tuning").exists()                         # no choice without all its runs
    shutil.rmtree(tmp_path / "out")                                               # a fresh machine
    (sel,) = run_tuning(ovs, str(tmp_path))
    assert [t["run_id"] for t in sel["val_metric"]] == [compute_run_id(first), compute_run_id(second)]
    assert not (tmp_path / "out" / "runs" / compute_run_id(first) / "metrics.json").exists()   # skipped: not retrained
    assert (tmp_path / "out" / "runs" / compute_run_id(second) / "metrics.json").is_file()
    assert sel["chosen"] == {"local.lr": 0.05}


def test_a_task_leaves_the_runs_another_launcher_holds_and_comes_back_for_them(tmp_path, one_thread):
    """Two launchers on one tuning (FOLA Fig. 5 at N = 100 on two cores): a selection run whose claim a live holder
    has is left to it; with nothing else free the task answers DEFERRED, and later selects as a lone launcher would."""
    from fedbench.launch.tuning import DEFERRED, selection_config, tune_task, tuning_tasks
    from fedbench.results.claims import claim

    root = tmp_path / "out"
    ovs = TINY + [f"paths.output_root={root}", f"paths.data_root={tmp_path / 'data'}", "tuning=on"]
    spec, tasks = tuning_tasks(ovs)
    (task,) = [t for t in tasks if t.grid]
    first, second = (root / "runs" / compute_run_id(selection_config(task, spec, p)) for p in grid_points(task.grid))
    with claim(first / ".claim", "the other launcher's run"):
        assert tune_task(task, spec, root, str(tmp_path), defer_busy=True) == DEFERRED
        assert (second / "metrics.json").is_file() and not (first / "metrics.json").exists()
        assert not (root / "tuning").exists()                     # no choice before every selection run is in
    sel = tune_task(task, spec, root, str(tmp_path), defer_busy=True)   # released: the task goes on
    assert [t["run_id"] for t in sel["val_metric"]] == [first.name, second.name]   # grid order, not training order
    assert sel["chosen"] == {"local.lr": 0.05} and (root / "runs" / sel["final_run_id"] / "metrics.json").is_file()


def test_a_run_another_launcher_claims_after_the_busy_check_is_passed_over(tmp_path, monkeypatch, one_thread):
    """The race the busy check cannot see (both launchers check the same free point at one moment, the other claims
    it first): the claim itself answers, the task trains the next point and answers DEFERRED instead of waiting out
    the other's whole run."""
    import fedbench.launch.tuning as tuning
    from fedbench.launch.tuning import DEFERRED, selection_config, tune_task, tuning_tasks
    from tests.test_claims import claimed_in_another_thread

    root = tmp_path / "out"
    ovs = TINY + [f"paths.output_root={root}", f"paths.data_root={tmp_path / 'data'}", "tuning=on"]
    spec, tasks = tuning_tasks(ovs)
    (task,) = [t for t in tasks if t.grid]
    first, second = (root / "runs" / compute_run_id(selection_config(task, spec, p)) for p in grid_points(task.grid))
    monkeypatch.setattr(tuning, "_held_elsewhere", lambda cfg, root: False)   # checked before the other claimed
    with claimed_in_another_thread(first / ".claim", "the other launcher's run"):
        assert tune_task(task, spec, root, str(tmp_path), defer_busy=True) == DEFERRED
        assert (second / "metrics.json").is_file() and not (first / "metrics.json").exists()
    sel = tune_task(task, spec, root, str(tmp_path), defer_busy=True)   # released: the task goes on
    assert [t["run_id"] for t in sel["val_metric"]] == [first.name, second.name]
    assert (root / "runs" / sel["final_run_id"] / "metrics.json").is_file()


def test_run_tuning_comes_back_at_the_end_for_a_deferred_task(tmp_path, monkeypatch, capsys, one_thread):
    import fedbench.launch.tuning as tuning

    lone, _ = _tune(tmp_path, "lone")
    trained, real_run = [], tuning._run
    monkeypatch.setattr(tuning, "_run", lambda cfg, *a: trained.append(compute_run_id(cfg)) or real_run(cfg, *a))
    busy = lone["val_metric"][0]["run_id"]   # another launcher holds the first grid point for the whole first pass
    monkeypatch.setattr(tuning, "_held_elsewhere", lambda cfg, root: compute_run_id(cfg) == busy)
    (sel,) = tuning.run_tuning(TINY + [f"paths.output_root={tmp_path / 'two'}", f"paths.data_root={tmp_path / 'data'}",
                                       "tuning=on"], str(tmp_path))
    assert "being trained by another process; left for the end" in capsys.readouterr().err
    second = lone["val_metric"][1]["run_id"]
    # the free point, then in the second pass the held one (the free one again: a skip of its record) and the final
    assert trained == [second, busy, second, lone["final_run_id"]]
    assert sel["chosen"] == lone["chosen"] and sel["val_metric"] == lone["val_metric"]


@pytest.mark.parametrize("overrides, needle", [
    (["tuning=maybe"], "tuning='maybe' is not allowed: tuning must be one of off, on"),
    (["experiment=fedlap/table2", "tuning=on"], "tuning=on needs a preset with a table.tuning block; fedlap/table2 "
     "has none (presets with one: fedlap/table1, fedlpa/table10, fedlpa/table5, fedlpa/table6, fola/figure5, fola/table2)"),
    (["experiment=fedlap/table1", "tuning=on", "table.tuning.metric=ece"], "table.tuning: metric must be one of accuracy, nll"),
    (["experiment=fedlap/table1", "tuning=on", "table.tuning.val_fraction=1.5"], "val_fraction must be a number in (0, 1)"),
    (["experiment=fedlap/table1", "tuning=on", "table.tuning.grids=[{methods:{fedavg:{local.epochs:[]}}}]"],
     "grids[0].methods.fedavg.local.epochs must be a non-empty list"),
    (["experiment=fedlap/table1", "tuning=on", "+table.tuning.budget=3"], "unknown key(s) budget"),
    (["tuning_val.fraction=1.0"], "tuning_val.fraction=1.0 is not allowed"),
])
def test_bad_tuning_input_is_one_line(overrides, needle):
    from fedbench.config.preflight import check_script_overrides

    with pytest.raises(FedbenchError) as e:
        check_script_overrides(overrides)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_run_py_refuses_tuning_on_and_reproduce_prints_one_error_line(capsys):
    from fedbench.config.preflight import preflight

    with pytest.raises(FedbenchError, match="use scripts/reproduce.py"):
        preflight(["experiment=fedlap/table1", "tuning=on"])
    mod = load_script("reproduce.py")
    assert mod.main(["experiment=fedlap/table2", "tuning=on"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedbench: error: tuning=on needs a preset with a table.tuning block")
    sub = load_script("submit.py")
    assert sub.main(["experiment=fedlap/table1", "tuning=on"]) == 2
    assert capsys.readouterr().err.strip() == ("fedbench: error: tuning=on is run by scripts/reproduce.py (selection runs, "
                                               "then the final runs); submit does not support it yet")


def test_tuning_keys_leave_run_ids_unchanged():
    from omegaconf import OmegaConf

    from fedbench.results.records import identity_config

    base = {"seed": 0, "tuning": "on", "tuning_val": {"fraction": 0.0, "seed": 0}}
    assert identity_config(OmegaConf.create(base)) == {"seed": 0}
    on = identity_config(OmegaConf.create({**base, "tuning_val": {"fraction": 0.2, "seed": 0}}))
    assert on == {"seed": 0, "tuning_val": {"fraction": 0.2, "seed": 0}}


def test_parse_tuning_defaults():
    spec = parse_tuning({"tuning": {"grids": [{"methods": {"fedavg": {"local.epochs": [1, 2]}}}]}})
    assert spec.protocol() == {"val_fraction": 0.2, "val_seed": 0, "metric": "accuracy", "at_round": None, "select": {}}


def test_dry_run_counts_what_tuning_and_a_sweep_still_have_to_train(tmp_path, capsys, one_thread):

    from fedbench.launch.tuning import tuning_plan

    out = [f"paths.output_root={tmp_path / 'out'}", f"paths.data_root={tmp_path / 'data'}"]
    before = tuning_plan(TINY + out + ["tuning=on"], str(tmp_path))
    assert before == {"tasks": 1, "tasks_done": 0, "selection_runs": 2, "selection_done": 0}
    _tune(tmp_path, "out")
    made = sorted((tmp_path / "out" / "runs").glob("*/metrics.json"))
    after = tuning_plan(TINY + out + ["tuning=on"], str(tmp_path))
    assert after == {"tasks": 1, "tasks_done": 1, "selection_runs": 2, "selection_done": 2}
    mod = load_script("reproduce.py")
    capsys.readouterr()
    assert mod.main(["--dry-run", *TINY, *out, "tuning=on"]) == 0
    assert capsys.readouterr().out.strip() == "dry run: tuning 2/2 selection run(s) done, 1/1 (cell, method) task(s) finished"
    assert mod.main(["--dry-run", *TINY, *out, "local.lr=0.3"]) == 0   # the fixed-pick run was never made
    assert capsys.readouterr().out.strip() == "dry run: 0/1 run(s) done, 1 to do"
    assert sorted((tmp_path / "out" / "runs").glob("*/metrics.json")) == made   # the dry runs trained nothing
