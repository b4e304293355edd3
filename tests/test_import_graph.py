"""The import graph of fedbench (module-level and function-level imports, read with ast): no cycles, no module
importing a layer above its own, no private name imported across modules, and no fedbench import hidden inside a
function (that is how cycles were kept working before). Function-local imports stay allowed for optional or heavy
third-party packages only (``LAZY_PACKAGES``): they keep ``run.py``'s torch-free preflight and the CLI start fast.

The layers, lowest first. A module's layer is the entry with the longest matching prefix. A module may import its
own layer or any lower one:

    base      errors, registry, numerics, checksums          (no fedbench imports but each other)
    store     results.records / claims / summaries / schema / reference  (run records: schema, files, ids, claims;
                                                             the papers' reference numbers)
    config    config                                         (torch-free composition, validation, preset specs)
    data      data, partition, models, eval                  (tensors, splits, networks, metrics)
    train     train, curvature                               (local training, posterior curvature)
    methods   algorithms                                     (one module per method)
    fl        fl                                             (the round loop, client-stage cache, server data)
    run       run, runner, results.loggers                   (one config end to end -> one record)
    launch    launch                                         (sweeps, local parallel jobs, Slurm)
    report    report                                         (collect -> tables, figures, scoreboard, study
                                                             presets; the registry papers fill; names no paper)
    papers    papers                                         (each paper's row keys, labels, figures, studies,
                                                             registered into report by papers.load_papers())
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fedbench"

LAYERS: List[Tuple[str, ...]] = [
    ("fedbench", "fedbench.errors", "fedbench.registry", "fedbench.numerics", "fedbench.checksums"),
    ("fedbench.results.records", "fedbench.results.claims", "fedbench.results.summaries", "fedbench.results.schema",
     "fedbench.results.reference"),
    ("fedbench.config",),
    ("fedbench.data", "fedbench.partition", "fedbench.models", "fedbench.eval"),
    ("fedbench.train", "fedbench.curvature"),
    ("fedbench.algorithms",),
    ("fedbench.fl",),
    ("fedbench.run", "fedbench.runner", "fedbench.results.loggers"),
    ("fedbench.launch",),
    ("fedbench.report",),
    ("fedbench.papers",),
]
# third-party packages that may be imported inside a function: optional, or heavy enough to keep off the
# start-up path of the torch-free modules (config, launch, records) and of the CLI
LAZY_PACKAGES = {"matplotlib", "wandb", "submitit", "torch", "torchvision", "PIL", "ot", "curvlinops", "sklearn",
                 "pandas", "scipy", "joblib", "threadpoolctl", "hydra", "tqdm"}


def module_files() -> Dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def layer_of(module: str) -> int:
    best, found = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, found = len(p), i
    assert found is not None, f"{module} has no layer: add it to LAYERS"
    return found


def imports_of(module: str, path: Path, mods: Dict[str, Path]):
    """(target module, imported name or None, in a function?, line, top package) of every import in ``path``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []

    def target(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for a in child.names:
                    out.append((target(a.name) if a.name.startswith("fedbench") else None, None, in_function,
                                child.lineno, a.name.split(".")[0]))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for a in child.names:
                    full = f"{base}.{a.name}"
                    tgt = (full if full in mods else target(base)) if base.startswith("fedbench") else None
                    out.append((tgt, a.name, in_function, child.lineno, base.split(".")[0]))
            visit(child, inside)

    visit(ast.parse(path.read_text()), False)
    return out


@pytest.fixture(scope="module")
def graph():
    mods = module_files()
    return mods, {m: imports_of(m, p, mods) for m, p in mods.items()}


def _edges(graph) -> Dict[str, Set[str]]:
    mods, imports = graph
    return {m: {t for t, *_ in imps if t and t != m} for m, imps in imports.items()}


def find_cycle(edges: Dict[str, Set[str]]):
    """One import cycle as a list of modules, or None (iterative depth-first search)."""
    state: Dict[str, int] = {}
    for start in sorted(edges):
        if state.get(start):
            continue
        stack = [(start, iter(sorted(edges[start])))]
        path = [start]
        state[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                stack.append((nxt, iter(sorted(edges.get(nxt, ())))))
                path.append(nxt)
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_every_module_has_a_layer(graph):
    for m in graph[0]:
        layer_of(m)


def test_no_import_cycles(graph):
    # a package's __init__ importing its own submodules (registration) is not a cycle between layers
    edges = {m: {t for t in ts if not m.startswith(t + ".") or t == "fedbench"}
             for m, ts in _edges(graph).items()}
    edges = {m: {t for t in ts if not (t.startswith(m + ".") and graph[0][m].name == "__init__.py")}
             for m, ts in edges.items()}
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_module_imports_a_higher_layer(graph):
    bad = [f"{m}:{line} imports {t} (layer {layer_of(t)} > {layer_of(m)})"
           for m, imps in graph[1].items() for t, _, _, line, _ in imps if t and layer_of(t) > layer_of(m)]
    assert not bad, "\n".join(bad)


def test_no_private_names_across_modules(graph):
    bad = [f"{m}:{line} imports {name} from {t}" for m, imps in graph[1].items()
           for t, name, _, line, _ in imps if t and t != m and name and name.startswith("_")]
    assert not bad, "\n".join(bad)


def test_imports_inside_functions_only_for_lazy_packages(graph):
    bad = [f"{m}:{line} imports {top if t is None else t} inside a function" for m, imps in graph[1].items()
           for t, _, inside, line, top in imps if inside and (t is not None or top not in LAZY_PACKAGES)]
    assert not bad, "\n".join(bad)


# ---- short functions (issue 17: a god function in the runner) --------------------------------------------------
MAX_FUNCTION_LINES = 80
# left for the curvature speed work, which is changing this function at the same time
LONG_FUNCTIONS_LEFT = {"fedbench.curvature.compute._compute"}


def test_a_run_does_not_import_the_heavy_optional_packages():
    """Every sweep worker imports the runner: scipy (PFNM's matching), pandas (UCI/FLamby parsing) and torchvision
    (a data set's first load) stay where they are used, which saves each worker ~1-3 s of start-up."""
    import subprocess
    import sys

    code = ("import sys, fedbench.runner, fedbench.launch.jobs\n"
            "print(' '.join(sorted({m.split('.')[0] for m in sys.modules} & {'scipy', 'pandas', 'torchvision', "
            "'matplotlib', 'sklearn'})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent)
    assert out.stdout.strip() == "", f"imported at start-up: {out.stdout.strip()}"


def test_functions_are_short(graph):
    long = []
    for module, path in graph[0].items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES and f"{module}.{node.name}" not in LONG_FUNCTIONS_LEFT:
                    long.append(f"{module}.{node.name}: {lines} lines")
    assert not long, "\n".join(long)


def test_readme_lists_every_algorithm_hook():
    """The README's "Adding a method" table names every public method of ``Algorithm`` (a new hook must be documented)."""
    import inspect

    from fedbench.algorithms.base import Algorithm

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("## Adding a method"):readme.index("## Layout")]
    hooks = [n for n, f in inspect.getmembers(Algorithm, inspect.isfunction) if not n.startswith("_")]
    assert len(hooks) >= 10
    missing = [h for h in hooks if f"`{h}(" not in section and f"`{h}`" not in section]
    assert not missing, f"README 'Adding a method' lacks: {missing}"
