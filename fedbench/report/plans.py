"""A table's sweep, composed once per process and shared by every read of it (`make tables`, then the scoreboard).

Most runs of a table differ only in plain values (``seed=1``, ``local.lr=0.01``, ``num_clients=20``). Runs that differ
only in such values share one composition and its per-aggregator configs: their entries carry their value overrides,
and ``applied(entry)`` sets them in place on the shared configs with Hydra's own override step (what ``compose`` does
after the defaults list); the configs keep them until the next entry of their group sets its own. A value that an
``aggregators`` entry reads (``mu: ${hp.prox}``) is part of the group instead. The first reused entry of every kind
of group (its value keys) is checked against a real composition; a mismatch composes the whole table run by run.

Resolving each run's config is the other half of a table's cost. ``resolved_run`` keeps each shared config's resolution
per entry, and resolves a shared config for a further entry by re-reading only the nodes that can differ between the
entries of its group (the value keys and the interpolations that read one), checked once per config against a full
resolution. FOLA's Fig. 3 (2,250 runs in one group): ``scripts/bench_tables.py``.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import re
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from omegaconf import DictConfig, OmegaConf, read_write

from fedbench.config.aggregators import expand_runs
from fedbench.config.compose import is_config_group, parse_overrides
from fedbench.errors import FedbenchError
from fedbench.launch.sweep import compose_run, expand_sweep
from fedbench.results.records import compute_run_id

_SCALARS = (int, float, bool, str, type(None))
# expand_aggregators gives every run its own ``algorithm`` (and no ``aggregators``): a value there is no shared value
_PER_RUN = ("algorithm", "aggregators")


@dataclasses.dataclass(frozen=True, eq=False)
class SweepEntry:
    """One run of a table's sweep: the cell config, its per-aggregator run configs, and the value overrides to set
    on them (None: read them as composed). ``composed``: the values the shared configs were composed with."""
    cfg: DictConfig
    subs: tuple
    values: Optional[tuple] = None
    composed: tuple = ()


@functools.lru_cache(maxsize=128)
def sweep_configs(overrides: tuple, conf_dir: Path) -> Tuple[SweepEntry, ...]:
    """Every run of a table's sweep, composed once per process (read-only configs: a caller that changes one copies
    it first). Composition depends only on the overrides and the config files."""
    runs = expand_sweep(list(overrides), conf_dir)
    out = _compose_sweep(runs, conf_dir, reuse=True)
    return tuple(out if out is not None else _compose_sweep(runs, conf_dir, reuse=False))


def _compose_sweep(runs: List[List[str]], conf_dir: Path, reuse: bool) -> Optional[List[SweepEntry]]:
    """None when the first reused entry of a group differs from its real composition (the caller then composes
    every run); checked for the first group with each set of value keys."""
    out, groups, pins, checked = [], {}, {}, set()
    for ovs in runs:
        fixed, values = split_values(ovs, conf_dir) if reuse else (tuple(ovs), ())
        kind = (fixed, tuple(o.key_or_group for o in values))
        base = groups.get(_group_key(kind, values, pins[kind])) if kind in pins else None
        if base is None:
            cfg, subs = _compose_one(ovs, conf_dir)
            entry = SweepEntry(cfg, subs, None, values)
            if values:
                pinned = pins.setdefault(kind, _pinned(cfg, kind[1]))
                if any(o.key_or_group not in pinned for o in values):
                    groups.setdefault(_group_key(kind, values, pinned), entry)
        else:
            entry = SweepEntry(base.cfg, base.subs, values, base.composed)
            if kind[1] not in checked:   # once per set of value keys: a composition per group costs as much again
                checked.add(kind[1])
                try:
                    with applied(entry) as pair:
                        same = _containers(pair) == _containers(_compose_one(ovs, conf_dir))
                except Exception:   # a value Hydra applies differently in place: compose run by run
                    return None
                if not same:
                    return None
        out.append(entry)
    return out


def _group_key(kind: tuple, values: tuple, pinned: frozenset) -> tuple:
    return kind + (tuple(o.input_line for o in values if o.key_or_group in pinned),)


def _pinned(cfg: DictConfig, keys: tuple) -> frozenset:
    """The value keys that an ``aggregators`` entry reads through an interpolation (``mu: ${hp.prox}``):
    expand_aggregators resolves the entries once per composition, so runs that differ there compose apart."""
    if not cfg.get("aggregators"):
        return frozenset()
    nodes = dict(_interpolations(OmegaConf.to_container(cfg, resolve=False)))
    in_aggs = {p for p in nodes if p[0] == "aggregators"}
    return frozenset(k for k in keys
                     if in_aggs and in_aggs & set(dependent_interpolations(nodes, [tuple(k.split("."))])))


def split_values(ovs: Sequence[str], conf_dir: Path) -> Tuple[tuple, tuple]:
    """(the other override lines, the value overrides as Hydra parses them) of one run. A value override is a plain
    ``key=value`` of a key that is no config group, outside ``algorithm`` / ``aggregators``, set once, to a scalar or
    a list of scalars and no interpolation: setting it in place equals composing with it."""
    fixed, values = [], []
    parsed = [_parsed(line) for line in ovs]
    keys = [o.key_or_group for o in parsed if o is not None]
    for line, o in zip(ovs, parsed):
        if o is not None and keys.count(o.key_or_group) == 1 and _is_plain_value(o, conf_dir):
            values.append(o)
        else:
            fixed.append(line)
    return tuple(fixed), tuple(values)


@functools.lru_cache(maxsize=65_536)
def _parsed(line: str):
    """Hydra's parse of one override line, None if it does not parse (composing reports it); a table's runs repeat
    the same few lines, and building Hydra's parser is most of a parse."""
    try:
        return parse_overrides([line])[0]
    except FedbenchError:
        return None


def _is_plain_value(o, conf_dir: Path) -> bool:
    if o.is_add() or o.is_force_add() or o.is_delete() or o.is_sweep_override() or o.is_hydra_override():
        return False
    key = o.key_or_group
    if o.package is not None or key.split(".")[0] in _PER_RUN or is_config_group(key, conf_dir):
        return False
    v = o.value()
    return all(isinstance(x, _SCALARS) and not (isinstance(x, str) and "${" in x)
               for x in (v if isinstance(v, list) else [v]))


def _compose_one(ovs: Sequence[str], conf_dir: Path) -> tuple:
    cfg = compose_run(ovs, conf_dir)
    subs = expand_runs(cfg, conf_dir, allow_missing=True)
    for c in (cfg, *subs):
        OmegaConf.set_readonly(c, True)
    return cfg, tuple(subs)


def _containers(pair: tuple) -> list:
    return [OmegaConf.to_container(c, resolve=False) for c in (pair[0], *pair[1])]


# id(shared config) -> (that config, {key: value override now set}, {key: value override it was composed with}):
# the configs of a group keep the last entry's values, so the next entry sets only the values that differ (a sweep's
# innermost axis, often the seed). Registered at the first change; bounded, and an evicted config gets its composed
# values back.
_HELD: "collections.OrderedDict[int, tuple]" = collections.OrderedDict()
_HELD_MAX = 4_096


@contextlib.contextmanager
def applied(entry: SweepEntry) -> Iterator[tuple]:
    """(cell config, run configs) of an entry, as composing its run gives (interpolations follow the values set).
    Shared configs keep these values until the next ``applied`` of their group: read them inside one."""
    target = entry.values if entry.values is not None else entry.composed
    for c in {id(c): c for c in (entry.cfg, *entry.subs)}.values():   # no aggregators: the cell is the run
        _bring(c, target, entry.composed)
    yield entry.cfg, entry.subs


def _bring(c: DictConfig, target: tuple, composed: tuple) -> None:
    held = _HELD.get(id(c))
    if held is None or held[0] is not c:
        held = (c, {o.key_or_group: o.input_line for o in composed}, {o.key_or_group: o for o in composed})
    changes = [o for o in target if held[1].get(o.key_or_group) != o.input_line]
    if not changes:
        return
    _HELD[id(c)] = held
    _HELD.move_to_end(id(c))
    try:
        _set_values(c, changes)
        held[1].update((o.key_or_group, o.input_line) for o in changes)
    except BaseException:   # a half-set config: back to its composed values, and nothing held
        del _HELD[id(c)]
        _set_values(c, tuple(held[2].values()))
        raise
    if len(_HELD) > _HELD_MAX:
        _, (old, now, first) = _HELD.popitem(last=False)
        _set_values(old, [o for k, o in first.items() if now.get(k) != o.input_line])


def _set_values(c: DictConfig, values) -> None:
    from hydra._internal.config_loader_impl import ConfigLoaderImpl   # the step compose_config's shared base uses

    with read_write(c):
        ConfigLoaderImpl._apply_overrides_to_config(list(values), c)


def _state(c: DictConfig) -> Tuple[Optional[tuple], tuple]:
    """(the values now set on a shared config as text, None as composed; its value keys)."""
    held = _HELD.get(id(c))
    if held is None or held[0] is not c:
        return None, ()
    now = tuple(held[1].values())
    return (None if now == tuple(o.input_line for o in held[2].values()) else now), tuple(held[1])


# (id(shared config), the entry's values) -> (that config, its resolved container, its run id): a table read twice in
# one process (`make tables`, then the scoreboard) resolves each run once (scripts/bench_tables.py). The value holds
# the config itself, so its id cannot be reused while the entry lives.
_RESOLVED: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()
_RESOLVED_MAX = 40_000
# id(shared config) -> _Template: one full resolution and the paths that can differ between its group's entries
_TEMPLATES: "collections.OrderedDict[int, _Template]" = collections.OrderedDict()
_TEMPLATES_MAX = 4_096


@dataclasses.dataclass
class _Template:
    config: DictConfig
    resolved: dict
    interpolations: Optional[Dict[tuple, str]] = None   # path -> the node's text, for every node that interpolates
    paths: Dict[tuple, List[tuple]] = dataclasses.field(default_factory=dict)   # value keys -> the paths to read
    patch: bool = True                 # False: resolve in full (a patched resolution once differed)
    checked: bool = False


def resolved_run(sub, shared: bool) -> tuple:
    """(resolved container, run id) of a run config; cached when ``shared`` (a sweep_configs config, read inside
    ``applied``). The container is shared too: callers read it, never change it."""
    if not shared:
        c = OmegaConf.to_container(sub, resolve=True)
        return c, compute_run_id(c)
    sig, keys = _state(sub)
    key = (id(sub), sig)
    hit = _RESOLVED.get(key)
    if hit is not None and hit[0] is sub:
        _RESOLVED.move_to_end(key)
        return hit[1], hit[2]
    c = _resolve_shared(sub, keys)
    _RESOLVED[key] = (sub, c, compute_run_id(c))
    if len(_RESOLVED) > _RESOLVED_MAX:
        _RESOLVED.popitem(last=False)
    return c, _RESOLVED[key][2]


def _resolve_shared(sub: DictConfig, keys: tuple) -> dict:
    """A full resolution the first time; then the first one with the nodes that can differ read again: the group's
    value keys and the interpolations that depend on one (only ``applied`` changes a shared config, and only
    there). The first patched resolution of every config is checked against a full one."""
    tpl = _TEMPLATES.get(id(sub))
    if tpl is None or tpl.config is not sub:
        c = OmegaConf.to_container(sub, resolve=True)
        _TEMPLATES[id(sub)] = _Template(sub, c)   # most configs are read in one state only: no walk yet
        if len(_TEMPLATES) > _TEMPLATES_MAX:
            _TEMPLATES.popitem(last=False)
        return c
    _TEMPLATES.move_to_end(id(sub))
    if not tpl.patch:
        return OmegaConf.to_container(sub, resolve=True)
    if tpl.interpolations is None:   # the same nodes interpolate in every state (a value set is no interpolation)
        tpl.interpolations = dict(_interpolations(OmegaConf.to_container(sub, resolve=False)))
    if keys not in tpl.paths:
        value_paths = [tuple(k.split(".")) for k in keys]
        tpl.paths[keys] = value_paths + dependent_interpolations(tpl.interpolations, value_paths)
    try:
        c = _patched(sub, tpl.resolved, tpl.paths[keys])
    except Exception:   # a path the walk cannot read: resolve in full
        c = None
    if not tpl.checked or c is None:
        full = OmegaConf.to_container(sub, resolve=True)
        tpl.checked = True
        if c != full:
            tpl.patch, c = False, full
    return c


def _interpolations(node: Any, path: tuple = ()) -> Iterator[Tuple[tuple, str]]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _interpolations(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _interpolations(v, path + (i,))
    elif isinstance(node, str) and "${" in node:
        yield path, node


_REF = re.compile(r"\$\{([^${}]*)\}")
_ENV = re.compile(r"oc\.env:\w+(,[^,]*)?")
_KEY = re.compile(r"[A-Za-z_][\w-]*(\.[\w-]+)*")


def interpolation_refs(text: str) -> List[Optional[str]]:
    """The keys an interpolating text reads (``"${paths.output_root}/x"`` -> ["paths.output_root"]); "" for an
    environment variable (``oc.env``), None for anything else (another resolver, a relative key): it may read
    anything."""
    refs: List[Optional[str]] = []
    m = _REF.search(text)
    while m:   # innermost first: ${oc.env:A,${b}} reads b, then A
        inner = m.group(1).strip()
        refs.append("" if _ENV.fullmatch(inner) else inner if _KEY.fullmatch(inner) else None)
        text = text[:m.start()] + "_" + text[m.end():]
        m = _REF.search(text)
    return refs


def dependent_interpolations(interpolations: Dict[tuple, str], value_paths: List[tuple]) -> List[tuple]:
    """Paths of the interpolating nodes whose value can follow a value key: those reading a key at, above or below
    one, or another such node, or anything but keys and environment variables."""
    def overlaps(a: tuple, b: tuple) -> bool:
        n = min(len(a), len(b))
        return tuple(map(str, a[:n])) == tuple(map(str, b[:n]))

    memo: Dict[tuple, bool] = {}

    def dependent(path: tuple, seen: frozenset) -> bool:
        if path not in memo:
            memo[path] = path in seen or any(
                ref is None or (ref and (any(overlaps(tuple(ref.split(".")), v) for v in value_paths)
                                         or any(overlaps(tuple(ref.split(".")), q) and dependent(q, seen | {path})
                                                for q in interpolations)))
                for ref in interpolation_refs(interpolations[path]))
        return memo[path]

    return [p for p in interpolations if dependent(p, frozenset())]


def _patched(sub: DictConfig, resolved: dict, paths: List[tuple]) -> dict:
    """``resolved`` with every one of ``paths`` read again from ``sub`` as it stands. Only the containers along the
    paths are copied; the rest is shared with ``resolved`` (resolutions are read, never changed)."""
    c = dict(resolved)
    copied = {id(c)}
    for path in paths:
        node: Any = sub
        for part in path:
            node = node[part]
        target = c
        for part in path[:-1]:
            child = target[part]
            if id(child) not in copied:
                child = dict(child) if isinstance(child, dict) else list(child)
                target[part] = child
                copied.add(id(child))
            target = child
        target[path[-1]] = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
    return c
