"""``blockflow load``: the thesis's TaskGenerator. N clients send requests for one task.

Without ``--rate`` each client is synchronous (next request after the previous reply); with
``--rate L`` requests arrive as a Poisson process of L per second in total, spread over the
clients. Every request's round-trip time goes to ``--out`` (CSV) and a summary is printed, with
the server's own message for each kind of error. The run lasts ``duration`` seconds whatever the
server does: requests still unanswered at the end count as ``unfinished``, not as errors.
"""
from __future__ import annotations

import csv
import random
import sys
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from .client import BlockFlowError, Client
from .kpi import percentile


def run_load(address: str, task: str, clients: int = 1, batch: int = 1, duration: float = 10.0,
             rate: float | None = None, shape=(3, 224, 224), token: str | None = None, timeout: float = 30.0,
             seed: int = 0, out: str | None = None, progress: bool = False) -> dict:
    rng = random.Random(seed)
    x = torch.randn((batch, *shape), generator=torch.Generator().manual_seed(seed))
    records: list[tuple] = []
    lock = threading.Lock()
    errors: dict[str, int] = {}
    messages: dict[str, str] = {}  # error code -> the server's message, the first time it came
    unfinished = [0]
    stop_at = time.monotonic() + duration

    def note(t_sent: float, t_done: float, status: str, client_id: int, message: str | None = None):
        with lock:
            records.append((client_id, t_sent, (t_done - t_sent) * 1e3, status))
            if status != "ok":
                errors[status] = errors.get(status, 0) + 1
                if message:
                    messages.setdefault(status, message)

    def sync_client(cid: int):
        with Client(address, timeout=timeout, token=token) as c:
            while time.monotonic() < stop_at:
                t0 = time.monotonic()
                fut = c.submit(task, x)
                try:
                    fut.result(timeout=max(stop_at - t0, 0.0) + 0.001)
                except FutureTimeout:
                    with lock:
                        unfinished[0] += 1  # the run is over; this one is not counted either way
                    return
                except Exception:
                    pass
                note(t0, time.monotonic(), _status(fut), cid, _message(fut))

    def poisson_client(cid: int, client_rate: float):
        local = random.Random(rng.random())
        inflight: list[tuple[float, Future]] = []
        with Client(address, timeout=timeout, token=token) as c:
            next_t = time.monotonic() + local.expovariate(client_rate)
            while time.monotonic() < stop_at:
                now = time.monotonic()
                if now >= next_t and now < stop_at:
                    fut = c.submit(task, x)
                    t_sent = now
                    fut.add_done_callback(lambda f, t=t_sent: note(t, time.monotonic(), _status(f), cid, _message(f)))
                    inflight.append((t_sent, fut))
                    next_t += local.expovariate(client_rate)
                inflight = [(t, f) for t, f in inflight if not f.done()]
                time.sleep(max(0.0, min(next_t - time.monotonic(), 0.005)))
            with lock:
                unfinished[0] += sum(1 for _, f in inflight if not f.done())

    t_start = time.monotonic()
    threads = [threading.Thread(target=poisson_client if rate else sync_client,
                                args=(i, rate / clients) if rate else (i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    bar = _ProgressLine(duration, records, lock) if progress else None
    for t in threads:
        while t.is_alive():
            t.join(0.5)
            if bar is not None:
                bar.update()
    if bar is not None:
        bar.close()
    elapsed = time.monotonic() - t_start
    ok = [r[2] for r in records if r[3] == "ok"]
    summary = {"task": task, "clients": clients, "batch": batch, "rate": rate, "duration_s": elapsed,
               "count": len(records), "ok": len(ok), "errors": errors, "messages": messages,
               "unfinished": unfinished[0],
               "throughput_rps": len(ok) / elapsed if elapsed else 0.0,
               "mean_ms": sum(ok) / len(ok) if ok else None,
               "p50_ms": percentile(ok, 0.5) if ok else None, "p90_ms": percentile(ok, 0.9) if ok else None,
               "p99_ms": percentile(ok, 0.99) if ok else None}
    if out:
        with open(out, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["client", "sent_s", "rtt_ms", "status"])
            for r in sorted(records, key=lambda r: r[1]):
                w.writerow([r[0], f"{r[1] - t_start:.6f}", f"{r[2]:.4f}", r[3]])
    return summary


class _ProgressLine:
    """One line on stderr, redrawn while the load runs (tqdm; nothing when stderr is not a terminal)."""

    def __init__(self, duration: float, records: list, lock):
        from tqdm import tqdm
        self.records, self.lock, self.t0 = records, lock, time.monotonic()
        self.bar = tqdm(total=round(duration, 1), unit="s", desc="load", leave=False, file=sys.stderr,
                        disable=not sys.stderr.isatty(), bar_format="{desc} {bar} {n:.0f}/{total:.0f}s {postfix}")

    def update(self) -> None:
        with self.lock:
            ok = sum(1 for r in self.records if r[3] == "ok")
            failed = len(self.records) - ok
        self.bar.n = min(round(time.monotonic() - self.t0, 1), self.bar.total)
        self.bar.set_postfix_str(f"{ok} ok, {failed} errors")

    def close(self) -> None:
        self.bar.close()


def _message(fut: Future) -> str | None:
    exc = fut.exception()
    return None if exc is None else str(exc)


def _status(fut: Future) -> str:
    exc = fut.exception()
    if exc is None:
        return "ok"
    if isinstance(exc, BlockFlowError):
        return exc.code
    if isinstance(exc, TimeoutError):
        return "timeout"
    return "error"


def format_summary(s: dict) -> str:
    f = lambda v: "-" if v is None else f"{v:.2f}"
    failed = sum(s["errors"].values())
    lines = [f"task {s['task']}: {s['count']} requests in {s['duration_s']:.1f}s, {s['ok']} ok, {failed} failed"
             + (f", {s['unfinished']} unanswered at the end" if s.get("unfinished") else "")
             + f"; throughput {s['throughput_rps']:.2f}/s; "
             f"latency ms mean {f(s['mean_ms'])} p50 {f(s['p50_ms'])} p90 {f(s['p90_ms'])} p99 {f(s['p99_ms'])}"]
    for code, n in sorted(s["errors"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  {n} x {code}: {s.get('messages', {}).get(code, '(no message)')}")
    return "\n".join(lines)
