"""How often one NIID-Bench `noniid-labeldir` draw gives every client its minimum number of samples
(results/gaps.md#fedlpa-table2). NIID-Bench redraws the whole split until it does, with no limit, so a setting whose
odds are nil never finishes in the released code; fedbench stops after `partition.max_retries` draws.

Client sizes depend only on the Dirichlet draws and NIID-Bench's balance rule (a client holding N / K samples gets no
more), not on which indices are shuffled where, so this estimate draws the proportions alone (fast) from
numpy's legacy RandomState, as the released code does, and counts the draws in which every client reaches the
minimum:

    python scripts/gaps/niid_min_size_odds.py --clients 20 --beta 0.01 --draws 100000   # FedLPA Table 2's row
    python scripts/gaps/niid_min_size_odds.py --clients 50 --beta 0.01 --draws 100000

Defaults: 10 classes of 6,000 samples (Fashion-MNIST and nearly MNIST's training set), minimum 10 (NIID-Bench's
min_require_size).
"""
from __future__ import annotations

import argparse
import sys
from typing import Dict

import numpy as np


def client_sizes(rs: np.random.RandomState, clients: int, beta: float, per_class: int, classes: int) -> np.ndarray:
    """One draw's client sizes: per class a Dirichlet share, zeroed for clients at the N / K cap, renormalised, and
    cut at int(cumsum(p) * n_c) as NIID-Bench cuts the class's indices."""
    sizes = np.zeros(clients, dtype=np.int64)
    cap = per_class * classes / clients
    for _ in range(classes):
        p = rs.dirichlet(np.repeat(beta, clients)) * (sizes < cap)
        total = p.sum()
        if not total > 0:          # every client at the cap (or 0/0): NIID-Bench's cut would be garbage; not a success
            return np.zeros(clients, dtype=np.int64)
        cuts = (np.cumsum(p / total) * per_class).astype(int)[:-1]
        sizes += np.diff(np.concatenate([[0], cuts, [per_class]]))
    return sizes


def odds(clients: int, beta: float, draws: int, *, per_class: int = 6000, classes: int = 10, min_size: int = 10,
         seed: int = 0) -> Dict[str, float]:
    """Successes among ``draws`` draws, and the clients below ``min_size`` in the median and the best draw."""
    if clients < 1 or draws < 1 or per_class < 1 or classes < 1 or min_size < 0 or not beta > 0:
        raise ValueError("clients, draws, per_class and classes must be positive, min_size >= 0 and beta > 0")
    rs = np.random.RandomState(seed)
    short = np.empty(draws, dtype=np.int64)
    for i in range(draws):
        short[i] = int((client_sizes(rs, clients, beta, per_class, classes) < min_size).sum())
    ok = int((short == 0).sum())
    return {"draws": draws, "successes": ok, "rate": ok / draws, "median_short": float(np.median(short)),
            "fewest_short": int(short.min())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, required=True)
    ap.add_argument("--beta", type=float, required=True)
    ap.add_argument("--draws", type=int, default=100000)
    ap.add_argument("--per-class", type=int, default=6000)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--min-size", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    try:
        r = odds(a.clients, a.beta, a.draws, per_class=a.per_class, classes=a.classes, min_size=a.min_size,
                 seed=a.seed)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    every = f"about one draw in {1 / r['rate']:,.0f}" if r["successes"] else "none: the redraw loop would not end"
    print(f"{a.clients} clients, beta = {a.beta:g}, {a.classes} classes x {a.per_class} samples, minimum {a.min_size}: "
          f"{r['successes']} of {r['draws']:,} draws give every client the minimum ({every}); clients short of it: "
          f"median {r['median_short']:g}, fewest {r['fewest_short']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
