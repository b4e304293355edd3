"""Shared test fixtures."""
import os

import pytest
import torch

from fedbench.papers import load_papers

load_papers()   # the entry point every script calls: the papers' row keys, labels, plots and studies into report

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one xdist worker per core: one torch thread each, so workers do not oversubscribe the cores
    # (tests that need more threads set them and restore them).
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny problems: intra-op threads only add contention on shared CPUs (restored after the module)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def ok_record(run_id: str, algorithm: str, **fields):
    """A finished record as the runner writes it (status ok, current numerics) for table/figure tests."""
    from fedbench.numerics import current
    return {"run_id": run_id, "status": "ok", "algorithm": algorithm, "numerics": current(algorithm), **fields}


@pytest.fixture(autouse=True)
def _no_committed_records(tmp_path_factory, monkeypatch):
    """Tests never see (or skip a run because of) the repository's committed records (results/records), nor go on
    from its parked checkpoints (results/checkpoints)."""
    monkeypatch.setenv("FEDBENCH_RECORDS", str(tmp_path_factory.mktemp("committed_records")))
    monkeypatch.setenv("FEDBENCH_CHECKPOINTS", str(tmp_path_factory.mktemp("parked_checkpoints")))
