"""Compose a config with Hydra's compose API; every composition or override-grammar error becomes one
``FedbenchError`` line naming the override, the problem and what is allowed."""
from __future__ import annotations

import copy
import os
import re
from collections import OrderedDict
from pathlib import Path
from typing import List, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from fedbench.config import CONF_DIR, file_cache
from fedbench.errors import FedbenchError
from fedbench.results.records import compute_run_id, is_complete

GROUPS = ("dataset", "partition", "model", "algorithm", "hardware", "logger", "experiment", "local")
GRAMMAR = "https://hydra.cc/docs/advanced/override_grammar/basic/"


def register_resolvers() -> None:
    """``fedbench_run_id`` (the run directory) and ``fedbench_hydra_subdir`` (where Hydra saves its files)."""

    if not OmegaConf.has_resolver("fedbench_run_id"):
        OmegaConf.register_new_resolver("fedbench_run_id", lambda *, _root_: compute_run_id(_root_))
    if not OmegaConf.has_resolver("fedbench_hydra_subdir"):
        OmegaConf.register_new_resolver("fedbench_hydra_subdir", hydra_subdir)


def hydra_subdir(*, _root_) -> Optional[str]:
    """``.hydra``, or null when this run already has an ok record that will be skipped: Hydra must not
    rewrite that record's ``.hydra/overrides.yaml`` with the overrides of a run that does nothing."""

    if _root_.get("force"):
        return ".hydra"
    root = Path(str(_root_.paths.output_root))
    rec = root / "runs" / compute_run_id(_root_) / "metrics.json"
    return None if is_complete(rec, compute_run_id(_root_), need_model=bool(_root_.get("save_model"))) else ".hydra"


def group_options(group: str, conf_dir: Path = CONF_DIR) -> List[str]:
    folder = conf_dir / group
    return sorted(str(p.relative_to(folder).with_suffix("")) for p in folder.rglob("*.yaml")) if folder.is_dir() else []


def _options_hint(group: str, conf_dir: Path) -> str:
    options = group_options(group, conf_dir)
    if not options:
        return f"no options exist under conf/{group}/"
    if len(options) > 40:
        return f"choose one of the {len(options)} presets under conf/{group}/ (listed in conf/{group}/README.md)"
    return "choose one of: " + ", ".join(options)


def check_group_overrides(overrides: Sequence[str], conf_dir: Path = CONF_DIR) -> None:
    """An unknown group option (``dataset=foo``, ``experiment=x/y``) is one line, not Hydra's listing."""
    for arg in overrides:
        key, eq, value = arg.lstrip("+~").partition("=")
        if not eq or key not in GROUPS or value in ("null", "") or "(" in value:
            continue
        options = group_options(key, conf_dir)
        for v in value.split(","):
            v = v.strip().strip("[]").strip("'\"")
            if v and v not in options:
                raise FedbenchError(f"unknown {key} '{v}' (in {arg}); {_options_hint(key, conf_dir)}")


def parse_overrides(overrides: Sequence[str]) -> list:
    """Hydra's parsed overrides; a malformed one ends in one line naming it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    parsed = []
    for arg in overrides:
        try:
            if arg.startswith("="):
                raise ValueError(arg)
            parsed.extend(parser.parse_overrides([arg]))
        except Exception as e:   # OverrideParseException, or ValueError for '=3'
            raise FedbenchError(_parse_error(arg, e)) from None
    return parsed


def _parse_error(arg: str, exc: Exception) -> str:
    if arg.startswith("="):
        return f"override '{arg}' has no key; write key=value (e.g. seed=1)"
    if "=" not in arg:
        return (f"override '{arg}' is not key=value (e.g. seed=1, dataset=mnist, local.lr=0.1); "
                f"a preset is experiment=<paper>/<table>")
    detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    detail = re.sub(r"^(Error parsing override '.*'|LexerNoViableAltException: .*)$", "", detail).strip()
    why = f": {detail}" if detail else ""
    return (f"cannot parse override '{arg}'{why}; quote strings ('a b'), close lists [1,2] and mappings {{a:1}} "
            f"({GRAMMAR})")


def compose_config(overrides: Sequence[str], conf_dir: Path = CONF_DIR, *, with_hydra: bool = False) -> DictConfig:
    """``compose('config', overrides)``; ``with_hydra`` keeps the ``hydra`` node (group choices, sweeper)."""
    from hydra import compose, initialize_config_dir

    register_resolvers()
    file_cache.install()
    overrides = allow_pretrained(overrides)
    check_group_overrides(overrides, conf_dir)
    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
            cfg = _from_shared_base(overrides, conf_dir, with_hydra)
            return cfg if cfg is not None else compose("config", overrides=overrides, return_hydra_config=with_hydra)
    except FedbenchError:
        raise
    except Exception as e:
        parse_overrides(overrides)   # a malformed override: its own line (parsed only here, Hydra parsed them all)
        raise FedbenchError(composition_error(e, overrides, conf_dir)) from None


_BASES: "OrderedDict[tuple, DictConfig]" = OrderedDict()
_MAX_BASES = 256


def is_config_group(key: str, conf_dir: Path = CONF_DIR) -> bool:
    """Whether an override's key (``dataset``, ``experiment/fedlpa``; ``partition.spec`` is a value) names a config
    group: a folder under conf_dir, which is what Hydra's repository answers for fedbench's one search path (``hydra``
    keys, whose groups live in Hydra's package, are never asked). Outside a Hydra context, so table plans can ask."""
    return (Path(conf_dir) / key).is_dir()


def _from_shared_base(overrides: Sequence[str], conf_dir: Path, with_hydra: bool = False) -> Optional[DictConfig]:
    """Hydra's composition, done in its two steps with the first shared: the group overrides (``dataset=mnist``,
    ``experiment=...``) alone pick the defaults list and compose a base config, then Hydra's own
    ``_apply_overrides_to_config`` applies the value overrides (``seed=1``, ``partition.spec=...``) in order to a
    copy of it, as ``compose`` does after its defaults step. Tables, the scoreboard and sweep plans compose hundreds
    of runs that differ only in values; the base is composed once per group choice. ``with_hydra``: the base keeps
    the ``hydra`` node, whose two fields that name the value overrides (``overrides.task``, ``job.override_dirname``)
    are then written as ``compose`` writes them (tests/test_compose.py compares whole configs). None (compose as
    usual) for sweeps, ``hydra.`` overrides, anything that does not parse and any override Hydra would reject, so
    errors keep their own line. A base is keyed by every config file's path, mtime and size: an edited YAML
    composes again (and, with the hydra node, by the working directory it records)."""
    from hydra import compose
    from hydra._internal.config_loader_impl import ConfigLoaderImpl, get_overrides_dirname
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception:
        return None
    groups, values = [], []
    for o in parsed:
        if o.is_sweep_override() or o.is_hydra_override():
            return None
        # Hydra's own split (defaults_list.Overrides): a dict value, or a key that is no group, is a value override
        is_value = isinstance(o.value(), dict) or not is_config_group(o.key_or_group, conf_dir)
        (values if is_value else groups).append(o)
    key = (str(conf_dir), _conf_stamp(conf_dir), tuple(o.input_line for o in groups),
           os.getcwd() if with_hydra else None)
    base = _BASES.get(key)
    if base is None:
        base = compose("config", overrides=[o.input_line for o in groups], return_hydra_config=with_hydra)
        _BASES[key] = base
        if len(_BASES) > _MAX_BASES:
            _BASES.popitem(last=False)
    else:
        _BASES.move_to_end(key)
    cfg = copy.deepcopy(base)
    try:
        ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
    except Exception:
        return None
    if with_hydra:   # as compose: every (non-hydra) override in the given order, and the directory name from them
        job = cfg.hydra.job.config.override_dirname
        cfg.hydra.overrides.task = [o.input_line for o in parsed]
        cfg.hydra.job.override_dirname = get_overrides_dirname(overrides=parsed, kv_sep=job.kv_sep,
                                                               item_sep=job.item_sep, exclude_keys=job.exclude_keys)
    return cfg


def without_hydra(cfg: DictConfig) -> DictConfig:
    """A copy of a composed config without its ``hydra`` node (which run ids leave out), as strict as the original:
    copying and merging the hydra node, once per method of an aggregator list, was most of a sweep plan's time."""
    out = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    OmegaConf.set_struct(out, OmegaConf.is_struct(cfg))
    return out


def _conf_stamp(conf_dir: Path) -> tuple:
    return tuple(sorted((os.path.join(root, f), st.st_mtime_ns, st.st_size)
                        for root, _, files in os.walk(conf_dir) for f in files
                        for st in [os.stat(os.path.join(root, f))]))


def composition_error(exc: Exception, overrides: Sequence[str], conf_dir: Path = CONF_DIR) -> str:
    """One line for Hydra's multi-line composition errors."""
    text = str(exc)
    m = re.search(r"Could not override '([^']+)'", text)
    if m:
        return _unknown_key(m.group(1), overrides, conf_dir)
    m = re.search(r"Ambiguous value for argument '([^']+)'", text)
    if m:
        key = m.group(1).split("=", 1)[0]
        return (f"'{m.group(1)}' is a sweep: add -m to run each value (python run.py -m {m.group(1)}), "
                f"or give one value; a list value is written {key}=[a,b]")
    m = re.search(r"Could not find '([^']+)/([^']+)'", text)
    if m:
        return f"unknown {m.group(1)} '{m.group(2)}'; {_options_hint(m.group(1), conf_dir)}"
    m = re.search(r"Could not (?:delete|find) '?([\w.]+)'?", text) or re.search(r"full_key: ([\w.]+)", text)
    first = " ".join(line.strip() for line in text.splitlines()[:1]) or type(exc).__name__
    where = f" (key {m.group(1)})" if m else ""
    return f"cannot compose the config{where}: {first}"


def _unknown_key(key: str, overrides: Sequence[str], conf_dir: Path) -> str:
    arg = next((o for o in overrides if o.lstrip("+~").split("=", 1)[0] == key), key)
    if key == "model.pretrained":
        return f"{arg}: this model has no checkpoint key, so null is its default already; leave the override out"
    rest = [o for o in overrides if o != arg]
    parent, _, leaf = key.rpartition(".")
    known = ""
    try:
        from hydra import compose, initialize_config_dir

        with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
            cfg = compose("config", overrides=rest)
        node = OmegaConf.select(cfg, parent) if parent else cfg
        if isinstance(node, DictConfig):
            known = "; known keys" + (f" under {parent}" if parent else "") + ": " + ", ".join(str(k) for k in node)
    except Exception:
        pass
    return f"unknown config key '{key}' (in {arg}){known}"


def allow_pretrained(overrides: Sequence[str]) -> List[str]:
    """``model.pretrained=<ckpt>`` works on every model: the key is added when the model's YAML lacks it
    (``++``), so that the YAMLs, and with them the run ids of existing records, stay as they are. ``null`` is
    not added (it would change the run id of a model without the key): there it is the default already."""
    out = []
    for arg in overrides:
        key, eq, value = arg.lstrip("+~").partition("=")
        add = key == "model.pretrained" and eq and not arg.startswith("~") and value.strip() != "null"
        out.append("++" + arg.lstrip("+") if add else arg)
    return out
