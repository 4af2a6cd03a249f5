"""Per-block KPI logs: one JSON line per inference and one per resource sample.

Files live in the run directory: ``<block>.latency.jsonl`` and ``<block>.resources.jsonl``,
both created (empty) when the block starts, so ``blockflow kpi`` can tell a block that has
no records yet from one that does not exist. Records are buffered in memory and written on
``flush()``: by a timer at least every ``FLUSH_INTERVAL`` seconds (so a block killed with
``kill -9`` loses at most the last second of records), on the ``store`` control message, at
shutdown, and whenever the buffer reaches ``FLUSH_EVERY`` records so memory stays bounded.

A latency record holds ``ts`` (wall clock at arrival, seconds), ``rid``, ``task``, the
``LATENCY_FIELDS`` in milliseconds, ``queue``, ``batch``, and the two instants of the hop
record the block appended to the message (Note [Hop timestamps]): with them, the records of
one ``rid`` in several blocks' logs line up on one clock.

Note [Hop timestamps]
---------------------
Each block appends one record to the message's ``hops`` (blocks/process.py ``send_output``;
it travels on with the tensor and comes back to the client with the result): ``b`` the
block's name, the eq. 4.1 components ``wait``, ``deser``, ``dev``, ``inf``, ``share`` in
milliseconds, and two instants in seconds, rounded to the microsecond:

- ``t_in``: the message was taken off the block's data socket;
- ``t_out``: the output is encoded and the message is handed to the next hop's socket
  (serialising the header and ``send`` come after it: they are the next hop's cost).

Both read ``time.perf_counter()``, which on Linux is ``clock_gettime(CLOCK_MONOTONIC)`` --
the same clock as ``time.monotonic()``, one clock for every process on the host (check with
``time.get_clock_info``; tests/process/test_dataplane.py compares a block's instants with the
client's). What one more block on a path costs, per request, is
``t_out[i] - t_out[i-1] - inf[i]``: its predecessor's send, the transit, its own receive,
decode and encode (experiments/hop_overhead.py reports it). ``ts`` stays wall-clock time for
humans; it may step, the two instants never do.

Note [Swap time]
----------------
A block of a shared process with a memory budget (blocks/cache.py) may find its weights parked
when a request's turn comes: the request waits for the swap-in (parking what makes room, the
weights' copy, on a GPU the graphs' capture) before its input is decoded. That time is part of
its ``wait`` (the stages still add up to ``total``) and, for the request (or every request of
the batch) that paid it, also its own field ``swap``, in milliseconds; a hit has none.
"""
from __future__ import annotations

import os
import threading

import msgspec

from blockflow.core import settings

#: Records buffered before a flush happens on its own.
FLUSH_EVERY = settings.KPI_FLUSH_EVERY
#: Longest time a record stays in memory only (seconds).
FLUSH_INTERVAL = settings.KPI_FLUSH_INTERVAL

#: The latency components of thesis eq. 4.1, in milliseconds, in the order they happen.
LATENCY_FIELDS = ("wait", "deser", "dev", "inf", "share", "fwd", "total")
#: The fields of a latency record added as a row (``add_row``), in the row's order.
LATENCY_ROW = ("ts", "rid", "task", *LATENCY_FIELDS, "t_in", "t_out", "queue", "batch")


def _plain(obj):
    """A value JSON has no type for: a NumPy or torch scalar (psutil and pynvml give plain
    numbers) becomes its number, anything else its text -- a record is never dropped for it."""
    item = getattr(obj, "item", None)
    return item() if callable(item) else str(obj)


#: JSON lines by msgspec (C): a flush holds the GIL that the inference thread needs next, and
#: the standard library's ``json.dumps`` took ~5.4 us a record against ~0.5 us for this (warm,
#: this 2-core VM), so a second of records at 1000 requests/s held it ~5 ms, a request's worth.
#: The lines read back with ``json.loads`` to the same records (tests/unit/test_kpilog.py).
_ENCODER = msgspec.json.Encoder(enc_hook=_plain)


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
        self._rows: list[tuple] = []  # latency records added with add_row, written after _buf's
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

    def add_row(self, row: tuple) -> None:
        """A latency record as a tuple in ``LATENCY_ROW``'s order, from the thread running the
        block's requests only (its ``run_lock``'s holder: Note [Run to completion] in
        blocks/process.py). It runs right after a request was sent on, while the next block starts on it --
        often on this core, where anything done here delays it -- so it does the least it can:
        one append (atomic under the GIL; ``flush`` swaps the buffer under the lock), the dict
        is made when the record is written."""
        self._rows.append(row)
        self.count += 1
        if len(self._rows) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> int:
        with self._write_lock:
            with self._lock:
                bufs, self._buf = self._buf, {"latency": [], "resources": []}
                rows, self._rows = self._rows, []
            written = 0
            bufs["latency"] += [dict(zip(LATENCY_ROW, row)) for row in rows]
            for kind, records in bufs.items():
                if records:
                    with open(self.paths[kind], "ab") as f:
                        f.write(_ENCODER.encode_lines(records))
                    written += len(records)
            return written

    def close(self) -> int:
        """Stop the timer and write what is left."""
        self._closed.set()
        return self.flush()
