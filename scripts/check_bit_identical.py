"""Refactoring guard: a fixed set of tiny CPU runs, one per method family, whose every metric must stay
bit-identical across a change.

    python scripts/check_bit_identical.py --save tests/data/bit_identical_baseline.json   # before the change
    python scripts/check_bit_identical.py --compare tests/data/bit_identical_baseline.json   # after it

Prints every metric of every run; ``--compare`` exits 1 on any difference. Timings are left out (they vary);
everything else a record holds about the results (final metrics, summary, every history row, history columns,
split sizes, communication, cache hits, record and timing keys) is compared exactly (floats by ``repr``).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedbench.config.compose import compose_config  # noqa: E402

BASE = ["dataset=synthetic", "dataset.kwargs.like=fmnist", "dataset.kwargs.train_size=240",
        "dataset.kwargs.test_size=80", "model=mlp", "model.hidden=[16]", "num_clients=3", "rounds=1",
        "local.epochs=1", "local.batch_size=32", "hardware=cpu", "hardware.num_threads=1", "progress=false",
        "server_val.size=40"]
TWO_ROUNDS = ["rounds=2"]
UNLABELED = ["server_unlabeled.size=40"]

# name -> extra overrides (each run is a few seconds on one CPU thread)
RUNS = {
    "fedavg": TWO_ROUNDS + ["algorithm=fedavg", "eval.local_accuracy=true"],
    "fedprox": TWO_ROUNDS + ["algorithm=fedprox"],
    "scaffold": TWO_ROUNDS + ["algorithm=scaffold"],
    "fednova": TWO_ROUNDS + ["algorithm=fednova"],
    "feddyn": TWO_ROUNDS + ["algorithm=feddyn"],
    "fedlap": TWO_ROUNDS + ["algorithm=fedlap"],
    "fedlap_cov": TWO_ROUNDS + ["algorithm=fedlap_cov"],
    "fedlap_func": TWO_ROUNDS + ["algorithm=fedlap_func", "algorithm.server_iters=200"],
    "fola": TWO_ROUNDS + ["algorithm=fola"],
    # FOLA as Fig. 5 runs it (the code's squared minibatch gradient, the live prior removed from it, clipping on)
    "fola_code": TWO_ROUNDS + ["algorithm=fola", "algorithm.lambda_prior=100.0", "algorithm.round_scaling=code",
                               "algorithm.fisher.grad=minibatch_sq", "algorithm.fisher.normalize=none",
                               "local.clip_grad_norm=0.5"],
    "fedcurv": TWO_ROUNDS + ["algorithm=fedcurv"],
    "fedlpa": ["algorithm=fedlpa", "algorithm.gd_steps=200"],
    "fedfisher_diag": ["algorithm=fedfisher_diag"],
    "fedfisher_kfac": ["algorithm=fedfisher_kfac"],
    "regmean": ["algorithm=regmean"],
    "fisher_merge": ["algorithm=fisher_merge"],
    "otfusion": ["algorithm=otfusion"],
    "pfnm": ["algorithm=pfnm"],
    "fedbens": ["algorithm=fedbens", "algorithm.members=2", "algorithm.server_steps=20", "algorithm.val_every=10"],
    "dense": ["algorithm=dense", "algorithm.epochs=2", "algorithm.g_steps=2", "algorithm.synthesis_batch_size=16",
              "algorithm.nz=8", "algorithm.ngf=4"],
    "fedbe": UNLABELED + ["algorithm=fedbe", "algorithm.epochs=1", "algorithm.num_samples=2"],
    "fedov": UNLABELED + ["algorithm=fedov", "algorithm.distill_epochs=1", "algorithm.adv_steps=1"],
    "centralized": ["algorithm=centralized"],
    "fedavg_lenet_labelk": ["algorithm=fedavg", "model=lenet", "partition=noniid-label_k", "partition.k=2"],
}
TIMING_COLUMNS = ("client_train_s", "client_train_compute_s", "client_post_s", "client_post_compute_s",
                  "server_s", "eval_s")


def run_all(names) -> dict:
    """Every run of ``names`` in one fresh output folder (the client cache is shared, as in a real sweep)."""
    from fedbench.runner import execute

    out = {}
    with tempfile.TemporaryDirectory(prefix="fedbench-bitcheck-") as tmp:
        os.environ["FEDBENCH_RECORDS"] = str(Path(tmp) / "records")
        for name in names:
            cfg = compose_config(BASE + RUNS[name] + [f"paths.output_root={tmp}/out",
                                                      f"paths.data_root={tmp}/data"])
            rec = execute(cfg, Path(tmp) / "runs" / name, launch_dir=str(ROOT))
            out[name] = summarize_run(rec, Path(tmp) / "runs" / name)
    return out


def summarize_run(rec: dict, run_dir: Path) -> dict:
    """What must not change: everything but wall-clock times, dates and host details."""
    with open(run_dir / "history.csv") as f:
        reader = csv.DictReader(f)
        columns = list(reader.fieldnames or [])
        rows = [{k: v for k, v in row.items() if k not in TIMING_COLUMNS} for row in reader]
    return {"run_id": rec["run_id"], "status": rec["status"], "metrics": _exact(rec["metrics"]),
            "summary": _exact(rec["summary"]), "history": rows, "history_columns": columns,
            "partition": rec["partition"], "num_parameters": rec["model"]["num_parameters"],
            "communication": rec["communication"], "cache_hits": rec["cache"]["hits"],
            "cache_misses": rec["cache"]["misses"], "rounds_completed": rec["rounds_completed"],
            "record_keys": sorted(rec), "timing_keys": sorted(rec["timing"])}


def _exact(value):
    """Floats as ``repr`` strings, so JSON keeps every bit and NaN compares equal to NaN."""
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, dict):
        return {k: _exact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_exact(v) for v in value]
    return value


def differences(base: dict, now: dict, path: str = ""):
    if isinstance(base, dict) and isinstance(now, dict):
        for k in sorted(set(base) | set(now)):
            if k not in now or k not in base:
                yield f"{path}/{k}: {'missing now' if k not in now else 'new'}"
            else:
                yield from differences(base[k], now[k], f"{path}/{k}")
    elif base != now:
        yield f"{path}: {base!r} -> {now!r}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--save", metavar="FILE")
    mode.add_argument("--compare", metavar="FILE")
    ap.add_argument("--only", nargs="*", help="run only these names (compare only them)")
    args = ap.parse_args(argv)
    names = args.only or list(RUNS)
    now = run_all(names)
    for name, run in now.items():
        print(f"{name}: " + " ".join(f"{k}={v}" for k, v in run["metrics"].items()))
    if args.save:
        Path(args.save).parent.mkdir(parents=True, exist_ok=True)
        Path(args.save).write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
        print(f"saved {len(now)} runs to {args.save}")
        return 0
    base = json.loads(Path(args.compare).read_text())
    diffs = [d for name in names for d in differences(base.get(name, {}), now[name], name)]
    for d in diffs:
        print(f"DIFF {d}")
    print(f"compared {len(names)} runs: {'IDENTICAL' if not diffs else f'{len(diffs)} difference(s)'}")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
