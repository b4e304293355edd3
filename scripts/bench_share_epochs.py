"""Time a one-round sweep over local.epochs with and without ``share_epochs`` (FOLA Figs. 3-4's setting).

FOLA Fig. 3 runs every (alpha, N, lr, B, seed) at E = 1, 5, 10, 15, 20 with FedAvg, FOLA aggregation-only and
FOLA-offline on the same round-1 clients. Without sharing each E trains its clients from scratch (51 epochs per
setting and stage); with ``share_epochs`` the first run trains max(E) epochs once and caches the stage after every
listed E, and the other runs load it. Both ways give the same records (the script checks the accuracies).

Each E is one ``run.py experiment=fola/figure3`` process (the three aggregators, one thread), in fresh output
directories; the ratio is the plain sweep's CPU time (its processes' user + system seconds, so other load on the
machine does not move it) over the shared one's; wall times beside.

    python scripts/bench_share_epochs.py [--epochs 1,2,3,4,5] [--fraction 0.1] [--clients 5] [--batch-size 32]
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def sweep(epochs, share, out, args):
    """Run the sweep's E values in order; (wall seconds, CPU seconds, {run id: accuracy})."""
    env = {**os.environ, "FEDBENCH_OUTPUTS": str(out)}
    t0, cpu0 = time.perf_counter(), _children_cpu()
    for e in epochs:
        cmd = [sys.executable, "run.py", "experiment=fola/figure3", f"local.epochs={e}",
               f"partition.data_fraction={args.fraction}", f"num_clients={args.clients}",
               f"local.batch_size={args.batch_size}", "local.lr=0.1", "partition.alpha=1",
               f"share_epochs=[{','.join(map(str, epochs)) if share else ''}]",
               "hardware=cpu", "hardware.num_threads=1", "progress=false"]
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"run failed:\n{p.stderr[-2000:]}")
    wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    acc = {}
    for path in Path(out, "runs").glob("*/metrics.json"):
        rec = json.loads(path.read_text())
        acc[rec["run_id"]] = rec["metrics"]["accuracy"]   # share_epochs is not part of the run id
    return wall, cpu, acc


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", default="1,2,3,4,5")
    ap.add_argument("--fraction", type=float, default=0.1, help="partition.data_fraction (MNIST share)")
    ap.add_argument("--clients", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=32)
    args = ap.parse_args()
    epochs = [int(e) for e in args.epochs.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        plain_wall, plain_cpu, plain = sweep(epochs, False, Path(tmp, "plain"), args)
        shared_wall, shared_cpu, shared = sweep(epochs, True, Path(tmp, "shared"), args)
    print(f"E = {epochs}: {sum(epochs)} client epochs per stage without sharing, {max(epochs)} with")
    print(f"plain {plain_cpu:.1f} CPU s ({plain_wall:.1f} s wall), shared {shared_cpu:.1f} CPU s ({shared_wall:.1f} s "
          f"wall), ratio {plain_cpu / shared_cpu:.2f}x; same accuracies: {plain == shared} ({len(plain)} records)")


if __name__ == "__main__":
    main()
