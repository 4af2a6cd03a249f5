"""Per-block KPI logs: one JSON line per inference and one per resource sample.

Files live in the run directory: ``<block>.latency.jsonl`` and ``<block>.resources.jsonl``.
Records are buffered in memory and written on ``flush()``: on the ``store`` control message,
at shutdown, and whenever the buffer reaches ``FLUSH_EVERY`` records so memory stays bounded.
"""
from __future__ import annotations

import json
import os
import threading
from blockflow import settings

#: Records buffered before a flush happens on its own.
FLUSH_EVERY = settings.KPI_FLUSH_EVERY

#: The latency components of thesis eq. 4.1, in milliseconds, in the order they happen.
LATENCY_FIELDS = ("wait", "deser", "dev", "inf", "share", "fwd", "total")


class KpiLog:
    def __init__(self, run_dir: str, name: str):
        os.makedirs(run_dir, exist_ok=True)
        self.paths = {
            "latency": os.path.join(run_dir, f"{name}.latency.jsonl"),
            "resources": os.path.join(run_dir, f"{name}.resources.jsonl"),
        }
        self._buf: dict[str, list[dict]] = {"latency": [], "resources": []}
        self._lock = threading.Lock()
        self.count = 0

    def add(self, kind: str, record: dict) -> None:
        with self._lock:
            self._buf[kind].append(record)
            if kind == "latency":
                self.count += 1
            full = len(self._buf[kind]) >= FLUSH_EVERY
        if full:
            self.flush()

    def flush(self) -> int:
        with self._lock:
            bufs, self._buf = self._buf, {"latency": [], "resources": []}
        written = 0
        for kind, records in bufs.items():
            if records:
                with open(self.paths[kind], "a") as f:
                    f.write("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))
                written += len(records)
        return written
