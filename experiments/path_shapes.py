"""The shapes a request's path could take, as bare pyzmq processes (issue 40 item 3).

Issue 40 asks to decide *with measurements* how a client's tensor reaches the first block and the
answer reaches the client with the fewest crossings. This measures the crossings alone: processes
that do nothing but move a short header (a request id and where the answer goes) with pyzmq,
wired the way BlockFlow wires its processes (the client to the dispatcher over TCP, a ROUTER
there; everything else PUSH/PULL over ipc), in interleaved rounds on one machine, against
BlockFlow's own path through the same number of identity blocks (TensorMQ, a 1 KB tensor through
lent slots, so only headers cross there too):

  ``today``          client -> dispatcher -> s1 -> ... -> sN -> dispatcher -> client: the path
                     BlockFlow takes (the dispatcher keeps every request in flight by id)
  ``direct answer``  client -> dispatcher -> s1 -> ... -> sN -> client, and sN also tells the
                     dispatcher that the request is done (what the dispatcher must learn to keep
                     admission, back-pressure and its KPIs): the last block answering the client
  ``no dispatcher``  client -> s1 -> ... -> sN -> client: the floor of the stages alone
  ``BlockFlow``      ``Client.infer`` through a ``StandalonePipeline`` of N identity blocks

Each round runs the turns twice: with every process of the paths free to run on any core, and
with all of them (their every thread, this process's too) pinned to one core (``one core``),
where a message wakes its receiver by a context switch on the same core instead of waking the
other one. With one request in flight nothing runs in parallel anyway; under load one core
would halve what the path can serve, so this measures where a single request's time goes, not
a deployment to copy.

``today`` minus ``direct answer`` is what the dispatcher's place on the way out costs on this
machine; ``BlockFlow`` minus ``today`` is what BlockFlow's own code (client library, dispatcher,
blocks) adds to the crossings. The shapes take turns request by request (the order rotating);
every figure is the median of the rounds' medians with the rounds' range (``hop_budget.spread``),
and each difference also the median of the differences of the requests of one turn.
"""
from __future__ import annotations

import multiprocessing
import os
import shutil
import statistics
import tempfile
import time

#: The shapes in the order a round runs them (the order rotates every round).
SHAPES = ("today", "direct answer", "no dispatcher", "BlockFlow")
#: What the BlockFlow row sends: 1 KB, through the slots the dispatcher lends a local client.
SMALL = (1, 256)
#: The two placements of every round: all cores, and one (the same one for every process).
PLACEMENTS = ("all cores", "one core")


def pin(pids: list[int], cpus: set[int]) -> None:
    """Every thread of every process in ``pids`` may run only on ``cpus`` (threads started later
    inherit their creator's)."""
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                os.sched_setaffinity(int(tid), cpus)
            except (ProcessLookupError, PermissionError):
                pass  # a thread that ended meanwhile


def _stage(work: str, i: int, last: bool, ready) -> None:
    """One stage: receive a header, pass it on; the last one sends it where the header says (and
    tells the dispatcher, when the header names it)."""
    import zmq
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"ipc://{work}/s{i}")
    nxt = None
    if not last:
        nxt = ctx.socket(zmq.PUSH)
        nxt.connect(f"ipc://{work}/s{i + 1}")
    out: dict[bytes, zmq.Socket] = {}

    def to(endpoint: bytes):
        sock = out.get(endpoint)
        if sock is None:
            sock = out[endpoint] = ctx.socket(zmq.PUSH)
            sock.connect(endpoint.decode())
        return sock

    ready.put(i)
    while True:
        frames = pull.recv_multipart()
        if frames[0] == b"stop":
            break
        if nxt is not None:
            nxt.send_multipart(frames)
            continue
        rid, ret, notice = frames[0].split(b" ")
        to(ret).send_multipart(frames)
        if notice != b"-":
            to(notice).send(rid)
    ctx.destroy(linger=0)


def _dispatcher(work: str, ready) -> None:
    """The dispatcher's part: a ROUTER for clients, requests in flight by id, results back to the
    client that asked (``today``), or only the done notices (``direct answer``)."""
    import zmq
    ctx = zmq.Context()
    front = ctx.socket(zmq.ROUTER)
    port = front.bind_to_random_port("tcp://127.0.0.1")
    results, notices = ctx.socket(zmq.PULL), ctx.socket(zmq.PULL)
    results.bind(f"ipc://{work}/d_results")
    notices.bind(f"ipc://{work}/d_done")
    first = ctx.socket(zmq.PUSH)
    first.connect(f"ipc://{work}/s0")
    poller = zmq.Poller()
    for s in (front, results, notices):
        poller.register(s, zmq.POLLIN)
    in_flight: dict[bytes, bytes] = {}
    ready.put(port)
    while True:
        events = dict(poller.poll())
        if front in events:
            client, msg = front.recv_multipart()
            if msg == b"stop":
                break
            mode, rid, ret = msg.split(b" ")
            in_flight[rid] = client
            if mode == b"today":
                first.send(b"%s ipc://%s/d_results -" % (rid, work.encode()))
            else:
                first.send(b"%s %s ipc://%s/d_done" % (rid, ret, work.encode()))
        if results in events:
            frames = results.recv_multipart()
            rid = frames[0].split(b" ", 1)[0]
            front.send_multipart([in_flight.pop(rid), frames[0]])
        if notices in events:
            in_flight.pop(notices.recv(), None)
    ctx.destroy(linger=0)


class BarePath:
    """The dispatcher and ``chain`` stages as processes, and the client's sockets in this one."""

    def __init__(self, chain: int):
        import zmq
        self.work = tempfile.mkdtemp(prefix="bf-shapes-")
        mp = multiprocessing.get_context("spawn")
        ready = mp.Queue()
        self.procs = [mp.Process(target=_stage, args=(self.work, i, i == chain - 1, ready), daemon=True)
                      for i in range(chain)]
        self.procs.append(mp.Process(target=_dispatcher, args=(self.work, ready), daemon=True))
        for p in self.procs:
            p.start()
        got = [ready.get(timeout=60) for _ in self.procs]
        port = max(got)  # the stages put their index, the dispatcher its port
        self.ctx = zmq.Context()
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.connect(f"tcp://127.0.0.1:{port}")
        self.pull = self.ctx.socket(zmq.PULL)
        self.mine = f"ipc://{self.work}/client"
        self.pull.bind(self.mine)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(f"ipc://{self.work}/s0")
        self.rid = 0

    def one(self, shape: str) -> None:
        self.rid += 1
        if shape == "today":
            self.dealer.send(b"today %d -" % self.rid)
            self.dealer.recv()
        elif shape == "direct answer":
            self.dealer.send(b"direct %d %s" % (self.rid, self.mine.encode()))
            self.pull.recv()
        else:
            self.push.send(b"%d %s -" % (self.rid, self.mine.encode()))
            self.pull.recv()

    def close(self) -> None:
        """Stop every process (each reads "stop" from its own socket) and remove the sockets' folder."""
        import zmq
        self.dealer.send(b"stop")
        for i in range(len(self.procs) - 1):
            s = self.ctx.socket(zmq.PUSH)
            s.connect(f"ipc://{self.work}/s{i}")
            s.send(b"stop")
            s.close(linger=1000)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.work, ignore_errors=True)


def measure_shapes(rounds: int, n: int, chain: int, warmup: int = 50) -> dict:
    """Round trips (ms) of every shape in ``rounds`` rounds of ``n`` turns each (a request of every
    shape per turn), on all cores and then on one in every round: per shape and placement the
    median of the rounds' medians and their range, the differences between shapes (all cores),
    and per shape one core over all cores (median of the rounds' ratios). On a machine with one
    core only the first placement runs."""
    import torch

    from blockflow.client import Client
    from blockflow.standalone import StandalonePipeline
    from experiments.hop_budget import _toy_repo, spread

    repo = _toy_repo()
    names = [f"i{k}" for k in range(chain)]
    everywhere = os.sched_getaffinity(0)
    one = {min(everywhere)}
    bare = BarePath(chain)
    placements = PLACEMENTS if len(everywhere) > 1 else PLACEMENTS[:1]
    keys = [(s, pl) for pl in placements for s in SHAPES]
    per_round: dict[tuple, list[float]] = {k: [] for k in keys}
    samples: dict[tuple, list[float]] = {k: [] for k in keys}
    try:
        with StandalonePipeline(repo, {nm: "toy/identity.pt" for nm in names}, {"hop": names}, transport="tensormq",
                                threads=1, env={"BLOCKFLOW_KPI_FLUSH_EVERY": "100000"},
                                shm_prefix="bfbench-shapes") as p, Client(p.address, timeout=60) as c:
            x = torch.randn(*SMALL)
            pids = [os.getpid()] + [pr.pid for pr in bare.procs] + [pr.pid for pr in p.procs.values()]

            def run(shape: str) -> None:
                if shape == "BlockFlow":
                    c.infer("hop", x)
                else:
                    bare.one(shape)

            for shape in SHAPES:
                for _ in range(warmup):
                    run(shape)
            try:
                for r in range(rounds):
                    for placement in placements:
                        pin(pids, one if placement == "one core" else everywhere)
                        for _ in range(warmup // 5):  # the first turns after a move pay for it
                            for shape in SHAPES:
                                run(shape)
                        lat: dict[str, list[float]] = {s: [] for s in SHAPES}
                        for k in range(n):  # the shapes take turns request by request, the order rotating
                            for shape in SHAPES[k % len(SHAPES):] + SHAPES[:k % len(SHAPES)]:
                                t0 = time.perf_counter()
                                run(shape)
                                lat[shape].append((time.perf_counter() - t0) * 1e3)
                        for shape, v in lat.items():
                            per_round[(shape, placement)].append(statistics.median(v))
                            samples[(shape, placement)] += v
            finally:
                pin(pids, everywhere)
    finally:
        bare.close()
        shutil.rmtree(repo, ignore_errors=True)
    out = {s: spread(per_round[(s, PLACEMENTS[0])]) for s in SHAPES}
    out["per_round_ms"] = {s: per_round[(s, PLACEMENTS[0])] for s in SHAPES}
    if "one core" in placements:
        out["one core"] = {s: spread(per_round[(s, "one core")]) for s in SHAPES}
        out["one core"]["per_round_ms"] = {s: per_round[(s, "one core")] for s in SHAPES}
        # each round ran both placements back to back: their ratio per round, and its median
        out["one core / all cores"] = {s: spread([a / b for a, b in zip(per_round[(s, "one core")],
                                                                         per_round[(s, PLACEMENTS[0])])])
                                       for s in SHAPES}
        out["one core"]["cpu"] = min(one)
    samples = {s: samples[(s, PLACEMENTS[0])] for s in SHAPES}
    per_round = {s: per_round[(s, PLACEMENTS[0])] for s in SHAPES}
    diffs = {"dispatcher on the way out (today - direct answer)": ("today", "direct answer"),
             "the dispatcher in all (today - no dispatcher)": ("today", "no dispatcher"),
             "BlockFlow's code (BlockFlow - today)": ("BlockFlow", "today")}
    # the requests of one turn ran back to back: their differences are free of the machine's drift
    out["differences"] = {k: {**spread([a - b for a, b in zip(per_round[x], per_round[y])]),
                              "paired_median": statistics.median(a - b for a, b in zip(samples[x], samples[y]))}
                          for k, (x, y) in diffs.items()}
    return out


def shapes_table(shapes: dict, chain: int) -> str:
    from experiments.hop_budget import _f
    lines = [f"| path shape ({chain} stages, header only) | round trip, median ms (rounds' range) |", "|---|---|"]
    for s in SHAPES:
        v = shapes[s]
        lines.append(f"| {s} | {_f(v)} |")
    for k, v in shapes["differences"].items():
        lines.append(f"| {k} | {_f(v)}; request by request {v['paired_median']:.3f} |")
    if "one core" in shapes:
        for s in SHAPES:
            lines.append(f"| {s}, every process on CPU {shapes['one core']['cpu']} | {_f(shapes['one core'][s])}; "
                         f"one core / all cores {_f(shapes['one core / all cores'][s])} |")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - a quick look: python -m experiments.path_shapes
    res = measure_shapes(int(os.environ.get("ROUNDS", "5")), int(os.environ.get("N", "200")), 3)
    print(shapes_table(res, 3))
