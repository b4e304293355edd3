"""Every method of every experiment preset runs on that preset's model (fedbench issue 18 item 3): an unsupported
(method, model) pair fails here, in CI, not on a cluster.

Each preset's sweep (both profiles) is expanded, the run override lists are reduced to what picks methods, model and
data (so a preset composes a handful of times, not once per seed / epoch count / split), the aggregator lists are
expanded as the runner does, and every distinct (method config, model config, data set) is checked:

* the method is built on the preset's model, with the data set's input shape and class count (its ``__init__`` is
  where a method refuses a model, in one line, e.g. PFNM on a ResNet);
* one full round runs on tiny synthetic data: 2 clients x 6 samples, one local step, the method's client messages
  (curvature, Gram matrices, ...), its server step and the evaluation. Iteration budgets (server steps, distillation
  epochs, generator sizes) are cut by ``CHEAP``; everything that selects a code path is left as the preset sets it.

ResNet-18 (FedFisher Table 3, FedBEns Table 9): construction on the real 11M-parameter model, then the round on a
narrow copy of the same architecture (same stem, blocks, shortcuts and head names, 8 channels per stage) — a full
round of K-FAC / RegMean / DENSE on ResNet-18 takes minutes on a CPU. OTFusion's real-ResNet-18 fusion is checked in
tests/test_matching.py.
"""
import json
from functools import lru_cache

import pytest
import torch
from omegaconf import OmegaConf

from fedbench.algorithms import build_algorithm
from fedbench.data.images import SHAPES
from fedbench.fl.loop import FLSetup, run_rounds
from fedbench.launch.sweep import CONF_DIR, compose_run, expand_sweep
from fedbench.models import build_model
from fedbench.models.resnet import ResNet18NoBN
from fedbench.runner import expand_aggregators, validate
from fedbench.train.config import LocalTrainConfig
from fedbench.train.engine import TrainData

PRESETS = sorted(p.relative_to(CONF_DIR / "experiment").with_suffix("").as_posix()
                 for p in (CONF_DIR / "experiment").rglob("*.yaml"))
# override keys that can change a run's methods, model or data set; the rest (seeds, epochs, splits, method
# hyperparameter values) cannot make a method unsupported on a model
PICKS = ("experiment", "profile", "dataset", "model", "aggregators", "algorithm", "server_unlabeled.size")
# per-sample input shape, classes, task of the non-image data sets (images: fedbench.data.images.SHAPES)
TABULAR = {"uci_credit": ((46,), 2, "classification"), "flamby_heart": ((13,), 2, "classification"),
           "fedfisher_synthetic": ((2,), 0, "regression")}
# iteration budgets capped for the test (only keys the method's config has; a smaller value stays)
CHEAP = {"steps": 2, "eval_every": 1, "server_steps": 2, "val_every": 1, "server_iters": 2, "gd_steps": 2,
         "cg_max_iters": 2, "epochs": 1, "g_steps": 1, "synthesis_batch_size": 4, "kd_batch_size": 4, "nz": 8,
         "ngf": 4, "batch_size": 4, "num_samples": 2, "distill_epochs": 1, "distill_batch_size": 4, "adv_steps": 1,
         "iterations": 1, "gram_max_samples": 16, "curvature_batch_size": 4, "members": 2}
CLIENTS, PER_CLIENT, HELD = 2, 6, 4


def _data_spec(dcfg):
    """(per-sample input shape, classes, task) of a data set config or name."""
    name = dcfg if isinstance(dcfg, str) else dcfg["name"]
    if name == "synthetic":
        name = dcfg["kwargs"]["like"]
    if name in SHAPES:
        return SHAPES[name][0], SHAPES[name][1], "classification"
    assert name in TABULAR, f"data set {name!r}: add its input shape to TABULAR"
    return TABULAR[name]


def _picks(ovs):
    """What of a run's overrides can change its methods, model or data shape (data sets of one shape are one)."""
    out = []
    for o in ovs:
        key, _, value = o.partition("=")
        if key == "dataset" and value != "synthetic":
            out.append(("dataset", str(_data_spec(value))))
        elif key in PICKS:
            out.append((key, value))
    return tuple(out)


def _cheap(algo):
    return {k: min(v, CHEAP[k]) if k in CHEAP and isinstance(v, int) and not isinstance(v, bool) else v
            for k, v in algo.items()}


def _paths_only(algo):
    """A method config with its real-valued hyperparameters dropped: two configs that differ only in a float
    (a temperature, a learning rate, a damping) take the same code paths, so one of them is run."""
    if isinstance(algo, dict):
        return {k: _paths_only(v) for k, v in algo.items() if not isinstance(v, float)}
    return algo


@lru_cache(maxsize=None)
def combos():
    """{(method config, model config, data spec, held-out server data): [presets naming it]} over every preset's
    paper profile (the quick profiles run subsets of the same methods with smaller budgets)."""
    out, configs = {}, {}
    for preset in PRESETS:
        seen = set()
        for ovs in expand_sweep([f"experiment={preset}", "profile=paper"]):
            if _picks(ovs) in seen:
                continue
            seen.add(_picks(ovs))
            cfg = compose_run(list(ovs))
            for sub in (expand_aggregators(cfg, CONF_DIR) if cfg.get("aggregators") else [cfg]):
                validate(sub)
                c = OmegaConf.to_container(sub, resolve=True)
                model = {k: v for k, v in c["model"].items() if k != "pretrained"}   # seeded init stands in
                held = {k: bool((c.get(k) or {}).get("size")) for k in ("server_val", "server_unlabeled")}
                spec = _data_spec(c["dataset"])
                algo = _cheap(c["algorithm"])
                # the class count does not change what a method supports: one per input shape
                key = json.dumps([_paths_only(algo), model, spec[0], spec[2], held], sort_keys=True)
                configs.setdefault(key, (algo, model, spec, held))
                out.setdefault(key, [])
                if preset not in out[key]:
                    out[key].append(preset)
    return {json.dumps(configs[k]): v for k, v in out.items()}


def _id(key):
    algo, model, spec, _ = json.loads(key)
    return f"{algo['name']}-{model['name']}-{'x'.join(map(str, spec[0]))}-{spec[1]}"


def _narrow(model):
    """A ResNet18NoBN of the same stem, blocks, shortcuts and head names with 8 channels per stage."""
    head = [getattr(model, n) for n in model.head_names]
    stem = "mod7" if model.conv1.kernel_size == (7, 7) else "cifar"
    return ResNet18NoBN(model.input_shape, model.num_classes, stem=stem, head=[m.out_features for m in head[:-1]],
                        head_names=model.head_names, widths=(8, 8, 8, 8))


def _setup(model, shape, k, task, held, mcfg):
    g = torch.Generator().manual_seed(0)
    n = CLIENTS * PER_CLIENT + 2 * HELD
    x = torch.randn(n, *shape, generator=g)
    y = torch.randn(n, generator=g) if task == "regression" else torch.arange(n) % k
    train = TrainData(x, y, task=task)
    idx = [torch.arange(i * PER_CLIENT, (i + 1) * PER_CLIENT) for i in range(CLIENTS)]
    rest = torch.arange(CLIENTS * PER_CLIENT, n)
    return FLSetup(model=model, train=train, test_inputs=train.inputs, test_y=y[rest], client_indices=idx,
                   local=LocalTrainConfig(lr=0.01, batch_size=PER_CLIENT, epochs=1), seed=0,
                   device=torch.device("cpu"), task=task, stage_parts={"model": mcfg},
                   server_val=(x[rest[:HELD]], y[rest[:HELD]]) if held["server_val"] else None,
                   server_unlabeled=x[rest[HELD:]] if held["server_unlabeled"] else None)


def test_every_preset_names_some_method():
    named = {p for presets in combos().values() for p in presets}
    assert named == set(PRESETS), set(PRESETS) - named


@pytest.mark.parametrize("key", sorted(combos(), key=_id), ids=_id)
def test_method_runs_on_the_presets_model(key):
    acfg, mcfg, (shape, k, task), held = json.loads(key)
    opts = {o: v for o, v in mcfg.items() if o != "name"}
    torch.manual_seed(0)
    model = build_model(mcfg["name"], input_shape=shape, num_classes=k, **opts)
    # the preset's model as the runner builds it: a method that does not support it refuses here, in one line
    build_algorithm(acfg, _setup(model, shape, k, task, held, mcfg))
    if isinstance(model, ResNet18NoBN):
        model = _narrow(model)
    setup = _setup(model, shape, k, task, held, mcfg)
    algo = build_algorithm(acfg, setup)   # acfg's budgets are capped by CHEAP already
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    state, logs = run_rounds(setup, algo, init, 1, progress=False)
    metric = "accuracy" if task == "classification" else "mse"
    assert metric in logs[0].metrics, (sorted(logs[0].metrics), combos()[key])
    assert state.get("params") is not None or algo.predict_params(state) is not None
