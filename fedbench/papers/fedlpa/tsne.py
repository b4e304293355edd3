"""FedLPA Figs. 1, 4, 5 (fedlpa.md §4 "Figures"): 2-D t-SNE of the penultimate-layer features of saved models.

``table.plots: [tsne_global, tsne_local]`` (registered as plot kinds; drawn by ``fedbench.report.figures.plot_preset_figures``):
- ``tsne_global``: one panel per finished run of the preset (FedLPA = Fig. 1; FedAvg, FedNova, SCAFFOLD, FedProx,
  DENSE = Fig. 5), embedding that run's final global model (``model.pt``);
- ``tsne_local``: one panel per round-1 client model (Fig. 4, panels a-j), from the FedLPA run's ``clients.pt``
  (else FedAvg's, else the first run that saved them).
The runs must have been made with ``save_model=true`` (the preset sets it). Features: the input of the model's last
``nn.Linear`` (the penultimate layer, after its ReLU) — the paper does not name the layer, so this is [I]. Points: a
seeded subsample (the run seed) of ``table.tsne.points`` TRAINING inputs (default 2000 [I]; Fig. 5 uses training
data), preprocessed as in training (without augmentation). t-SNE: ``sklearn.manifold.TSNE``, 2-D, PCA init,
``random_state`` = the run seed, perplexity 30 (less for tiny sets); an ensemble's members' features are
concatenated. The coordinates go beside the PNG (``..._data.csv``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pandas as pd
import torch
import torch.nn as nn

from fedbench.errors import FedbenchError
from fedbench.report.plotting import figure_title, pyplot, save_figure
from fedbench.report.registry import PlotRequest
from fedbench.report.runs import preset_records
from fedbench.data import load_dataset
from fedbench.train.engine import TrainData
from fedbench.models import build_model

PLOTS = ("tsne_global", "tsne_local")
NAMES = {"fedlpa": "FedLPA", "fedavg": "FedAvg", "fednova": "FedNova", "scaffold": "SCAFFOLD", "fedprox": "FedProx",
         "dense": "DENSE"}
DEFAULT_POINTS = 2000


def method_name(algo: Dict[str, Any]) -> str:
    name = str(algo.get("name"))
    label = NAMES.get(name, name)
    if name == "fedprox" and algo.get("mu") is not None:
        label += f" μ={float(algo['mu']):g}"
    return label


# ---- features --------------------------------------------------------------------------------------------------
def last_linear(model: nn.Module) -> nn.Linear:
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise FedbenchError(f"t-SNE: model {type(model).__name__} has no nn.Linear layer to take the features before")
    return linears[-1]


@torch.no_grad()
def penultimate_features(model: nn.Module, params: Dict[str, torch.Tensor], x: torch.Tensor,
                         batch_size: int = 2048) -> torch.Tensor:
    """[n, d]: the input of ``model``'s last ``nn.Linear`` when run with ``params`` (a weight dict) on ``x``."""
    from torch.func import functional_call

    layer, grabbed = last_linear(model), []
    handle = layer.register_forward_hook(lambda mod, inp, out: grabbed.append(inp[0].detach()))
    try:
        p = {k: v.to(x.device, torch.float32) for k, v in params.items()}
        for s in range(0, len(x), batch_size):
            functional_call(model, p, (x[s:s + batch_size],), strict=False)
    finally:
        handle.remove()
    return torch.cat(grabbed).flatten(1).cpu()


def embed(features: np.ndarray, seed: int) -> np.ndarray:
    """[n, 2] t-SNE coordinates (PCA init, ``random_state=seed``; perplexity 30, less when n is small)."""
    from sklearn.manifold import TSNE
    from threadpoolctl import threadpool_limits   # a scikit-learn dependency

    n = len(features)
    perplexity = float(min(30.0, max(1.0, (n - 1) / 3.0)))
    # one OpenMP/BLAS thread: on a busy 2-core machine sklearn's threaded Barnes-Hut ran 15x slower with 2 threads
    # than with 1 (300 points: 13.3 s vs 0.9 s, measured)
    with threadpool_limits(1):
        return TSNE(n_components=2, init="pca", random_state=int(seed), perplexity=perplexity).fit_transform(
            np.asarray(features, dtype=np.float64)).astype(np.float32)


# ---- runs ----------------------------------------------------------------------------------------------------
def _runs(df: pd.DataFrame, output_root: Path) -> List[Dict[str, Any]]:
    """The preset's finished runs with their record, label and folder; a clear error without any."""
    out = []
    for _, r in df.iterrows():
        if r["status"] != "ok":
            continue
        folder = Path(output_root) / "runs" / r["run_id"]
        rec = json.loads((folder / "metrics.json").read_text())
        out.append({"run_id": r["run_id"], "dir": folder, "record": rec, "seed": int(r["seed"]),
                    "method": method_name(rec["config"]["algorithm"]), "algorithm": rec["config"]["algorithm"]["name"],
                    "saved": rec.get("saved") or {}})
    if not out:
        raise FedbenchError("no finished runs to plot (run the sweep first)")
    return out


def _points(rec: Dict[str, Any], n_points: int, seed: int):
    """(model inputs, labels, train indices) of the seeded training subsample, preprocessed as in the run."""

    cfg = rec["config"]
    dcfg = cfg["dataset"]
    data = load_dataset(dcfg["name"], Path(cfg["paths"]["data_root"]).expanduser(), **(dcfg.get("kwargs") or {}))
    if data.task != "classification":
        raise FedbenchError(f"t-SNE figures need a classification data set, got {dcfg['name']} ({data.task})")
    n = len(data.train_y)
    idx = np.sort(np.random.default_rng(seed).choice(n, size=min(int(n_points), n), replace=False))
    norm = dcfg.get("normalize", True)
    train = TrainData(data.train_x, data.train_y, data.mean if norm else None, data.std if norm else None)
    it = torch.as_tensor(idx, dtype=torch.long)
    return train.inputs(it), data.train_y[it].cpu().numpy(), idx


def _load(path: Path) -> Dict[str, Any]:
    blob = torch.load(path, map_location="cpu", weights_only=True)
    blob["module"] = build_model(blob["model"], input_shape=tuple(blob["input_shape"]),
                                 num_classes=int(blob["num_classes"]), **(blob.get("model_kwargs") or {})).eval()
    return blob


def _need(run: Dict[str, Any], key: str, meta: Dict[str, Any]) -> Path:
    f = run["saved"].get(key)
    path = run["dir"] / f if f else None
    if path is None or not path.is_file():
        what = "final global weights (model.pt)" if key == "model" else "round-1 client weights (clients.pt)"
        raise FedbenchError(f"run {run['run_id']} ({run['method']}) has no saved {what}: rerun the preset with "
                            f"save_model=true (scripts/reproduce.py experiment={meta.get('paper')}/{meta.get('id')} "
                            f"... save_model=true; finished runs without the file are rerun)")
    return path


def _features(blob: Dict[str, Any], params, x: torch.Tensor) -> np.ndarray:
    if isinstance(params, (list, tuple)):   # an ensemble: its members' features side by side
        return np.concatenate([penultimate_features(blob["module"], p, x).numpy() for p in params], axis=1)
    return penultimate_features(blob["module"], params, x).numpy()


# ---- plot ------------------------------------------------------------------------------------------------------
def _draw(panels: List[Dict[str, Any]], labels: np.ndarray, title: str, path: Path, num_classes: int) -> Path:
    plt = pyplot()
    cols = min(5, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 3.4 * rows + 0.9), squeeze=False)
    cmap = plt.get_cmap("tab10" if num_classes <= 10 else "tab20")
    handles = {}
    for ax, p in zip(axes.flat, panels):
        xy = p["xy"]
        for c in range(num_classes):
            m = labels == c
            if m.any():
                handles[c] = ax.scatter(xy[m, 0], xy[m, 1], s=2, color=cmap(c % cmap.N), label=str(c), rasterized=True)
        ax.set_title(p["title"], fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    # beside the first row's last panel (an axes legend, so that tight_layout makes room for it)
    axes[0, cols - 1].legend([handles[c] for c in sorted(handles)], [str(c) for c in sorted(handles)],
                             title="class", loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=7,
                             markerscale=4, frameon=False)
    data = pd.concat([pd.DataFrame({"panel": p["panel"], "method": p["method"], "run_id": p["run_id"],
                                    "client": p.get("client", ""), "train_index": p["idx"], "label": labels,
                                    "x": p["xy"][:, 0], "y": p["xy"][:, 1]}) for p in panels], ignore_index=True)
    return save_figure(fig, path, data, title)


def plot_tsne(kind: str, df: pd.DataFrame, meta: Dict[str, Any], path: Path, profile: str,
              output_root: Path) -> Path:
    """Draw ``tsne_global`` or ``tsne_local`` for the preset's finished runs (see the module docstring)."""

    runs = _runs(df, output_root)
    n_points = int((meta.get("tsne") or {}).get("points", DEFAULT_POINTS))
    if n_points < 5:
        raise FedbenchError(f"table.tsne.points must be >= 5, got {n_points}")
    missing = sorted({method_name({"name": a}) for a in df.loc[df["status"] != "ok", "algorithm"]})
    layer = "input of the last Linear (penultimate layer, [I])"
    if kind == "tsne_global":
        for r in runs:   # every file is checked before any t-SNE is computed
            _need(r, "model", meta)
        chosen = runs
    else:
        with_clients = [r for r in runs if r["saved"].get("clients")]
        order = {"fedlpa": 0, "fedavg": 1}
        chosen = sorted(with_clients, key=lambda r: order.get(r["algorithm"], 2))[:1] or runs[:1]
        _need(chosen[0], "clients", meta)
    cache: Dict[tuple, Any] = {}
    panels: List[Dict[str, Any]] = []
    labels = None
    for r in chosen:
        key = (json.dumps(r["record"]["config"]["dataset"], sort_keys=True), r["seed"])
        if key not in cache:
            cache[key] = _points(r["record"], n_points, r["seed"])
        x, labels, idx = cache[key]
        if kind == "tsne_global":
            blob = _load(_need(r, "model", meta))
            acc = (r["record"].get("metrics") or {}).get("accuracy")
            t = r["method"] + (f" (test acc {acc:.1f}%)" if acc is not None else "")
            if len({q["seed"] for q in runs}) > 1:
                t += f", seed {r['seed']}"
            panels.append({"panel": r["method"], "method": r["method"], "run_id": r["run_id"], "idx": idx,
                           "title": t, "xy": embed(_features(blob, blob["params"], x), r["seed"])})
        else:
            blob = _load(_need(r, "clients", meta))
            counts = (r["record"].get("partition") or {}).get("client_label_counts") or []
            for c, params in enumerate(blob["params"]):
                t = f"({chr(ord('a') + c) if c < 26 else c}) client {c + 1}"
                if c < len(counts) and sum(counts[c]):
                    top = int(np.argmax(counts[c]))
                    t += f": n={sum(counts[c])}, most class {top} ({100 * counts[c][top] / sum(counts[c]):.0f}%)"
                panels.append({"panel": f"client {c + 1}", "method": r["method"], "run_id": r["run_id"],
                               "client": c + 1, "idx": idx, "title": t,
                               "xy": embed(_features(blob, params, x), r["seed"])})
    what = ("global models" if kind == "tsne_global"
            else f"round-1 local models (as received by {chosen[0]['method']}, run {chosen[0]['run_id']})")
    title = (figure_title(meta, profile) + f" — t-SNE of {what}: {layer} features of {len(labels)} training points "
             f"(seeded subsample), colour = true class" + (f"; not run: {', '.join(missing)}" if missing else ""))
    return _draw(panels, labels, title, path, int(blob["num_classes"]))


# ---- the plot kinds FedLPA registers (fedbench.report.registry) --------------------------------------------------
def describe_run(sub, a: Dict[str, Any]) -> Dict[str, Any]:
    return {"algorithm": a.get("name"), "seed": int(sub.seed)}


def preset_runs(overrides, output_root: Path) -> pd.DataFrame:
    """The preset's runs with their status, algorithm and seed (fedbench.report.runs.preset_records)."""
    return preset_records(overrides, output_root, describe_run)


def plot_kind(req: PlotRequest) -> Path:
    """``tsne_global`` or ``tsne_local`` of the preset's runs."""
    return plot_tsne(req.kind, req.frame(preset_runs), req.meta, req.path, req.profile, req.output_root)
