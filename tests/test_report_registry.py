"""The report/papers split (issue 17 item 5): generic report code names no paper; each paper registers its row keys,
labels, plot kinds and studies into fedbench.report.registry, and every preset's plots and studies are registered."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from fedbench.errors import FedbenchError
from fedbench.papers import load_papers
from fedbench.report import registry
from fedbench.report.registry import register_row_key
from fedbench.report.tables import key_funcs, method_label, partition_label, row_value

ROOT = Path(__file__).resolve().parents[1]
PAPER_NAME = re.compile(r"fedlpa|fola|fedfisher|fedbens|fedlap", re.IGNORECASE)


def _code_names(path: Path):
    """Every identifier, imported name and non-docstring string constant of a module, with its line."""
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            yield n.lineno, n.value
        elif isinstance(n, ast.Name):
            yield n.lineno, n.id
        elif isinstance(n, ast.alias):
            yield n.lineno, n.name


def test_generic_report_code_names_no_paper():
    datasets = {OmegaConf.load(p).get("name") for p in (ROOT / "conf" / "dataset").glob("*.yaml")}
    hits = [f"{p.name}:{line}: {text!r}" for p in sorted((ROOT / "fedbench" / "report").glob("*.py"))
            for line, text in _code_names(p) if PAPER_NAME.search(text) and text not in datasets]
    assert not hits, "\n".join(hits)


def test_the_scan_finds_a_paper_name(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text('"""FedLPA in a docstring is fine."""\nLABEL = "fedbens_diag"\n')
    assert [t for _, t in _code_names(bad) if PAPER_NAME.search(t)] == ["fedbens_diag"]


def test_papers_register_their_row_keys():
    assert load_papers() == ("fedlpa", "fola", "fedfisher", "fedbens", "fedlap")
    assert {"lambda", "s_q", "width", "M", "T", "sigma2", "map_delta"} <= set(key_funcs())
    assert row_value({"algorithm": {"name": "fedlpa", "damping": 0.01}}, "lambda") == 0.01
    assert row_value({"algorithm": {"name": "fedavg", "damping": 0.01}}, "lambda") is None
    kfac = {"name": "fedfisher_kfac", "compression": True, "factor_bits": 8}
    assert row_value({"algorithm": kfac}, "s_q") == 4
    assert row_value({"algorithm": {**kfac, "compression": False}}, "s_q") == 1
    assert row_value({"algorithm": {"name": "fedfisher_diag", "fisher_bits": 16}}, "s_q") == 2
    assert row_value({"algorithm": {"name": "fedbens", "members": 5}}, "M") == 5
    assert row_value({"algorithm": {"name": "fedbens", "members": 5, "members_per_client": [1, 2]}}, "M") == "custom"
    assert row_value({"algorithm": {"name": "fedbens", "temperature": 2.0, "prior_var": 0.1}}, "sigma2") == 0.1
    assert row_value({"model": {"width": 64}}, "width") == 64
    assert row_value({"eval": {"map_reference": 1e-3}}, "map_delta") == 1e-3


def test_papers_register_their_labels():
    assert method_label({"name": "fedbens", "laplace": "diag"}) == "fedbens_diag"
    assert method_label({"name": "fedbens", "laplace": "diag_full_last"}) == "fedbens_diag_full"
    assert method_label({"name": "fedbens", "laplace": "kfac"}) == "fedbens"
    assert method_label({"name": "fola", "fisher": {"mode": "offline"}}) == "fola_offline"
    assert method_label({"name": "fola", "fisher": {"mode": "online"}}) == "fola"
    assert method_label({"name": "fedprox", "mu": 0.01}) == "fedprox(mu=0.01)"
    assert partition_label({"name": "dirichlet_clientwise", "alpha": 0.1}) == "alpha=0.1"
    assert partition_label({"name": "dirichlet_per_class_contiguous", "alpha": 100}) == "alpha=100"
    assert partition_label({"name": "dirichlet_per_class_contiguous", "alpha": 0.1, "coarse_clients": 5}) == \
        "alpha=0.1/coarse=5"
    assert partition_label({"name": "homo", "coarse_clients": None}) == "homog"
    assert [partition_label({"name": n}) for n in ("size_class_dirichlet", "uci_inhomogeneous", "natural")] == \
        ["heterog"] * 3
    assert partition_label({"name": "noniid-labeldir", "beta": 0.5}) == "beta=0.5"
    assert partition_label({"name": "noniid-#label", "k": 2}) == "#C=2"
    assert partition_label({"name": "homo"}) == "homog"


def test_every_preset_plot_and_study_is_registered():
    plots, studies = set(), set()
    for p in (ROOT / "conf" / "experiment").rglob("*.yaml"):
        table = OmegaConf.load(p).get("table") or {}
        plots |= set(table.get("plots") or [])
        studies |= {table["study"]} if table.get("study") else set()
    assert plots and plots <= set(registry.PLOT_KINDS)
    assert studies == set(registry.STUDIES) == {"fola_laplace", "gmi_attack"}
    assert registry.STUDIES["gmi_attack"].publish is not None and registry.STUDIES["fola_laplace"].publish is None


def test_registering_twice_is_a_no_op_and_a_clash_an_error():
    before = dict(registry.ROW_KEYS)
    load_papers()
    register_row_key("lambda", registry.ROW_KEYS["lambda"])
    assert registry.ROW_KEYS == before
    with pytest.raises(ValueError, match="registered twice"):
        register_row_key("lambda", lambda c: None)
    assert registry.ROW_KEYS == before


def test_report_refuses_to_run_without_the_papers(monkeypatch):
    """report never imports papers: a caller that skipped load_papers() gets a clear error, not tables that
    silently lost the papers' row keys and labels."""
    monkeypatch.setattr(registry, "LOADED_PAPERS", [])
    for read in (lambda: row_value({"algorithm": {"name": "fedlpa", "damping": 0.01}}, "lambda"),
                 lambda: method_label({"name": "fola"}), lambda: partition_label({"name": "natural"})):
        with pytest.raises(FedbenchError, match="load_papers"):
            read()
    assert partition_label({"name": "homo"}) == "homog"   # the generic labels need no paper


def test_readme_layout_names_every_package():
    """The README's package map lists every package of fedbench (and no removed one)."""
    readme = (ROOT / "README.md").read_text()
    layout = readme[readme.index("## Layout"):]
    layout = layout[:layout.index("\n```\n", layout.index("```") + 3)]
    listed = set(re.findall(r"^fedbench/(\w+) ", layout, re.MULTILINE))   # packages, not runner.py
    packages = {p.parent.name for p in (ROOT / "fedbench").glob("*/__init__.py")}
    assert listed == packages
