"""Where a request's time goes, step by step (issue 40, item 1): a per-hop budget.

Two tables, both medians of interleaved rounds with their spread (the lowest and highest of
the rounds' medians), on the CPU (or ``--device cuda``):

``path``: a steady stream of requests through the dispatcher and a chain of ``--chain``
identity TensorMQ blocks (the handle of a ResNet50 block1 output, 3.2 MB at batch 1, is
forwarded: no tensor bytes move between blocks), measured by the code on the path itself. Per
request the client stamps its send and the reply's arrival on CLOCK_MONOTONIC, which the
blocks' hop records use too (Note [Hop timestamps] in blocks/kpilog.py), so the request splits
into:

- ``way in``: the client library's send (header, I/O thread hand-over), the transfer of the
  tensor's bytes to the dispatcher, the dispatcher's copy into a slot and send, and the first
  block's receive, up to its ``t_in``;
- per block, its own KPI components (blocks/process.py ``send_output``): ``wait`` (header
  decode and admission, queue), ``deser`` (slot lookup and mapping), ``dev``, ``inf`` (the
  model: here an identity), ``share`` (the output's encode and hop record), and from its KPI
  log ``fwd`` (the header's serialisation and the send);
- ``transit``: from a block's ``t_out`` to the next block's ``t_in`` (its send, the socket, the
  next one's wake-up and receive): ``fwd`` is the sender's part of it;
- ``way out``: from the last block's ``t_out`` to the reply in the client's hands (the
  dispatcher's receive, its read of the slot, the bytes back, the client's I/O thread and the
  future).

``steps``: the steps of a block's hot path one at a time, each on the real function in this
process, warm (what a step costs at least; in a block its caches are colder): receive a
header-only message, decode a data header, open a shared-memory slot from its descriptor (the
slot lookup), forward the handle (encode), write the hop record, serialise the header, send
it, add the KPI row, release the slot; a hand-over between two threads (a ZeroMQ ``inproc``
pair, as the client's I/O thread and a block's control thread get messages) and the client
library's encoding of a request (descriptor, header).

``shapes`` (experiments/path_shapes.py; ``--shapes 0`` skips it): the same path's crossings
alone, as bare pyzmq processes moving a header, the way BlockFlow wires them (``today``), with
the last stage answering the client directly (``direct answer``) and with no dispatcher, in turns
with BlockFlow's own round trip through as many identity blocks (1 KB, lent slots): what the
dispatcher's place on the path costs, and what BlockFlow's code adds to the crossings.

``--profile DIR`` records flame graphs (py-spy, the ``bench`` extra) of every block, the
dispatcher and this process (the client) during the ``path`` rounds, one SVG each.

Run::

    python -m experiments.hop_budget [--quick] [--rounds R] [--n N] [--chain K]
        [--device cpu|cuda] [--shapes N] [--profile DIR] [--out DIR]
"""
from __future__ import annotations

import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

log = logging.getLogger("experiments.hop_budget")

#: ResNet50's block1 output at batch 1: the 3.2 MB of the issue's goal.
SHAPE = (1, 256, 56, 56)
#: py-spy's output formats (``--profile-format``) and their files' suffixes.
SUFFIX = {"flamegraph": "svg", "raw": "txt", "speedscope": "json"}
#: The order of the path table's rows (per block rows are repeated per block).
BLOCK_STEPS = ("wait", "deser", "dev", "inf", "share", "fwd")


def spread(round_medians: list[float]) -> dict:
    """A figure from interleaved rounds: the median of the rounds' medians and their range."""
    if not round_medians:
        return {"median": None, "low": None, "high": None, "rounds": 0}
    return {"median": statistics.median(round_medians), "low": min(round_medians), "high": max(round_medians),
            "rounds": len(round_medians)}


def _toy_repo() -> str:
    from experiments.hop_overhead import _toy_repo as toy
    return toy("identity")  # the same identity module hop_overhead serves


# -- the path -------------------------------------------------------------------------------
def path_round(client, task: str, x, n: int) -> list[dict]:
    """``n`` requests one after the other; per request its parts in milliseconds."""
    parts = []
    for _ in range(n):
        t_send = time.perf_counter()
        r = client.infer_details(task, x)
        t_back = time.perf_counter()
        hops = r.hops
        rec = {"way_in": (hops[0]["t_in"] - t_send) * 1e3, "way_out": (t_back - hops[-1]["t_out"]) * 1e3,
               "total": (t_back - t_send) * 1e3, "server": r.server_ms}
        for i, h in enumerate(hops):
            for key in ("wait", "deser", "dev", "inf", "share"):
                rec[f"{h['b']}.{key}"] = h.get(key, 0.0)
            if i:
                rec[f"{h['b']}.transit"] = (h["t_in"] - hops[i - 1]["t_out"]) * 1e3
        parts.append(rec)
    return parts


def read_fwd(run_dir: str, names: list[str], since: dict) -> dict:
    """Each block's ``fwd`` (its send) from its KPI log, rows after ``since`` (name -> rows seen)."""
    import json
    out = {}
    for nm in names:
        with open(os.path.join(run_dir, f"{nm}.latency.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        out[nm] = [r["fwd"] for r in rows[since.get(nm, 0):] if "fwd" in r]
        since[nm] = len(rows)
    return out


class Profiler:
    """py-spy flame graphs of some processes for ``seconds`` (started now, joined by ``wait``)."""

    def __init__(self, pids: dict[str, int], out: str, seconds: float, rate: int = 250, fmt: str = "flamegraph"):
        exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
        if not os.path.exists(exe):
            raise SystemExit("--profile needs py-spy: pip install py-spy (the [bench] extra)")
        os.makedirs(out, exist_ok=True)
        # --nonblocking: the profiled process is never paused, so the profile does not slow what it measures
        self.procs = [subprocess.Popen([exe, "record", "--nonblocking", "-r", str(rate), "-d", str(int(seconds)),
                                        "-p", str(pid), "-o", os.path.join(out, f"{name}.{SUFFIX[fmt]}"), "-f", fmt],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                      for name, pid in pids.items()]

    def wait(self, timeout: float) -> None:
        for p in self.procs:
            try:
                _, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
            if p.returncode:
                log.warning("py-spy exited %s: %s", p.returncode, err.decode(errors="replace")[-400:])


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds a process has used so far, by kind of thread: ``main`` (the thread the process
    started with: a block's inference thread, the dispatcher's loop), ``zmq`` (libzmq's I/O
    threads, which move every message between the socket and the kernel) and ``other`` (control,
    monitor, KPI flush, a client's I/O thread)."""
    out = {"main": 0.0, "zmq": 0.0, "other": 0.0}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                comm = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])  # time on a CPU, in ns: finer than the 10 ms ticks of stat
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
        kind = "main" if int(tid) == pid else "zmq" if comm.startswith("ZMQbg") else "other"
        out[kind] += ns / 1e9
    return out


def cpu_per_request(pids: dict[str, int], run) -> tuple[dict, int]:
    """CPU milliseconds per request of each process and kind of thread while ``run()`` serves
    its requests (it returns how many)."""
    before = {nm: thread_cpu(pid) for nm, pid in pids.items()}
    served = run()
    after = {nm: thread_cpu(pid) for nm, pid in pids.items()}
    return {f"{nm}.cpu_{kind}": (after[nm][kind] - before[nm][kind]) * 1e3 / served
            for nm in pids for kind in before[nm]}, served


#: ``--client``: how the client's tensor and its result travel (Note [Lent slots] in
#: dispatcher/lending.py): ``shm`` through slots the dispatcher lends (what a client on the
#: dispatcher's host does), ``bytes`` in the messages (``Client(shared_memory=False)``, a client
#: on another host), ``both`` in interleaved rounds, the bytes way's keys prefixed ``bytes:``.
CLIENT_WAYS = {"shm": [("", True)], "bytes": [("", False)], "both": [("", True), ("bytes:", False)]}


def measure_path(rounds: int, n: int, chain: int, device: str, profile: str | None,
                 profile_seconds: float, idle_seconds: float, profile_format: str = "flamegraph",
                 client: str = "shm") -> dict:
    from blockflow.client import Client
    from blockflow.core.protocol import DISPATCHER
    from blockflow.standalone import StandalonePipeline

    repo = _toy_repo()
    names = [f"i{k}" for k in range(chain)]
    try:
        with StandalonePipeline(repo, {nm: "toy/identity.pt" for nm in names}, {"hop": names}, transport="tensormq",
                                threads=1, env={"BLOCKFLOW_KPI_FLUSH_EVERY": "100000"}, device=device,
                                shm_prefix="bfbench-budget") as p:
            x = torch.randn(*SHAPE)
            since: dict = {}
            per_round: dict[str, list[float]] = {}
            ways = [(prefix, Client(p.address, timeout=60, shared_memory=shm)) for prefix, shm in CLIENT_WAYS[client]]
            try:
                for _, c in ways:
                    path_round(c, "hop", x, 20)  # warm-up: slots (lent ones too), mappings, sockets
                c = ways[0][1]
                for nm in names:
                    p.command(nm, "store")
                read_fwd(p.run, names, since)
                pids = {nm: p.procs[nm].pid for nm in names}
                pids["dispatcher"], pids["client"] = p.procs[DISPATCHER].pid, os.getpid()
                if profile:
                    profiler = Profiler(pids, profile, profile_seconds, fmt=profile_format)
                    stop = time.monotonic() + profile_seconds + 1
                    while time.monotonic() < stop:  # steady load for the whole profile
                        path_round(c, "hop", x, 50)
                    profiler.wait(60)
                for r in range(rounds):
                    for prefix, c in ways[r % 2:] + ways[:r % 2]:  # each way goes first in turn
                        parts = []

                        def serve():
                            parts.extend(path_round(c, "hop", x, n))
                            return len(parts)
                        cpu, _ = cpu_per_request(pids, serve)
                        for key, val in cpu.items():
                            per_round.setdefault(prefix + key, []).append(val)
                        for nm in names:
                            p.command(nm, "store")
                        fwd = read_fwd(p.run, names, since)
                        for key in parts[0]:
                            per_round.setdefault(prefix + key, []).append(statistics.median(r[key] for r in parts))
                        for nm, vals in fwd.items():
                            if vals:
                                per_round.setdefault(f"{prefix}{nm}.fwd", []).append(statistics.median(vals))
                # idle: what each process burns with no request to serve (the goal: <= 1% of a core)
                idle_before = {nm: sum(thread_cpu(pid).values()) for nm, pid in pids.items() if nm != "client"}
                t0 = time.monotonic()
                time.sleep(idle_seconds)  # the measurement itself: a window with no traffic
                spent = time.monotonic() - t0
                idle = {nm: (sum(thread_cpu(pids[nm]).values()) - v) / spent * 100 for nm, v in idle_before.items()}
            finally:
                for _, c in ways:
                    c.close()
            left = p.stop()
            if left["left"] != {"slots": [], "sockets": []}:
                log.warning("left behind: %s", left["left"])
    finally:
        shutil.rmtree(repo, ignore_errors=True)
    out = {key: spread(vals) for key, vals in per_round.items()}
    out["idle_cpu_pct"] = idle
    return out


# -- the steps, one at a time ---------------------------------------------------------------
def _time(fn, iters: int) -> float:
    """Median microseconds of one call of ``fn`` over ``iters`` calls."""
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def measure_steps(rounds: int, iters: int) -> dict:
    """The block's hot path, step by step, on the real functions (see the module docstring)."""
    import zmq

    from blockflow.blocks.kpilog import KpiLog
    from blockflow.sockthread import SocketThread
    from blockflow.tensormq.shm import SlotMapper, SlotPool
    from blockflow.tensormq.transport import Transport, bytes_fields, recv_message
    from blockflow.tensormq.wire import DataHeader, dumps, loads_data_header

    work = tempfile.mkdtemp(prefix="bf-budget-")
    shm = tempfile.mkdtemp(prefix="bfbench-budget-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ctx = zmq.Context()
    socks, closers = [], []
    try:
        pull = ctx.socket(zmq.PULL)
        push = ctx.socket(zmq.PUSH)
        socks += [pull, push]
        pull.bind(f"ipc://{work}/data")
        push.connect(f"ipc://{work}/data")
        producer = SlotPool(shm, "budget-producer", 8)
        mapper = SlotMapper(shm)
        closers += [producer.close, mapper.close]
        transport = Transport(ctx, "budget", "tensormq", shm)
        closers.append(transport.close)
        x = torch.randn(*SHAPE)
        nxt, ret = f"ipc://{work}/next", f"ipc://{work}/ret"
        sink = ctx.socket(zmq.PULL)
        socks.append(sink)
        sink.bind(nxt)
        transport.socket(nxt)
        desc = producer.put(f"ipc://{work}/data", x, 5.0).to_json()
        hop = {"b": "i0", "wait": 0.1, "deser": 0.01, "dev": 0.001, "inf": 0.01, "share": 0.02,
               "t_in": 1234.123456, "t_out": 1234.123556}
        raw = dumps({"v": 1, "t": "data", "rid": 123456789, "task": "hop", "path": [["i1", nxt], ["@return", ret]],
                     "hops": [hop], "x": desc})
        header = loads_data_header(raw)
        kpi = KpiLog(work, "budget", interval=0)
        row = (time.time(), 1, "hop", 0.1, 0.01, 0.001, 0.01, 0.02, 0.03, 0.2, 1234.1, 1234.2, 0, 1)

        # a hand-over between threads: one message to an owner thread and its answer, halved
        a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        socks += [a, b]
        a.bind(f"inproc://budget-{id(a)}")
        b.connect(f"inproc://budget-{id(a)}")
        echo = threading.Thread(target=lambda: [b.send(b.recv()) for _ in range(rounds * iters + 1)], daemon=True)
        echo.start()

        def handover():
            a.send(b"x")
            a.recv()

        def recv():
            push.send(raw)
            t0 = time.perf_counter()
            recv_message(pull)
            return time.perf_counter() - t0

        def lookup():
            tensor, lease = transport.decode(desc, [None])
            lease.release()
            producer.slot_named(desc["seg"]).mark_in_flight()  # in flight again, under its generation
            desc["gen"] = producer.slot_named(desc["seg"]).generation

        def forward():
            tensor, lease = transport.decode(desc, [None])
            transport.encode(tensor, nxt, lease, same_as=desc)

        def record():
            h = {"b": "i1", "wait": 0.1, "deser": 0.01, "dev": 0.001, "inf": 0.01, "t_in": round(1234.5, 6)}
            header.hops = header.hops[:63] + [h]
            header.hops = header.hops[:1]

        def send():
            transport.send(nxt, header)
            sink.recv()

        client_io = SocketThread(ctx.socket(zmq.PAIR), "budget-io", lambda frames: None)
        steps = {
            "receive (header only)": lambda: recv() * 1e6,
            "header decode (DataHeader)": lambda: _time(lambda: loads_data_header(raw), 1),
            "slot lookup (open a handle, release)": lambda: _time(lookup, 1),
            "forward the handle (decode + encode)": lambda: _time(forward, 1),
            "hop record into the header": lambda: _time(record, 1),
            "header serialise (msgspec)": lambda: _time(lambda: dumps(header), 1),
            "send, header only (and its receive)": lambda: _time(send, 1),
            "KPI row": lambda: _time(lambda: kpi.add_row(row), 1),
            "thread hand-over, one way": lambda: _time(handover, 1) / 2,
            "client library: encode a request": lambda: _time(lambda: dumps({"v": 1, "id": 1, "op": "infer",
                                                                                "task": "hop", **bytes_fields(x)[0]}), 1),
        }
        per_round: dict[str, list[float]] = {k: [] for k in steps}
        for _ in range(rounds):
            for name, step in steps.items():  # interleaved: every step once per round
                per_round[name].append(statistics.median(step() for _ in range(iters)))
        a.send(b"x")
        echo.join(5)
        client_io.sock.close(linger=0)
        kpi.close()
        del header, DataHeader
    finally:
        for close in closers:
            close()
        for s in socks:
            s.close(linger=0)
        ctx.term()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return {k: spread(v) for k, v in per_round.items()}


# -- output ---------------------------------------------------------------------------------
def _f(s: dict, scale: float = 1.0, digits: int = 3) -> str:
    if s.get("median") is None:
        return "-"
    return (f"{s['median'] * scale:.{digits}f} ({s['low'] * scale:.{digits}f}-{s['high'] * scale:.{digits}f})")


def path_table(path: dict, names: list[str]) -> str:
    lines = ["| part of the request | median ms (rounds' range) |", "|---|---|"]
    lines.append(f"| way in: client library, to the dispatcher (bytes it copies into a slot, or a lent slot), to {names[0]} | "
                 f"{_f(path['way_in'])} |")
    for i, nm in enumerate(names):
        if i:
            lines.append(f"| {names[i - 1]} -> {nm}: transit (send, socket, wake-up, receive) | "
                         f"{_f(path.get(f'{nm}.transit', {}))} |")
        for key in BLOCK_STEPS:
            lines.append(f"| {nm}: {key} | {_f(path.get(f'{nm}.{key}', {}))} |")
    lines.append(f"| way out: {names[-1]} to the dispatcher, the bytes (or the slot's handle) back, the client's future | "
                 f"{_f(path['way_out'])} |")
    lines.append(f"| round trip at the client | {_f(path['total'])} |")
    lines.append(f"| of which inside the dispatcher's view (server_ms) | {_f(path['server'])} |")
    lines += ["", "| process | CPU ms per request: main thread | libzmq I/O threads | other threads | idle, % of a core |",
              "|---|---|---|---|---|"]
    for nm in [*names, "dispatcher", "client"]:
        idle = path["idle_cpu_pct"].get(nm)
        lines.append(f"| {nm} | {_f(path[f'{nm}.cpu_main'])} | {_f(path[f'{nm}.cpu_zmq'])} | "
                     f"{_f(path[f'{nm}.cpu_other'])} | {'-' if idle is None else f'{idle:.2f}'} |")
    return "\n".join(lines)


def ways_table(path: dict) -> str:
    """The two ways of ``--client both`` side by side: medians and lent/bytes ratios."""
    lines = ["| part | lent slots, median ms | bytes, median ms | lent / bytes |", "|---|---|---|---|"]
    keys = ["way_in", "way_out", "total", "dispatcher.cpu_main", "dispatcher.cpu_zmq", "client.cpu_main",
            "client.cpu_zmq"]
    for key in keys:
        a, b = path.get(key, {}).get("median"), path.get(f"bytes:{key}", {}).get("median")
        ratio = f"{a / b:.2f}" if a is not None and b else "-"
        lines.append(f"| {key} | {_f(path.get(key, {}))} | {_f(path.get(f'bytes:{key}', {}))} | {ratio} |")
    return "\n".join(lines)


def steps_table(steps: dict) -> str:
    lines = ["| step (warm, in one process) | median us (rounds' range) |", "|---|---|"]
    lines += [f"| {k} | {_f(v, digits=1)} |" for k, v in steps.items()]
    return "\n".join(lines)


#: The parts of a block's hop in the picture, in the order a request meets them.
PICTURE_STAGES = ("wait", "deser", "dev", "inf", "share", "fwd")


def picture(path: dict, names: list[str], out: str | None) -> str | None:
    """``hop_budget.png``: where a request's round trip goes, one bar per way the client's tensor
    travels (lent slots, bytes), each split into the way in, every block's stages and the transit
    to the next block, and the way out; beside them the floor, what the blocks' own work (their
    ``inf``) costs. Medians of the rounds, so the parts do not add up to the round trip exactly:
    the rest is drawn as "unaccounted"."""
    from experiments.common import pyplot, results_dir, save_fig
    plt = pyplot()
    if plt is None:
        return None
    ways = [("lent slots", "")] + ([("bytes", "bytes:")] if f"bytes:total" in path else [])
    colours = {"way in": "#546e7a", "transit": "#b0bec5", "wait": "#9e9e9e", "deser": "#8d6e63", "dev": "#ffb300",
               "inf": "#1e88e5", "share": "#43a047", "fwd": "#8e24aa", "way out": "#37474f", "unaccounted": "#eceff1"}
    fig, ax = plt.subplots(figsize=(9, 1.0 + 0.7 * (len(ways) + 1)))
    labels, seen = [], set()

    def bar(y: int, parts: list[tuple[str, float]]) -> None:
        left = 0.0
        for kind, ms in parts:
            ax.barh(y, ms, left=left, color=colours[kind], edgecolor="white", linewidth=0.5,
                    label=None if kind in seen else kind)
            seen.add(kind)
            left += ms

    for y, (label, prefix) in enumerate(ways):
        def med(key: str) -> float:
            return (path.get(prefix + key) or {}).get("median") or 0.0
        parts = [("way in", med("way_in"))]
        for i, b in enumerate(names):
            if i:
                parts.append(("transit", med(f"{b}.transit")))
            parts += [(stage, med(f"{b}.{stage}")) for stage in PICTURE_STAGES]
        parts.append(("way out", med("way_out")))
        parts.append(("unaccounted", max(med("total") - sum(ms for _, ms in parts), 0.0)))
        bar(y, parts)
        labels.append(f"BlockFlow, {label}\n{med('total'):.2f} ms")
    floor = sum((path.get(f"{b}.inf") or {}).get("median") or 0.0 for b in names)
    bar(len(ways), [("inf", floor)])
    labels.append(f"floor: the blocks' own work\n{floor:.2f} ms")
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel(f"ms of a request's round trip ({len(names)} identity blocks, 3.2 MB, medians of interleaved rounds)")
    ax.legend(loc="lower right", ncols=5, fontsize=8)
    fig.tight_layout()
    return save_fig(fig, results_dir(out), "hop_budget.png")


def main(argv=None) -> int:
    from experiments.common import env_info, parser, setup_logging, write_json
    ap = parser("hop_budget", __doc__)
    ap.add_argument("--rounds", type=int, help="interleaved rounds (default 7, quick 3)")
    ap.add_argument("--chain", type=int, default=3, help="identity blocks on the path (default 3)")
    ap.add_argument("--device", default="cpu", help="where the blocks run: cpu, cuda or cuda:N")
    ap.add_argument("--iters", type=int, help="calls per step and round in the steps table (default 200, quick 30)")
    ap.add_argument("--profile", help="write py-spy flame graphs (one SVG per process) into this directory")
    ap.add_argument("--profile-seconds", type=float, default=20.0, help="seconds of steady load profiled (default 20)")
    ap.add_argument("--profile-format", default="flamegraph", choices=sorted(SUFFIX),
                    help="py-spy's format: flamegraph (SVG, default), raw (collapsed stacks), speedscope")
    ap.add_argument("--idle-seconds", type=float, help="seconds without traffic to measure idle CPU (default 10, "
                                                       "quick 2)")
    ap.add_argument("--shapes", type=int, default=None, metavar="N",
                    help="requests per round and shape in the path-shapes table (experiments/path_shapes.py: "
                         "the same path as bare pyzmq processes, with the last stage answering the client "
                         "directly and with no dispatcher; default 200, quick 20; 0 skips it)")
    ap.add_argument("--client", default="shm", choices=sorted(CLIENT_WAYS),
                    help="how the tensor and result travel between client and dispatcher: shm (lent slots, "
                         "default), bytes (shared_memory=False), both (interleaved rounds)")
    args = ap.parse_args(argv)
    setup_logging(args.verbose)
    rounds = args.rounds or (3 if args.quick else 7)
    n = args.n or (20 if args.quick else 200)
    iters = args.iters or (30 if args.quick else 200)
    if args.idle_seconds is None:
        args.idle_seconds = 2.0 if args.quick else 10.0
    if args.chain < 1:
        ap.error("--chain must be at least 1")
    names = [f"i{k}" for k in range(args.chain)]
    started = time.monotonic()
    steps = measure_steps(rounds, iters)
    print(steps_table(steps), flush=True)
    path = measure_path(rounds, n, args.chain, args.device, args.profile, args.profile_seconds, args.idle_seconds,
                        args.profile_format, args.client)
    print()
    print(path_table(path, names))
    if args.client == "both":
        print()
        print(ways_table(path))
    shapes_n = args.shapes if args.shapes is not None else (20 if args.quick else 200)
    shapes = None
    if shapes_n > 0:
        from experiments.path_shapes import measure_shapes, shapes_table
        shapes = measure_shapes(rounds, shapes_n, args.chain)
        print()
        print(shapes_table(shapes, args.chain))
    print(f"took {time.monotonic() - started:.0f} s")
    picture(path, names, args.out)
    write_json(args.out, "hop_budget", {"env": env_info(), "settings": {
        "rounds": rounds, "n": n, "iters": iters, "chain": args.chain, "device": args.device, "shape": list(SHAPE),
        "quick": args.quick, "profile": args.profile, "client": args.client, "shapes_n": shapes_n},
        "path": path, "steps": steps, "blocks": names, "shapes": shapes})
    return 0


if __name__ == "__main__":
    sys.exit(main())
