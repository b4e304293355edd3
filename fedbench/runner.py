"""Run one composed config end to end and write its record. ``run.py`` is a thin Hydra wrapper."""
from __future__ import annotations

import datetime as _dt
import math
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from omegaconf import DictConfig, OmegaConf

import fedbench
from fedbench import numerics
from fedbench.algorithms import ALGORITHMS, build_algorithm
from fedbench.algorithms.options import read_options
from fedbench.config.aggregators import expand_runs
from fedbench.config.paths import absolute_path
from fedbench.config.validate import validate_config
from fedbench.curvature.compute import curvature_seconds
from fedbench.data import DATASETS
from fedbench.errors import FedbenchError
from fedbench.fl.loop import run_rounds
from fedbench.fl.resume import RoundCheckpoint
from fedbench.models import MODELS, count_parameters
from fedbench.partition import PARTITIONS
from fedbench.results.claims import ClaimHeld, claim
from fedbench.results.loggers import make_logger
from fedbench.results.records import (atomic_write_bytes, compute_run_id, identity_config, is_complete, read_record,
                                      records_dir, write_csv_atomic, write_json_atomic, write_torch_atomic)
from fedbench.results.schema import HISTORY_COLUMNS, RoundLog, final_metrics, totals
from fedbench.results.summaries import summarize
from fedbench.fl.map_reference import first_round_within
from fedbench.run.setup import (RunSetup, build_setup, config_group, resolve_backend, resolve_device,
                                 tuning_val_config)


TRACEBACK_FILE = "traceback.txt"   # beside a record that failed on an unexpected exception (not bad input)


def validate(cfg: DictConfig, launch_dir: Optional[str] = None) -> None:
    """Every check that needs no data: the torch-free pass (fedbench/config/validate.py: types, ranges, group
    keys, devices, paths, profiles), then the registries and the CUDA devices torch sees. One-line FedbenchError."""

    validate_config(cfg, launch_dir=launch_dir)
    DATASETS.get(config_group(cfg, "dataset")["name"])
    pname = config_group(cfg, "partition")["name"]
    if not pname.startswith("noniid-#label"):
        PARTITIONS.get(pname)
    MODELS.get(config_group(cfg, "model")["name"])
    check_method_options(config_group(cfg, "algorithm"))
    resolve_backend(cfg.hardware.backend, resolve_device(cfg.hardware.device))


def validate_all(cfg: DictConfig, conf_dir: Path, launch_dir: Optional[str] = None) -> List[DictConfig]:
    """``validate`` for a run, or for each aggregator of its ``aggregators`` list; returns the runs (the list's
    configs, else ``[cfg]``)."""
    subs = expand_runs(cfg, conf_dir)
    for sub in subs:
        validate(sub, launch_dir)
    return subs


def check_methods(cfg: DictConfig, conf_dir: Path) -> None:
    """run.py's check before Hydra makes the run directory: the options of the run's method, or of each entry of its
    ``aggregators`` list (not the devices: a Slurm submit host may have no GPU for a job that will)."""
    for sub in expand_runs(cfg, conf_dir):
        check_method_options(config_group(sub, "algorithm"))


def check_method_options(algorithm: Dict[str, Any]) -> None:
    """The method's own rules for its keys (choices, ranges, checks of its Options dataclass), the ones the torch-free
    pass cannot know: read here as the method's ``__init__`` will read them, before any data is loaded."""
    method = ALGORITHMS.get(algorithm["name"])
    if method.Options is not None:
        read_options(method.Options, {k: v for k, v in algorithm.items() if k != "name"}, method.name)


def _finished_record(rec_path: Path, run_id: str, save_model: bool, launch_dir: Optional[str]) -> Optional[Path]:
    """The complete, current record of ``run_id``: this run's own folder, else the committed store
    (results/records; a ``save_model`` run needs its weights, which only its own folder has)."""
    if is_complete(rec_path, run_id, need_model=save_model):
        return rec_path
    stored = Path(absolute_path(str(records_dir()), launch_dir)) / run_id / "metrics.json"
    return stored if not save_model and is_complete(stored, run_id) else None


def _git(*args: str) -> Optional[str]:
    try:
        root = Path(fedbench.__file__).resolve().parents[1]
        res = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=5)
        return res.stdout.strip() if res.returncode == 0 else None
    except Exception:
        return None


def _cpu() -> str:
    """The CPU model and the instruction set torch's kernels use: two machines can train one run id to different
    floats (a GPU run is the same run as a CPU one), and this says which machine made a record. A virtual machine's
    model name can be as vague as 'AMD EPYC' for several generations, so x86's family/model numbers go with it."""
    return cpu_description(_read_cpuinfo(), platform.processor() or platform.machine(),
                           torch.backends.cpu.get_cpu_capability())


def _read_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_description(cpuinfo: str, fallback: str, capability: str) -> str:
    """'AMD EPYC, family 25 model 17 (AVX512)' from the first processor's /proc/cpuinfo lines."""
    fields: Dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break                                       # the first processor's block only
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    model = fields.get("model name") or fallback
    if fields.get("cpu family") and fields.get("model"):
        model += f", family {fields['cpu family']} model {fields['model']}"
    return f"{model} ({capability})"


def _git_sha() -> Optional[str]:
    return _git("rev-parse", "--short", "HEAD") or None


def _git_dirty() -> Optional[bool]:
    """Whether the code that ran differed from its commit (tracked files under fedbench/, conf/, run.py)."""
    out = _git("status", "--porcelain", "--untracked-files=no", "--", "fedbench", "conf", "run.py")
    return None if out is None else bool(out)


def execute(cfg: DictConfig, output_dir: str | Path, *, launch_dir: Optional[str] = None,
            memory_cache: Optional[Dict[str, Any]] = None, wait_for_claim: bool = True) -> Dict[str, Any]:
    """Run ``cfg`` and write ``metrics.json`` + ``history.csv`` into ``output_dir``; returns the record.

    A run without an ok record is claimed first (``<output_dir>/.claim``, fedbench/results/claims.py), so
    two processes never train it at once: the second waits, then ``_execute`` checks the record again and
    returns the first one's ok record as a skip, or runs it itself if the first one failed or died.
    ``wait_for_claim=False`` (a sweep's first pass): raise ClaimHeld instead of waiting."""

    out, run_id = Path(output_dir), compute_run_id(cfg)
    if not cfg.get("force", False) and _finished_record(out / "metrics.json", run_id,
                                                        bool(cfg.get("save_model", False)), launch_dir):
        return _execute(cfg, output_dir, launch_dir=launch_dir)   # the skip: no claim needed
    try:
        with claim(out / ".claim", f"run {run_id}", wait=wait_for_claim):
            return _execute(cfg, output_dir, launch_dir=launch_dir, memory_cache=memory_cache)
    finally:   # a run rejected before writing anything leaves no empty folder behind
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()


def _execute(cfg: DictConfig, output_dir: str | Path, *, launch_dir: Optional[str] = None,
             memory_cache: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """``execute``'s body: skip a run with an ok record, else check the config, train, write the record."""
    t_start, cpu_start = time.perf_counter(), time.process_time()
    out = Path(output_dir)
    # everything that can be rejected is rejected here, before the skip check and any training
    validate(cfg, launch_dir)
    skipped = _skip(cfg, out / "metrics.json", launch_dir)
    if skipped is not None:
        return skipped
    run = build_setup(cfg, launch_dir, memory_cache)
    if run.fl.cache is not None:   # noted beside the cache entries it uses: parking keeps them till it ends
        run.fl.cache.user = compute_run_id(cfg)
    algo = build_algorithm(config_group(cfg, "algorithm"), run.fl)
    record = _train_and_record(cfg, out, run, algo, t_start, cpu_start)
    _print_summary(cfg, record, run, out / "metrics.json")
    return record


def _skip(cfg: DictConfig, rec_path: Path, launch_dir: Optional[str]) -> Optional[Dict[str, Any]]:
    """The ok record of an already finished run (marked ``skipped``), or None when it must run."""
    if cfg.get("force", False):
        return None
    run_id = compute_run_id(cfg)
    done = _finished_record(rec_path, run_id, bool(cfg.get("save_model", False)), launch_dir)
    if done is None:
        return None
    print(f"fedbench: run {run_id} already has an ok record at {done}; skipped (force=true reruns it)")
    rec = read_record(done)
    rec["skipped"] = True
    return rec


def _train_and_record(cfg: DictConfig, out: Path, run: RunSetup, algo, t_start: float,
                      cpu_start: float) -> Dict[str, Any]:
    """Run the rounds; write the record (also of a failed run, then re-raise) and return it."""
    run_id, save_model = compute_run_id(cfg), bool(cfg.get("save_model", False))
    config = OmegaConf.to_container(cfg, resolve=True)
    logger = make_logger(config.get("logger") or {"name": "none"}, run_id, config, out)
    out.mkdir(parents=True, exist_ok=True)
    started = _dt.datetime.now().isoformat(timespec="seconds")
    history: List[Dict[str, Any]] = []

    def on_round(log: RoundLog):
        row = log.row()
        history.append(row)
        logger.log_round(row)

    ckpt, resumed = _round_checkpoint(cfg, out, algo, run)
    prior_s, prior_cpu, resumed_after = 0.0, 0.0, []
    if resumed is not None:
        for row in resumed.rows:
            history.append(row)
            logger.log_round(row)
        prior_s, prior_cpu, resumed_after = resumed.elapsed_s, resumed.cpu_s, resumed.resumed_after
        started = resumed.started or started
        print(f"fedbench: run {run_id} resumes after round {resumed.round} of {int(cfg.rounds)} ({ckpt.path})")

    def on_state(r: int, state) -> None:
        if ckpt is not None and r < int(cfg.rounds) and ckpt.due():
            ckpt.save(r, state, history, prior_s + time.perf_counter() - t_start,
                      prior_cpu + time.process_time() - cpu_start, resumed_after, started)

    curv_t0 = curvature_seconds()
    status, error, final_state, saved, trace_text = "failed", None, None, {}, None
    round1_clients = []   # save_model of a one-shot run: the client weights the aggregator received
    keep_clients = save_model and int(cfg.rounds) == 1
    try:
        final_state, _ = run_rounds(run.fl, algo, run.init_params, int(cfg.rounds), eval_every=int(cfg.eval.every),
                                    progress=bool(cfg.get("progress", True)), on_round=on_round,
                                    on_clients=(lambda r, ps: round1_clients.extend(ps)) if keep_clients else None,
                                    resume_after=resumed.round if resumed else 0,
                                    resume_state=resumed.state if resumed else None, on_state=on_state)
        if save_model:
            saved = _save_model(out, algo.predict_params(final_state), round1_clients, config_group(cfg, "model"),
                                run.data, run_id)
        status = "ok"
    except KeyboardInterrupt:
        error = "interrupted"
        raise
    except Exception as e:  # record the failure, then let it surface
        error = f"{type(e).__name__}: {e}"
        if not isinstance(e, FedbenchError):   # a bug, not bad input: keep where it happened beside the record
            trace_text = traceback.format_exc()
        raise
    finally:
        logger.finish(status)
        # cpu_s: this process's CPU seconds (all its threads) over the run; beside total_s it tells a reader whether
        # the wall time was inflated by other load or a paused process (cpu_s / total_s well below the thread count)
        timing = {"total_s": prior_s + time.perf_counter() - t_start,
                  "cpu_s": prior_cpu + time.process_time() - cpu_start,
                  "curvature_s": curvature_seconds() - curv_t0}   # this start's only (not kept across a resume)
        record = _record(cfg, run, config, history, status, error, timing, saved, started)
        if resumed_after:
            record["resumed_after_rounds"] = resumed_after   # the rounds it went on after, one per restart
        if trace_text:
            record["traceback"] = TRACEBACK_FILE
        if _write_record(out, record, history, final_state):   # the traceback belongs to the record written
            if trace_text:
                atomic_write_bytes(out / TRACEBACK_FILE, trace_text.encode())
            elif (out / TRACEBACK_FILE).exists():
                (out / TRACEBACK_FILE).unlink()
        if status == "ok" and ckpt is not None:
            ckpt.discard()
    return record


def _round_checkpoint(cfg: DictConfig, out: Path, algo, run: RunSetup):
    """The run's resume file (fedbench/fl/resume.py) and what it holds, when ``checkpoint_every_s`` > 0, the
    method is resumable and the run has more than one round; force=true starts over."""
    every = float(cfg.get("checkpoint_every_s") or 0)
    if every <= 0 or not getattr(algo, "resumable", False) or int(cfg.rounds) < 2:
        return None, None
    ckpt = RoundCheckpoint(out, compute_run_id(cfg), every, numerics.current(str(cfg.algorithm.name)))
    if cfg.get("force", False):
        ckpt.discard()
        return ckpt, None
    return ckpt, ckpt.load(run.fl.device)


def _record(cfg: DictConfig, run: RunSetup, config: Dict[str, Any], history: List[Dict[str, Any]], status: str,
            error: Optional[str], timing: Dict[str, float], saved: Dict[str, str], started: str) -> Dict[str, Any]:
    """The run record (metrics.json) of a finished or failed run."""
    dcfg, pcfg, mcfg, acfg = (config_group(cfg, k) for k in ("dataset", "partition", "model", "algorithm"))
    cache, sums = run.fl.cache, totals(history)
    return {
        "run_id": compute_run_id(cfg),
        "status": status,
        "error": error,
        "algorithm": acfg["name"],
        "dataset": dcfg["name"],
        "dataset_approximate": run.data.approximate,
        "config": config,
        "identity": identity_config(cfg),
        "partition": {"name": pcfg["name"], "client_sizes": run.client_sizes,
                      "client_label_counts": run.client_label_counts()},
        "model": {"name": mcfg["name"], "num_parameters": count_parameters(run.fl.model), "pretrained": run.pretrained},
        "evaluated_on": "tuning_val (held-out training data)" if tuning_val_config(cfg) else "test",
        "metrics": final_metrics(history),
        "summary": {**summarize(history, last=int(cfg.eval.get("last_k", 3)),
                                thresholds=list(cfg.eval.get("thresholds") or [])), **map_summary(cfg, history)},
        "cache": {"dir": cache.root and str(cache.root), "hits": cache.hits, "misses": cache.misses},
        "communication": sums["communication"],
        "timing": {"total_s": timing["total_s"], "cpu_s": timing["cpu_s"], **sums["timing"],
                   "curvature_s": timing["curvature_s"]},
        "rounds_completed": len(history),
        "saved": saved,   # save_model=true: file names (beside this record) of the final / client weights
        "numerics": numerics.current(acfg["name"]),   # stale when the arithmetic changes (fedbench/numerics.py)
        "environment": {"device": str(run.fl.device), "backend": run.backend, "torch": torch.__version__,
                        "python": platform.python_version(), "fedbench": fedbench.__version__,
                        "git": _git_sha(), "git_dirty": _git_dirty(), "host": platform.node(), "cpu": _cpu()},
        "started": started,
        "finished": _dt.datetime.now().isoformat(timespec="seconds"),
    }


def _write_record(out: Path, record: Dict[str, Any], history: List[Dict[str, Any]], final_state) -> bool:
    """metrics.json, history.csv (and a method's trace.csv); a failed rerun never overwrites a completed record
    (False: nothing written)."""
    rec_path = out / "metrics.json"
    if record["status"] != "ok" and is_complete(rec_path, current=False):
        return False
    extra = [k for h in history for k in h if k not in HISTORY_COLUMNS]
    write_csv_atomic(out / "history.csv", history, list(HISTORY_COLUMNS) + list(dict.fromkeys(extra)))
    trace = (final_state or {}).get("trace")
    if record["status"] == "ok" and trace:   # a method's per-step/epoch server trace of its last round (e.g. DENSE's epochs)
        write_csv_atomic(out / "trace.csv", list(trace))
    write_json_atomic(rec_path, record)
    return True


def map_summary(cfg: DictConfig, history: List[Dict[str, Any]]) -> Dict[str, Any]:
    """``eval.map_reference``: the first round whose training NLL is within 1 % of the centralised MAP's."""
    if cfg.eval.get("map_reference") is None:
        return {}
    return {"first_round_train_nll_within_1pct": first_round_within(history)}


def _print_summary(cfg: DictConfig, record: Dict[str, Any], run: RunSetup, rec_path: Path) -> None:
    m = record["metrics"]
    summary = " ".join(f"{k}={v:.4g}" for k, v in m.items() if v is not None and not math.isnan(v))
    approx = " [APPROXIMATE DATA: see dataset_approximate]" if run.data.approximate else ""
    print(f"fedbench: {record['algorithm']} on {record['dataset']}{approx} ({cfg.num_clients} clients, "
          f"{record['partition']['name']}, {record['rounds_completed']} round(s)): {summary} | "
          f"{record['timing']['total_s']:.1f}s | {rec_path}")


def _save_model(out: Path, params, clients, mcfg: Dict[str, Any], data, run_id: str) -> Dict[str, str]:
    """``save_model=true``: the final global weights (``predict_params``: one dict, or a list for an ensemble)
    to ``model.pt`` and, for a one-shot run, the round-1 client weights to ``clients.pt``; each file also says
    how to rebuild the model (``fedbench.models.build_model(name, input_shape=, num_classes=, **kwargs)``)."""
    def cpu(p):
        if isinstance(p, (list, tuple)):
            return [cpu(q) for q in p]
        if isinstance(p, dict) and all(isinstance(v, torch.Tensor) for v in p.values()):
            return {k: v.detach().cpu().clone() for k, v in p.items()}
        raise TypeError(type(p).__name__)

    try:
        params = cpu(params)
    except TypeError as e:   # e.g. FedOV's open-set vote: a predictor, not weights
        print(f"fedbench: WARNING: save_model: the method predicts with a {e}, not weights; model.pt not written",
              file=sys.stderr)
        return {"model": None}   # recorded as "nothing to save", so the run is not redone for want of a file
    head = {"run_id": run_id, "model": mcfg["name"], "input_shape": list(data.input_shape),
            "num_classes": data.num_classes,
            "model_kwargs": {k: v for k, v in mcfg.items() if k not in ("name", "pretrained")}}
    write_torch_atomic(out / "model.pt", {**head, "params": params})
    saved = {"model": "model.pt"}
    if clients:
        write_torch_atomic(out / "clients.pt", {**head, "params": cpu(clients)})
        saved["clients"] = "clients.pt"
    return saved


def execute_all(cfg: DictConfig, output_dir: str | Path, conf_dir: Path, *, launch_dir: Optional[str] = None,
                wait_for_claim: bool = True):
    """Run ``cfg``, or, when ``aggregators`` is a list, every aggregator on the same (cached) clients.

    Each aggregator succeeds or fails on its own: a failure is written as that aggregator's failed record
    (with its one-line reason), the others still run, and the job then raises one FedbenchError naming the failures.
    ``wait_for_claim=False``: a run another process holds raises ClaimHeld while this call has trained nothing
    (its skips are cheap to repeat); once it has, the rest waits its turn, as a retry would count the trained twice.
    """
    if not cfg.get("aggregators"):
        return [execute(cfg, output_dir, launch_dir=launch_dir, wait_for_claim=wait_for_claim)]
    subs = validate_all(cfg, conf_dir)   # every bad entry is rejected before any of them trains
    root = Path(absolute_path(cfg.paths.output_root, launch_dir)) / "runs"
    records, failed = [], []
    memory = {} if not cfg.get("cache", True) else None   # cache=false: the list still trains its clients once
    for sub in subs:
        run_dir = root / compute_run_id(sub)
        wait = wait_for_claim or any(not r.get("skipped") for r in records)
        try:
            records.append(execute(sub, run_dir, launch_dir=launch_dir, memory_cache=memory, wait_for_claim=wait))
        except ClaimHeld:   # nothing trained yet: the caller hands the whole list back
            raise
        except Exception as e:   # KeyboardInterrupt still ends the job
            reason = str(e) if isinstance(e, FedbenchError) else f"{type(e).__name__}: {e}"
            where = f" (traceback: {run_dir / TRACEBACK_FILE})" if (run_dir / TRACEBACK_FILE).is_file() else ""
            print(f"fedbench: error: {sub.algorithm.name}: {reason}{where}", file=sys.stderr)
            records.append(_failure_record(sub, run_dir, reason))
            failed.append(sub.algorithm.name)
    write_json_atomic(Path(output_dir) / "aggregators.json",
                      {"records": [str(root / r["run_id"] / "metrics.json") for r in records]})
    ok = sum(r.get("status") == "ok" for r in records)
    print(f"fedbench: aggregators: {ok} ok, {len(failed)} failed ({', '.join(failed) or 'none'})")
    if failed:
        raise FedbenchError(f"{len(failed)} of {len(subs)} aggregators failed: {', '.join(failed)} "
                            f"(their failed records say why; the other {ok} finished)")
    return records


def _failure_record(cfg: DictConfig, run_dir: Path, reason: str) -> Dict[str, Any]:
    """The failed record of a run that stopped with ``reason``: the one ``execute`` wrote when training raised,
    else a minimal one (a failure before training); an ok record already there is never overwritten."""
    path = run_dir / "metrics.json"
    rec = read_record(path)
    if rec and rec.get("run_id") == compute_run_id(cfg) and (rec.get("status") == "failed" or is_complete(path, current=False)):
        return rec
    rec = {"run_id": compute_run_id(cfg), "status": "failed", "error": reason,
           "algorithm": cfg.algorithm.name, "config": OmegaConf.to_container(cfg, resolve=True),
           "identity": identity_config(cfg), "numerics": numerics.current(cfg.algorithm.name),
           "finished": _dt.datetime.now().isoformat(timespec="seconds")}
    write_json_atomic(path, rec)
    return rec
