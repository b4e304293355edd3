"""The reproduction scoreboard (results/REPRODUCTION.md): what fedbench reproduces, table by table and claim by claim.

Generated from three committed inputs only, so a test can check that the committed file is up to date:
- the collections (results/collections.yaml) and the run records behind them (results/records/): every cell run,
  compared with the paper's number under the tables' tolerance (fedbench.report.tables.tolerance);
- the reference CSVs (results/reference/): how many cells each paper table has, and which are runnable here;
- the campaign plan (results/campaign.yaml): per table, what is runnable, its cost on this machine and what is
  left out and why; the headline claims with the rule that checks each; gap explanations (results/gaps.md).
"""
from __future__ import annotations

import re
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Dict, List, Optional

import pandas as pd
from omegaconf import OmegaConf

from fedbench.errors import FedbenchError
from fedbench.report.costs import is_cost
from fedbench.report.plotting import pyplot, save_figure
from fedbench.results.records import read_history
from fedbench.results.reference import available_tables, load_reference
from fedbench.results.summaries import first_round_reaching
from fedbench.report.tables import (COLLECTIONS, LOWER_IS_BETTER, SUMMARY_VARIANTS, as_printed, attach_reference,
                                     complete_seeds, norm_key, paper_seeds, read_collections, score, summarise,
                                     table_runs, tolerance_floor, within_tolerance)

CAMPAIGN = "campaign.yaml"
FIGURE = "figures/scoreboard.png"   # ours against the paper's number, cell by cell (its data: scoreboard_data.csv)
GAPS = "gaps.md"
# Data the project has offline (../shared/datasets) or generates (FedFisher's synthetic regression).
OFFLINE_DATASETS = ("mnist", "fmnist", "uci_credit", "flamby_heart", "fedfisher_synthetic")
# Cells on data here that need a GPU in practice (results/campaign.yaml's intro has the measurements): DENSE's 200
# synthesis epochs (≈ 4.7 CPU h a run) and 50-200 local epochs of an image model (a 200-epoch stage of 60,000
# samples ≈ 30 CPU min, ≈ 4.5 min on one H200). They count in "on data here" and in "needs GPU"; the rest is
# "runnable on CPU", the set the campaign runs here.
GPU_ONLY_METHODS = ("dense",)
GPU_MIN_LOCAL_EPOCHS = 50


# What the experiment behind a cell outside tolerance found (campaign.yaml `verdicts:`, gaps.md has the experiment).
# A cell no entry matches is "untested". "reading" names the collection that runs the paper's setup as the experiment
# read it; the scoreboard looks the cell up there and counts it explained only where that reading is within tolerance.
# "noise" carries the standard deviation of the released code's draws measured in the gap experiment (`spread:`): a
# paper whose printed ± is far below its own code's spread gets the measured one in the tolerance instead.
# "threshold" is for a rounds-to-accuracy count whose curve is flat near the threshold, so a fraction of a point moves
# the first round by several: `shift:` is our excess over the paper in the accuracy table of the same runs, and the
# scoreboard re-counts each run's first round at threshold + shift from its round history (explained only where that
# count is within tolerance).
VERDICTS = {
    "paper_vs_code": "the paper's released code, run here on the same split, gives fedbench's number, not the "
                     "paper's: a gap between the paper and its code",
    "solver": "the released solver's numerics: its fixed step is past the stability limit on this split and "
              "diverges (the collapse is explained; the paper's number may still differ)",
    "one_number": "the paper prints one number for several settings that fedbench runs apart (FedProx's μ), "
                  "without saying which it reports",
    "reading": "a setting the paper leaves unstated: the named reading of it (a collection of runs) is checked "
               "cell by cell",
    "noise": "the released code's own spread, measured here over several training draws (`spread:`), replaces the "
             "paper's printed ±: explained where the difference is within max(floor, 2·sqrt(s²/n + spread²/n_paper))",
    "threshold": "a first round to reach an accuracy on a curve flat near it: re-counted at the threshold plus our "
                 "excess over the paper in the accuracy table of the same runs (`shift:`)",
    "open": "hypotheses tested and rejected: not explained yet",
}
UNTESTED = "untested"
EXPLAINED = ("paper_vs_code", "solver", "one_number")   # "reading", "noise", "threshold": where their check is within


def load_campaign(results: Path) -> Dict[str, Any]:
    path = Path(results) / CAMPAIGN
    if not path.is_file():
        raise FedbenchError(f"{path} is missing: the campaign plan lists every table's cost and claims")
    plan = OmegaConf.to_container(OmegaConf.load(path), resolve=True) or {}
    check_verdicts(plan.get("verdicts") or [], path)
    check_claims(plan.get("claims") or [], path)
    return plan


CLAIM_KEYS = {"paper", "text", "collection", "winner", "loser", "where", "significant", "paper_seeds", "method",
              "along", "direction", "best_on_test_over", "note"}


def check_claims(claims: List[Dict[str, Any]], where: Any = CAMPAIGN) -> None:
    """One line per malformed entry of `claims:` (before anything is rendered). ``note:`` is free text printed
    beside the claim's status: what the rule alone cannot say (a row won only on a technicality)."""
    for i, cl in enumerate(claims):
        missing = [k for k in ("paper", "text", "collection") if not cl.get(k)]
        if missing:
            raise FedbenchError(f"{where}: claims[{i}] lacks {', '.join(missing)}")
        unknown = set(cl) - CLAIM_KEYS
        if unknown:
            raise FedbenchError(f"{where}: claims[{i}] has unknown keys {sorted(unknown)}; known: "
                                f"{', '.join(sorted(CLAIM_KEYS))}")
        if "note" in cl and not (isinstance(cl["note"], str) and cl["note"].strip()):
            raise FedbenchError(f"{where}: claims[{i}]: note must be a non-empty text, got {cl['note']!r}")


def check_verdicts(verdicts: List[Dict[str, Any]], where: Any = CAMPAIGN) -> None:
    """One line per malformed entry of `verdicts:` (before anything is rendered)."""
    for i, v in enumerate(verdicts):
        missing = [k for k in ("paper", "table", "verdict", "anchor") if not v.get(k)]
        if missing:
            raise FedbenchError(f"{where}: verdicts[{i}] lacks {', '.join(missing)}")
        if v["verdict"] not in VERDICTS:
            raise FedbenchError(f"{where}: verdicts[{i}] has verdict {v['verdict']!r}; one of {', '.join(VERDICTS)}")
        if (v["verdict"] == "reading") != bool(v.get("reading")):
            raise FedbenchError(f"{where}: verdicts[{i}]: `reading: <collection>` goes with verdict 'reading' "
                                "and only with it")
        if (v["verdict"] == "noise") != ("spread" in v):
            raise FedbenchError(f"{where}: verdicts[{i}]: `spread: <std of the released code's draws>` goes with "
                                "verdict 'noise' and only with it")
        if (v["verdict"] == "threshold") != ("shift" in v):
            raise FedbenchError(f"{where}: verdicts[{i}]: `shift: <points of our excess in the accuracy table>` goes "
                                "with verdict 'threshold' and only with it")
        if "shift" in v and not (isinstance(v["shift"], (int, float)) and not isinstance(v["shift"], bool)):
            raise FedbenchError(f"{where}: verdicts[{i}]: shift must be a number of points, got {v['shift']!r}")
        if "spread" in v and not (isinstance(v["spread"], (int, float)) and not isinstance(v["spread"], bool)
                                  and v["spread"] > 0):
            raise FedbenchError(f"{where}: verdicts[{i}]: spread must be a positive number, got {v['spread']!r}")
        unknown = set(v) - {"paper", "table", "cells", "methods", "verdict", "anchor", "reading", "spread", "shift",
                            "note"}
        if unknown:
            raise FedbenchError(f"{where}: verdicts[{i}] has unknown keys {sorted(unknown)}")


def match_verdict(verdicts: List[Dict[str, Any]], paper: str, table: str, cell: str, method: str):
    """The first entry whose paper and table are the cell's and whose `cells` / `methods` patterns (shell-style, as
    printed: "fmnist/#C=2", "fedprox(*"; all when absent) match it; None when none does."""
    for v in verdicts:
        if (v["paper"], v["table"]) != (paper, table) or not fnmatchcase(cell, str(v.get("cells", "*"))):
            continue
        if any(fnmatchcase(method, str(m)) for m in (v.get("methods") or ["*"])):
            return v
    return None


def base_method(label: str) -> str:
    """The method a table label names: fedbench spells a setting run apart as ``method(key=value)``."""
    return str(label).split("(")[0]


def _cell_name(c: Dict[str, Any], r: Dict[str, Any]) -> str:
    """A cell as the scoreboard prints it ("mnist/heterog/10/97.5"): the collection's row keys (and its column)
    of a summary row or of a run row."""
    keys = [k for k in (c["meta"].get("rows") or ["dataset", "partition"]) if k in c["summary"]]
    keys += ["column"] if "column" in c["summary"] else []
    return "/".join(norm_key(r.get(k)) for k in keys)


def _reading_cell(colls: dict, name: str, cell: str, method: str):
    """The same cell in the reading's collection: (mean, within) or None when it did not run there. A method whose
    reading spells out its parameters ("fedprox(mu=0.01)" for "fedprox") is found under that one label; a setting
    run apart ("fedprox(mu=1.0)") is found under the reading's bare method when the reading has one row of it (a
    ``tuning=on`` reading: the hold-out chose the setting the paper's one number leaves unstated)."""
    c = colls.get(name)
    if c is None:
        raise FedbenchError(f"verdict reading {name!r} is not a committed collection (results/collections.yaml)")
    paper_n = paper_seeds(c["meta"])
    rows = [r for r in c["summary"].to_dict("records") if _cell_name(c, r) == cell]
    hit = [r for r in rows if r["method"] == method] or \
        [r for r in rows if base_method(r["method"]) == method and r["method"] != method] or \
        [r for r in rows if r["method"] == base_method(method) != method]
    if len(hit) != 1 or int(hit[0]["n"]) == 0 or hit[0].get("paper") is None or pd.isna(hit[0].get("paper")):
        return None
    ok = within_tolerance(hit[0], paper_n)
    return None if ok is None else (float(hit[0]["mean"]), bool(ok))


def _threshold_recount(colls: dict, name: str, cell: str, method: str, shift: float) -> Optional[Dict[str, Any]]:
    """The cell's first rounds re-counted at threshold + shift from each finished run's round history: {mean, std, n,
    never, threshold}, or None when the collection has no such runs (a cell that is not a rounds-to-accuracy count)."""
    c = colls[name]
    runs = c.get("runs")
    if runs is None or not len(runs) or "threshold" not in runs:
        return None
    rounds, never, threshold = [], 0, None
    for r in runs.to_dict("records"):
        if r["status"] != "ok" or r["method"] != method or pd.isna(r.get("threshold")) or _cell_name(c, r) != cell:
            continue
        threshold = float(r["threshold"]) + float(shift)
        first = first_round_reaching(read_history(Path(r["record_dir"]) / "history.csv"), threshold, "accuracy")
        if first is None:
            never += 1
        else:
            rounds.append(float(first))
    if not rounds and not never:
        return None
    s = pd.Series(rounds, dtype=float)
    return {"mean": float(s.mean()) if len(s) else float("nan"), "std": float(s.std()) if len(s) > 1 else float("nan"),
            "n": len(s), "never": never, "threshold": threshold}


def has_reference(paper: str, table: str) -> bool:
    """Whether the paper prints numbers for this table (figures print none: they are checked through claims)."""
    return (paper, table) in set(available_tables())


def needs_gpu(row: Dict[str, Any], table_epochs: Any = None) -> bool:
    """Whether a cell (a reference or summary row) needs a GPU in practice: DENSE, or 50+ local epochs (the row's,
    else ``table_epochs``: a table whose rows do not name the epochs, as FedLPA Table 9's, has one count)."""
    if base_method(row.get("method")) in GPU_ONLY_METHODS:
        return True
    epochs = pd.to_numeric(row.get("local_epochs", table_epochs), errors="coerce")
    return bool(pd.notna(epochs) and epochs >= GPU_MIN_LOCAL_EPOCHS)


def table_local_epochs(paper: str, table: str) -> Any:
    """The one local-epoch count of a paper table's reference cells, or None (none given, or several)."""
    ref = load_reference(paper, table)
    counts = ref["local_epochs"].dropna().unique() if "local_epochs" in ref else []
    return counts[0] if len(counts) == 1 else None


def paper_cells(paper: str, table: str) -> tuple:
    """(cells with a number in the paper, of which on data available here, of those the cells that need a GPU)."""
    ref = load_reference(paper, table)
    ref = ref[pd.to_numeric(ref["mean"], errors="coerce").notna()]
    if "metric" in ref:   # figures-as-tables with text cells (FOLA Table I) have no numeric metric
        ref = ref[ref["metric"] != "augmentation"]
    here = ref[ref["dataset"].isin(OFFLINE_DATASETS)] if "dataset" in ref else ref.iloc[0:0]
    # costs, and FedFisher Table 1's overhead over FedAvg (a ratio of two), are never scored, so never "run"
    if "metric" in here:
        here = here[~here["metric"].map(lambda m: is_cost(m) or m == "overhead_pct")]
    return len(ref), len(here), sum(needs_gpu(r) for r in here.to_dict("records"))


def setting_variants(names: List[str], colls: dict, gpu: Optional[bool] = None) -> int:
    """Extra runnable cells where fedbench runs several settings apart against one paper number (FedProx's four μ
    against the paper's one FedProx column; fedbench's labels ``method(key=value)``): each setting beyond the first is
    one more cell here, run and scored on its own, so 'runnable here' counts it too. ``gpu``: True counts only the
    cells that need a GPU (needs_gpu), False only the others, None all."""
    seen: Dict[tuple, set] = {}
    for n in names:
        s = colls[n]["summary"]
        epochs = _coll_epochs(colls[n]) if gpu is not None else None   # once a collection: it reads a CSV
        if not len(s) or "paper" not in s:
            continue
        keys = [k for k in (colls[n]["meta"].get("rows") or []) if k in s]
        for r in s[s["paper"].notna()].to_dict("records"):
            if r.get("dataset") is not None and r.get("dataset") not in OFFLINE_DATASETS:
                continue
            if "metric" in r and is_cost(r["metric"]):
                continue
            if gpu is not None and needs_gpu(r, epochs) != gpu:
                continue
            # a multi-column table (App. D.2: rounds, gap, MAP NLL) has one paper cell per column of a row
            cell = tuple(norm_key(r.get(k)) for k in keys) + ((norm_key(r.get("column")),) if "column" in r else ())
            seen.setdefault((cell, base_method(r["method"])), set()).add(str(r["method"]))
    return sum(len(v) - 1 for v in seen.values())


def collection_summaries(results: Path, output_root: Path) -> Dict[str, Dict[str, Any]]:
    """name -> {meta, summary, score, n_full} for every committed collection."""
    out = {}
    for e in read_collections(Path(results) / COLLECTIONS):
        df = table_runs(list(e["overrides"]), output_root)
        meta = df.attrs.get("table") or {}
        metric = e.get("metric") or "accuracy"
        summary = attach_reference(summarise(df, metric), meta["paper"], meta["id"], metric,
                                   SUMMARY_VARIANTS.get(meta.get("summary")))
        want = paper_seeds(meta) or 0
        ran = summary[(summary["n"] > 0) & summary["paper"].notna()] if len(summary) else summary
        if "metric" in ran:   # costs are never scored (score()), so they count in no column of the scoreboard
            ran = ran[~ran["metric"].map(is_cost)]
        out[e["name"]] = {"meta": meta, "summary": summary, "score": score(summary, meta, metric), "entry": e, "metric": metric,
                          "runs": df,   # per run: a threshold verdict re-counts from each run's round history
                          "full_seeds": int((ran["n"] >= want).sum()) if want and len(ran) else 0}
    return out


def _claim_status(claim: Dict[str, Any], colls: Dict[str, Dict[str, Any]]) -> tuple:
    """(status, detail) of a headline claim: ``{collection, winner, loser}`` (our means must order every row of the
    collection where both methods ran as the claim says; for a loss such as NLL the winner's mean is the lower; with
    ``significant: true`` by more than 2 combined standard errors; ``loser`` may be a list: the winner must beat each
    one of them that ran in the row) or
    ``{collection, method, along, direction}`` (the method's means must fall, or rise, strictly along the row key
    ``along``). The detail says "provisional" while a compared row has fewer than the paper's seeds for either
    method (the means then rest on fewer, or different, seeds). A best-of claim (``best_on_test_over``) leaves out,
    and names, the rows where a method's grid of settings ran only in part."""
    c = colls.get(claim.get("collection"))
    if c is None:
        return "not run", "collection not committed"
    if c["summary"].empty:
        return "not run", "no records"
    s, keys = claim_cells(claim, c)
    if "along" in claim:
        status, detail = _monotone_status(claim, c, s, keys)
    else:
        status, detail = _ordering_status(claim, c, s, keys)
    return status, detail + _left_out(claim, s.attrs.get("partly_run") or [], keys)


def _left_out(claim: Dict[str, Any], partly_run: List[tuple], keys: List[str]) -> str:
    """The detail's note on the rows a best-of claim left out because a method's grid there ran only in part."""
    methods = {claim.get("method"), claim.get("winner"), *([claim.get("loser")] if isinstance(claim.get("loser"), str)
                                                          else claim.get("loser") or [])} - {None}
    where = {k: [norm_key(x) for x in (v if isinstance(v, list) else [v])]
             for k, v in (claim.get("where") or {}).items()}
    rows = sorted({"/".join(g[:-1]) or "all" for g in partly_run if g[-1] in methods
                   and all(dict(zip(keys, g[:-1])).get(k, w[0]) in w for k, w in where.items())})
    if not rows:
        return ""
    return f"; {len(rows)} row(s) left out until their grid of settings has run in full ({', '.join(rows)})"


def _ordering_status(claim: Dict[str, Any], c: Dict[str, Any], s: pd.DataFrame, keys: List[str]) -> tuple:
    """A ``{winner, loser}`` claim over the rows of ``s`` (see ``_claim_status``)."""
    rows, held, failed, short = 0, 0, [], 0
    want = claim.get("paper_seeds") or paper_seeds(c["meta"]) or 0   # a figure's seeds live in its sweep
    where = claim.get("where") or {}
    metric = c.get("metric", "accuracy")
    sign = -1.0 if metric in LOWER_IS_BETTER else 1.0   # a loss: the lower mean beats
    # a list of losers ("highest in round 1"): the winner must beat every one of them that ran in the row
    losers = [claim["loser"]] if isinstance(claim["loser"], str) else list(claim["loser"])
    for rv, g in s.groupby(keys, sort=False, dropna=False):
        rv = rv if isinstance(rv, tuple) else (rv,)
        row = dict(zip(keys, rv))
        if any(norm_key(row.get(k)) not in [norm_key(x) for x in (v if isinstance(v, list) else [v])]
               for k, v in where.items()):
            continue
        w = g[(g["method"] == claim["winner"]) & (g["n"] > 0)]
        ran = [lo for lo in (g[(g["method"] == name) & (g["n"] > 0)] for name in losers) if not lo.empty]
        if w.empty or not ran:
            continue
        rows += 1
        short += int(min([int(w["n"].iloc[0])] + [int(lo["n"].iloc[0]) for lo in ran]) < want)
        wm = float(w["mean"].iloc[0])
        not_beaten = []
        for lo in ran:
            # significant: a claim that one setting is clearly worse ("drops significantly") needs a gap beyond noise
            margin = _noise(_point(w), _point(lo)) if claim.get("significant") else 0.0
            lm = float(lo["mean"].iloc[0])
            # the lead must show in the printed means, as a row's winner does (10.00 against 9.997 ties)
            if not (sign * (wm - lm) > margin and sign * (as_printed(wm, metric) - as_printed(lm, metric)) > 0):
                not_beaten.append(str(lo["method"].iloc[0]))
        label = "/".join(norm_key(v) for v in rv)
        if not not_beaten:
            held += 1
        else:   # a list of losers: name the ones the winner did not beat
            failed.append(label if isinstance(claim["loser"], str) else f"{label}: not ahead of {' + '.join(not_beaten)}")
    if rows == 0:
        return "not run", "no row has both methods"
    partial = f"; provisional: fewer than {want} seeds in {short} of {rows} rows" if short else ""
    if held == rows:
        return "reproduced", f"{held}/{rows} rows{partial}"
    return "not reproduced", f"{held}/{rows} rows (fails: {', '.join(failed)}){partial}"


DIRECTIONS = ("decreasing", "increasing", "falls_then_rises")


def claim_cells(claim: Dict[str, Any], c: Dict[str, Any]) -> tuple:
    """(summary, row keys) that a claim reads. With ``best_on_test_over: [row keys]`` each method keeps, per group
    of the other row keys, only its best cell over those keys (the highest mean over seeds; for a loss the lowest):
    a figure that plots the best over a hyperparameter grid chosen on the test set, as FOLA's Figs. 3-4 do. It is
    the paper's selection, named in the claim, never a default. The means compared come from the same seeds: per
    group, only the seeds that ran every cell of it while one has (fedbench.report.tables.complete_seeds)."""
    s = c["summary"]
    keys = [k for k in (c["meta"].get("rows") or ["dataset", "partition"]) if k in s]
    over = claim.get("best_on_test_over") or []
    if not over:
        return s, keys
    unknown = [k for k in over if k not in keys]
    if unknown:
        raise FedbenchError(f"claim {claim.get('text')!r}: best_on_test_over names {unknown}, not row keys of "
                            f"{claim.get('collection')} ({', '.join(keys)})")
    rest = [k for k in keys if k not in over]
    partial = _partly_run(c["summary"], rest + ["method"])
    runs = c.get("runs")
    if runs is not None and "seed" in runs and "status" in runs:
        ok = runs[runs["status"] == "ok"]
        ok.attrs = dict(runs.attrs)
        s = summarise(complete_seeds(ok, rest + ["method"], keys + ["method"]), c.get("metric", "accuracy"))
    keys = rest
    ran = s[s["n"] > 0] if len(s) else s
    if len(ran) and partial:
        ran = ran[[tuple(norm_key(v) for v in r) not in partial
                   for r in ran[keys + ["method"]].itertuples(index=False)]]
    if not ran.empty:
        lower = c.get("metric", "accuracy") in LOWER_IS_BETTER
        groups = ran.groupby(keys + ["method"], sort=False, dropna=False)["mean"]
        ran = ran.loc[groups.idxmin() if lower else groups.idxmax()].reset_index(drop=True)
    ran.attrs["partly_run"] = sorted(partial)
    return ran, keys


def _partly_run(summary: pd.DataFrame, group: List[str]) -> set:
    """The ``group`` values (normalised tuples) whose grid of planned cells ran only in part: some cells have runs,
    others none yet. Their best over the grid is the best over the cells that happened to run first, not the
    paper's selection, so a best-of claim leaves them out until the grid is complete."""
    if summary.empty or "n" not in summary:
        return set()
    ran = (summary["n"] > 0).groupby([summary[k].map(norm_key) for k in group], sort=False, dropna=False)
    share = ran.mean()
    return {k if isinstance(k, tuple) else (k,) for k, v in share.items() if 0 < v < 1}


def _as_number(v: Any) -> float:
    """A row value along a figure's x axis as a number: 64, "64", or a printed setting such as "alpha=0.01"."""
    return float(str(v).rsplit("=", 1)[-1]) if isinstance(v, str) else float(v)


def _point(g: pd.DataFrame) -> tuple:
    """(mean, std, n) of a summary row; a missing std (one seed) counts as 0."""
    sd = float(g["std"].iloc[0]) if "std" in g else 0.0
    return float(g["mean"].iloc[0]), (sd if sd == sd else 0.0), max(int(g["n"].iloc[0]), 1)


def _noise(a: tuple, b: tuple) -> float:
    """2 combined standard errors of two (mean, std, n) points: a step smaller than this does not break a shape."""
    return 2.0 * (a[1] ** 2 / a[2] + b[1] ** 2 / b[2]) ** 0.5


def _shape_holds(pts: List[tuple], direction: str) -> bool:
    """Whether (mean, std, n) points, in the order of the swept value, have the claimed shape: monotone (the last
    beyond the first in ``direction``, no step against it beyond noise), or ``falls_then_rises`` (a U: the lowest
    mean is an interior point, both ends above it beyond noise, no rise beyond noise before it, no fall after it)."""
    if len(pts) < 2:
        return False
    if direction == "falls_then_rises":
        low = min(range(len(pts)), key=lambda i: pts[i][0])
        if low in (0, len(pts) - 1):
            return False
        ends = all(e[0] - pts[low][0] > _noise(e, pts[low]) for e in (pts[0], pts[-1]))
        left = all(b[0] - a[0] <= _noise(a, b) for a, b in zip(pts[:low], pts[1:low + 1]))
        right = all(a[0] - b[0] <= _noise(a, b) for a, b in zip(pts[low:], pts[low + 1:]))
        return ends and left and right
    sign = -1.0 if direction == "decreasing" else 1.0
    against = any(-sign * (b[0] - a[0]) > _noise(a, b) for a, b in zip(pts, pts[1:]))
    return sign * (pts[-1][0] - pts[0][0]) > 0 and not against


def _monotone_status(claim: Dict[str, Any], c: Dict[str, Any], s: pd.DataFrame, keys: List[str]) -> tuple:
    """A ``{method, along, direction}`` claim: in every group of the other row keys, over the values of ``along``
    that ran (numeric order), the method's means must have the claimed shape (``_shape_holds``: monotone, or falling
    then rising), where a step within 2 combined standard errors (sqrt(s_a²/n_a + s_b²/n_b)) does not break it.
    Only the values with the group's most seeds are compared; one still running its seeds is left out and named
    (sweeps run seeds in order, so the same n is the same seeds)."""
    direction, along = claim.get("direction", "decreasing"), claim["along"]
    if direction not in DIRECTIONS:
        raise FedbenchError(f"claim {claim.get('text')!r}: direction must be one of {', '.join(DIRECTIONS)}, "
                            f"got {direction!r}")
    single = int(((s["method"] == claim["method"]) & (s["n"] == 1)).sum())
    s = s[(s["method"] == claim["method"]) & (s["n"] > 1)]   # one draw has no standard error to judge a step by
    if along not in s or s.empty:
        return "not run", f"no {claim['method']} cells along {along} with 2 or more seeds"
    keys = [k for k in keys if k != along]
    groups = s.groupby(keys, sort=False, dropna=False) if keys else [((), s)]
    held, failed, points, short, running, fewest = 0, [], [], 0, [], 10 ** 9
    for rv, g in groups:
        # a value still short of its row's seeds would put a mean over other draws beside the rest (the synthetic
        # draws of FedFisher's Fig. 1a differ 100x between seeds): left out, and named, until it has them
        most = int(g["n"].max())
        fewer = g["n"] < most
        running += [f"{_as_number(x):g} (n = {int(n)} of {most})" for x, n in g.loc[fewer, [along, "n"]].values]
        g = g[~fewer]
        if g[along].nunique() < 2:   # a single value has no shape: the group is not run yet, not a failure
            short += 1
            continue
        g = g.assign(_x=g[along].map(_as_number)).sort_values("_x")
        pts = [(float(m), float(sd) if sd == sd else 0.0, int(n)) for m, sd, n in zip(g["mean"], g["std"], g["n"])]
        fewest = min(fewest, min(p[2] for p in pts))
        sign = 1.0 if direction == "increasing" else -1.0
        moved = sum(sign * (b[0] - a[0]) > 0 for a, b in zip(pts, pts[1:]))
        shape = (f"lowest at {along} = {g['_x'].iloc[min(range(len(pts)), key=lambda i: pts[i][0])]:g}"
                 if direction == "falls_then_rises" else f"{moved} of {len(pts) - 1} steps {direction}")
        points.append(f"{len(pts)} values of {along}, n = {min(p[2] for p in pts)}–{max(p[2] for p in pts)}, {shape}")
        if _shape_holds(pts, direction):
            held += 1
        else:
            failed.append("/".join(norm_key(v) for v in (rv if isinstance(rv, tuple) else (rv,))) or "all")
    if not points:
        return "not run", f"no group with 2 or more values of {along} that ran {claim['method']} with 2 or more seeds"
    # the failing rows right after the count, as the other claim kinds put them, not after the notes below
    fails = f" (fails: {', '.join(failed)})" if failed else ""
    detail = f"{held}/{held + len(failed)} rows{fails}; " + "; ".join(points)
    if short:
        detail += f"; {short} row(s) with one value of {along} left out"
    if single:
        detail += f"; {single} value(s) with one seed left out"
    if running:
        verb = "it has its row's" if len(running) == 1 else "they have their row's"
        detail += f"; {along} {', '.join(running)} left out until {verb} seeds"
    want = claim.get("paper_seeds") or paper_seeds(c["meta"])   # a figure's seeds live in its sweep: the claim says
    if want and fewest < want:   # the values compared, not those left out above
        detail += f"; provisional: fewer than the paper's {want} seeds"
    return ("not reproduced" if failed else "reproduced"), detail


def _gap_anchors(results: Path) -> set:
    path = Path(results) / GAPS
    if not path.is_file():
        return set()
    return {m.group(1) for m in re.finditer(r'<a id="([^"]+)"></a>', path.read_text())}


_HEADER = ["# Reproduction scoreboard", "",
           "Generated by `make tables` (`python scripts/reproduce.py --collect-only --all`) from the committed run "
           "records (`results/records/`), the papers' numbers (`results/reference/`) and the campaign plan "
           "(`results/campaign.yaml`); `tests/test_scoreboard.py` checks that this file is up to date. "
           "A cell is **within tolerance** when |ours − paper| ≤ max(3 points, 2 × the combined standard error "
           "sqrt(s²/n + s_p²/n_p)); quick-profile and extra collections (`_<name>` suffix) do not count here.", ""]


def _cost_plan(plan: dict) -> List[str]:
    lines = ["## 1. Cost plan", "", plan.get("intro", "").strip(), "",
             "| table | paper cells | on data here | of which need a GPU | status here | "
             "CPU hours (paper profile, this machine) | order | notes |",
             "|---|---|---|---|---|---|---|---|"]
    planned = {(t["paper"], t["table"]): t for t in plan.get("tables") or []}
    for paper, table in available_tables():
        n_all, n_here, n_gpu = paper_cells(paper, table)
        t = planned.get((paper, table), {})
        lines.append(f"| {paper} {table} | {n_all} | {n_here} | {n_gpu} | {t.get('status', 'not planned')} | "
                     f"{t.get('cpu_hours', '?')} | {t.get('order', '')} | {t.get('notes', '')} |")
    listed = set(available_tables())
    for (paper, table), t in planned.items():
        if (paper, table) not in listed:
            lines.append(f"| {paper} {table} | — | — | — | {t.get('status', '')} | {t.get('cpu_hours', '?')} | "
                         f"{t.get('order', '')} | {t.get('notes', '')} |")
    return lines


def _scoreboard_table(by_table: Dict[tuple, List[str]], figures: Dict[tuple, List[str]], colls: dict,
                      cells: pd.DataFrame) -> List[str]:
    lines = ["", "## 2. Scoreboard", "",
             "Per paper table with committed paper-profile records: cells the paper prints, cells on data here "
             "(offline data; a paper cell that fedbench runs as several settings, FedProx's four μ, counts once per "
             "setting), of those the cells that need a GPU in practice (DENSE, 50-200 local epochs: §1), cells we "
             "ran, of which with all of the paper's seeds, within tolerance, outside, and "
             "of those the cells an experiment explains (§4: the paper vs its released code, the released solver, "
             "one paper number for several settings, a reading of an unstated setting, the released code's spread "
             "or a threshold re-count, each where its check is within tolerance); "
             "and whether the paper's winner of each row also wins here.", "",
             "| table | paper cells | on data here | need a GPU | run | all seeds | within | outside | "
             "outside, explained | row winner holds |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    keys = ("paper", "here", "gpu", "run", "run_gpu", "full", "within", "outside", "explained")
    tot = dict.fromkeys(keys, 0)
    for (paper, table), names in sorted(by_table.items()):
        n = _table_counts(paper, table, names, colls, cells)
        links = ", ".join(f"[{c}](tables/{c}.md)" for c in names)
        lines.append(f"| {paper} {table} ({links}) | {n['paper']} | {n['here']} | {n['gpu']} | {n['run']} | "
                     f"{n['full']} | {n['within']} | {n['outside']} | {n['explained']} | {n['held']}/{n['rows']} |")
        for k in keys:
            tot[k] += n[k]
    lines.append(f"| **all** | {tot['paper']} | {tot['here']} | {tot['gpu']} | {tot['run']} | {tot['full']} | "
                 f"{tot['within']} | {tot['outside']} | {tot['explained']} | |")
    cpu, cpu_run = tot["here"] - tot["gpu"], tot["run"] - tot["run_gpu"]
    unrecorded = [(p, t, here - gpu) for p, t in available_tables() if (p, t) not in by_table
                  for _, here, gpu in [paper_cells(p, t)] if here > gpu]
    lines += ["", f"Runnable on this CPU (on data here, less the cells that need a GPU): **{cpu}** cells, **{cpu_run}** "
                  f"of them run ({cpu - cpu_run} to run; §1 names the step of each table)"
                  + (f"; {tot['run_gpu']} cells that need a GPU were run as well" if tot["run_gpu"] else "")
                  + ("; tables without committed records yet: " + ", ".join(f"{p} {t} ({n} CPU-runnable cells)"
                                                                         for p, t, n in unrecorded)
                     if unrecorded else "") + "."]
    if figures:
        lines += ["", "Figures without printed numbers (their shape is checked in the claims below): " + "; ".join(
            f"{paper} {table} ({', '.join(f'[{n}](tables/{n}.md)' for n in names)}: "
            f"{sum(int((colls[n]['summary']['n'] > 0).sum()) for n in names)} points run)"
            for (paper, table), names in sorted(figures.items())) + "."]
    return lines


def _table_counts(paper: str, table: str, names: List[str], colls: dict, cells: pd.DataFrame) -> Dict[str, int]:
    """One scoreboard row's counts over the table's collections."""
    n_all, n_here, n_gpu = paper_cells(paper, table)
    run = sum(colls[n]["score"]["run"] for n in names)
    within = sum(colls[n]["score"]["within"] for n in names)
    mine = cells[(cells["paper"] == paper) & (cells["table"] == table)] if len(cells) else cells
    return {"paper": n_all, "here": n_here + setting_variants(names, colls),
            "gpu": n_gpu + setting_variants(names, colls, gpu=True), "run": run,
            "run_gpu": sum(_gpu_cells_run(colls[n]) for n in names),
            "full": sum(colls[n]["full_seeds"] for n in names), "within": within, "outside": run - within,
            "explained": int(mine["explained"].sum()) if len(mine) else 0,
            "rows": sum(colls[n]["score"]["rows"] for n in names),
            "held": sum(colls[n]["score"]["order_held"] for n in names)}


def _gpu_cells_run(coll: Dict[str, Any]) -> int:
    """Cells of a collection that were run (n > 0, a paper number, not a cost) and need a GPU (needs_gpu)."""
    s = coll["summary"]
    if not len(s) or "paper" not in s:
        return 0
    ran = s[(s["n"] > 0) & s["paper"].notna()]
    if "metric" in ran:
        ran = ran[~ran["metric"].map(is_cost)]
    epochs = _coll_epochs(coll)
    return sum(needs_gpu(r, epochs) for r in ran.to_dict("records"))


def _coll_epochs(coll: Dict[str, Any]) -> Any:
    """The local-epoch count of a collection's paper table when its reference has one (else None)."""
    meta = coll.get("meta") or {}
    if not meta.get("paper") or not has_reference(meta["paper"], meta.get("id")):
        return None
    return table_local_epochs(meta["paper"], meta["id"])


def _claims(plan: dict, colls: dict) -> List[str]:
    lines = ["", "## 3. Headline claims", "", "| paper | claim | checked on | status |", "|---|---|---|---|"]
    counts: Dict[str, int] = {}
    provisional = 0
    for cl in plan.get("claims") or []:
        status, detail = _claim_status(cl, colls)
        counts[status] = counts.get(status, 0) + 1
        provisional += "provisional:" in detail
        note = "; note: " + cl["note"].strip().replace("|", "\\|") if cl.get("note") else ""   # a bar would end the cell
        lines.append(f"| {cl['paper']} | {cl['text']} | {cl['collection']} | **{status}** ({detail}){note} |")
    lines.append("")
    lines.append("Claims: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
                 + (f" ({provisional} provisional: fewer than the paper's seeds)" if provisional else "") + "."
                 if counts else "No claims listed.")
    return lines


_VERDICT_TITLES = {"paper_vs_code": "Paper vs its released code", "solver": "The released solver diverges",
                   "one_number": "One paper number for several settings", "reading": "An unstated setting, read",
                   "noise": "Within the released code's own spread",
                   "threshold": "A threshold on a flat curve", "open": "Open: tested, not explained",
                   UNTESTED: "Untested"}


def _num(x) -> str:
    return "—" if x is None or pd.isna(x) else f"{float(x):.2f}"


def _gap_line(row: dict, colls: dict, verdicts: list, anchors) -> str:
    v = match_verdict(verdicts, row["paper"], row["table"], row["cell"], row["method"])
    anchor = v["anchor"] if v else f"{row['paper']}-{row['table']}"
    link = f"[why](gaps.md#{anchor})" if anchor in anchors else "**explanation missing**"
    delta = "—" if row["ours"] is None or pd.isna(row["ours"]) else f"{row['ours'] - row['paper_value']:+.2f}"
    line = (f"- {row['paper']} {row['table']} {row['cell']} {row['method']}: ours {_num(row['ours'])}, paper "
            f"{row['paper_value']:.2f} (Δ {delta}) — {link}")
    if v and v["verdict"] == "reading":
        there = _reading_cell(colls, v["reading"], row["cell"], row["method"])
        line += (f"; read as [{v['reading']}](tables/{v['reading']}.md): " +
                 ("not run there" if there is None else f"{there[0]:.2f} {'✓ within' if there[1] else '✗ outside'}"))
    if v and v["verdict"] == "threshold":
        there = _threshold_recount(colls, row["collection"], row["cell"], row["method"], v["shift"])
        line += (f"; re-counted at accuracy ≥ {there['threshold']:g} (shift {float(v['shift']):+g}): "
                 f"{_num(there['mean'])} {'✓ within' if row['explained'] else '✗ outside'}" if there else
                 "; no round history to re-count")
    if v and v["verdict"] == "noise":
        line += f"; with the released code's spread ± {float(v['spread']):.2f}: " + \
            ("✓ within" if row["explained"] else "✗ outside")
    return line


def _gaps(cells: pd.DataFrame, colls: dict, verdicts: list, anchors) -> List[str]:
    lines = ["", "## 4. Cells outside tolerance", "",
             "Each cell carries the verdict of the experiment that tested it (`verdicts:` in "
             "[campaign.yaml](campaign.yaml)) and links to that experiment in [gaps.md](gaps.md). A reading's cell "
             "counts as explained only where the reading's own runs are within tolerance of the paper; a threshold "
             "verdict's cell only where its re-count is.", ""]
    out = cells[~cells["within"]] if len(cells) else cells
    if not len(out):
        return lines + ["None among the cells run."]
    lines += ["| verdict | what the experiment found | cells | explained |", "|---|---|---|---|"]
    for key in list(VERDICTS) + [UNTESTED]:
        g = out[out["verdict"] == key]
        if len(g):
            meaning = VERDICTS.get(key, "no experiment yet: a hypothesis to test")
            lines.append(f"| {_VERDICT_TITLES[key]} | {meaning} | {len(g)} | {int(g['explained'].sum())} |")
    lines.append(f"| **all** | | {len(out)} | {int(out['explained'].sum())} |")
    for key in list(VERDICTS) + [UNTESTED]:
        g = out[out["verdict"] == key]
        if len(g):
            lines += ["", f"### {_VERDICT_TITLES[key]} ({len(g)})", ""]
            lines += [_gap_line(r, colls, verdicts, anchors) for r in g.to_dict("records")]
    return lines


def _scored(colls: dict) -> tuple:
    """(paper, table) -> collection names, for tables with printed numbers and for figures without, counting only
    the paper-profile collections without a ``_<name>`` suffix."""
    by_table: Dict[tuple, List[str]] = {}
    figures: Dict[tuple, List[str]] = {}   # committed figures without printed numbers: checked through claims
    for name, c in colls.items():
        if c["entry"].get("suffix") is None and c["entry"].get("profile", "paper") == "paper":
            key = (c["meta"]["paper"], c["meta"]["id"])
            (by_table if has_reference(*key) else figures).setdefault(key, []).append(name)
    return by_table, figures


CELL_COLUMNS = ["paper", "table", "collection", "cell", "method", "metric", "ours", "n", "never", "paper_value",
                "all_seeds", "within", "verdict", "explained"]


def _verdict_of(colls: dict, verdicts: list, row: dict, summary_row: dict | None = None,
                paper_n: int | None = None) -> tuple:
    """(verdict, explained, reading detail) of a cell outside tolerance; verdict "" for a cell within. A "noise"
    verdict re-checks the cell's summary row with the measured spread in place of the paper's ±."""
    if row["within"]:
        return "", False, None
    v = match_verdict(verdicts, row["paper"], row["table"], row["cell"], row["method"])
    if v is None:
        return UNTESTED, False, None
    if v["verdict"] == "noise":
        ok = summary_row is not None and within_tolerance({**summary_row, "paper_std": float(v["spread"])}, paper_n)
        return "noise", bool(ok), None
    if v["verdict"] == "threshold":
        there = _threshold_recount(colls, row["collection"], row["cell"], row["method"], v["shift"])
        ok = there is not None and summary_row is not None and \
            within_tolerance({**summary_row, **{k: there[k] for k in ("mean", "std", "n", "never")}}, paper_n)
        return "threshold", bool(ok), there
    if v["verdict"] != "reading":
        return v["verdict"], v["verdict"] in EXPLAINED, None
    there = _reading_cell(colls, v["reading"], row["cell"], row["method"])
    return "reading", bool(there and there[1]), there


def scoreboard_cells(colls: dict, verdicts: list | None = None) -> pd.DataFrame:
    """One line per scored cell run: where it is, ours (mean, n) and the paper's number, whether it has all of the
    paper's seeds and whether it is within tolerance (the scoreboard's counts, cell by cell); for a cell outside, the
    verdict of the experiment that tested it (campaign.yaml `verdicts:`; `untested` where none did) and whether that
    explains it."""
    by_table, _ = _scored(colls)
    rows = []
    for (paper, table), names in sorted(by_table.items()):
        for name in names:
            c = colls[name]
            paper_n = paper_seeds(c["meta"])
            for r in c["summary"].to_dict("records"):
                if r.get("paper") is None or pd.isna(r.get("paper")) or is_cost(r.get("metric")):
                    continue
                ok = within_tolerance(r, paper_n)
                if ok is None:
                    continue
                row = {"paper": paper, "table": table, "collection": name,
                       "cell": _cell_name(c, r), "method": r["method"],
                       "metric": r.get("metric") if isinstance(r.get("metric"), str) else c["metric"],
                       "ours": round(float(r["mean"]), 4) if not pd.isna(r["mean"]) else None,
                       "n": int(r["n"]), "never": int(r.get("never") or 0), "paper_value": float(r["paper"]),
                       "all_seeds": bool(paper_n and int(r["n"]) >= paper_n), "within": bool(ok)}
                row["verdict"], row["explained"], _ = _verdict_of(colls, verdicts or [], row, r, paper_n)
                rows.append(row)
    return pd.DataFrame(rows, columns=CELL_COLUMNS)


def plot_scoreboard(cells: pd.DataFrame, path: Path) -> Path:
    """One panel per paper table: ours against the paper's number, the diagonal with the tolerance floor around
    it, green within tolerance, orange outside but explained (§4), red outside and not, hollow where a cell has
    fewer than the paper's seeds. A cell whose runs
    partly never reached a threshold has no mean and is left out of the picture (it counts as outside)."""
    plt = pyplot()
    groups = list(cells.groupby(["paper", "table"], sort=True)) if len(cells) else []
    ncol = min(4, max(1, len(groups)))
    nrow = max(1, -(-len(groups) // ncol))
    fig, axes = plt.subplots(nrow, ncol, figsize=(3.3 * ncol, 3.2 * nrow), squeeze=False)
    for ax in axes.flat[len(groups):]:
        ax.axis("off")
    for ax, ((paper, table), g) in zip(axes.flat, groups):
        shown = g[g["ours"].notna()]
        lo = float(min(shown["ours"].min(), shown["paper_value"].min())) if len(shown) else 0.0
        hi = float(max(shown["ours"].max(), shown["paper_value"].max())) if len(shown) else 1.0
        pad = 0.05 * (hi - lo or 1.0)
        lo, hi = lo - pad, hi + pad
        floor = tolerance_floor(g["metric"].iloc[0])
        ax.fill_between([lo, hi], [lo - floor, hi - floor], [lo + floor, hi + floor], color="0.9", lw=0)
        ax.plot([lo, hi], [lo, hi], color="0.5", lw=0.8)
        explained = shown["explained"] if "explained" in shown else pd.Series(False, index=shown.index)
        kinds = ((shown["within"], "tab:green"), (~shown["within"] & explained.astype(bool), "tab:orange"),
                 (~shown["within"] & ~explained.astype(bool), "tab:red"))
        for mask, color in kinds:
            for full in (True, False):
                d = shown[mask & (shown["all_seeds"] == full)]
                ax.scatter(d["paper_value"], d["ours"], s=14, edgecolors=color, linewidths=0.8,
                           facecolors=color if full else "none")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        metric = str(g["metric"].iloc[0]).replace("summary.", "")
        ax.set_title(f"{paper} {table}: {int(g['within'].sum())}/{len(g)} within", fontsize=8)
        ax.set_xlabel(f"paper ({metric})", fontsize=7)
        ax.set_ylabel("ours", fontsize=7)
        ax.tick_params(labelsize=6)
    title = ("Ours against the paper, cell by cell (green within tolerance; outside: orange where an experiment "
             "explains it, red where not; hollow: fewer than the paper's seeds; grey band: the tolerance floor; "
             "results/REPRODUCTION.md)")
    return save_figure(fig, Path(path), cells, title)


def render(results: Path, output_root: Path, colls: dict | None = None, cells: pd.DataFrame | None = None) -> str:
    results = Path(results)
    plan = load_campaign(results)
    colls = collection_summaries(results, output_root) if colls is None else colls
    verdicts = plan.get("verdicts") or []
    cells = scoreboard_cells(colls, verdicts) if cells is None else cells
    by_table, figures = _scored(colls)
    lines = _HEADER + _cost_plan(plan) + _scoreboard_table(by_table, figures, colls, cells)
    lines += ["", f"![ours against the paper, cell by cell]({FIGURE}) (the cells of the table above; data: "
                  f"`{FIGURE.replace('.png', '_data.csv')}`)"]
    lines += _claims(plan, colls) + _gaps(cells, colls, verdicts, _gap_anchors(results))
    return "\n".join(lines) + "\n"


def write_scoreboard(results: Path, output_root: Path) -> Path:
    """REPRODUCTION.md and its figure (figures/scoreboard.png with scoreboard_data.csv)."""
    results = Path(results)
    path = results / "REPRODUCTION.md"
    colls = collection_summaries(results, output_root)
    cells = scoreboard_cells(colls, load_campaign(results).get("verdicts") or [])   # once, for the page and figure
    path.write_text(render(results, output_root, colls, cells))
    plot_scoreboard(cells, results / FIGURE)
    return path
