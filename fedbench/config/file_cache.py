"""Hydra reads and parses every YAML file of a composition again on every compose (its cache lives for one
compose). Tables, the scoreboard, sweeps and the tests compose hundreds of runs in one process, and loading the
files was about half of each compose. ``install`` keeps each file's parsed config, keyed by its path, modification
time and size (an edited file is read again), and hands Hydra a deep copy, since Hydra edits what it loads."""
from __future__ import annotations

import copy
import dataclasses
import os

from omegaconf import DictConfig, OmegaConf

_CACHE: dict = {}
_INSTALLED = False
_YAML: dict = {}


def _stamp(source, config_path: str):
    """(mtime, size) of a file source's file; None for a package's files, which do not change in a process."""
    if source.scheme() != "file":
        return None
    root = source.path.split("://", 1)[-1]
    try:
        st = os.stat(os.path.join(root, source._normalize_file_name(config_path)))
    except OSError:
        return "missing"   # not cached below: the load raises Hydra's own error
    return st.st_mtime_ns, st.st_size


def _cached(load):
    def load_config(self, config_path: str):
        key = (type(self).__name__, self.path, config_path, _stamp(self, config_path))
        hit = _CACHE.get(key)
        if hit is None:
            hit = _CACHE[key] = load(self, config_path)
        return dataclasses.replace(hit, config=copy.deepcopy(hit.config), header=dict(hit.header))

    load_config.__wrapped__ = load
    return load_config


def _hydra_sources() -> list:
    from hydra.core.plugins import Plugins
    from hydra.plugins.config_source import ConfigSource

    # Hydra imports its plugin modules itself, so its sources are the classes its registry names
    return [cls for cls in Plugins.instance().discover(ConfigSource) if cls.scheme() in ("file", "pkg")]


def install() -> None:
    """Wrap the loaders of Hydra's file and package config sources (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    for cls in _hydra_sources():
        cls.load_config = _cached(cls.load_config)
    _INSTALLED = True


def cached_sources() -> list:
    """Hydra's file and package config-source classes, their loaders wrapped (Hydra's own is ``__wrapped__``)."""
    install()
    return _hydra_sources()


def load_yaml(path) -> DictConfig:
    """``OmegaConf.load(path)`` kept per path, modification time and size (an edited file is read again); a deep copy
    each call, so a caller's edits stay its own. A sweep plan validates every run against its group YAMLs and
    expands its aggregator lists from the algorithm YAMLs: parsing them again for every run was a fifth of a plan."""
    st = os.stat(path)
    key = (os.fspath(path), st.st_mtime_ns, st.st_size)
    if key not in _YAML:
        _YAML[key] = OmegaConf.load(path)
    return copy.deepcopy(_YAML[key])
