"""One validation pass over a composed config, without torch: every key's type and range, group keys against
their YAML defaults, profiles, devices and paths. Raises a one-line ``FedbenchError`` naming the key, the bad
value and what is allowed. Checks that need data or torch (registries, CUDA device count) stay in the runner."""
from __future__ import annotations

import difflib
import math
import os
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from omegaconf import DictConfig, OmegaConf

from fedbench.config import CONF_DIR, file_cache
from fedbench.config.paths import absolute_path
from fedbench.config.profiles import table_profile
from fedbench.config.tuning import check_switch as check_tuning_switch
from fedbench.errors import FedbenchError

OPTIMIZERS = ("sgd", "adam")
SERVER_VAL_MODES = ("sampled_with_replacement_from_train", "holdout")
SERVER_UNLABELED_MODES = ("holdout", "sampled_from_train")
BACKENDS = ("auto", "serial", "batched")
CONV_STRATEGIES = ("auto", "grouped", "unfold", "loop")
MEMORY_FORMATS = ("contiguous", "channels_last")   # fedbench.train.engine.MEMORY_FORMATS
DEVICE_SYNTAX = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
# keys whose value may legitimately change type: checked by their own rule (below or in the runner)
POLYMORPHIC = {"dataset": ("normalize",), "model": ("pretrained",)}


def _fail(key: str, value: Any, allowed: str) -> None:
    raise FedbenchError(f"{key}={_show(value)} is not allowed: {key} must be {allowed}")


def _show(value: Any) -> str:
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=False)
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return repr(value) if isinstance(value, str) else str(value).replace("\n", " ")


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(key, v, lo=None, hi=None, null_ok=False) -> None:
    if v is None and null_ok:
        return
    if not is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f" >= {lo}" if hi is None else f" in [{lo}, {hi}]"
        _fail(key, v, ("null or " if null_ok else "") + f"an integer{rng if lo is not None else ''}")


def _number(key, v, *, gt=None, ge=None, lt=None, null_ok=False) -> None:
    if v is None and null_ok:
        return
    bad = (not is_number(v) or not math.isfinite(v) or (gt is not None and not v > gt) or (ge is not None and not v >= ge)
           or (lt is not None and not v < lt))
    if bad:
        rng = " and ".join(s for s in (f"> {gt}" if gt is not None else "", f">= {ge}" if ge is not None else "",
                                          f"< {lt}" if lt is not None else "") if s)
        _fail(key, v, ("null or " if null_ok else "") + "a number" + (f" {rng}" if rng else ""))


def _bool(key, v) -> None:
    if not isinstance(v, bool):
        _fail(key, v, "true or false")


def _choice(key, v, options: Iterable[str]) -> None:
    options = tuple(options)
    if v not in options:
        _fail(key, v, "one of " + ", ".join(options))


def _known(section: str, node: Mapping, known: Iterable[str]) -> None:
    unknown = sorted(set(node) - set(known))
    if unknown:
        raise FedbenchError(f"unknown key(s) {', '.join(f'{section}.{k}' for k in unknown)}; "
                            f"{section} has: {', '.join(known)}")


def validate_config(cfg: DictConfig, conf_dir: Path = CONF_DIR, launch_dir: Optional[str] = None,
                    allow_missing: bool = False, need_checkpoint: bool = True) -> None:
    """Every check that needs neither data nor torch; ``cfg`` may carry its ``hydra`` node (group choices).
    ``allow_missing``: aggregators naming methods not implemented yet pass (the scripts list and drop them);
    ``need_checkpoint=False``: a ``model.pretrained`` file need not exist yet (collecting, plotting)."""
    try:
        c = {k: (OmegaConf.to_container(cfg[k], resolve=True) if OmegaConf.is_config(cfg[k]) else cfg[k])
             for k in cfg if k != "hydra"}
    except Exception as e:   # e.g. ${oc.env:MISSING}
        raise FedbenchError(f"cannot resolve the config: {str(e).splitlines()[0]}") from None
    choices = _choices(cfg)
    check_top_level(c)
    check_local(c.get("local") or {})
    check_eval(c.get("eval") or {})
    for section, modes in (("server_val", SERVER_VAL_MODES), ("server_unlabeled", SERVER_UNLABELED_MODES)):
        if c.get(section) is not None:
            check_server_data(section, c[section], modes)
    check_hardware(c.get("hardware") or {})
    check_paths(c.get("paths") or {}, launch_dir)
    for group in ("dataset", "partition", "model", "algorithm"):
        check_group(group, c.get(group), choices.get(group), conf_dir)
    check_normalize(c["dataset"].get("normalize", True))
    ckpt = c["model"].get("pretrained")
    if ckpt is not None and (need_checkpoint or not isinstance(ckpt, str)):
        check_checkpoint_path(absolute_path(ckpt, launch_dir) if isinstance(ckpt, str) else ckpt)
    check_aggregators(c.get("aggregators"), conf_dir, allow_missing)
    table_profile(c.get("table"), c.get("profile"))
    check_tuning_switch(c)


def _choices(cfg: DictConfig) -> dict:
    try:
        return dict(OmegaConf.to_container(cfg.hydra.runtime.choices, resolve=False))
    except Exception:   # composed without the hydra node
        return {}


def check_top_level(c: Mapping) -> None:
    _int("seed", c.get("seed"), 0, 2**32 - 1)   # numpy's RandomState takes seeds in [0, 2**32)
    _int("num_clients", c.get("num_clients"), 1)
    _int("rounds", c.get("rounds"), 1)
    for key in ("cache", "force", "save_model", "progress"):
        if key in c:
            _bool(key, c[key])
    if c.get("checkpoint_every_s") is not None:
        _number("checkpoint_every_s", c["checkpoint_every_s"], ge=0)
    _number("cache_max_gb", c.get("cache_max_gb"), gt=0, null_ok=True)
    if not isinstance(c.get("tags", []), list):
        _fail("tags", c.get("tags"), "a list, e.g. tags=[a,b]")
    check_share_epochs(c)
    if c.get("profile") is not None and not isinstance(c["profile"], str):
        _fail("profile", c["profile"], "null or a profile name of the preset's table")
    if c.get("table") is not None and not isinstance(c["table"], Mapping):
        _fail("table", c["table"], "null or a mapping (set by experiment presets)")


def check_share_epochs(c: Mapping) -> None:
    """share_epochs: distinct epoch counts >= 1; the shared stage lives in the on-disk client-stage cache."""
    share = c.get("share_epochs")
    if share is None or (isinstance(share, list) and not share):
        return
    if not (isinstance(share, list) and all(isinstance(e, int) and not isinstance(e, bool) and e >= 1 for e in share)
            and len(set(share)) == len(share)):
        _fail("share_epochs", share, "a list of distinct local epoch counts >= 1, e.g. share_epochs=[1,5,10,15,20], "
                                     "or [] (off)")
    if not c.get("cache", True):
        raise FedbenchError("share_epochs stores round 1's client stage at each listed E in the client-stage cache "
                            "for the runs of the other E values; it needs cache=true")


def check_local(local: Mapping) -> None:
    known = ("optimizer", "lr", "momentum", "dampening", "nesterov", "weight_decay", "betas", "eps", "batch_size",
             "epochs", "clip_grad_norm", "drop_last")
    _known("local", local, known)
    _choice("local.optimizer", local.get("optimizer", "sgd"), OPTIMIZERS)
    _number("local.lr", local.get("lr", 0.01), gt=0)
    _number("local.momentum", local.get("momentum", 0.0), ge=0, lt=1)
    _number("local.dampening", local.get("dampening", 0.0), ge=0, lt=1)
    _bool("local.nesterov", local.get("nesterov", False))
    _number("local.weight_decay", local.get("weight_decay", 0.0), ge=0)
    betas = local.get("betas", [0.9, 0.999])
    if betas is not None and not (isinstance(betas, list) and len(betas) == 2
                                  and all(is_number(b) and 0 <= b < 1 for b in betas)):
        _fail("local.betas", betas, "null or two numbers in [0, 1), e.g. [0.9,0.999]")
    _number("local.eps", local.get("eps", 1e-8), gt=0)
    _int("local.batch_size", local.get("batch_size", 64), 1)
    _int("local.epochs", local.get("epochs", 1), 0)
    _number("local.clip_grad_norm", local.get("clip_grad_norm"), gt=0, null_ok=True)
    _bool("local.drop_last", local.get("drop_last", False))
    if local.get("nesterov") and (local.get("momentum", 0) <= 0 or local.get("dampening", 0) != 0):
        raise FedbenchError("local.nesterov=true needs local.momentum > 0 and local.dampening = 0")


def check_eval(ev: Mapping) -> None:
    _known("eval", ev, ("batch_size", "ece_bins", "every", "local_accuracy", "last_k", "thresholds", "map_reference"))
    _number("eval.map_reference", ev.get("map_reference"), ge=0, null_ok=True)
    _int("eval.batch_size", ev.get("batch_size", 2048), 1)
    _int("eval.ece_bins", ev.get("ece_bins", 15), 1)
    _int("eval.every", ev.get("every", 1), 1)
    _bool("eval.local_accuracy", ev.get("local_accuracy", False))
    _int("eval.last_k", ev.get("last_k", 3), 1)
    th = ev.get("thresholds", [])
    if th is not None and not (isinstance(th, list) and all(is_number(t) and 0 < t <= 100 for t in th)):
        _fail("eval.thresholds", th, "a list of accuracies in (0, 100], e.g. eval.thresholds=[75,80]")


def check_server_data(section: str, node: Mapping, modes) -> None:
    _known(section, node, ("size", "mode", "seed"))
    _int(f"{section}.size", node.get("size", 0), 0)
    _choice(f"{section}.mode", node.get("mode"), modes)
    _int(f"{section}.seed", node.get("seed"), 0, 2**32 - 1, null_ok=True)


def check_hardware(hw: Mapping) -> None:
    _known("hardware", hw, ("device", "backend", "conv_strategy", "memory_format", "num_threads", "jobs"))
    _choice("hardware.memory_format", hw.get("memory_format", "contiguous"), MEMORY_FORMATS)
    device = hw.get("device", "auto")
    if not isinstance(device, str) or not DEVICE_SYNTAX.match(device):
        _fail("hardware.device", device, "auto, cpu, cuda or cuda:N (N = 0, 1, ...)")
    check_cuda_present(device)
    _choice("hardware.backend", hw.get("backend", "auto"), BACKENDS)
    conv = hw.get("conv_strategy", "auto")
    if isinstance(conv, Mapping):
        for layer, strategy in conv.items():
            _choice(f"hardware.conv_strategy.{layer}", strategy, CONV_STRATEGIES[1:])
    else:
        _choice("hardware.conv_strategy", conv, CONV_STRATEGIES)
    threads = hw.get("num_threads", "auto")
    if threads not in (None, "auto") and not (is_int(threads) and threads >= 1):
        _fail("hardware.num_threads", threads, "auto, null or an integer >= 1")
    jobs = hw.get("jobs", "auto")
    if jobs not in (None, "auto") and not (is_int(jobs) and jobs >= 1):
        _fail("hardware.jobs", jobs, "auto or an integer >= 1 (runs of a sweep at once)")


def cuda_device_count() -> Optional[int]:
    """GPUs the NVIDIA driver shows, read from /proc (no torch); None when it cannot be told (AMD, no /proc)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return 0
    gpus = Path("/proc/driver/nvidia/gpus")
    if gpus.is_dir():
        n = len(list(gpus.iterdir()))
        return min(n, len(visible.split(","))) if visible else n
    if any(Path(p).exists() for p in ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")) or not Path("/proc").is_dir():
        return None   # a driver without the /proc listing (ROCm, WSL): leave the check to torch
    return 0


def check_cuda_present(device: str) -> None:
    if not device.startswith("cuda"):
        return
    n = cuda_device_count()
    if n == 0:
        raise FedbenchError(f"hardware.device={device} but no CUDA device is available; use hardware=cpu or hardware=auto")
    index = int(device.split(":")[1]) if ":" in device else 0
    if n is not None and index >= n:
        raise FedbenchError(f"hardware.device={device} but only {n} CUDA device(s) exist (cuda:0 .. cuda:{n - 1})")


def check_paths(paths: Mapping, launch_dir: Optional[str]) -> None:
    for key in ("data_root", "output_root", "cache_dir"):
        value = paths.get(key)
        if value is None and key == "cache_dir":
            continue
        if not isinstance(value, str) or not value:
            _fail(f"paths.{key}", value, "a directory path")
        check_directory(f"paths.{key}", value, launch_dir)


def check_directory(key: str, value: str, launch_dir: Optional[str]) -> None:
    """A directory, or a path that can be created (its nearest existing ancestor is a writable directory)."""
    p = Path(os.path.expanduser(value))
    p = p if p.is_absolute() else Path(launch_dir or os.getcwd()) / p
    if p.exists():
        if not p.is_dir():
            _fail(key, value, "a directory (or a path that can be created), not a file")
        return
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        _fail(key, value, f"a directory or a creatable path, but {parent} is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        _fail(key, value, f"an existing directory or a path that can be created, but {parent} is not writable")


def check_checkpoint_path(path: Any) -> Path:
    """``model.pretrained``: an existing checkpoint file (its content is checked by models/pretrained.py)."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise FedbenchError(f"model.pretrained must be a checkpoint path or null, got {path!r}")
    p = Path(os.path.expanduser(str(path)))
    if not p.is_file():
        raise FedbenchError(f"model.pretrained: no checkpoint at {p}; make one with scripts/pretrain_tiny_imagenet.py "
                            f"(FedFisher Table 3) or set model.pretrained=null for a random initialisation")
    return p


def check_normalize(value) -> None:
    if isinstance(value, bool):
        return
    if isinstance(value, Mapping) and set(value) == {"mean", "std"}:
        mean, std = value["mean"], value["std"]
        if (isinstance(mean, list) and isinstance(std, list) and len(mean) == len(std) > 0
                and all(is_number(v) for v in [*mean, *std]) and all(v > 0 for v in std)):
            return
    _fail("dataset.normalize", value, "true, false or {mean: [...], std: [...]} with one positive std per channel")


def did_you_mean(name: str, options: Iterable[str]) -> str:
    """'; did you mean 'x'?' for a name one typo away from an option (a misspelt method reads as a missing one)."""
    close = difflib.get_close_matches(name, list(options), n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


def _yaml_default(group: str, choice: Optional[str], name: Optional[str], conf_dir: Path) -> Optional[dict]:
    """The group option's YAML (by the composed choice, else by a file named like ``name``); None if unknown."""
    for stem in (choice, name):
        path = conf_dir / group / f"{stem}.yaml" if stem else None
        if path is not None and path.is_file():
            node = file_cache.load_yaml(path)
            node.pop("defaults", None)
            return OmegaConf.to_container(node, resolve=False)
    return None


def check_group(group: str, node: Any, choice: Optional[str], conf_dir: Path) -> None:
    if not isinstance(node, Mapping) or not isinstance(node.get("name"), str):
        raise FedbenchError(f"config group '{group}' is missing or has no 'name' (pick one with {group}=<option>)")
    default = _yaml_default(group, choice, node["name"], conf_dir)
    if default is None:
        return
    label = f"{group} '{choice or node['name']}'"
    if group == "algorithm" and choice:   # unknown algorithm keys are an error (the other groups: Hydra's struct
        # mode); without the composed choice the YAML is only guessed from the name (dense_fedfisher is 'dense')
        _known_keys(group, node, default, label)
    check_types(group, node, default, label, skip=POLYMORPHIC.get(group, ()))


def _known_keys(prefix: str, node: Mapping, default: Mapping, label: str) -> None:
    unknown = sorted(set(node) - set(default))
    if unknown:
        raise FedbenchError(f"unknown key(s) {', '.join(f'{prefix}.{k}' for k in unknown)} for {label}; "
                            f"its keys: {', '.join(k for k in default if k != 'name')}")


def kind(v: Any) -> str:
    if isinstance(v, bool):
        return "bool"
    if is_number(v):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, (list, tuple)):
        return "list"
    if isinstance(v, Mapping):
        return "mapping"
    return type(v).__name__


def check_types(prefix: str, node: Mapping, default: Mapping, label: str, skip=()) -> None:
    """A value must have the YAML default's kind (number / string / bool / list / mapping); null defaults and
    interpolations accept anything; mappings are checked key by key."""
    for key, want in default.items():
        if key in skip or key == "name" or key not in node or want is None:
            continue
        value = node[key]
        if isinstance(want, str) and want.startswith("${"):
            continue
        if isinstance(want, Mapping) and isinstance(value, Mapping):
            check_types(f"{prefix}.{key}", value, want, label)
            continue
        if kind(value) != kind(want):
            hint = " (quote it: 'true')" if kind(want) == "string" and kind(value) == "bool" else ""
            _fail(f"{prefix}.{key}", value, f"a {kind(want)} like its default {_show(want)} in {label}{hint}")


def check_aggregators(aggs: Any, conf_dir: Path, allow_missing: bool = False) -> None:
    """``aggregators: [name, {name: ..., key: value}]``: each names an algorithm YAML and only its keys."""
    if aggs is None:
        return
    if not isinstance(aggs, list) or not aggs:
        _fail("aggregators", aggs, "null or a non-empty list like [fedavg,{name:fedprox,mu:0.1}]")
    options = [p.stem for p in sorted((conf_dir / "algorithm").glob("*.yaml"))]
    for entry in aggs:
        name = entry if isinstance(entry, str) else entry.get("name") if isinstance(entry, Mapping) else None
        if not isinstance(name, str):
            _fail("aggregators", aggs, "a list of algorithm names or {name: ..., key: value} mappings")
        default = _yaml_default("algorithm", name, None, conf_dir)
        if default is None and allow_missing:
            continue
        if default is None:
            raise FedbenchError(f"aggregators: algorithm '{name}' is not implemented yet (no conf/algorithm/"
                                f"{name}.yaml){did_you_mean(name, options)}; available: {', '.join(options)}")
        if isinstance(entry, Mapping):
            label = f"aggregators entry '{name}'"
            extra = {k: v for k, v in entry.items() if k != "name"}
            _known_keys(f"aggregators[{name}]", extra, default, label)
            check_types(f"aggregators[{name}]", extra, default, label)
