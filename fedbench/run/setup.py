"""``build_setup``: everything a run trains on, from a composed config — data, server sets, client split,
seeded template model (and checkpoint), normalised train/test tensors, the client-stage cache key and the
``FLSetup``. One builder for ``fedbench.runner.execute`` and the studies, so they cannot drift apart."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from fedbench import numerics
from fedbench.config.hardware import parse_num_threads
from fedbench.config.paths import absolute_path
from fedbench.algorithms.centralized import pooled_indices
from fedbench.data import load_dataset
from fedbench.data.transforms import Augment
from fedbench.data.tuning_split import hold_out_validation
from fedbench.errors import FedbenchError
from fedbench.fl.cache import ClientStageCache
from fedbench.eval.metrics import evaluate
from fedbench.fl.loop import FLSetup
from fedbench.fl.map_reference import map_round_metrics
from fedbench.fl.server_data import (ServerUnlabeledConfig, ServerValConfig, draw_server_unlabeled,
                                     draw_server_val)
from fedbench.models import build_model, count_parameters
from fedbench.models.pretrained import check_checkpoint_path, load_pretrained
from fedbench.partition import client_label_counts, make_partition
from fedbench.train.config import LocalTrainConfig
from fedbench.train.engine import TrainData


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
    n = parse_num_threads(spec)
    if n is None:
        if device.type == "cpu" and num_params < 10_000:
            torch.set_num_threads(1)
        return
    torch.set_num_threads(n)


def config_group(cfg: DictConfig, key: str) -> Dict[str, Any]:
    node = cfg.get(key)
    if node is None or "name" not in node:
        raise FedbenchError(f"config group '{key}' is missing or has no 'name' (pick one with {key}=<option>)")
    return OmegaConf.to_container(node, resolve=True)


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


@dataclass
class RunSetup:
    """What ``build_setup`` returns: the ``FLSetup`` and seeded initial weights every method starts from, and
    what a record says about them."""

    fl: FLSetup
    init_params: Dict[str, Tensor]
    data: Any                             # the data set, on the device
    parts: List[np.ndarray]               # per client, indices into the full training set
    pretrained: Optional[Dict[str, Any]]  # the checkpoint's summary (path, sha256, ...) or None
    backend: str

    @property
    def client_sizes(self) -> List[int]:
        return [int(len(p)) for p in self.parts]

    def client_label_counts(self) -> Optional[List[List[int]]]:
        if self.data.task != "classification":
            return None
        return client_label_counts(self.parts, np.asarray(self.data.train_y.cpu()), self.data.num_classes).tolist()


@dataclass
class ServerSets:
    """The server's validation and unlabelled index sets, and what is left for the clients (None = all)."""

    val: ServerValConfig
    val_idx: Optional[np.ndarray]
    unlabeled: ServerUnlabeledConfig
    unlabeled_idx: Optional[np.ndarray]
    keep: Optional[np.ndarray]
    unlabeled_holdout: bool


def _section(cfg: DictConfig, key: str):
    return OmegaConf.to_container(cfg[key], resolve=True) if cfg.get(key) is not None else None


def draw_server_sets(cfg: DictConfig, num_train: int, seed: int) -> ServerSets:
    sval = ServerValConfig.from_cfg(_section(cfg, "server_val"))
    val_idx, keep = draw_server_val(sval, num_train, seed)
    sunl = ServerUnlabeledConfig.from_cfg(_section(cfg, "server_unlabeled"))
    unl_idx, keep_after = draw_server_unlabeled(sunl, num_train, keep, seed)
    return ServerSets(sval, val_idx, sunl, unl_idx, keep_after, keep_after is not keep)


def split_clients(pcfg: Dict[str, Any], data, num_clients: int, seed: int, keep: Optional[np.ndarray]):
    """Client index lists into the full training set; a hold-out (``keep``) is split, indices still global."""
    pparams = {k: v for k, v in pcfg.items() if k != "name"}
    labels_all = np.asarray(data.train_y.cpu())
    if keep is None:
        return make_partition(pcfg["name"], labels_all, num_clients, seed,
                              groups=data.train_groups, num_classes=data.num_classes or None, **pparams)
    groups = None if data.train_groups is None else np.asarray(data.train_groups)[keep]
    return [keep[p] for p in make_partition(pcfg["name"], labels_all[keep], num_clients, seed,
                                            groups=groups, num_classes=data.num_classes or None, **pparams)]


def build_template(mcfg: Dict[str, Any], data, device: torch.device, seed: int, ckpt: Optional[str]):
    """The seeded template model (every client starts from this initialisation) and the checkpoint summary."""
    torch.manual_seed(seed)
    model = build_model(mcfg["name"], input_shape=tuple(data.input_shape), num_classes=data.num_classes,
                        **{k: v for k, v in mcfg.items() if k not in ("name", "pretrained")}).to(device)
    # e.g. FedFisher Table 3's Tiny-ImageNet ResNet-18; the rest keeps the seeded init
    pretrained = load_pretrained(model, ckpt) if ckpt is not None else None
    return model, pretrained


def train_test_data(dcfg: Dict[str, Any], data):
    """Normalised (and, for training, augmented) tensors on the data's device."""
    mean, std = normalization(dcfg.get("normalize", True), (data.mean, data.std))
    if mean is not None and data.mean is not None and len(mean) != len(data.mean):
        raise FedbenchError(f"dataset.normalize gives {len(mean)} channel(s), {dcfg['name']} has {len(data.mean)}")
    aug = Augment(**dcfg["augment"]) if dcfg.get("augment") else None
    train = TrainData(data.train_x, data.train_y, mean, std, aug if aug is not None and aug.enabled else None,
                      data.task)
    test = TrainData(data.test_x, data.test_y, mean, std, None, data.task)
    return train, test


def client_stage_parts(cfg: DictConfig, groups: Dict[str, Dict[str, Any]], seed: int,
                       pretrained: Optional[Dict[str, Any]], server: ServerSets) -> Dict[str, Any]:
    """Everything that determines the trained clients: the client-stage cache key."""
    parts = {"dataset": groups["dataset"], "partition": groups["partition"], "num_clients": int(cfg.num_clients),
             "seed": seed, "model": groups["model"], "local": OmegaConf.to_container(cfg.local, resolve=True)}
    if numerics.CORE != 1:   # cached clients of older core numerics are retrained (1: the keys of existing entries)
        parts["numerics_core"] = numerics.CORE
    if pretrained is not None:   # the checkpoint's content, not just its path, determines the clients
        parts["pretrained_sha256"] = pretrained["sha256"]
    if server.val.mode == "holdout" and server.val.size > 0:   # a hold-out changes the clients' data
        parts["server_val_holdout"] = {"size": server.val.size, "seed": server.val.seed}
    tuning_val = tuning_val_config(cfg)
    if tuning_val:   # the clients train on less data
        parts["tuning_val"] = tuning_val
    if server.unlabeled_holdout:
        sunl = server.unlabeled
        parts["server_unlabeled_holdout"] = {"size": sunl.size, "seed": sunl.seed if sunl.seed is not None else seed}
    return parts


def tuning_val_config(cfg: DictConfig) -> Optional[Dict[str, Any]]:
    """``tuning_val`` when switched on (fraction > 0: a tuning selection run), else None."""
    tv = cfg.get("tuning_val")
    if tv is None or not tv.get("fraction"):
        return None
    return {"fraction": float(tv.fraction), "seed": int(tv.seed)}


def _indices(idx, device: torch.device) -> Tensor:
    return torch.as_tensor(idx, dtype=torch.long, device=device)


def build_setup(cfg: DictConfig, launch_dir: Optional[str] = None,
                memory_cache: Optional[Dict[str, Any]] = None) -> RunSetup:
    """The ``FLSetup`` and initial weights of ``cfg`` (checked with ``fedbench.runner.validate`` first).
    The order of the seeded steps (server sets, split, ``manual_seed`` + model) is part of every result."""
    groups = {k: config_group(cfg, k) for k in ("dataset", "partition", "model")}
    dcfg, mcfg = groups["dataset"], groups["model"]
    local = LocalTrainConfig.from_cfg(OmegaConf.to_container(cfg.local, resolve=True))
    device = resolve_device(cfg.hardware.device)
    backend = resolve_backend(cfg.hardware.backend, device)
    seed = int(cfg.seed)
    ckpt = None
    if mcfg.get("pretrained") is not None:   # checked before the data are loaded
        ckpt = str(check_checkpoint_path(absolute_path(str(mcfg["pretrained"]), launch_dir)))

    data = load_dataset(dcfg["name"], absolute_path(cfg.paths.data_root, launch_dir), **(dcfg.get("kwargs") or {}))
    if data.approximate:
        print(f"fedbench: WARNING: {data.approximate}", file=sys.stderr)
    tuning_val = tuning_val_config(cfg)
    if tuning_val:   # a tuning selection run: evaluated on a hold-out of the training data, never the test set
        data = hold_out_validation(data, tuning_val["fraction"], tuning_val["seed"])
    server = draw_server_sets(cfg, len(data.train_y), seed)
    parts = split_clients(groups["partition"], data, int(cfg.num_clients), seed, server.keep)
    sizes = [int(len(p)) for p in parts]
    if any(s == 0 for s in sizes) and local.epochs > 0:
        print(f"fedbench: WARNING: {sizes.count(0)} client(s) received no data", file=sys.stderr)

    model, pretrained = build_template(mcfg, data, device, seed, ckpt)
    init_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    set_threads(cfg.hardware.get("num_threads"), device, count_parameters(model))
    data = data.to(device)
    train, test = train_test_data(dcfg, data)
    server_val = None
    if server.val_idx is not None:
        vi = _indices(server.val_idx, device)
        server_val = (train.inputs(vi), data.train_y[vi])
    # inputs only: the methods never see these labels
    server_unlabeled = train.inputs(_indices(server.unlabeled_idx, device)) if server.unlabeled_idx is not None else None
    cache_dir = cfg.paths.get("cache_dir") if cfg.get("cache", True) else None
    fl = FLSetup(model=model, train=train, test_inputs=test.inputs, test_y=data.test_y,
                 client_indices=[_indices(p, device) for p in parts],
                 local=local, seed=seed, device=device, task=data.task, backend=backend,
                 conv_strategy=cfg.hardware.get("conv_strategy", "auto"),
                 memory_format=str(cfg.hardware.get("memory_format", "contiguous")),
                 eval_batch_size=int(cfg.eval.batch_size), ece_bins=int(cfg.eval.ece_bins),
                 local_accuracy=bool(cfg.eval.get("local_accuracy", False)),
                 cache=ClientStageCache(absolute_path(cache_dir, launch_dir) if cache_dir else None, memory=memory_cache,
                                        max_bytes=_cache_budget(cfg)),
                 stage_parts=client_stage_parts(cfg, groups, seed, pretrained, server),
                 server_val=server_val, server_unlabeled=server_unlabeled,
                 share_epochs=tuple(int(e) for e in (cfg.get("share_epochs") or ())))
    if cfg.eval.get("map_reference") is not None:   # FedLap App. D.2: distance to the centralised MAP per round
        fl.round_metrics = map_reference_metrics(fl, init_params, float(cfg.eval.map_reference))
    return RunSetup(fl, init_params, data, parts, pretrained, backend)


def _cache_budget(cfg: DictConfig) -> Optional[int]:
    gb = cfg.get("cache_max_gb")
    return None if gb is None else int(float(gb) * 1e9)


def map_reference_metrics(fl: FLSetup, init_params: Dict[str, Tensor], delta: float):
    """The per-round metrics of ``eval.map_reference`` (fedbench/fl/map_reference.py), MAP solved on the pooled
    client data."""
    idx = pooled_indices(fl.client_indices)
    x, y = fl.train.inputs(idx), fl.train.y[idx]

    def test(params):
        return evaluate(fl.model, params, fl.test_inputs, fl.test_y, task=fl.task,
                        batch_size=fl.eval_batch_size, n_bins=fl.ece_bins)

    return map_round_metrics(fl.model, init_params, x, y, delta, fl.task, test)
