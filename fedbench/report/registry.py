"""What each paper adds to the generic report (fedbench.papers registers into it; report names no paper).

* row keys (``register_row_key``): a table row key computed from a run config, e.g. FedLPA Table 3's ``lambda``;
* partition labels (``register_partition_label``): how a table names a partition family, e.g. ``alpha=0.1``;
* method labels (``register_method_label``): a table's name for an algorithm config whose variants share one
  algorithm name (FOLA-offline is ``name: fola``);
* plot kinds (``register_plot_kind``): a preset's named plots (``table.plots``), drawn from a ``PlotRequest``;
* studies (``register_study``): presets that run a study instead of ``run.py`` (``table.study``).

Registering a name twice with a different function is an error (one place per thing); the same function again
is a no-op, so loading the papers twice changes nothing. fedbench.report never imports fedbench.papers (report <
papers): the entry points (scripts, tests/conftest.py) call ``fedbench.papers.load_papers()`` once, and the report
reads the tables through ``registered``, which refuses to run without them (a table read without the papers would
silently lose their row keys and labels).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from fedbench.errors import FedbenchError

ROW_KEYS: Dict[str, Callable[[Dict[str, Any]], Any]] = {}
PARTITION_LABELS: Dict[str, Callable[[Dict[str, Any]], str]] = {}
METHOD_LABELS: Dict[str, Callable[[Dict[str, Any]], Optional[str]]] = {}
PLOT_KINDS: Dict[str, Callable[["PlotRequest"], Path]] = {}
STUDIES: Dict[str, "Study"] = {}
LOADED_PAPERS: List[str] = []   # the papers that have registered (fedbench.papers.load_papers)


@dataclass(frozen=True)
class Study:
    """A study a preset runs instead of ``run.py``: ``settings(cfg)`` checks one run's config before any work,
    ``run(cfg, out_dir, launch_dir=..., log=...)`` computes it (``log(line)``: its progress) and returns the record's
    extra fields, ``publish(runs,
    figures_dir, profile, suffix=None)`` (optional) copies its figures into results/figures/."""
    settings: Callable
    run: Callable
    publish: Optional[Callable] = None


@dataclass
class PlotRequest:
    """One named plot of a preset: where it goes and what it reads. ``frame(build)`` is ``build(overrides,
    output_root)`` computed once per preset, so several plots of one preset share one scan of the records."""
    kind: str
    overrides: Sequence[str]
    output_root: Path
    path: Path
    profile: str
    meta: Dict[str, Any]
    frames: Dict[Callable, Any] = field(default_factory=dict)

    def frame(self, build: Callable):
        if build not in self.frames:
            self.frames[build] = build(self.overrides, self.output_root)
        return self.frames[build]


def registered(table: Dict[str, Any]) -> Dict[str, Any]:
    """``table`` (one of the above), once the papers have registered into it."""
    if not LOADED_PAPERS:
        raise FedbenchError("the papers' row keys, labels, plots and studies are not registered: call "
                            "fedbench.papers.load_papers() first")
    return table


def _register(table: Dict[str, Any], what: str, name: str, value) -> None:
    if table.get(name, value) != value:
        raise ValueError(f"{what} {name!r} is registered twice with different definitions")
    table[name] = value


def register_row_key(name: str, fn: Callable[[Dict[str, Any]], Any]) -> None:
    """``fn(run config as a dict)`` -> the row key's value (None where it does not apply)."""
    _register(ROW_KEYS, "row key", name, fn)


def register_partition_label(partition: str, fn: Callable[[Dict[str, Any]], str]) -> None:
    """``fn(partition config)`` -> the label tables use for the partition family ``partition``."""
    _register(PARTITION_LABELS, "partition label", partition, fn)


def register_method_label(algorithm: str, fn: Callable[[Dict[str, Any]], Optional[str]]) -> None:
    """``fn(algorithm config)`` -> the table label of a variant of ``algorithm``, or None for its plain name."""
    _register(METHOD_LABELS, "method label", algorithm, fn)


def register_plot_kind(kind: str, fn: Callable[[PlotRequest], Path]) -> None:
    """``fn(request)`` draws the plot into ``request.path`` and returns the path."""
    _register(PLOT_KINDS, "plot kind", kind, fn)


def register_study(name: str, study: Study) -> None:
    _register(STUDIES, "study", name, study)


def alpha_label(p: Dict[str, Any]) -> str:
    """``alpha=0.1``: the label of a Dirichlet split with concentration ``alpha``."""
    return f"alpha={p.get('alpha'):g}"


def heterogeneous_label(p: Dict[str, Any]) -> str:
    return "heterog"


def algorithm_key(c: Dict[str, Any], names, fn):
    """``fn(algorithm config)`` for runs whose algorithm name starts with ``names``, else None (a method's own
    axis: other methods of the table have no value there)."""
    a = c.get("algorithm") or {}
    return fn(a) if str(a.get("name", "")).startswith(names) else None
