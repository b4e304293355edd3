"""FOLA Fig. 3, alpha = 0.1, N = 100: why FedAvg's one-shot average gains from many distinct label mixes
(results/gaps.md#fola-figures3-4). Reads FedAvg runs made with ``save_model=true`` (the global model and the 100
round-1 clients), on the released split (M = 100) and with the label mixes of M = 5, 20, 50 clients
(``+partition.coarse_clients=M``), and prints per run:

- GA: the global model's test accuracy (equal to the run's record); the same clients averaged with uniform weights;
- ensemble: the size-weighted mean of the clients' softmax outputs, i.e. what the clients know as a committee,
  without averaging weights;
- rebalanced: the ensemble's vote for each class divided by the total weight of that class's holders (below), a
  test of whether unequal holder weights alone cost the committee its accuracy;
- per class (a second line): its holders' weight and its accuracy in the ensemble;
- the holders of class c: the clients with at least 5 % of their samples in c; their total weight (share of the
  data) per class: its spread over the classes (sd) and smallest value, and the Spearman correlation over the 10
  classes between a class's holder weight and its test accuracy, in the global model and in the ensemble;
- balanced weights: the client weights (on the simplex) that make the classes' holder weights as equal as they can
  be, used for the average (GA) and for the ensemble: the same test from the weights' side;
- wrong-vote concentration, with size and with balanced weights: per test sample, the share of the non-holders'
  weight that falls on their single most voted wrong class, averaged (high when clients with the same mix repeat);
- a rejected first guess, pair coverage: class pairs (a, b) that some clients see together (the rarer class's share
  of samples held beside the other class, summed over clients, at least 5 %); errors per 1,000 test samples of a
  pair, covered against uncovered pairs (the guess predicts more errors on uncovered pairs).

The runs (about 3 CPU min each; any outputs folder):

    FEDBENCH_OUTPUTS=<out> python run.py experiment=fola/figure3 partition.alpha=0.1 num_clients=100 local.lr=0.1 \\
      local.batch_size=32 local.epochs=20 seed=<s> 'aggregators=[fedavg]' hardware=cpu hardware.num_threads=1 \\
      hardware.memory_format=channels_last save_model=true [+partition.coarse_clients=<M>]

then ``FEDBENCH_OUTPUTS=<out> PYTHONPATH=$PWD python scripts/gaps/fola_mix_confusion.py --seeds 0 1 2 --mixes 5 20 50
100`` (runs not there are reported and skipped).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
from scipy.optimize import minimize
from scipy.stats import spearmanr

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from fedbench.config.compose import compose_config  # noqa: E402
from fedbench.eval.metrics import predict_proba  # noqa: E402
from fedbench.partition import client_label_counts  # noqa: E402
from fedbench.results.records import compute_run_id  # noqa: E402
from fedbench.run.setup import build_setup  # noqa: E402

HOLDS = 0.05     # a client holds class c when at least this share of its samples is c
COVERED = 0.05   # co-training mass at which a class pair counts as covered
BASE = ["experiment=fola/figure3", "partition.alpha=0.1", "num_clients=100", "local.lr=0.1", "local.batch_size=32",
        "local.epochs=20", "aggregators=[fedavg]", "hardware=cpu", "hardware.num_threads=1",
        "hardware.memory_format=channels_last", "save_model=true"]


def co_mass(counts: np.ndarray) -> np.ndarray:
    """[C, C]: for each class pair, the rarer class's share of samples that a client holds beside the other class."""
    tot = counts.sum(0)
    c = counts.shape[1]
    return np.array([[np.minimum(counts[:, a], counts[:, b]).sum() / max(min(tot[a], tot[b]), 1) for b in range(c)]
                     for a in range(c)])


def per_class_accuracy(pred: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.array([(pred[y == c] == c).mean() for c in range(10)])


def pair_errors(pred: np.ndarray, y: np.ndarray, covered: np.ndarray):
    """Errors per 1,000 test samples of a pair, averaged over covered and over uncovered pairs."""
    confusion = np.zeros((10, 10))
    np.add.at(confusion, (y, pred), 1)
    iu = np.triu_indices(10, 1)
    per_class = np.bincount(y, minlength=10)
    rate = (confusion + confusion.T)[iu] / (per_class[:, None] + per_class[None, :])[iu] * 1000
    return rate[covered].mean(), (rate[~covered].mean() if (~covered).any() else float("nan"))


def balanced_weights(holds: np.ndarray, w0: np.ndarray) -> np.ndarray:
    """Client weights on the simplex that make the holder weights of the classes as equal as they can be (least
    variance; a small pull towards the size weights ``w0`` picks one of the equally balanced solutions)."""
    res = minimize(lambda w: np.var(w @ holds) + 1e-3 * np.sum((w - w0) ** 2), w0, method="SLSQP",
                   bounds=[(0, 1)] * len(w0), constraints=[{"type": "eq", "fun": lambda w: w.sum() - 1}],
                   options={"maxiter": 500})
    w = np.clip(res.x, 0, None)
    return w / w.sum()


def wrong_vote_concentration(probs, weight: np.ndarray, holds: np.ndarray, y: np.ndarray) -> float:
    """Mean over test samples of the share of the non-holders' weight (clients that do not hold the sample's class)
    that lands on their single most voted wrong class: near 1 when they all vote the same wrong class."""
    stacked = np.stack(probs)                                          # [clients, samples, classes]
    non_holders = weight[:, None] * (holds[:, y] == 0)                 # [clients, samples]
    wrong = np.einsum("kn,knc->nc", non_holders, stacked)
    wrong[np.arange(len(y)), y] = 0
    return float((wrong.max(1) / np.maximum(non_holders.sum(0), 1e-12)).mean())


def run_folder(cfg, out: Path):
    listing = out / "runs" / compute_run_id(cfg) / "aggregators.json"
    if not listing.is_file():
        return None
    folder = Path(json.loads(listing.read_text())["records"][0]).parent   # the one aggregator's own run
    return folder if (folder / "clients.pt").is_file() else None


def analyse(overrides, out: Path):
    cfg = compose_config(overrides)
    folder = run_folder(cfg, out)
    if folder is None:
        return None
    run = build_setup(cfg)
    fl, n_test = run.fl, len(run.fl.test_y)
    clients = torch.load(folder / "clients.pt", weights_only=False)["params"]
    counts = client_label_counts(run.parts, run.data.train_y.cpu().numpy(), 10).astype(float)
    weight = counts.sum(1) / counts.sum()
    y = fl.test_y.cpu().numpy()

    def predict(params):
        return predict_proba(fl.model, params, fl.test_inputs, n_test)

    def average(w):
        return {k: sum(a * p[k] for a, p in zip(w, clients)) for k in clients[0]}

    probs = [predict(p).cpu().numpy() for p in clients]
    glob = predict(torch.load(folder / "model.pt", weights_only=False)["params"]).argmax(1).cpu().numpy()
    committee = sum(w * p for w, p in zip(weight, probs))
    ensemble = committee.argmax(1)
    holds = (counts / counts.sum(1, keepdims=True) >= HOLDS).astype(float)
    holder_weight = weight @ holds
    rebalanced = (committee / holder_weight).argmax(1)   # each class's vote divided by its holders' weight
    bal = balanced_weights(holds, weight)
    covered = co_mass(counts)[np.triu_indices(10, 1)] >= COVERED
    return {"ga": 100 * (glob == y).mean(),
            "uniform": 100 * (predict(average([1 / len(clients)] * len(clients))).argmax(1).cpu().numpy() == y).mean(),
            "bal_ga": 100 * (predict(average(bal)).argmax(1).cpu().numpy() == y).mean(),
            "bal_ens": 100 * (sum(w * p for w, p in zip(bal, probs)).argmax(1) == y).mean(),
            "bal_sd": (bal @ holds).std(),
            "conc": wrong_vote_concentration(probs, weight, holds, y),
            "bal_conc": wrong_vote_concentration(probs, bal, holds, y),
            "ensemble": 100 * (ensemble == y).mean(), "rebalanced": 100 * (rebalanced == y).mean(),
            "hw_sd": holder_weight.std(), "hw_min": holder_weight.min(),
            "rho_ga": spearmanr(holder_weight, per_class_accuracy(glob, y))[0],
            "rho_ens": spearmanr(holder_weight, per_class_accuracy(ensemble, y))[0],
            "class_hw": holder_weight, "class_ens": per_class_accuracy(ensemble, y),
            "covered": int(covered.sum()), "pairs": pair_errors(glob, y, covered)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--mixes", type=int, nargs="+", default=[5, 20, 50, 100], help="M (100 = the released split)")
    args = ap.parse_args()
    out = Path(os.environ.get("FEDBENCH_OUTPUTS", ROOT / "outputs"))
    print("  M  seed   GA   uniform ensemble rebalanced | holder weight sd   min | Spearman(holder weight, class acc) "
          "GA  ensemble | balanced weights: sd  GA  ensemble | wrong-vote concentration size / balanced | "
          "covered pairs  err/1000 covered  uncovered")
    for m in args.mixes:
        for seed in args.seeds:
            extra = [f"+partition.coarse_clients={m}"] if m != 100 else []
            r = analyse(BASE + extra + [f"seed={seed}"], out)
            if r is None:
                print(f"{m:3d}  {seed:4d}  no saved run under {out}; skipped")
                continue
            print(f"{m:3d}  {seed:4d}  {r['ga']:5.2f}  {r['uniform']:5.2f}   {r['ensemble']:5.2f}"
                  f"    {r['rebalanced']:5.2f}   |"
                  f"        {r['hw_sd']:.3f}      {r['hw_min']:.3f} |"
                  f"                              {r['rho_ga']:5.2f}  {r['rho_ens']:5.2f}  |"
                  f"                 {r['bal_sd']:.3f}  {r['bal_ga']:5.2f}  {r['bal_ens']:5.2f}  |"
                  f"                       {r['conc']:.3f}   {r['bal_conc']:.3f}  |"
                  f"    {r['covered']:2d} of 45       {r['pairs'][0]:5.1f}          {r['pairs'][1]:5.1f}")
            print(f"           per class 0-9: holder weight {np.round(r['class_hw'], 2).tolist()}, "
                  f"ensemble accuracy {np.round(r['class_ens'], 2).tolist()}")


if __name__ == "__main__":
    main()
