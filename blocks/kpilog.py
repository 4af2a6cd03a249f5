"""Per-block KPI logs: one JSON line per inference and one per resource sample.

Files live in the run directory: ``<block>.latency.jsonl`` and ``<block>.resources.jsonl``,
both created (empty) when the block starts, so ``blockflow kpi`` can tell a block that has
no records yet from one that does not exist. Records are buffered in memory and written on
``flush()``: by a timer at least every ``FLUSH_INTERVAL`` seconds (so a block killed with
``kill -9`` loses at most the last second of records), on the ``store`` control message, at
shutdown, and whenever the buffer reaches ``FLUSH_EVERY`` records so memory stays bounded.
"""
from __future__ import annotations

import json
import os
import threading
from blockflow import settings

#: Records buffered before a flush happens on its own.
FLUSH_EVERY = settings.KPI_FLUSH_EVERY
#: Longest time a record stays in memory only (seconds).
FLUSH_INTERVAL = settings.KPI_FLUSH_INTERVAL

#: The latency components of thesis eq. 4.1, in milliseconds, in the order they happen.
LATENCY_FIELDS = ("wait", "deser", "dev", "inf", "share", "fwd", "total")


class KpiLog:
    def __init__(self, run_dir: str, name: str, interval: float = FLUSH_INTERVAL):
        os.makedirs(run_dir, exist_ok=True)
        self.paths = {
            "latency": os.path.join(run_dir, f"{name}.latency.jsonl"),
            "resources": os.path.join(run_dir, f"{name}.resources.jsonl"),
        }
        for path in self.paths.values():
            open(path, "a").close()  # present from the start: "no records yet", not "no such block"
        self._buf: dict[str, list[dict]] = {"latency": [], "resources": []}
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()  # the timer and a store/shutdown flush append in order
        self.count = 0
        self._closed = threading.Event()
        self._timer = None
        if interval > 0:
            self._timer = threading.Thread(target=self._flush_periodically, args=(interval,),
                                           name=f"kpi-flush-{name}", daemon=True)
            self._timer.start()

    def _flush_periodically(self, interval: float) -> None:
        while not self._closed.wait(interval):
            try:
                self.flush()
            except OSError:  # the run directory went away (server cleanup): nothing to keep
                pass

    def add(self, kind: str, record: dict) -> None:
        with self._lock:
            self._buf[kind].append(record)
            if kind == "latency":
                self.count += 1
            full = len(self._buf[kind]) >= FLUSH_EVERY
        if full:
            self.flush()

    def flush(self) -> int:
        with self._write_lock:
            with self._lock:
                bufs, self._buf = self._buf, {"latency": [], "resources": []}
            written = 0
            for kind, records in bufs.items():
                if records:
                    with open(self.paths[kind], "a") as f:
                        f.write("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))
                    written += len(records)
            return written

    def close(self) -> int:
        """Stop the timer and write what is left."""
        self._closed.set()
        return self.flush()
