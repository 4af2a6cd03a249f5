"""The per-block KPI log (blocks/kpilog.py): what a flush writes reads back as the records added."""
from __future__ import annotations

import json
import os

import numpy as np
import torch

from blocks.kpilog import LATENCY_ROW, KpiLog


def _lines(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_flushed_records_read_back_as_added(tmp_path):
    log = KpiLog(str(tmp_path), "b1", interval=0)  # no timer: this test flushes
    assert _lines(log.paths["latency"]) == [] and _lines(log.paths["resources"]) == []  # present, empty
    rows = [(1796612198.3821144 + i, i, "classify", 0.0123, 0.0456, 0.0011, 0.0441, 0.0167, 0.0123, 0.2345,
             1234.567891 + i, 1234.568123 + i, i % 3, 1) for i in range(5)]
    for row in rows:
        log.add_row(row)
    log.add("latency", {"ts": 2.5, "rid": 99, "task": "t", "swap": 1.25})
    log.add("resources", {"ts": 3.0, "cpu": np.float32(12.5), "mem": np.int64(7), "gpu": torch.tensor(0.5),
                          "note": {"nvml": None, "dev": ("cuda", 0)}})
    assert log.count == 6
    assert log.flush() == 7
    latency = _lines(log.paths["latency"])
    # records added as dicts first, then the rows, each row a record in LATENCY_ROW's order
    assert latency[0] == {"ts": 2.5, "rid": 99, "task": "t", "swap": 1.25}
    assert latency[1:] == [dict(zip(LATENCY_ROW, row)) for row in rows]
    assert list(latency[1]) == list(LATENCY_ROW)
    # NumPy and torch scalars become their numbers; a tuple a list
    assert _lines(log.paths["resources"]) == [{"ts": 3.0, "cpu": 12.5, "mem": 7, "gpu": 0.5,
                                               "note": {"nvml": None, "dev": ["cuda", 0]}}]
    assert log.flush() == 0  # nothing left: nothing written twice
    assert len(_lines(log.paths["latency"])) == 6


def test_a_value_json_cannot_hold_is_written_as_text_not_dropped(tmp_path):
    log = KpiLog(str(tmp_path), "b2", interval=0)

    class Odd:
        def __str__(self):
            return "odd value"

    log.add("resources", {"ts": 1.0, "what": Odd()})
    assert log.close() == 1
    assert _lines(log.paths["resources"]) == [{"ts": 1.0, "what": "odd value"}]


def test_close_stops_the_timer_and_writes_the_rest(tmp_path):
    log = KpiLog(str(tmp_path), "b3", interval=60.0)  # the timer would not flush within the test
    log.add_row((1.0, 1, "t", *([0.1] * 7), 2.0, 3.0, 0, 1))
    assert log.close() == 1
    log._timer.join(5)
    assert not log._timer.is_alive()
    assert [r["rid"] for r in _lines(log.paths["latency"])] == [1]
    assert os.path.getsize(log.paths["resources"]) == 0
