"""Park the unfinished runs' round checkpoints in the committed store, so that a session ending on this machine can
go on from them on a fresh one (fedbench/fl/resume.py).

Copies ``<outputs>/runs/<run_id>/resume.pt`` to ``results/checkpoints/<run_id>.pt`` (``$FEDBENCH_CHECKPOINTS``) and
removes the parked files of runs that have finished since (an ok record in ``<outputs>/runs`` or in the committed
record store). Commit results/checkpoints/ afterwards; a run that finds no resume file of its own starts from its
parked one. A one-round run's long client stage is parked too: the clients it finished so far
(``<outputs>/cache/clients/*/<key>.clients/``) go to ``results/checkpoints/stages/<key>/``, where the stage's
next training takes them from (fedbench/fl/cache.py ``ClientProgress``); a stage whose cache entry exists here is
removed from there. So is a finished cache entry (a stage's clients, a client's curvature) that a run without its
record used (a one-shot run killed in its server solves): ``results/checkpoints/stages/<key>.pt``, with the run ids
that need it, loaded from there on a fresh machine and removed once they all have their records.

    python scripts/park_checkpoints.py [--outputs outputs]       (bash scripts/campaign.sh --park)
"""
import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fedbench.fl.cache import park_stages  # noqa: E402
from fedbench.fl.resume import park_checkpoints, parked_store  # noqa: E402
from fedbench.results.records import is_complete, records_dir  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--outputs", default=os.environ.get("FEDBENCH_OUTPUTS", "outputs"))
    ap.add_argument("--cache", default=None, help="the client-stage cache (default <outputs>/cache/clients)")
    args = ap.parse_args()
    out = Path(args.outputs)
    store = parked_store()
    candidates = {p.parent.name for p in out.glob("runs/*/resume.pt")} | {p.stem for p in store.glob("*.pt")}

    def has_record(r: str) -> bool:
        return is_complete(out / "runs" / r / "metrics.json", r) or is_complete(records_dir() / r / "metrics.json", r)

    finished = {r for r in candidates if has_record(r)}
    done = park_checkpoints(out, store, finished)
    for key in ("parked", "kept", "removed"):
        print(f"{key}: {', '.join(done[key]) or 'none'}")
    stages = park_stages(Path(args.cache) if args.cache else out / "cache" / "clients", store, has_record)
    print(f"stages parked: {', '.join(stages['parked']) or 'none'}; finished entries parked for unfinished runs: "
          f"{', '.join(stages['entries']) or 'none'}; removed (finished): {', '.join(stages['removed']) or 'none'}")
    print(f"store: {store} ({len(list(store.glob('*.pt'))) if store.is_dir() else 0} parked run(s)); commit it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
