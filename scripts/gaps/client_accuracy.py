"""Each trained client's own test accuracy, read from the client-stage cache of finished fedbench runs, beside the
released FedLPA code's clients on the same split (results/gaps.md#fedlpa-table9).

A one-shot run's record keeps the global model's accuracy only. Its trained clients stay in the client-stage cache
(``outputs/cache``) of the machine that ran it, so a client stage can be inspected without training it again:

    FEDBENCH_OUTPUTS=/work/campaign/outputs PYTHONPATH=$PWD python scripts/gaps/client_accuracy.py \\
        --seeds 2 3 --released /work/released_lpa /work/hold/t9dump/*.pt -- \\
        experiment=fedlpa/table9 profile=paper dataset=fmnist "partition.spec='beta=0.3'" partition.fixed_seed=0

prints, per training draw (fedbench seed or released dump), every client's size and test accuracy and the
size-weighted mean of them, clients in fedbench's order (a released dump's clients are matched by size). A seed whose
stage is not cached is reported and skipped (its run was made on another machine, or with ``cache=false``).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import List, Optional

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def fedbench_clients(overrides: List[str], seed: int):
    """(client sizes, test accuracies of the cached trained clients or None) of one fedbench seed."""
    from fedbench.algorithms import build_algorithm
    from fedbench.config.compose import compose_config
    from fedbench.eval.metrics import evaluate
    from fedbench.run.setup import build_setup, config_group
    cfg = compose_config(list(overrides) + [f"seed={seed}", "hardware=cpu", "hardware.num_threads=1"])
    run = build_setup(cfg)
    fl = run.fl
    algo = build_algorithm(config_group(cfg, "algorithm"), fl)
    stage = {**fl.stage_parts, "round": 1, "local_objective": algo.client_stage_key(1)}
    payload = fl.cache.load({**stage, "product": "local_training"})
    if payload is None:
        return run.client_sizes, None
    accs = [evaluate(fl.model, p, fl.test_inputs, fl.test_y, task=fl.task, batch_size=fl.eval_batch_size)["accuracy"]
            for p in payload["params"]]
    return run.client_sizes, accs


def released_clients(dump_path: Path, sizes: List[int], test) -> Optional[List[float]]:
    """Test accuracies of a released dump's clients, in fedbench's client order (matched by size)."""
    from fedlpa_cross_server import accuracy
    dump = torch.load(dump_path, map_location="cpu", weights_only=False)
    n = sum(sizes)
    theirs = [round(p * n) for p in dump["p"]]
    if sorted(theirs) != sorted(sizes) or len(set(sizes)) != len(sizes):
        print(f"{dump_path.name}: its client sizes {theirs} do not match fedbench's split {sizes} one to one; skipped")
        return None
    accs = [accuracy(dump["model"], sd, test) for sd in dump["clients"]]
    return [accs[theirs.index(s)] for s in sizes]


def row(name: str, sizes: List[int], accs: List[float]) -> str:
    mean = sum(a * n for a, n in zip(accs, sizes)) / sum(sizes)
    return f"| {name} | " + " | ".join(f"{a:.2f}" for a in accs) + f" | {mean:.2f} |"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", required=True, help="fedbench training draws (run seeds)")
    ap.add_argument("--released", type=Path, nargs="+", metavar=("CHECKOUT", "DUMP"),
                    help="the released FedLPA checkout, then dumps of fedlpa_released_baseline.sh (DUMP=) on the split")
    ap.add_argument("overrides", nargs="+", help="the fedbench run's overrides without seed (after --)")
    a = ap.parse_args(argv)
    checkout, dumps = (a.released[0], a.released[1:]) if a.released else (None, [])
    if checkout is not None and not (checkout / "experiments_our.py").is_file():
        print(f"error: {checkout} has no experiments_our.py (not FedLPA's released code)", file=sys.stderr)
        return 2
    missing = [str(d) for d in dumps if not d.is_file()]
    if missing:
        print(f"error: no such dump: {', '.join(missing)}", file=sys.stderr)
        return 2
    from fedbench.errors import FedbenchError
    torch.set_num_threads(1)
    rows, sizes, per_client = [], None, []
    for seed in a.seeds:
        try:
            sizes, accs = fedbench_clients(a.overrides, seed)
        except FedbenchError as e:   # an unknown name or invalid value in the overrides
            print(f"error: {e}", file=sys.stderr)
            return 2
        if accs is None:
            print(f"seed {seed}: its client stage is not in the cache (run it here first); skipped")
            continue
        rows.append(row(f"fedbench seed {seed}", sizes, accs))
        per_client.append(("fedbench", accs))
    if dumps:
        sys.path.insert(0, str(checkout.resolve()))
        from fedlpa_cross_server import load_test
        dataset = next((o.split("=", 1)[1] for o in a.overrides if o.startswith("dataset=")), "mnist")
        test = load_test(checkout, dataset)
        for d in dumps:
            accs = released_clients(d, sizes, test)
            if accs is not None:
                rows.append(row(f"released {d.stem}", sizes, accs))
                per_client.append(("released", accs))
    if not rows:
        return 1
    print("| draw | " + " | ".join(f"client {k} (n = {n})" for k, n in enumerate(sizes)) + " | size-weighted mean |")
    print("|---" * (len(sizes) + 2) + "|")
    print("\n".join(rows))
    for who in ("fedbench", "released"):
        draws = [acc for w, acc in per_client if w == who]
        if len(draws) >= 2:
            spread = [statistics.stdev(col) for col in zip(*draws)]
            print(f"{who}: per-client std over {len(draws)} draws: " + " / ".join(f"{s:.2f}" for s in spread))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
