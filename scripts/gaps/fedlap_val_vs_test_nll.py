"""FedLap Table 5's "validation NLL" (results/gaps.md#fedlap-table5): one final global model, two evaluation sets.

Table 5's caption says "validation negative log-likelihood", App. F "test". A run with ``tuning_val.fraction=0.2``
holds out a seeded 20 % of the training set (before the split; the clients train on the rest) and records its metrics
on that hold-out; with ``save_model=true`` it also writes its final global weights. This script evaluates those
weights on the test set too, so the two NLLs come from the same model:

    python scripts/reproduce.py --name valnll experiment=fedlap/table5 profile=paper dataset=fmnist \\
        partition=homo,size_class_dirichlet num_clients=10 tuning_val.fraction=0.2 save_model=true ...
    python scripts/gaps/fedlap_val_vs_test_nll.py outputs/runs/<run id> [...]

It prints, per run, the method, partition and seed, the hold-out NLL and accuracy from the record, and the test NLL
and accuracy of the same weights.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from fedbench.data import load_dataset  # noqa: E402
from fedbench.eval.metrics import evaluate  # noqa: E402
from fedbench.models import build_model  # noqa: E402
from fedbench.run.setup import train_test_data  # noqa: E402


def test_metrics(run_dir: Path, cache: dict) -> dict:
    rec = json.loads((run_dir / "metrics.json").read_text())
    cfg = rec["config"]
    dcfg = cfg["dataset"]
    key = json.dumps(dcfg, sort_keys=True)
    if key not in cache:
        data = load_dataset(dcfg["name"], Path(cfg["paths"]["data_root"]).expanduser(), **(dcfg.get("kwargs") or {}))
        cache[key] = (train_test_data(dcfg, data)[1], data.test_y)
    test, test_y = cache[key]
    blob = torch.load(run_dir / "model.pt", map_location="cpu", weights_only=True)
    model = build_model(blob["model"], input_shape=tuple(blob["input_shape"]), num_classes=int(blob["num_classes"]),
                        **(blob.get("model_kwargs") or {})).eval()
    m = evaluate(model, blob["params"], test.inputs, test_y)
    return {"method": rec["algorithm"].get("name") if isinstance(rec["algorithm"], dict) else rec["algorithm"],
            "partition": cfg["partition"].get("name"), "seed": cfg["seed"],
            "evaluated_on": rec.get("evaluated_on"), "val": rec["metrics"], "test": m}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", type=Path, nargs="+", help="run folders with metrics.json and model.pt")
    a = ap.parse_args(argv)
    missing = [str(r) for r in a.runs if not (r / "metrics.json").is_file() or not (r / "model.pt").is_file()]
    if missing:
        print(f"error: no metrics.json and model.pt in: {', '.join(missing)}", file=sys.stderr)
        return 2
    cache: dict = {}
    print("method | partition | seed | hold-out NLL / acc (record) | test NLL / acc (same weights)")
    for r in a.runs:
        t = test_metrics(r, cache)
        if "tuning_val" not in str(t["evaluated_on"]):
            print(f"error: {r} was evaluated on {t['evaluated_on']!r}, not a tuning_val hold-out", file=sys.stderr)
            return 2
        print(f"{t['method']} | {t['partition']} | {t['seed']} | {t['val']['nll']:.3f} / {t['val']['accuracy']:.2f} | "
              f"{t['test']['nll']:.3f} / {t['test']['accuracy']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
