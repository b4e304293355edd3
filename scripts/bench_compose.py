#!/usr/bin/env python
"""Composition speed: Hydra composes with its own file loaders, with fedbench.config.file_cache, and with the
shared base composition as well (compose_config's default).

    python scripts/bench_compose.py                 # the runs of FedLap Table 1 and FedLPA Table 6, 3 rounds each
    python scripts/bench_compose.py --presets fedbens/table1 --rounds 5

Tables, the scoreboard, sweep planning and many tests compose hundreds of runs in one process. Hydra reads and
parses every config file again on each compose; the cache keeps each parsed file and hands Hydra a copy. Runs
that differ only in values (seed, partition.spec) share one base composition of their group choices, to which
Hydra's own override step applies the values; each round starts with no base composed, as a fresh process does.
The variants compose the same runs in the same process, alternating round by round, timed in CPU seconds
(``time.process_time``), and must give identical configs. Prints CPU seconds per compose and the ratio; never a
pass/fail. Other work on the machine skews wall time more than CPU time, but still: compare on the same machine.

``--plan``: a sweep plan (``fedbench.launch.sweep.plan``, what ``scripts/reproduce.py`` and ``campaign.sh`` do before
training: compose every run with its hydra node, validate it, find its aggregators' records) of the first ``--runs``
runs of ``--plan-preset`` (default FOLA Fig. 3's reduced grid), the plain way (Hydra's full composition for every
run, every aggregator expanded into a full config copy, every group YAML parsed again) against fedbench's (the shared
base with its hydra node, one working copy for the aggregators' run ids, the parsed YAMLs kept); the same to-do and
done lists checked.

    python scripts/bench_compose.py --plan [--runs 150] [--plan-preset fola/figure3 --profile reduced]
"""
from __future__ import annotations

import argparse
import time

from omegaconf import OmegaConf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["fedlap/table1", "fedlpa/table6"])
    ap.add_argument("--runs", type=int, default=40, help="runs per preset (the first N of its paper profile)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--plan", action="store_true", help="time a sweep plan instead (see the docstring)")
    ap.add_argument("--plan-preset", default="fola/figure3")
    ap.add_argument("--profile", default="reduced")
    args = ap.parse_args()
    if args.plan:
        return bench_plan(args)

    from fedbench.config import compose as composing
    from fedbench.config.compose import compose_config
    from fedbench.config.file_cache import cached_sources
    from fedbench.launch.sweep import expand_sweep

    runs = [r for p in args.presets for r in expand_sweep([f"experiment={p}", "profile=paper"])[:args.runs]]
    compose_config(runs[0])   # installs the cache, imports Hydra's plugins
    cached = {c: c.load_config for c in cached_sources()}
    plain = {c: c.load_config.__wrapped__ for c in cached}

    shared_base = composing._from_shared_base

    def timed(loaders, share: bool):
        for cls, fn in loaders.items():
            cls.load_config = fn
        composing._from_shared_base = shared_base if share else (lambda *a: None)
        composing._BASES.clear()
        t = time.process_time()
        out = [OmegaConf.to_yaml(compose_config(r), resolve=False) for r in runs]
        return time.process_time() - t, out

    variants = (("hydra", plain, False), ("cached", cached, False), ("shared", cached, True))
    secs = {name: [] for name, _, _ in variants}
    for _ in range(args.rounds):
        for name, loaders, share in variants:
            s, out = timed(loaders, share)
            secs[name].append(s)
            if name == "hydra":
                reference = out
            elif out != reference:
                raise SystemExit(f"the {name} compositions differ from Hydra's own")
    composing._from_shared_base = shared_base
    per = {k: min(v) / len(runs) for k, v in secs.items()}
    print(f"{len(runs)} runs of {', '.join(args.presets)}, best of {args.rounds} rounds, CPU s per compose:")
    print(f"  hydra's loaders          {per['hydra']:.3f}")
    print(f"  file_cache               {per['cached']:.3f}")
    print(f"  file_cache + shared base {per['shared']:.3f}")
    print(f"  ratios: hydra / file_cache {per['hydra'] / per['cached']:.2f}x, file_cache / shared base "
          f"{per['cached'] / per['shared']:.2f}x, hydra / shared base {per['hydra'] / per['shared']:.2f}x "
          f"(identical configs)")


def bench_plan(args) -> None:
    from omegaconf import OmegaConf as OC

    from fedbench.config import compose as composing, file_cache
    from fedbench.config.aggregators import expand_aggregators
    from fedbench.launch import sweep
    from fedbench.results.records import compute_run_id

    shared_base, run_ids, load_yaml = composing._from_shared_base, sweep.aggregator_run_ids, file_cache.load_yaml
    runs = sweep.expand_sweep([f"experiment={args.plan_preset}", f"profile={args.profile}"])[:args.runs]
    sweep.expand_sweep = lambda overrides: runs   # plan these runs only

    def plain(on: bool):
        composing._from_shared_base = (lambda o, c, h=False: None if h else shared_base(o, c)) if on else shared_base
        sweep.aggregator_run_ids = (lambda cfg, cd: [compute_run_id(x) for x in expand_aggregators(cfg, cd)]) \
            if on else run_ids
        file_cache.load_yaml = OC.load if on else load_yaml
        composing._BASES.clear()
        file_cache._YAML.clear()

    secs, plans = {"plain": [], "fedbench": []}, {}
    for _ in range(args.rounds):
        for name in secs:
            plain(name == "plain")
            t = time.process_time()
            plans[name] = sweep.plan([], ".")
            secs[name].append(time.process_time() - t)
    plain(False)
    if plans["plain"] != plans["fedbench"]:
        raise SystemExit("the two plans differ")
    best = {k: min(v) for k, v in secs.items()}
    todo, done = plans["fedbench"]
    print(f"sweep plan of {len(runs)} runs of {args.plan_preset} ({args.profile}; {len(todo)} to do, "
          f"{len(done)} done), "
          f"best of {args.rounds}, CPU s: plain {best['plain']:.1f} ({best['plain'] / len(runs) * 1e3:.0f} ms a run), "
          f"fedbench {best['fedbench']:.1f} ({best['fedbench'] / len(runs) * 1e3:.0f} ms a run), "
          f"ratio {best['plain'] / best['fedbench']:.2f}x (same plan)")


if __name__ == "__main__":
    main()
