"""FLamby-Heart per-hospital test accuracy of saved final models (results/gaps.md#fedlap-table1, "FLamby-Heart rows"):
does the mean over the four hospitals (FLamby's usual metric) instead of fedbench's pooled accuracy explain the gap?

    FEDBENCH_OUTPUTS=/tmp/heart/out python run.py experiment=fedlap/table1 dataset=flamby_heart partition=natural \\
        num_clients=4 rounds=20 local.batch_size=4 local.epochs=5 hp.delta=1.0 hp.prox=1.0 hp.dyn_alpha=0.1 \\
        hp.dyn_wd=1.0e-3 'aggregators=[fedavg,{name:fedprox,...},...]' seed=0 save_model=true hardware=cpu
    PYTHONPATH=$PWD python scripts/gaps/heart_per_hospital.py /tmp/heart/out/runs

Prints, per run folder with a model.pt: the pooled test accuracy (recomputed; equals the record's), each hospital's,
and their unweighted mean."""
import json
import sys
from pathlib import Path

import torch

from fedbench.data import default_mirror, load_dataset
from fedbench.models import build_model

HOSPITALS = ("Cleveland", "Hungary", "Switzerland", "Long Beach")
ds = load_dataset("flamby_heart", "data", mirror=default_mirror())
x, y, g = torch.as_tensor(ds.test_x).float(), torch.as_tensor(ds.test_y).long(), torch.as_tensor(ds.test_groups)
print("test rows per hospital:", dict(zip(HOSPITALS, torch.bincount(g).tolist())))
for weights in sorted(Path(sys.argv[1]).glob("*/model.pt")):
    rec = json.loads((weights.parent / "metrics.json").read_text())
    model = build_model(rec["config"]["model"]["name"], input_shape=tuple(ds.input_shape), num_classes=ds.num_classes)
    model.load_state_dict(torch.load(weights, map_location="cpu")["params"])
    model.eval()
    with torch.no_grad():
        out = model(x)
    pred = (out.squeeze(-1) > 0).long() if out.shape[-1] == 1 else out.argmax(-1)
    hit = (pred == y).float()
    per = [100 * hit[g == c].mean().item() for c in range(len(HOSPITALS))]
    print(f"{rec['algorithm']:11s} pooled {100 * hit.mean().item():.2f} (record {rec['metrics']['accuracy']:.2f}); "
          + ", ".join(f"{h} {p:.1f}" for h, p in zip(HOSPITALS, per)) + f"; mean of hospitals {sum(per) / len(per):.2f}")
