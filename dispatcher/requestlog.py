"""The dispatcher's request log: one JSON line per answered request, read by ``GET /metrics``.

``<run_dir>/@dispatcher.requests.jsonl``, one record per reply::

    {"ts": 1700000000.1, "task": "classify", "code": "ok", "ms": 41.2,
     "stages": {"wait": 0.4, "deser": 0.1, "dev": 0.0, "inf": 38.0, "share": 0.2}}

``code`` is ``ok`` or the error code the client got (blockflow.core.protocol.ErrorCode). ``ms`` is
the time from the request's arrival at the dispatcher to its reply, present when the request
got that far. ``stages`` sums the eq. 4.1 components the blocks on the path reported in their
hops (successful requests only); what is left of ``ms`` is forwarding, transit between
processes and the dispatcher's own work, so the stages and the rest add up to ``ms``.
Only the dispatcher's main thread records and flushes: no lock. It flushes every second (its loop) and at exit.
"""
from __future__ import annotations

import json
import os
import time

from blockflow.core.protocol import ErrorCode

#: The codes a record may carry; anything else (a code only a forged message could bring) is "error".
CODES = {"ok", "error", *(c.value for c in ErrorCode)}

#: Components the blocks put in each hop, in the order they happen.
HOP_STAGES = ("wait", "deser", "dev", "inf", "share")


class RequestLog:
    #: Task label of requests that named no task served here (unknown ids, unreadable messages):
    #: one fixed label, so that clients cannot grow the metrics without bound.
    UNKNOWN_TASK = "_unknown"
    #: Records buffered before a flush happens on its own.
    FLUSH_EVERY = 1000

    def __init__(self, run_dir: str):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "@dispatcher.requests.jsonl")
        self._buf: list[str] = []

    def record(self, task: str, code: str, since: float | None, hops) -> None:
        rec = {"ts": time.time(), "task": task, "code": code if code in CODES else "error"}
        if since is not None:
            rec["ms"] = (time.monotonic() - since) * 1e3
        if code == "ok" and isinstance(hops, list):
            rec["stages"] = {k: sum(float(h.get(k, 0.0)) for h in hops if isinstance(h, dict)) for k in HOP_STAGES}
        self._buf.append(json.dumps(rec, separators=(",", ":")))
        if len(self._buf) >= self.FLUSH_EVERY:
            self.flush()

    def flush(self) -> int:
        if not self._buf:
            return 0
        lines, self._buf = self._buf, []
        with open(self.path, "a") as f:
            f.write("\n".join(lines) + "\n")
        return len(lines)
