"""``blockflow load``: the thesis's TaskGenerator. N clients send requests for one task.

Without ``--rate`` each client is synchronous (next request after the previous reply); with
``--rate L`` requests arrive as a Poisson process of L per second in total, spread over the
clients. Every request's round-trip time goes to ``--out`` (CSV) and a summary is printed.
"""
from __future__ import annotations

import csv
import random
import threading
import time
from concurrent.futures import Future

import torch

from .client import BlockFlowError, Client
from .kpi import percentile


def run_load(address: str, task: str, clients: int = 1, batch: int = 1, duration: float = 10.0,
             rate: float | None = None, shape=(3, 224, 224), token: str | None = None, timeout: float = 30.0,
             seed: int = 0, out: str | None = None) -> dict:
    rng = random.Random(seed)
    x = torch.randn((batch, *shape), generator=torch.Generator().manual_seed(seed))
    records: list[tuple] = []
    lock = threading.Lock()
    errors: dict[str, int] = {}
    stop_at = time.monotonic() + duration

    def note(t_sent: float, t_done: float, status: str, client_id: int):
        with lock:
            records.append((client_id, t_sent, (t_done - t_sent) * 1e3, status))
            if status != "ok":
                errors[status] = errors.get(status, 0) + 1

    def sync_client(cid: int):
        with Client(address, timeout=timeout, token=token) as c:
            while time.monotonic() < stop_at:
                t0 = time.monotonic()
                try:
                    c.infer(task, x)
                    status = "ok"
                except BlockFlowError as exc:
                    status = exc.code
                except TimeoutError:
                    status = "timeout"
                note(t0, time.monotonic(), status, cid)

    def poisson_client(cid: int, client_rate: float):
        local = random.Random(rng.random())
        inflight: list[tuple[float, Future]] = []
        with Client(address, timeout=timeout, token=token) as c:
            next_t = time.monotonic() + local.expovariate(client_rate)
            while time.monotonic() < stop_at or inflight:
                now = time.monotonic()
                if now >= next_t and now < stop_at:
                    fut = c.submit(task, x)
                    t_sent = now
                    fut.add_done_callback(lambda f, t=t_sent: note(t, time.monotonic(), _status(f), cid))
                    inflight.append((t_sent, fut))
                    next_t += local.expovariate(client_rate)
                inflight = [(t, f) for t, f in inflight if not f.done()]
                time.sleep(max(0.0, min(next_t - time.monotonic(), 0.005)) if time.monotonic() < stop_at else 0.005)

    t_start = time.monotonic()
    threads = [threading.Thread(target=poisson_client if rate else sync_client,
                                args=(i, rate / clients) if rate else (i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t_start
    ok = [r[2] for r in records if r[3] == "ok"]
    summary = {"task": task, "clients": clients, "batch": batch, "rate": rate, "duration_s": elapsed,
               "count": len(records), "ok": len(ok), "errors": errors,
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
    return (f"task {s['task']}: {s['count']} requests in {s['duration_s']:.1f}s, {s['ok']} ok, "
            f"errors {s['errors'] or 0}; throughput {s['throughput_rps']:.2f}/s; "
            f"latency ms mean {f(s['mean_ms'])} p50 {f(s['p50_ms'])} p90 {f(s['p90_ms'])} p99 {f(s['p99_ms'])}")
