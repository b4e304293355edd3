"""FedFisher Table 6 (GMI attack): evaluator and attack variants on a finished study run, without retraining its
clients or GAN (results/gaps.md#fedfisher-table6). Reads the run's record (metrics.json: its config and attack
accuracies) and attack_inputs.pt (GAN, the three targets, client 1's K-FAC, every reconstruction; written by
runs from session 20 on; of older runs only the Fig. 4 grid, reconstructions.pt, can be relabelled).

    PYTHONPATH=$PWD .venv/bin/python scripts/gaps/fedfisher_table6_attack.py outputs/runs/<id> \
        --evaluators mlp simple_cnn                       # relabel the run's own reconstructions
    ... --attack lambda_kfac=1e-5 --cases aggregate_plus_client1_kfac   # a new attack with the saved GAN

The study's MLP evaluator is retrained with the run's seed, so its row must reproduce the recorded accuracy (the
script says so when it does not). Prints one row per (case, evaluator); --csv writes them.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from fedbench.errors import FedbenchError
from fedbench.papers.fedfisher import gmi_attack as g

ATTACK_KEYS = ("attack_steps", "attack_lr", "attack_momentum", "lambda_id", "lambda_kfac", "num_reconstructions")


def parse_overrides(items):
    out = {}
    for it in items or []:
        key, sep, val = it.partition("=")
        if not sep or key not in ATTACK_KEYS:
            raise FedbenchError(f"--attack takes key=value with key one of {', '.join(ATTACK_KEYS)}, got {it!r}")
        try:
            out[key] = int(val) if key in ("attack_steps", "num_reconstructions") else float(val)
        except ValueError:
            raise FedbenchError(f"--attack {key} needs a number, got {val!r}") from None
    return out


def load_run(run_dir: Path, need_gan: bool):
    """(record, attack inputs, whether the reconstructions are all of them). Runs before session 20 kept only the
    Fig. 4 grid (reconstructions.pt, the first grid_per_case of each case): relabelling those is allowed, a new
    attack is not."""
    rec_path, inp_path, grid_path = (run_dir / f for f in ("metrics.json", "attack_inputs.pt", "reconstructions.pt"))
    if not rec_path.exists():
        raise FedbenchError(f"{rec_path} is missing")
    rec = json.loads(rec_path.read_text())
    if rec.get("study") != "gmi_attack":
        raise FedbenchError(f"{rec_path} is not a GMI study record")
    if inp_path.exists():
        return rec, torch.load(inp_path, map_location="cpu", weights_only=False), True
    if grid_path.exists() and not need_gan:
        return rec, {"reconstructions": torch.load(grid_path, map_location="cpu", weights_only=False)}, False
    raise FedbenchError(f"{inp_path} is missing (written by study runs from session 20 on; older runs keep only the "
                        f"Fig. 4 grid, which can be relabelled but not attacked again)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dirs", nargs="+", type=Path)
    ap.add_argument("--evaluators", nargs="+", default=["mlp", "simple_cnn"],
                    help="fedbench model names; mlp = the study's own evaluator")
    ap.add_argument("--attack", nargs="*", help=f"rerun the attack with these study values ({', '.join(ATTACK_KEYS)})")
    ap.add_argument("--cases", nargs="+", choices=g.CASES, default=list(g.CASES))
    ap.add_argument("--csv", type=Path)
    args = ap.parse_args(argv)
    try:
        overrides = parse_overrides(args.attack) if args.attack is not None else None
        loaded = [(d, *load_run(d, need_gan=overrides is not None)) for d in args.run_dirs]
    except FedbenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = []
    for run_dir, rec, inp, complete in loaded:
        cfg = OmegaConf.create(rec["config"])
        cfg.progress = False
        st = g.study_settings(cfg)
        seed, label = int(cfg.seed), int(st["target_label"])
        data, _, setup, _ = g._setup(cfg, None)
        images = inp["reconstructions"]
        if overrides is not None:
            st = {**st, **overrides}
            G = g.Generator(inp["z_dim"], inp["gan_width"]).to(setup.device)
            D = g.Critic(inp["gan_width"]).to(setup.device)
            G.load_state_dict(inp["generator"])
            D.load_state_dict(inp["critic"])
            for p in list(G.parameters()) + list(D.parameters()):
                p.requires_grad_(False)
            G.eval()
            D.eval()
            tg = {"models": inp["targets"], "kfac1": inp["kfac1"], "conv": inp["conv"]}
            images = {}
            for case in args.cases:
                images[case] = g.attack(case, st, setup, tg, G, D, seed)[1]["images"]
        for arch in args.evaluators:
            evaluator, test_acc = g._evaluator(st, setup, data, seed, arch=arch)
            for case in args.cases:
                pred = g.predict(evaluator, setup.train.normalize(images[case].to(setup.device))).cpu().numpy()
                acc = 100.0 * float((pred == label).mean())
                recorded = rec["metrics"].get(f"attack_accuracy_{case}") if overrides is None else None
                if not complete:   # the grid's first images only: the record's accuracy is over all of them
                    recorded = None
                rows.append({"run": run_dir.name, "seed": seed, "case": case, "evaluator": arch,
                             "evaluator_test_acc": round(test_acc, 2), "attack": json.dumps(overrides or {}),
                             "n": len(pred), "attack_accuracy": round(acc, 2),
                             "recorded": None if recorded is None else round(recorded, 2),
                             "label_counts": np.bincount(pred, minlength=int(data.num_classes)).tolist()})
                r = rows[-1]
                note = "" if complete else "  (the Fig. 4 grid only)"
                # the study's float32 mean can differ from this float64 one in the 6th digit; one image is 1 %
                if arch == "mlp" and recorded is not None and abs(acc - recorded) > 1e-3:
                    note = "  (differs from the record: not the study's evaluator)"
                print(f"{r['run']} seed {seed} {case:28s} {arch:10s} (test {test_acc:.2f}): attack accuracy "
                      f"{acc:6.2f} of {len(pred)}, labels {r['label_counts']}{note}", flush=True)
    if args.csv:
        import pandas as pd

        pd.DataFrame(rows).to_csv(args.csv, index=False)
        print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
