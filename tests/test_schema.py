"""The record schema (fedbench/results/schema.py): history columns, non-metrics and totals come from RoundLog's
fields, so a new per-round cost is one field."""
import math
from dataclasses import dataclass

from fedbench.results.schema import (HISTORY_COLUMNS, RoundLog, cost, final_metrics, history_columns, non_metrics,
                                     totals)

COSTS = ("train_loss", "cached_clients", "uplink_bytes", "downlink_bytes", "client_train_s", "client_train_compute_s",
         "client_post_s", "client_post_compute_s", "server_s", "eval_s")


def _log(r, **kw):
    base = dict(train_loss=0.5, uplink_bytes=100 * r, downlink_bytes=10 * r, client_train_s=1.0 * r,
                client_train_compute_s=2.0 * r, client_post_s=0.25, client_post_compute_s=0.5, server_s=0.125,
                eval_s=0.0625)
    return RoundLog(r, {"accuracy": 50.0 + r, "nll": 1.0 / r}, **{**base, **kw})


def test_columns_and_non_metrics_are_the_fields():
    assert HISTORY_COLUMNS == ("round", "accuracy", "nll", "ece", "mse", "local_accuracy") + COSTS
    assert non_metrics() == frozenset(("round",) + COSTS)


def test_row_order_and_values():
    row = _log(2, cached_clients=True).row()
    assert list(row) == ["round", "accuracy", "nll", *COSTS]
    assert row["round"] == 2 and row["accuracy"] == 52.0 and row["cached_clients"] is True and row["uplink_bytes"] == 200


def test_totals_and_final_metrics():
    history = [_log(1).row(), _log(2).row(), _log(3).row()]
    t = totals(history)
    assert t["communication"] == {"uplink_bytes": 600, "downlink_bytes": 60}
    assert t["timing"] == {"client_train_s": 6.0, "client_train_compute_s": 12.0, "client_post_s": 0.75,
                           "client_post_compute_s": 1.5, "server_s": 0.375, "eval_s": 0.1875}
    assert final_metrics(history) == {"accuracy": 53.0, "nll": 1.0 / 3}
    assert totals([])["communication"] == {"uplink_bytes": 0, "downlink_bytes": 0} and final_metrics([]) == {}
    assert math.isnan(RoundLog(1, {}).train_loss)


def test_a_new_cost_field_is_one_edit():
    @dataclass
    class WithUpload(RoundLog):
        upload_s: float = cost("timing")          # the one edit
        gpu_bytes: int = cost(None, 0)            # a column that is not summed

    log = WithUpload(1, {"accuracy": 1.0}, upload_s=0.75, gpu_bytes=3)
    assert history_columns(WithUpload)[-2:] == ("upload_s", "gpu_bytes")
    assert {"upload_s", "gpu_bytes"} <= non_metrics(WithUpload)
    rows = [log.row(), WithUpload(2, {"accuracy": 2.0}, upload_s=0.5).row()]
    assert list(rows[0])[-2:] == ["upload_s", "gpu_bytes"]
    t = totals(rows, WithUpload)
    assert t["timing"]["upload_s"] == 1.25 and "gpu_bytes" not in t.get("timing", {}) | t["communication"]
    assert final_metrics(rows, WithUpload) == {"accuracy": 2.0}
