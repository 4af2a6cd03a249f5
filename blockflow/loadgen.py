"""Load for a running server: the thesis's TaskGenerator, used by ``blockflow load`` and by every
experiment that sends requests (throughput, multiclient, batching, multi_gpu, soak, chaos).

:func:`generate_load` is the one loop. N clients (one :class:`~blockflow.client.Client` and one
thread each) start together and send for ``duration`` seconds:

- without ``rate`` each client is synchronous: the next request goes when the previous reply is back;
- with ``rate`` L, requests arrive as a Poisson process of L per second in total (L/N per client,
  exponential gaps from a seeded generator per client), whatever the replies do.

After the sending window the run waits up to ``drain`` seconds for the replies still due; a
request unanswered by then is recorded as ``unanswered`` (a reply arriving later is ignored), so
the run lasts ``duration + drain`` seconds at most whatever the server does. Every request gets a
:class:`Request` record: client, task, input index, send and reply times (seconds from the run's
start), status (``ok``, the server's error code, ``deadline`` when the client's ``timeout``
passed, ``unanswered``) and the server's message. A request's task and input are chosen per request by ``choose(rng, n)`` (default: the
tasks in turn, input 0), for topologies that serve several tasks.

:func:`run_load` is ``blockflow load``: one task, a summary dict, the records as CSV.
"""
from __future__ import annotations

import csv
import random
import sys
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .client import BlockFlowError, Client
from .kpi import percentile

#: Status of a request with no reply by the end of the run (sending window + drain).
UNANSWERED = "unanswered"
#: Status of a request whose deadline (``timeout``) passed on the client without a reply.
DEADLINE = "deadline"
OK = "ok"


@dataclass
class Request:
    """One request of a load run; times in seconds from the run's start (``LoadRun.t0``)."""
    client: int
    task: str
    sent: float
    input: int = 0
    done: float | None = None
    status: str = UNANSWERED
    message: str | None = None
    #: the reply (tensor, or ``Result`` with ``details``) when the run keeps results
    result: Any = None

    @property
    def rtt_ms(self) -> float | None:
        return None if self.done is None else (self.done - self.sent) * 1e3

    @property
    def ok(self) -> bool:
        return self.status == OK


@dataclass
class LoadRun:
    """What :func:`generate_load` returns: every request's record and the run's times."""
    records: list[Request]
    t0: float               #: time.monotonic() at the start of sending
    duration_s: float       #: the sending window
    elapsed_s: float        #: start to the end of the run (window + the wait for replies)
    duplicates: int = 0     #: replies the server sent twice (a bug: must be 0)
    late: int = 0           #: replies that came after their request's deadline
    settings: dict = field(default_factory=dict)

    @property
    def ok(self) -> list[Request]:
        return [r for r in self.records if r.ok]

    @property
    def drain_s(self) -> float:
        """Seconds after the sending window until the last reply (or the end of the wait)."""
        done = [r.done for r in self.records if r.done is not None]
        return max(0.0, max(done, default=self.duration_s) - self.duration_s)

    def statuses(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.records:
            counts[r.status] = counts.get(r.status, 0) + 1
        return counts

    def by_client(self) -> list[list[Request]]:
        clients = self.settings.get("clients") or (1 + max((r.client for r in self.records), default=0))
        out: list[list[Request]] = [[] for _ in range(clients)]
        for r in self.records:
            out[r.client].append(r)
        return out


def generate_load(address: str, tasks: str | list[str], *, inputs: torch.Tensor | list[torch.Tensor],
                  clients: int = 1, rate: float | None = None, duration: float = 10.0, seed: int = 0,
                  timeout: float = 30.0, drain: float = 0.0, token: str | None = None,
                  choose: Callable[[random.Random, int], tuple[str, int]] | None = None, details: bool = False,
                  keep_results: bool = False, on_reply: Callable[[Request, Future], None] | None = None,
                  progress: Callable[[float], None] | None = None) -> LoadRun:
    """Send load for ``duration`` s from ``clients`` clients (Poisson at ``rate``/s in total, or
    synchronous without ``rate``), wait up to ``drain`` s for the replies due, return the records.

    ``choose(rng, n)`` gives the task and the index into ``inputs`` of a client's ``n``-th request
    (``rng`` is that client's seeded generator); ``on_reply(record, future)`` runs as each reply
    arrives (on the client's I/O thread: keep it short); ``progress(seconds)`` is called a few
    times a second from the calling thread while the run lasts."""
    tasks = [tasks] if isinstance(tasks, str) else list(tasks)
    inputs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
    if clients < 1 or duration <= 0 or (rate is not None and rate <= 0) or not tasks or not inputs:
        raise ValueError("generate_load needs clients >= 1, duration > 0, rate > 0 (or None), a task and an input")
    choose = choose or (lambda rng, n: (tasks[n % len(tasks)], 0))
    records: list[Request] = []
    lock = threading.Lock()
    closed = threading.Event()  # set when the run is over: later replies are not recorded
    times = {"t0": 0.0, "stop_at": 0.0}
    stats = {"duplicates": 0, "late": 0}

    def start():  # runs once, in the last client to reach the barrier, before all are released
        times["t0"] = time.monotonic()
        times["stop_at"] = times["t0"] + duration

    start_together = threading.Barrier(clients, action=start)

    def send(c: Client, cid: int, n: int, rng: random.Random, gone: threading.Event, at: float) -> Future | None:
        """Send request ``n``; ``at`` is the clock read that put it inside the window, and its
        record's ``sent`` (a second read here could fall past the window's end)."""
        task, k = choose(rng, n)
        rec = Request(cid, task, at - times["t0"], input=k)
        with lock:
            records.append(rec)
        try:
            fut = c.submit(task, inputs[k], details=details)
        except BlockFlowError as exc:  # refused before sending (the client's queue is full)
            finish(rec, None, exc, gone)
            return None
        fut.add_done_callback(lambda f: finish(rec, f, f.exception(), gone))
        return fut

    def finish(rec: Request, fut: Future | None, exc: BaseException | None, gone: threading.Event) -> None:
        now = time.monotonic() - times["t0"]
        with lock:
            if closed.is_set() or gone.is_set():  # the run (or this client) gave up on it: unanswered
                return
            rec.done = now
            rec.status = _status_of(exc)
            rec.message = None if exc is None else str(exc)
            if exc is None and keep_results:
                rec.result = fut.result()
        if on_reply is not None and fut is not None:
            on_reply(rec, fut)

    def synchronous(c: Client, cid: int, rng: random.Random, gone: threading.Event) -> None:
        stop_at, n = times["stop_at"], 0
        while (now := time.monotonic()) < stop_at:
            fut = send(c, cid, n, rng, gone, now)
            n += 1
            if fut is not None:
                try:
                    fut.exception(timeout=max(0.0, stop_at + drain - time.monotonic()) + 0.001)
                except FutureTimeout:
                    return  # the run is over; this one stays unanswered

    def poisson(c: Client, cid: int, rng: random.Random, gone: threading.Event) -> None:
        stop_at, n, client_rate = times["stop_at"], 0, rate / clients
        pending: list[Future] = []
        next_t = times["t0"] + rng.expovariate(client_rate)
        while next_t < stop_at:
            pause = next_t - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            now = time.monotonic()
            if now >= stop_at:  # overslept past the window's end: that one is not sent
                break
            fut = send(c, cid, n, rng, gone, now)
            n += 1
            if fut is not None:
                pending.append(fut)
            next_t += rng.expovariate(client_rate)
        time.sleep(max(0.0, stop_at - time.monotonic()))
        end = stop_at + drain
        for fut in pending:  # the client (and its socket) must live until the replies are in
            try:
                fut.exception(timeout=max(0.0, end - time.monotonic()))
            except FutureTimeout:
                return

    def client_loop(cid: int) -> None:
        rng = random.Random(f"{seed}/{cid}")
        gone = threading.Event()  # set before the client closes: its close() fails what is still due
        try:
            with Client(address, timeout=timeout, token=token) as c:
                try:
                    c.ping(timeout=min(5.0, timeout))  # connected before the clock starts
                except (TimeoutError, BlockFlowError):
                    pass  # the requests will say what is wrong
                start_together.wait()
                try:
                    (synchronous if rate is None else poisson)(c, cid, rng, gone)
                finally:
                    gone.set()
                    with lock:
                        stats["duplicates"] += c.stats["duplicates"]
                        stats["late"] += c.stats["late"]
        except threading.BrokenBarrierError:
            pass  # another client failed to start; it raised
        except BaseException:
            start_together.abort()  # the others must not wait for this one at the barrier
            raise

    threads = [threading.Thread(target=client_loop, args=(i,), name=f"load-client-{i}", daemon=True)
               for i in range(clients)]
    for t in threads:
        t.start()
    t_wall = time.monotonic()
    for t in threads:
        while t.is_alive():
            t.join(0.25)
            if progress is not None and times["t0"]:
                progress(min(time.monotonic() - times["t0"], duration))
    closed.set()
    t0 = times["t0"] or t_wall
    with lock:
        return LoadRun(list(records), t0, duration, time.monotonic() - t0, stats["duplicates"], stats["late"],
                       {"clients": clients, "rate": rate, "duration_s": duration, "drain_s": drain, "seed": seed,
                        "tasks": tasks, "timeout_s": timeout})


def _status_of(exc: BaseException | None) -> str:
    if exc is None:
        return OK
    if isinstance(exc, BlockFlowError):
        return exc.code
    if isinstance(exc, TimeoutError):
        return DEADLINE
    return "error"


def run_load(address: str, task: str, clients: int = 1, batch: int = 1, duration: float = 10.0,
             rate: float | None = None, shape=(3, 224, 224), token: str | None = None, timeout: float = 30.0,
             seed: int = 0, out: str | None = None, progress: bool = False, *, drain: float) -> dict:
    """``blockflow load``: :func:`generate_load` for one task and a seeded input of ``(batch, *shape)``;
    requests still unanswered ``drain`` s after ``duration`` ends count as ``unfinished``, not as errors."""
    x = torch.randn((batch, *shape), generator=torch.Generator().manual_seed(seed))
    bar = _ProgressLine(duration) if progress else None
    run = generate_load(address, task, inputs=x, clients=clients, rate=rate, duration=duration, seed=seed,
                        timeout=timeout, token=token, drain=drain,
                        on_reply=bar.note if bar is not None else None, progress=bar.update if bar else None)
    if bar is not None:
        bar.close()
    answered = [r for r in run.records if r.status != UNANSWERED]
    ok = [r.rtt_ms for r in answered if r.ok]
    errors: dict[str, int] = {}
    messages: dict[str, str] = {}  # error code -> the server's message, the first time it came
    for r in sorted(answered, key=lambda r: r.sent):
        if not r.ok:
            errors[r.status] = errors.get(r.status, 0) + 1
            if r.message:
                messages.setdefault(r.status, r.message)
    elapsed = run.elapsed_s
    summary = {"task": task, "clients": clients, "batch": batch, "rate": rate, "duration_s": elapsed,
               "count": len(answered), "ok": len(ok), "errors": errors, "messages": messages,
               "unfinished": len(run.records) - len(answered),
               "throughput_rps": len(ok) / elapsed if elapsed else 0.0,
               "mean_ms": sum(ok) / len(ok) if ok else None,
               "p50_ms": percentile(ok, 0.5) if ok else None, "p90_ms": percentile(ok, 0.9) if ok else None,
               "p99_ms": percentile(ok, 0.99) if ok else None}
    if out:
        with open(out, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["client", "sent_s", "rtt_ms", "status"])
            for r in sorted(answered, key=lambda r: r.sent):
                w.writerow([r.client, f"{r.sent:.6f}", f"{r.rtt_ms:.4f}", r.status])
    return summary


class _ProgressLine:
    """One line on stderr, redrawn while the load runs (tqdm; nothing when stderr is not a terminal)."""

    def __init__(self, duration: float):
        from tqdm import tqdm
        self.ok = self.failed = 0
        self.bar = tqdm(total=round(duration, 1), unit="s", desc="load", leave=False, file=sys.stderr,
                        disable=not sys.stderr.isatty(), bar_format="{desc} {bar} {n:.0f}/{total:.0f}s {postfix}")

    def note(self, rec: Request, fut: Future) -> None:
        if rec.ok:
            self.ok += 1
        else:
            self.failed += 1

    def update(self, seconds: float) -> None:
        self.bar.n = min(round(seconds, 1), self.bar.total)
        self.bar.set_postfix_str(f"{self.ok} ok, {self.failed} errors")

    def close(self) -> None:
        self.bar.close()


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
