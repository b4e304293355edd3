"""Run one composed config end to end and write its record. ``run.py`` is a thin Hydra wrapper."""
from __future__ import annotations

import datetime as _dt
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

import fedbench
from fedbench.errors import FedbenchError
from fedbench.results.summaries import summarize
from fedbench import numerics
from fedbench.results.records import (compute_run_id, identity_config, is_complete, read_record, records_dir,
                                      write_csv_atomic, write_json_atomic, write_torch_atomic)

HISTORY_COLUMNS = ("round", "accuracy", "nll", "ece", "mse", "local_accuracy", "train_loss", "cached_clients",
                   "uplink_bytes", "downlink_bytes", "client_train_s", "client_train_compute_s", "client_post_s", "client_post_compute_s", "server_s", "eval_s")
_NON_METRICS = {"round", "train_loss", "cached_clients", "uplink_bytes", "downlink_bytes", "client_train_s",
                "client_train_compute_s", "client_post_s", "client_post_compute_s", "server_s", "eval_s"}


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(spec)
    except RuntimeError:
        raise FedbenchError(f"hardware.device '{spec}' is not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise FedbenchError(f"hardware.device={spec} but no CUDA device is available; use hardware=cpu or hardware=auto")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise FedbenchError(f"hardware.device={spec} but only {torch.cuda.device_count()} CUDA device(s) exist")
    return dev


def resolve_backend(spec: str, device: torch.device) -> str:
    if spec == "auto":
        return "batched" if device.type == "cuda" else "serial"
    if spec not in ("serial", "batched"):
        raise FedbenchError(f"hardware.backend must be auto, serial or batched, got '{spec}'")
    return spec


def set_threads(spec, device: torch.device, num_params: int) -> None:
    """CPU intra-op threads. ``auto``: one thread for tiny models (tabular / logistic regression), whose
    per-step ops are too small to split — extra threads only add synchronisation (measured 15x slower
    per Adam step on a 47-parameter model with 2 threads on a busy 2-core machine); torch's default otherwise."""
    if spec in (None, "auto"):
        if device.type == "cpu" and num_params < 10_000:
            torch.set_num_threads(1)
        return
    try:
        n = int(spec)
    except (TypeError, ValueError):
        raise FedbenchError(f"hardware.num_threads must be auto or a positive integer, got {spec!r}") from None
    if n < 1:
        raise FedbenchError(f"hardware.num_threads must be auto or a positive integer, got {spec!r}")
    torch.set_num_threads(n)


def _group(cfg: DictConfig, key: str) -> Dict[str, Any]:
    node = cfg.get(key)
    if node is None or "name" not in node:
        raise FedbenchError(f"config group '{key}' is missing or has no 'name' (pick one with {key}=<option>)")
    return OmegaConf.to_container(node, resolve=True)


def validate(cfg: DictConfig, launch_dir: Optional[str] = None) -> None:
    """Every check that needs no data: the torch-free pass (fedbench/config/validate.py: types, ranges, group
    keys, devices, paths, profiles), then the registries and the CUDA devices torch sees. One-line FedbenchError."""
    from fedbench.algorithms import ALGORITHMS
    from fedbench.config.validate import validate_config
    from fedbench.data import DATASETS
    from fedbench.models import MODELS
    from fedbench.partition import PARTITIONS

    validate_config(cfg, launch_dir=launch_dir)
    DATASETS.get(_group(cfg, "dataset")["name"])
    pname = _group(cfg, "partition")["name"]
    if not pname.startswith("noniid-#label"):
        PARTITIONS.get(pname)
    MODELS.get(_group(cfg, "model")["name"])
    ALGORITHMS.get(_group(cfg, "algorithm")["name"])
    resolve_backend(cfg.hardware.backend, resolve_device(cfg.hardware.device))


def normalization(value, default_stats):
    """``dataset.normalize``: true = the data set's own statistics (``default_stats`` = (mean, std)), false = none
    (ToTensor only), or ``{mean: [...], std: [...]}`` per channel (FOLA Table I's (0.5, 0.5, 0.5)). Returns
    (mean, std) or (None, None); ``default_stats=None`` only checks the value."""
    if isinstance(value, bool):
        return (default_stats if default_stats is not None else (None, None)) if value else (None, None)
    if isinstance(value, Mapping) and set(value) == {"mean", "std"}:
        mean, std = value["mean"], value["std"]
        ok = (isinstance(mean, Sequence) and isinstance(std, Sequence) and len(mean) == len(std) > 0
              and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in [*mean, *std])
              and all(v > 0 for v in std))
        if ok:
            return tuple(float(v) for v in mean), tuple(float(v) for v in std)
    raise FedbenchError(f"dataset.normalize must be true, false or {{mean: [...], std: [...]}} with one positive std "
                        f"per channel, got {value!r}")


def _finished_record(rec_path: Path, run_id: str, save_model: bool, launch_dir: Optional[str]) -> Optional[Path]:
    """The complete, current record of ``run_id``: this run's own folder, else the committed store
    (results/records; a ``save_model`` run needs its weights, which only its own folder has)."""
    if is_complete(rec_path, run_id, need_model=save_model):
        return rec_path
    stored = Path(_abs(str(records_dir()), launch_dir)) / run_id / "metrics.json"
    return stored if not save_model and is_complete(stored, run_id) else None


def _git(*args: str) -> Optional[str]:
    try:
        root = Path(fedbench.__file__).resolve().parents[1]
        res = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=5)
        return res.stdout.strip() if res.returncode == 0 else None
    except Exception:
        return None


def _git_sha() -> Optional[str]:
    return _git("rev-parse", "--short", "HEAD") or None


def _git_dirty() -> Optional[bool]:
    """Whether the code that ran differed from its commit (tracked files under fedbench/, conf/, run.py)."""
    out = _git("status", "--porcelain", "--untracked-files=no", "--", "fedbench", "conf", "run.py")
    return None if out is None else bool(out)


def _abs(path: str, base: Optional[str]) -> str:
    p = Path(os.path.expanduser(path))
    return str(p if p.is_absolute() else Path(base or os.getcwd()) / p)


def execute(cfg: DictConfig, output_dir: str | Path, *, launch_dir: Optional[str] = None,
            memory_cache: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Run ``cfg`` and write ``metrics.json`` + ``history.csv`` into ``output_dir``; returns the record.

    A run without an ok record is claimed first (``<output_dir>/.claim``, fedbench/results/claims.py), so
    two processes never train it at once: the second waits, then ``_execute`` checks the record again and
    returns the first one's ok record as a skip, or runs it itself if the first one failed or died."""
    from fedbench.results.claims import claim

    out, run_id = Path(output_dir), compute_run_id(cfg)
    if not cfg.get("force", False) and _finished_record(out / "metrics.json", run_id,
                                                        bool(cfg.get("save_model", False)), launch_dir):
        return _execute(cfg, output_dir, launch_dir=launch_dir)   # the skip: no claim needed
    try:
        with claim(out / ".claim", f"run {run_id}"):
            return _execute(cfg, output_dir, launch_dir=launch_dir, memory_cache=memory_cache)
    finally:   # a run rejected before writing anything leaves no empty folder behind
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()


def _execute(cfg: DictConfig, output_dir: str | Path, *, launch_dir: Optional[str] = None,
             memory_cache: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """``execute``'s body: skip a run with an ok record, else check the config, train, write the record."""
    from fedbench.algorithms import build_algorithm
    from fedbench.data import load_dataset
    from fedbench.data.transforms import Augment
    from fedbench.fl.cache import ClientStageCache
    from fedbench.fl.loop import FLSetup, run_rounds
    from fedbench.fl.server_data import (ServerUnlabeledConfig, ServerValConfig, draw_server_unlabeled,
                                         draw_server_val)
    from fedbench.models import build_model, count_parameters
    from fedbench.partition import client_label_counts, make_partition
    from fedbench.results.loggers import make_logger
    from fedbench.train.config import LocalTrainConfig
    from fedbench.train.engine import TrainData

    t_start = time.perf_counter()
    out = Path(output_dir)
    rec_path = out / "metrics.json"
    run_id = compute_run_id(cfg)
    save_model = bool(cfg.get("save_model", False))
    # ---- everything that can be rejected is rejected here, before the skip check and any training --------
    validate(cfg, launch_dir)
    done = _finished_record(rec_path, run_id, save_model, launch_dir) if not cfg.get("force", False) else None
    if done is not None:
        print(f"fedbench: run {run_id} already has an ok record at {done}; skipped (force=true reruns it)")
        rec = read_record(done)
        rec["skipped"] = True
        return rec

    dcfg, pcfg, mcfg, acfg = (_group(cfg, k) for k in ("dataset", "partition", "model", "algorithm"))
    local = LocalTrainConfig.from_cfg(OmegaConf.to_container(cfg.local, resolve=True))
    device = resolve_device(cfg.hardware.device)
    backend = resolve_backend(cfg.hardware.backend, device)
    seed = int(cfg.seed)
    ckpt = None
    if mcfg.get("pretrained") is not None:   # checked before the data are loaded
        from fedbench.models.pretrained import check_checkpoint_path
        ckpt = str(check_checkpoint_path(_abs(str(mcfg["pretrained"]), launch_dir)))

    data = load_dataset(dcfg["name"], _abs(cfg.paths.data_root, launch_dir), **(dcfg.get("kwargs") or {}))
    if data.approximate:
        print(f"fedbench: WARNING: {data.approximate}", file=sys.stderr)
    pparams = {k: v for k, v in pcfg.items() if k != "name"}
    sval = ServerValConfig.from_cfg(OmegaConf.to_container(cfg.server_val, resolve=True)
                                    if cfg.get("server_val") is not None else None)
    val_idx, keep = draw_server_val(sval, len(data.train_y), seed)
    sunl = ServerUnlabeledConfig.from_cfg(OmegaConf.to_container(cfg.server_unlabeled, resolve=True)
                                          if cfg.get("server_unlabeled") is not None else None)
    unl_idx, keep_after = draw_server_unlabeled(sunl, len(data.train_y), keep, seed)
    unl_holdout = keep_after is not keep
    keep = keep_after
    labels_all = np.asarray(data.train_y.cpu())
    if keep is None:
        parts = make_partition(pcfg["name"], labels_all, int(cfg.num_clients), seed,
                               groups=data.train_groups, num_classes=data.num_classes or None, **pparams)
    else:   # hold-out server data: partition only what is left, indices still refer to the full set
        groups = None if data.train_groups is None else np.asarray(data.train_groups)[keep]
        parts = [keep[p] for p in make_partition(pcfg["name"], labels_all[keep], int(cfg.num_clients), seed,
                                                 groups=groups, num_classes=data.num_classes or None, **pparams)]
    sizes = [int(len(p)) for p in parts]
    if any(s == 0 for s in sizes) and local.epochs > 0:
        print(f"fedbench: WARNING: {sizes.count(0)} client(s) received no data", file=sys.stderr)
    counts = (client_label_counts(parts, np.asarray(data.train_y.cpu()), data.num_classes).tolist()
              if data.task == "classification" else None)

    torch.manual_seed(seed)  # every client starts from the same seeded initialisation
    model = build_model(mcfg["name"], input_shape=tuple(data.input_shape), num_classes=data.num_classes,
                        **{k: v for k, v in mcfg.items() if k not in ("name", "pretrained")}).to(device)
    pretrained = None
    if ckpt is not None:   # e.g. FedFisher Table 3's Tiny-ImageNet ResNet-18; the rest keeps the seeded init
        from fedbench.models.pretrained import load_pretrained
        pretrained = load_pretrained(model, ckpt)
    init_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    set_threads(cfg.hardware.get("num_threads"), device, count_parameters(model))

    data = data.to(device)
    mean, std = normalization(dcfg.get("normalize", True), (data.mean, data.std))
    if mean is not None and data.mean is not None and len(mean) != len(data.mean):
        raise FedbenchError(f"dataset.normalize gives {len(mean)} channel(s), {dcfg['name']} has {len(data.mean)}")
    aug = Augment(**dcfg["augment"]) if dcfg.get("augment") else None
    train = TrainData(data.train_x, data.train_y, mean, std, aug if aug is not None and aug.enabled else None,
                      data.task)
    test = TrainData(data.test_x, data.test_y, mean, std, None, data.task)
    cache_dir = cfg.paths.get("cache_dir") if cfg.get("cache", True) else None
    stage_parts = {"dataset": dcfg, "partition": pcfg, "num_clients": int(cfg.num_clients), "seed": seed,
                   "model": mcfg, "local": OmegaConf.to_container(cfg.local, resolve=True)}
    if numerics.CORE != 1:   # cached clients of older core numerics are retrained (1: the keys of existing entries)
        stage_parts["numerics_core"] = numerics.CORE
    if pretrained is not None:   # the checkpoint's content, not just its path, determines the clients
        stage_parts["pretrained_sha256"] = pretrained["sha256"]
    if sval.mode == "holdout" and sval.size > 0:   # a hold-out changes the clients' data
        stage_parts["server_val_holdout"] = {"size": sval.size, "seed": sval.seed}
    if unl_holdout:
        stage_parts["server_unlabeled_holdout"] = {"size": sunl.size, "seed": sunl.seed if sunl.seed is not None else seed}
    server_val = None
    if val_idx is not None:
        vi = torch.as_tensor(val_idx, dtype=torch.long, device=device)
        server_val = (train.inputs(vi), data.train_y[vi])
    server_unlabeled = None
    if unl_idx is not None:   # inputs only: the methods never see these labels
        server_unlabeled = train.inputs(torch.as_tensor(unl_idx, dtype=torch.long, device=device))
    setup = FLSetup(model=model, train=train, test_inputs=test.inputs, test_y=data.test_y,
                    client_indices=[torch.as_tensor(p, dtype=torch.long, device=device) for p in parts],
                    local=local, seed=seed, device=device, task=data.task, backend=backend,
                    conv_strategy=cfg.hardware.get("conv_strategy", "auto"),
                    eval_batch_size=int(cfg.eval.batch_size), ece_bins=int(cfg.eval.ece_bins),
                    local_accuracy=bool(cfg.eval.get("local_accuracy", False)),
                    cache=ClientStageCache(_abs(cache_dir, launch_dir) if cache_dir else None, memory=memory_cache),
                    stage_parts=stage_parts, server_val=server_val, server_unlabeled=server_unlabeled)
    if cfg.eval.get("map_reference") is not None:   # FedLap App. D.2: distance to the centralised MAP per round
        setup.round_metrics = _map_reference_metrics(setup, init_params, float(cfg.eval.map_reference))
    algo = build_algorithm(acfg, setup)
    config = OmegaConf.to_container(cfg, resolve=True)
    logger = make_logger(config.get("logger") or {"name": "none"}, run_id, config, out)

    # ---- training ----------------------------------------------------------------------------
    out.mkdir(parents=True, exist_ok=True)
    started = _dt.datetime.now().isoformat(timespec="seconds")
    history = []

    def on_round(log):
        row = {"round": log.round, **log.metrics, "train_loss": log.train_loss, "cached_clients": log.cached_clients,
               "uplink_bytes": log.uplink_bytes,
               "downlink_bytes": log.downlink_bytes, "client_train_s": log.client_train_s,
               "client_train_compute_s": log.client_train_compute_s,
               "client_post_s": log.client_post_s, "client_post_compute_s": log.client_post_compute_s,
               "server_s": log.server_s, "eval_s": log.eval_s}
        history.append(row)
        logger.log_round(row)

    from fedbench.curvature.compute import curvature_seconds
    curv_t0 = curvature_seconds()
    status, error = "failed", None
    final_state = None
    round1_clients = []   # save_model of a one-shot run: the client weights the aggregator received
    keep_clients = save_model and int(cfg.rounds) == 1
    saved: Dict[str, str] = {}
    try:
        final_state, logs = run_rounds(setup, algo, init_params, int(cfg.rounds), eval_every=int(cfg.eval.every),
                             progress=bool(cfg.get("progress", True)), on_round=on_round,
                             on_clients=(lambda r, ps: round1_clients.extend(ps)) if keep_clients else None)
        if save_model:
            saved = _save_model(out, algo.predict_params(final_state), round1_clients, mcfg, data, run_id)
        status = "ok"
    except KeyboardInterrupt:
        error = "interrupted"
        raise
    except Exception as e:  # record the failure, then let it surface
        error = f"{type(e).__name__}: {e}"
        raise
    finally:
        logger.finish(status)
        final = history[-1] if history else {}
        record = {
            "run_id": run_id,
            "status": status,
            "error": error,
            "algorithm": acfg["name"],
            "dataset": dcfg["name"],
            "dataset_approximate": data.approximate,
            "config": config,
            "identity": identity_config(cfg),
            "partition": {"name": pcfg["name"], "client_sizes": sizes, "client_label_counts": counts},
            "model": {"name": mcfg["name"], "num_parameters": count_parameters(model), "pretrained": pretrained},
            "metrics": {k: v for k, v in final.items() if k not in _NON_METRICS},
            "summary": {**summarize(history, last=int(cfg.eval.get("last_k", 3)),
                                    thresholds=list(cfg.eval.get("thresholds") or [])), **_map_summary(cfg, history)},
            "cache": {"dir": setup.cache.root and str(setup.cache.root), "hits": setup.cache.hits,
                      "misses": setup.cache.misses},
            "communication": {"uplink_bytes": sum(h["uplink_bytes"] for h in history),
                              "downlink_bytes": sum(h["downlink_bytes"] for h in history)},
            "timing": {"total_s": time.perf_counter() - t_start,
                       "client_train_s": sum(h["client_train_s"] for h in history),
                       "client_train_compute_s": sum(h["client_train_compute_s"] for h in history),
                       "client_post_s": sum(h["client_post_s"] for h in history),
                       "client_post_compute_s": sum(h["client_post_compute_s"] for h in history),
                       "server_s": sum(h["server_s"] for h in history),
                       "curvature_s": curvature_seconds() - curv_t0,
                       "eval_s": sum(h["eval_s"] for h in history)},
            "rounds_completed": len(history),
            "saved": saved,   # save_model=true: file names (beside this record) of the final / client weights
            "numerics": numerics.current(acfg["name"]),   # stale when the arithmetic changes (fedbench/numerics.py)
            "environment": {"device": str(device), "backend": backend, "torch": torch.__version__,
                            "python": platform.python_version(), "fedbench": fedbench.__version__,
                            "git": _git_sha(), "git_dirty": _git_dirty(), "host": platform.node()},
            "started": started,
            "finished": _dt.datetime.now().isoformat(timespec="seconds"),
        }
        # a failed rerun never overwrites a completed record
        if status == "ok" or not is_complete(rec_path, current=False):
            extra = [k for h in history for k in h if k not in HISTORY_COLUMNS]
            write_csv_atomic(out / "history.csv", history, list(HISTORY_COLUMNS) + list(dict.fromkeys(extra)))
            trace = (final_state or {}).get("trace")
            if status == "ok" and trace:   # a method's per-step/epoch server trace of its last round (e.g. DENSE's epochs)
                write_csv_atomic(out / "trace.csv", list(trace))
            write_json_atomic(rec_path, record)
    m = record["metrics"]
    summary = " ".join(f"{k}={v:.4g}" for k, v in m.items() if v is not None and not math.isnan(v))
    approx = " [APPROXIMATE DATA: see dataset_approximate]" if data.approximate else ""
    print(f"fedbench: {acfg['name']} on {dcfg['name']}{approx} ({cfg.num_clients} clients, {pcfg['name']}, "
          f"{len(history)} round(s)): {summary} | {record['timing']['total_s']:.1f}s | {rec_path}")
    return record


def _save_model(out: Path, params, clients, mcfg: Dict[str, Any], data, run_id: str) -> Dict[str, str]:
    """``save_model=true``: the final global weights (``predict_params``: one dict, or a list for an ensemble)
    to ``model.pt`` and, for a one-shot run, the round-1 client weights to ``clients.pt``; each file also says
    how to rebuild the model (``fedbench.models.build_model(name, input_shape=, num_classes=, **kwargs)``)."""
    def cpu(p):
        if isinstance(p, (list, tuple)):
            return [cpu(q) for q in p]
        if isinstance(p, dict) and all(isinstance(v, torch.Tensor) for v in p.values()):
            return {k: v.detach().cpu().clone() for k, v in p.items()}
        raise TypeError(type(p).__name__)

    try:
        params = cpu(params)
    except TypeError as e:   # e.g. FedOV's open-set vote: a predictor, not weights
        print(f"fedbench: WARNING: save_model: the method predicts with a {e}, not weights; model.pt not written",
              file=sys.stderr)
        return {"model": None}   # recorded as "nothing to save", so the run is not redone for want of a file
    head = {"run_id": run_id, "model": mcfg["name"], "input_shape": list(data.input_shape),
            "num_classes": data.num_classes,
            "model_kwargs": {k: v for k, v in mcfg.items() if k not in ("name", "pretrained")}}
    write_torch_atomic(out / "model.pt", {**head, "params": params})
    saved = {"model": "model.pt"}
    if clients:
        write_torch_atomic(out / "clients.pt", {**head, "params": cpu(clients)})
        saved["clients"] = "clients.pt"
    return saved


def _map_reference_metrics(setup, init_params, delta: float):
    """The per-round metrics of ``eval.map_reference`` (fedbench/eval/map_reference.py), MAP solved on the pooled
    client data."""
    from fedbench.algorithms.centralized import pooled_indices
    from fedbench.eval.map_reference import map_round_metrics
    from fedbench.eval.metrics import evaluate

    idx = pooled_indices(setup.client_indices)
    x, y = setup.train.inputs(idx), setup.train.y[idx]

    def test(params):
        return evaluate(setup.model, params, setup.test_inputs, setup.test_y, task=setup.task,
                        batch_size=setup.eval_batch_size, n_bins=setup.ece_bins)

    return map_round_metrics(setup.model, init_params, x, y, delta, setup.task, test)


def _map_summary(cfg, history) -> Dict[str, Any]:
    if cfg.eval.get("map_reference") is None:
        return {}
    from fedbench.eval.map_reference import first_round_within
    return {"first_round_train_nll_within_1pct": first_round_within(history)}


def expand_aggregators(cfg: DictConfig, conf_dir: Path, allow_missing: bool = False) -> list:
    """``aggregators: [fedavg, fednova, {name: fedprox, mu: 0.1}, ...]`` -> one full config per aggregator.

    Each gets the algorithm group's YAML (updated by the dict's keys), so its run_id equals that of
    a plain ``algorithm=<name>`` run and the records are interchangeable; all share the cached clients.
    """
    out = []
    for entry in cfg.aggregators:
        entry = OmegaConf.to_container(entry, resolve=True) if OmegaConf.is_config(entry) else entry
        name = entry if isinstance(entry, str) else entry.get("name") if isinstance(entry, dict) else None
        path = conf_dir / "algorithm" / f"{name}.yaml"
        if not name or not path.exists():
            if allow_missing and name:   # collect: mark the column as not implemented yet
                algo = OmegaConf.create({"name": name, "_missing": True})
                sub = OmegaConf.merge(cfg, {"aggregators": None})
                sub.algorithm = algo
                out.append(sub)
                continue
            options = sorted(p.stem for p in (conf_dir / "algorithm").glob("*.yaml"))
            raise FedbenchError(f"aggregators: algorithm {entry!r} is not implemented yet (no conf/algorithm/"
                                f"{name}.yaml); available: {', '.join(options)}")
        algo = OmegaConf.load(path)
        if isinstance(entry, dict):   # the entry's name picks the YAML (e.g. dense_fedfisher, whose method is dense)
            algo = OmegaConf.merge(algo, {k: v for k, v in entry.items() if k != "name"})
        sub = OmegaConf.merge(cfg, {"aggregators": None})
        sub.algorithm = algo
        out.append(sub)
    return out


def execute_all(cfg: DictConfig, output_dir: str | Path, conf_dir: Path, *, launch_dir: Optional[str] = None):
    """Run ``cfg``, or, when ``aggregators`` is a list, every aggregator on the same (cached) clients.

    Each aggregator succeeds or fails on its own: a failure is written as that aggregator's failed record
    (with its one-line reason), the others still run, and the job then raises one FedbenchError naming the failures.
    """
    if not cfg.get("aggregators"):
        return [execute(cfg, output_dir, launch_dir=launch_dir)]
    subs = expand_aggregators(cfg, conf_dir)
    for sub in subs:   # reject every bad entry before training any of them
        validate(sub)
    root = Path(_abs(cfg.paths.output_root, launch_dir)) / "runs"
    records, failed = [], []
    memory = {} if not cfg.get("cache", True) else None   # cache=false: the list still trains its clients once
    for sub in subs:
        run_dir = root / compute_run_id(sub)
        try:
            records.append(execute(sub, run_dir, launch_dir=launch_dir, memory_cache=memory))
        except Exception as e:   # KeyboardInterrupt still ends the job
            reason = str(e) if isinstance(e, FedbenchError) else f"{type(e).__name__}: {e}"
            print(f"fedbench: error: {sub.algorithm.name}: {reason}", file=sys.stderr)
            records.append(_failure_record(sub, run_dir, reason))
            failed.append(sub.algorithm.name)
    write_json_atomic(Path(output_dir) / "aggregators.json",
                      {"records": [str(root / r["run_id"] / "metrics.json") for r in records]})
    ok = sum(r.get("status") == "ok" for r in records)
    print(f"fedbench: aggregators: {ok} ok, {len(failed)} failed ({', '.join(failed) or 'none'})")
    if failed:
        raise FedbenchError(f"{len(failed)} of {len(subs)} aggregators failed: {', '.join(failed)} "
                            f"(their failed records say why; the other {ok} finished)")
    return records


def _failure_record(cfg: DictConfig, run_dir: Path, reason: str) -> Dict[str, Any]:
    """The failed record of a run that stopped with ``reason``: the one ``execute`` wrote when training raised,
    else a minimal one (a failure before training); an ok record already there is never overwritten."""
    path = run_dir / "metrics.json"
    rec = read_record(path)
    if rec and rec.get("run_id") == compute_run_id(cfg) and (rec.get("status") == "failed" or is_complete(path, current=False)):
        return rec
    rec = {"run_id": compute_run_id(cfg), "status": "failed", "error": reason,
           "algorithm": cfg.algorithm.name, "config": OmegaConf.to_container(cfg, resolve=True),
           "identity": identity_config(cfg), "numerics": numerics.current(cfg.algorithm.name),
           "finished": _dt.datetime.now().isoformat(timespec="seconds")}
    write_json_atomic(path, rec)
    return rec
