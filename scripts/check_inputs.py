#!/usr/bin/env python
"""Run every invalid invocation of run.py and the scripts that fedbench must reject, and print a Markdown table:
case, exit status, seconds, whether torch was imported, stderr line count (each must be: 2, 1 line
`fedbench: error: ...`, nothing written, and no torch import except for a method's own options, which the methods
check after importing torch).

    python scripts/check_inputs.py            # all cases
    python scripts/check_inputs.py -k device  # cases whose text contains 'device'

Every case runs in a fresh temporary directory with FEDBENCH_OUTPUTS pointing into it and no CUDA device
visible, so the table is the same on any machine; a case "wrote" files if anything appeared under outputs/.
tests/test_validation.py runs the same cases.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]

# (script, arguments); {file} = an existing regular file
RUN_CASES: List[str] = [
    # issue 15: tracebacks
    "local.lr=abc", "local.batch_size=abc", "local.epochs=1.5", "eval.thresholds=notalist", "eval.ece_bins=0",
    "eval.batch_size=0", "algorithm=fedprox algorithm.mu=abc", "paths.data_root={file}",
    # issue 15: Hydra's multi-line errors
    "foo=1", "local.foo=1", "local.lr=[1,2", "seed={a:", "num_clients='5", "bare", "model.pretrained=/nonexistent.pt",
    # issue 15: silently accepted
    "profile=nonexistent", "experiment=fedlpa/table6 profile=nonexistent", "hardware.device=cuda",
    "hardware.device=cuda:3", "hardware.device=tpu", "hardware.backend=foo", "hardware.num_threads=0",
    # same families
    "experiment=nonexistent", "dataset=foo", "model=foo", "algorithm=foo", "partition=foo", "hardware=tpu",
    "logger=foo", "local=x", "seed=-1", "seed=abc", "seed=1.5", "num_clients=0", "num_clients=abc", "rounds=0",
    "rounds=true", "local.optimizer=rmsprop", "local.lr=0", "local.lr=-0.1", "local.lr=inf", "local.momentum=1.0",
    "local.weight_decay=-1", "local.epochs=-1", "local.clip_grad_norm=0", "local.batch_size=0",
    "+local.nesterov=true local.momentum=0", "eval.every=0", "eval.last_k=0", "eval.local_accuracy=maybe",
    "eval.thresholds=[101]", "server_val.size=-1", "server_val.mode=foo", "server_val.seed=abc",
    "server_unlabeled.mode=foo", "server_unlabeled.size=1.5", "hardware.device=cuda:x", "hardware.device=''",
    "hardware.conv_strategy=foo", "hardware.num_threads=abc", "hardware.jobs=0", "hardware.jobs=abc",
    "paths.output_root={file}",
    "paths.data_root={file}/sub", "+algorithm.foo=1", "algorithm=fedlpa algorithm.solver=1",
    "algorithm=fedlpa algorithm.damping=abc", "algorithm=fedbens algorithm.fisher=true",
    "aggregators=[fedavg,nonexistent]", "aggregators=[{name:fedprox,mu:abc}]",
    "aggregators=[{name:fedprox,muu:0.1}]", "aggregators=notalist", "dataset.normalize=maybe",
    "partition.beta=abc", "dataset.foo=1", "model.pretrained=123", "tags=notalist", "cache=maybe",
    "force=maybe", "seed=0,1", "-m seed=0,abc", "experiment=fedlpa/table6 profile=quick local.lr=abc",
    "local.lr=${oc.env:FEDBENCH_UNSET_VARIABLE}", "=3", "local.lr", "~seed",
]
# the methods' own option rules (choices and ranges of their Options dataclasses, which live beside their torch code):
# run.py checks them after the torch-free pass and before Hydra makes the run directory, so these cases import torch
METHOD_CASES: List[Tuple[str, str]] = [("run.py", a) for a in (
    "algorithm=fedlpa algorithm.gd_step=foo", "algorithm=fedprox algorithm.mu=-1",
    "aggregators=[fedavg,{name:fedlpa,posterior_term:foo}]", "-m seed=0,1 algorithm=fedlap algorithm.init=foo")] + [
    ("scripts/reproduce.py", "experiment=fedlap/table1 profile=quick aggregators=[{name:fedlap,init:foo}]")]
SCRIPT_CASES: List[Tuple[str, str]] = [
    ("scripts/reproduce.py", "experiment=nonexistent"), ("scripts/submit.py", "dataset=foo --dry-run"),
    ("scripts/collect.py", "experiment=nonexistent"), ("scripts/plot.py", "experiment=nonexistent"),
    ("scripts/submit.py", "local.lr=abc --dry-run"), ("scripts/submit.py", "profile=quick --dry-run"),
    ("scripts/reproduce.py", "experiment=fedlpa/table6 profile=nonexistent"),
    ("scripts/reproduce.py", "experiment=fedlpa/table6 local.lr=[1,2"),
]
CASES: List[Tuple[str, str]] = [("run.py", a) for a in RUN_CASES] + METHOD_CASES + SCRIPT_CASES


def run_case(script: str, args: str, workdir: Path) -> Dict:
    """Run one case in ``workdir`` (arguments split on spaces, no shell quoting); returns rc, seconds, stderr
    lines and the files written under outputs/."""
    workdir.mkdir(parents=True, exist_ok=True)
    afile = workdir / "a_file"
    afile.write_text("not a directory\n")
    outputs = workdir / "outputs"
    env = {**os.environ, "FEDBENCH_OUTPUTS": str(outputs), "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("FEDBENCH_UNSET_VARIABLE", None)
    path = str(ROOT / script)
    # the script runs as `python <script> ...` would (its folder first on sys.path, run as __main__); at exit the
    # probe file says whether torch was imported (a rejection should not need it: heavy, seconds on a busy machine)
    probe = workdir / "torch_imported"
    code = (f"import atexit, runpy, sys\n"
            f"atexit.register(lambda: open({str(probe)!r}, 'w').write(str('torch' in sys.modules)))\n"
            f"sys.argv = [{path!r}, *{args.replace('{file}', str(afile)).split()!r}]\n"
            f"sys.path.insert(0, {str(Path(path).parent)!r})\n"
            f"runpy.run_path({path!r}, run_name='__main__')\n")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=300)
    seconds = time.perf_counter() - t0
    written = sorted(str(p.relative_to(outputs)) for p in outputs.rglob("*")) if outputs.exists() else []
    torch_imported = probe.read_text() == "True" if probe.is_file() else None
    return {"rc": proc.returncode, "seconds": seconds, "stderr": proc.stderr.splitlines(), "written": written,
            "torch": torch_imported}


def markdown(rows) -> str:
    out = ["| # | case | exit | seconds | torch | stderr lines | wrote | stderr |",
           "|---|---|---|---|---|---|---|---|"]
    for i, ((script, args), r) in enumerate(rows, 1):
        first = r["stderr"][0] if r["stderr"] else ""
        out.append(f"| {i} | `{script} {args}` | {r['rc']} | {r['seconds']:.2f} | {r['torch']} | {len(r['stderr'])} | "
                   f"{len(r['written'])} | {first.replace('|', '/')[:150]} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-k", default="", help="only cases containing this text")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, case in enumerate(c for c in CASES if args.k in " ".join(c)):
            rows.append((case, run_case(*case, Path(tmp) / f"case{i}")))
    print(markdown(rows))
    ok = all(r["rc"] == 2 and len(r["stderr"]) == 1 and r["stderr"][0].startswith("fedbench: error:")
             and not r["written"] and (case in METHOD_CASES or r["torch"] is False) for case, r in rows)
    print(f"\n{len(rows)} case(s); {'all' if ok else 'NOT all'} rejected in one line with exit status 2, nothing "
          f"written and, but for a method's own options, no torch import; slowest "
          f"{max((r['seconds'] for _, r in rows), default=0):.2f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
