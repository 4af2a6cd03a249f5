"""blockflow kpi's summaries: warm-up dropped, CPU over the measured window, the newest run."""
from __future__ import annotations

import json
import os
import time

import pytest

from blockflow.kpi import blocks_in, newest_run, summarize_block


def write(path, records):
    with open(path, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))


def lat(ts, inf):
    return {"ts": ts, "wait": 0.1, "deser": 0.1, "dev": 0.0, "inf": inf, "share": 0.1, "fwd": 0.1,
            "total": inf + 0.4, "queue": 0}


def test_warmup_window_errors_and_newest_run(tmp_path):
    old, new = tmp_path / "runs" / "old", tmp_path / "runs" / "new"
    for d in (old, new):
        os.makedirs(d)
    write(old / "b.latency.jsonl", [lat(1.0, 1.0)])
    # 3 warm-up inferences (slow), 4 measured ones, one error record; the block idled long before
    records = [lat(100.0 + i, 50.0) for i in range(3)] + [lat(200.0 + i, 2.0) for i in range(4)]
    records.append({"ts": 203.5, "rid": 9, "error": "block_failed"})
    write(new / "b.latency.jsonl", records)
    write(new / "b.resources.jsonl", [{"ts": 10.0, "cpu_percent": 0.0, "rss_mb": 100.0},
                                      {"ts": 150.0, "cpu_percent": 0.0, "rss_mb": 100.0},
                                      {"ts": 201.0, "cpu_percent": 90.0, "rss_mb": 120.0},
                                      {"ts": 203.0, "cpu_percent": 70.0, "rss_mb": 120.0}])
    write(new / "@dispatcher.requests.jsonl", [{"ts": 200.0, "task": "t", "code": "ok", "ms": 3.0}])
    now = time.time()
    os.utime(old, (now - 100, now - 100))
    os.utime(new, (now, now))

    assert newest_run(str(tmp_path)) == str(new)
    assert newest_run(str(new)) == str(new)
    assert blocks_in(str(new)) == ["b"]  # the dispatcher's log is not a block
    s = summarize_block(str(new), "b", skip=3)
    assert s["count"] == 4 and s["latency_ms"]["inf"]["mean"] == 2.0
    assert s["resources"]["cpu_percent"] == 80.0  # the idle samples before the window do not dilute it
    everything = summarize_block(str(new), "b", skip=0)
    assert everything["count"] == 7 and everything["resources"]["cpu_percent"] < 80.0


def test_a_value_written_as_null_is_left_out_not_averaged(tmp_path):
    """msgspec writes a NaN (a value the block could not measure) as null in the JSON lines
    (blocks/kpilog.py); the summary leaves it out instead of failing on it or averaging it."""
    records = [lat(1.0 + i, 2.0) for i in range(3)]
    records[1]["inf"] = None
    records[2]["wait"] = float("nan")  # the standard library's writer: NaN, read back as a float
    write(tmp_path / "b.latency.jsonl", records)
    write(tmp_path / "b.resources.jsonl", [{"ts": 1.5, "cpu_percent": 40.0, "power_w": None},
                                           {"ts": 2.5, "cpu_percent": None, "power_w": None}])
    s = summarize_block(str(tmp_path), "b")
    assert s["count"] == 3
    assert s["latency_ms"]["inf"]["mean"] == 2.0 and s["latency_ms"]["wait"]["mean"] == 0.1
    assert s["latency_ms"]["overhead"]["mean"] == pytest.approx(0.4)  # only the records with both numbers
    assert s["resources"]["cpu_percent"] == 40.0 and "power_w" not in s["resources"]
