"""Fuzz the data plane: random and mutated frames at the dispatcher and at a block, with correct
requests interleaved.

A ``StandalonePipeline`` (real dispatcher and block processes, real ZeroMQ sockets) serves task
``t`` = identity block ``a`` -> doubling block ``d``. Seeded generators then send, in lock-step:

- to the dispatcher's client socket (ROUTER, through a DEALER): truncated and bit-flipped
  headers, pickles, random bytes, every header field replaced by values of the wrong type,
  negative or huge sizes, a tensor descriptor claiming 100 GB, lying dtype/shape/stride, wrong
  numbers of frames, forged shared-memory handles, deeply nested JSON, integers longer than
  Python parses. Every message names its requester (the ROUTER identity), so every one must
  get exactly one reply;
- to block ``d``'s data socket (PULL, through a PUSH): the same mutations of a data message,
  plus real shared-memory handles from a slot pool of our own, replayed after release (stale)
  and with their generation, offset or size forged. A message whose header names a request id
  and a return address (ours) must get exactly one answer there; one that names no requester
  is dropped, and nothing may come back for it;
- to the dispatcher's result socket: forged results (request ids no request uses), which are
  dropped.

Every ``--every`` frames a correct request goes through the client and must return 2x. RSS and
open descriptors of the dispatcher and blocks are sampled as it goes; growth is measured from
the end of warm-up (the first fifth) to the end. Descriptors may grow by what the next hops the
frames forge cost the block (a socket, and a window of slot files once a tensor goes there:
``fd_budget``); which hops get a tensor differs from run to run even with one seed, since the
frames carry this run's pid and temporary directory, where the bit flips land. At the end every
process must still answer a ping, exit 0 on stop and leave no socket or slot behind.

    python -m experiments.fuzz [--frames 10000] [--seed 1] [--every 25]

Writes experiments/results/<machine>/fuzz.json.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import random
import shutil
import sys
import tempfile
import time

import psutil
import torch
import zmq

log = logging.getLogger("experiments.fuzz")

BLOCKS = {"a": "toy/identity.pt", "d": "toy/double.pt"}
TASKS = {"t": ["a", "d"]}
TARGET_BLOCK = "d"
#: Share of frames sent to each target (the rest go to the block).
SHARE_DISPATCHER, SHARE_RESULTS = 0.5, 0.05
#: Share of block frames whose return address is forged (each costs the block a 1 s send attempt).
SHARE_FORGED_RETURN = 0.002
#: Request ids used for forged results: far above anything the dispatcher hands out in a run.
FORGED_RID_BASE = 10 ** 12
#: Request ids of the barrier messages (``barrier`` in run_fuzz): above the forged ones.
BARRIER_RID_BASE = 2 * FORGED_RID_BASE
REPLY_TIMEOUT_MS = 15000
#: Marker that a pickle payload would create if anything ever unpickled it.
MARKER_ENV = "BLOCKFLOW_FUZZ_MARKER"


def toy_repo(path: str) -> str:
    """TorchScript identity and doubling blocks (no manifest: served as dropped in)."""

    class Identity(torch.nn.Module):
        def forward(self, x):
            return x

    class Double(torch.nn.Module):
        def forward(self, x):
            return x * 2

    os.makedirs(os.path.join(path, "toy"), exist_ok=True)
    torch.jit.save(torch.jit.script(Identity()), os.path.join(path, "toy", "identity.pt"))
    torch.jit.save(torch.jit.script(Double()), os.path.join(path, "toy", "double.pt"))
    return path


class _Touch:
    """Unpickling this runs ``open(path, 'w')``: proof that a pickle was executed."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def pickle_bomb(marker: str) -> bytes:
    return pickle.dumps({"id": 1, "task": "t", "x": _Touch(marker)})


# -- mutations ---------------------------------------------------------------------------------
WEIRD_VALUES = [None, True, False, 0, -1, -(1 << 63), 1 << 64, 1 << 200, 3.5, float("1e308"), "", "x" * 300,
                "\u202e\u0000\ud7ff", [], [None], {}, {"a": {"b": [1]}}, [[1, 2], [3]], "float32", "shm", "bytes"]


class Mutator:
    """Seeded frame mutations; every method returns a list of frames (bytes)."""

    def __init__(self, rng: random.Random, marker: str, shm_dir: str):
        self.rng, self.marker, self.shm_dir = rng, marker, shm_dir

    def weird(self):
        r = self.rng
        pick = r.random()
        if pick < 0.6:
            return r.choice(WEIRD_VALUES)
        if pick < 0.8:
            return r.randint(-(1 << 70), 1 << 70)
        return "".join(chr(r.randint(1, 0x10FFFF)) for _ in range(r.randint(0, 12)) if True).encode(
            "utf-8", "surrogatepass").decode("utf-8", "replace")

    def tensor(self):
        r = self.rng
        n = r.choice([1, 3, 16, 256])
        return torch.randn(n) if r.random() < 0.8 else torch.randn(2, n)

    def lie_desc(self, x: dict) -> dict:
        """A descriptor whose dtype, shape, stride, loc or handle fields lie."""
        r = self.rng
        x = dict(x)
        kind = r.randrange(12)
        if kind == 0:
            x["dtype"] = r.choice(["float64", "int8", "bool", "complex64", "float", "", None, 7, "bfloat16", "uint8"])
        elif kind == 1:
            x["shape"] = [r.randint(0, 64) for _ in range(r.randint(0, 9))]
        elif kind == 2:
            x["stride"] = [r.randint(0, 5) for _ in range(len(x.get("shape", [])))]
        elif kind == 3:
            x["shape"] = [-r.randint(1, 10)] + list(x["shape"])[1:]
        elif kind == 4:  # a header claiming 100 GB
            x["shape"], x["stride"] = [25 * (1 << 30)], [1]
        elif kind == 5:
            x["shape"] = [r.choice([1 << 39, (1 << 40) - 1, 1 << 63, 10 ** 30])] * r.randint(1, 8)
            x["stride"] = [1] * len(x["shape"])
        elif kind == 6:
            x["shape"], x["stride"] = [0] + [1 << 39] * 3, [1] * 4
        elif kind == 7:
            x["loc"] = r.choice(["shm", "cuda", "gpu", "", None, 1])
        elif kind == 8:
            x.update(loc="shm", seg=r.choice(["forged", "../../etc/passwd", "a" * 200, "dispatcher-0.1",
                                              f"d-0.{os.getpid()}.1", "", 5]),
                     gen=r.choice([0, 1, -1, 1 << 64, "1"]), off=r.choice([0, -8, 1 << 40, 3]),
                     nbytes=r.choice([0, 4, -1, 1 << 62]))
        elif kind == 9:
            x.update(loc="cuda", handle=r.choice(["AAAA", "", None, [1, 2]]), dev=r.choice([0, 7, "cuda:0"]))
        elif kind == 10:
            x[r.choice(["dtype", "shape", "stride", "loc"])] = self.weird()
        else:
            x.pop(r.choice(["dtype", "shape", "stride", "loc"]), None)
        return x

    def garbage(self) -> list[bytes]:
        """Frames that are not a valid header at all."""
        r = self.rng
        kind = r.randrange(8)
        if kind == 0:
            return [r.randbytes(r.randint(0, 512))]
        if kind == 1:
            return [pickle_bomb(self.marker)]
        if kind == 2:
            return [b"[" * r.randint(1000, 60000)]
        if kind == 3:
            return [b'{"id": ' + b"9" * r.randint(4400, 20000) + b"}"]
        if kind == 4:
            return [b""]
        if kind == 5:
            return [json.dumps(self.weird()).encode()]
        if kind == 6:
            return [b"\xff\xfe" + "{}".encode("utf-16-le")]
        return [b"x" * (70 * 1024)]  # larger than the header limit

    def mutate(self, header: dict, payload: bytes | None, fields: list[str]) -> list[bytes]:
        """One mutation of a valid (header, payload) message."""
        r = self.rng
        frames = [json.dumps(header).encode()] + ([payload] if payload is not None else [])
        kind = r.randrange(10)
        if kind == 0:  # truncated header
            frames[0] = frames[0][:r.randint(0, max(0, len(frames[0]) - 1))]
        elif kind == 1:  # flipped bits
            b = bytearray(frames[0])
            for _ in range(r.randint(1, 4)):
                i = r.randrange(len(b))
                b[i] ^= 1 << r.randrange(8)
            frames[0] = bytes(b)
        elif kind == 2:  # a field of the wrong type or value
            h = dict(header)
            h[r.choice(fields)] = self.weird()
            frames[0] = json.dumps(h).encode()
        elif kind == 3:  # a field missing
            h = dict(header)
            h.pop(r.choice(fields), None)
            frames[0] = json.dumps(h).encode()
        elif kind in (4, 5):  # lying tensor descriptor
            h = dict(header, x=self.lie_desc(header["x"]))
            frames[0] = json.dumps(h, default=str).encode()
        elif kind == 6:  # wrong number of frames
            choice = r.randrange(3)
            if choice == 0:
                frames = frames[:1]
            elif choice == 1:
                frames = frames + [r.randbytes(r.randint(0, 64)) for _ in range(r.randint(1, 3))]
            else:
                frames = frames[:1] + [b""]
        elif kind == 7:  # payload truncated or padded
            if payload is not None:
                frames[1] = payload[:r.randint(0, max(0, len(payload) - 1))] if r.random() < 0.5 \
                    else payload + r.randbytes(r.randint(1, 16))
        elif kind == 8:  # unknown extra fields: harmless, must still work
            h = dict(header, **{f"zz{r.randrange(100)}": self.weird()})
            frames[0] = json.dumps(h).encode()
        else:
            frames = self.garbage()
        return frames


# -- the run -----------------------------------------------------------------------------------
def _rss_mb(pids) -> float:
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2 ** 20


def _fds(pids) -> int:
    n = 0
    for pid in pids:
        try:
            n += psutil.Process(pid).num_fds()
        except psutil.NoSuchProcess:
            pass
    return n


def _fd_kinds(pids, slot_dir: str) -> dict[str, int]:
    """What the processes' descriptors are (Linux: /proc/PID/fd), so that a failed bound says
    what grew: ``slot`` files (every mapped slot keeps one: CPython's mmap holds a duplicate of
    the file's descriptor until it is closed), ``eventfd`` (one per ZeroMQ socket, its mailbox),
    ``socket``, ``pipe``, ``other``."""
    kinds: dict[str, int] = {}
    for pid in pids:
        try:
            names = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in names:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            kind = ("slot" if target.startswith(slot_dir + "/") else "eventfd" if target == "anon_inode:[eventfd]"
                    else "socket" if target.startswith("socket:") else "pipe" if target.startswith("pipe:")
                    else "other")
            kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def fds_per_hop(window: int) -> int:
    """Descriptors a block may keep for one next hop, a forged one too (until MAX_UNLISTED_HOPS
    of them make it close the oldest, tensormq/transport.py): a ZeroMQ socket (its mailbox's
    eventfd, and a connection or an attempt at one) and, once a tensor goes there by handle, the
    edge's whole window of slot files (tensormq/shm.py), each mapping holding a descriptor."""
    return window + 2


#: Descriptors that may come or go between two samples whatever is sent (a connection being
#: made or closed, a slot being grown).
FD_SLACK = 8


def fd_budget(summary: dict) -> int:
    """How many descriptors the dispatcher and blocks may gain from the end of warm-up to the
    end of a run: what the next hops that frames named after warm-up may cost (``fds_per_hop``
    each), and FD_SLACK. A leak (a descriptor per frame, per request, per refused handle) exceeds
    it: tests/process/test_fuzz.py plants one."""
    return fds_per_hop(summary["window"]) * summary["foreign_hops_after_warm"] + FD_SLACK


def run_fuzz(frames: int = 10000, seed: int = 1, every: int = 25, workdir: str | None = None,
             progress=None, env: dict | None = None) -> dict:
    """Fuzz a fresh pipeline with ``frames`` frames; returns the summary (see the module doc).
    ``env``: more environment for the dispatcher and blocks (tests plant a leak with it)."""
    from blockflow.core import settings
    from blockflow.client import BlockFlowError, Client
    from blockflow.core.protocol import DISPATCHER, RETURN_HOP
    from blockflow.standalone import StandalonePipeline
    from blockflow.blocks.process import _return_address
    from blockflow.tensormq.shm import IN_FLIGHT, SlotMapper, SlotPool
    from blockflow.tensormq.wire import TensorDesc, WireError, loads_data_header
    from blockflow.tensormq.transport import encode_bytes

    rng = random.Random(seed)
    own = workdir is None
    base = tempfile.mkdtemp(prefix="bfz-") if own else workdir
    repo = toy_repo(os.path.join(base, "repo"))
    marker = os.path.join(base, "PICKLE_WAS_EXECUTED")
    env = {"BLOCKFLOW_LOG": os.environ.get("BLOCKFLOW_LOG", "ERROR"), **(env or {})}
    pipe_window = settings.WINDOW
    pipe = StandalonePipeline(repo, BLOCKS, TASKS, threads=1, window=pipe_window, workdir=os.path.join(base, "p"),
                              env=env)
    ctx = zmq.Context()
    socks = []

    def sock(kind, **opts):
        s = ctx.socket(kind)
        s.linger = 0
        for k, v in opts.items():
            setattr(s, k, v)
        socks.append(s)
        return s

    counts = {"frames": 0, "dispatcher_frames": 0, "block_frames": 0, "result_frames": 0,
              "dispatcher_replies": 0, "dispatcher_error_replies": 0, "dispatcher_ok_replies": 0,
              "dispatcher_missing_replies": 0, "block_expected_replies": 0, "block_replies": 0,
              "block_error_replies": 0, "block_missing_replies": 0, "block_unexpected_replies": 0,
              "forged_return_frames": 0, "block_replies_uncertain": 0, "shm_handles_sent": 0, "correct_requests": 0, "correct_ok": 0,
              "correct_failed": 0, "barriers": 0, "handles_reclaimed": 0}
    failures: list[str] = []
    pool = mapper = None
    t0 = time.monotonic()
    try:
        pids = {n: p.pid for n, p in pipe.procs.items()}
        front = sock(zmq.DEALER, rcvtimeo=REPLY_TIMEOUT_MS, sndtimeo=5000)
        front.connect(pipe.address)
        push = sock(zmq.PUSH, sndtimeo=5000)
        push.connect(pipe.endpoints[TARGET_BLOCK])
        ret_addr = f"ipc://{os.path.join(pipe.workdir, 'fz.sock')}"
        pull = sock(zmq.PULL)
        pull.bind(ret_addr)
        results = sock(zmq.PUSH, sndtimeo=5000)
        results.connect(f"ipc://{os.path.join(pipe.sock, 'dispatcher-0.sock')}")
        pool = SlotPool(pipe.shm, "fuzz", window=16)
        mapper = SlotMapper(pipe.shm)
        client = Client(pipe.address, timeout=30)
        mut = Mutator(rng, marker, pipe.shm)
        maybe_rids: set = set()   # rids whose path a mutation pointed partly elsewhere
        foreign_hops: dict[str, int] = {}  # address other than ours a frame named -> the last frame that did

        def release_handle(header: dict) -> None:
            x = header.get("x")
            if isinstance(x, dict) and x.get("loc") == "shm":
                try:
                    _t, lease = mapper.open(TensorDesc.parse(x))
                    lease.release()
                except WireError as exc:
                    failures.append(f"a reply carried an unusable handle: {exc}")

        def any_dead() -> bool:
            """A process that died ends the run at once (the rest would only time out)."""
            dead = {n: p.returncode for n, p in pipe.procs.items() if p.poll() is not None}
            if dead:
                failures.append(f"frame {i}: processes died: {dead}; last frame {slow_from[2] if slow_from else ''}")
            return bool(dead)

        def reclaim_refused() -> None:
            """A block releases a handle only once it opened it; one it refused before that
            (malformed envelope, lying descriptor) stays ours to free, as the manager's reclaim
            does for a dead consumer. Lock-step: the block is done with the frame by now."""
            for slot in pool.edges.get(ret_addr, []):
                if slot.state == IN_FLIGHT:
                    slot.force_free()
                    counts["handles_reclaimed"] += 1

        def wait_block_reply(rid) -> dict | None:
            """The answer for ``rid`` at our return address (anything else is unexpected)."""
            deadline = time.monotonic() + REPLY_TIMEOUT_MS / 1e3
            while time.monotonic() < deadline:
                if not pull.poll(100):
                    continue
                fr = pull.recv_multipart()
                h = json.loads(fr[0])
                release_handle(h)
                if h.get("rid") == rid:
                    return h
                if h.get("rid") in maybe_rids:
                    counts["block_replies_uncertain"] += 1
                    continue
                counts["block_unexpected_replies"] += 1
                failures.append(f"block answered rid {h.get('rid')!r} while rid {rid} was awaited")
            return None

        def barrier() -> None:
            """Return once block d has handled every frame sent to it before: a correct message
            answered at our return address, after them (one inference thread, in order).

            A frame answered elsewhere, or not at all, gives no sign of when the block is done
            with it; without this, ``reclaim_refused`` after it could free the frame's slot while
            the block had yet to open it, and the block then refused a valid message as stale
            instead of running it (1 slot of ~230 reclaimed differed between two runs)."""
            counts["barriers"] += 1
            b_rid = BARRIER_RID_BASE + counts["barriers"]
            desc, payload = encode_bytes(torch.ones(1))
            push.send_multipart([json.dumps({"v": 1, "t": "data", "rid": b_rid, "task": "t",
                                             "path": [[RETURN_HOP, ret_addr]], "hops": [],
                                             "x": desc.to_json()}).encode(), bytes(payload)])
            if wait_block_reply(b_rid) is None:
                failures.append(f"block {TARGET_BLOCK} did not answer barrier {b_rid}")

        def note_hops(i: int, addresses) -> None:
            """Remember the addresses other than ours that frame ``i`` may make the block send to
            (a hop of its path, its return address): each costs the block a socket to it and,
            once a tensor goes there by handle, a window of slots (``fd_budget``)."""
            for a in addresses:
                if isinstance(a, str) and a != ret_addr:
                    foreign_hops[a] = i

        def correct_request(i: int) -> None:
            counts["correct_requests"] += 1
            x = torch.randn(4, generator=torch.Generator().manual_seed(i))
            try:
                y = client.infer("t", x, timeout=30)
                if torch.equal(y, x * 2):
                    counts["correct_ok"] += 1
                    return
                failures.append(f"correct request {i} returned a wrong tensor")
            except (BlockFlowError, TimeoutError) as exc:
                failures.append(f"correct request {i} failed: {exc}")
            counts["correct_failed"] += 1

        def dispatcher_frame(i: int) -> list[bytes]:
            x = mut.tensor()
            desc, payload = encode_bytes(x)
            header = {"v": 1, "op": "infer", "id": i, "task": "t", "x": desc.to_json(), "timeout": 20}
            if rng.random() < 0.1:
                return mut.garbage()
            if rng.random() < 0.05:
                header["op"] = rng.choice(["ping", "infer", "shutdown", "load"])
            return mut.mutate(header, bytes(payload), ["v", "op", "id", "task", "x", "timeout", "token"])

        def block_frame(rid: int) -> tuple[list[bytes], bool]:
            """(frames, whether an answer at our return address is due)."""
            path = [[RETURN_HOP, ret_addr]] if rng.random() < 0.7 else [["next", ret_addr], [RETURN_HOP, ret_addr]]
            forged = rng.random() < SHARE_FORGED_RETURN
            if forged:
                counts["forged_return_frames"] += 1
                path = [[RETURN_HOP, f"ipc:///nonexistent-bfz/{rng.randrange(1 << 30)}.sock"]]
                note_hops(i, [path[0][1]])
            x = mut.tensor()
            header = {"v": 1, "t": "data", "rid": rid, "task": "t", "path": path, "hops": []}
            if forged:
                # an unreadable tensor: the block answers the forged address (and spends up to 1 s
                # finding nobody there); a readable one would make it wait 10 s for the next hop
                header["x"] = {"dtype": "float32", "shape": [25 * (1 << 30)], "stride": [1], "loc": "bytes"}
                return [json.dumps(header).encode(), b"\x00" * 4], False
            payload = None
            handle = rng.random() < 0.3
            if handle:
                try:
                    header["x"] = pool.put(ret_addr, x, timeout=5).to_json()
                    counts["shm_handles_sent"] += 1
                except TimeoutError:
                    handle = False
            if not handle:
                desc, payload = encode_bytes(x)
                header["x"], payload = desc.to_json(), bytes(payload)
            if rng.random() < 0.15:  # a valid message: it must run
                frames = [json.dumps(header).encode()] + ([payload] if payload is not None else [])
            elif handle and rng.random() < 0.3:  # stale (replayed) or forged handle
                frames = [json.dumps(header).encode()]
                if rng.random() < 0.5:
                    push.send_multipart(frames)  # the real one first; the block releases it
                    counts["frames"] += 1
                    counts["block_frames"] += 1
                    got = wait_block_reply(rid) if not forged else None
                    if not forged:
                        counts["block_expected_replies"] += 1
                        if got is None:
                            counts["block_missing_replies"] += 1
                        else:
                            counts["block_replies"] += 1
                    # the replay below is the stale handle; only its rid differs
                    header["rid"] = rid = -rid
                else:
                    header["x"] = dict(header["x"], gen=header["x"]["gen"] + rng.choice([1, -1, 1000]))
                frames = [json.dumps(header).encode()]
            else:
                frames = mut.mutate(header, payload, ["v", "t", "rid", "task", "path", "hops", "x"])
            ra = _return_address(frames[0])
            if ra is None:
                return frames, False
            try:  # the path as the block reads it (as _return_address does): a DataHeader first
                path = loads_data_header(frames[0]).path
            except WireError:
                path = json.loads(frames[0])["path"]
            hops = {hop[1] for hop in path}
            note_hops(i, hops | {ra[1]})
            if hops != {ret_addr}:
                # a flipped bit made a hop of the path point elsewhere: a valid message is
                # forwarded there (and answered by nobody); an invalid one is answered here
                maybe_rids.add(ra[0])
                return frames, False
            return frames, True

        sample_every = max(50, frames // 40)
        rss: list[tuple[int, float]] = []
        fds: list[tuple[int, int]] = []
        fd_kinds: list[dict[str, int]] = []
        proc_pids = list(pids.values())
        rid = 0
        slow: list[dict] = []   # frames that took over a second to handle (what and how long)
        slow_from = None
        for i in range(frames):
            if i % every == 0:
                correct_request(i)
            if i % sample_every == 0:
                rss.append((i, _rss_mb(proc_pids)))
                fds.append((i, _fds(proc_pids)))
                fd_kinds.append(_fd_kinds(proc_pids, pipe.shm))
                if progress:
                    progress(i, frames)
            roll = rng.random()
            counts["frames"] += 1
            started = time.monotonic()
            if slow_from is not None and time.monotonic() - slow_from[1] > 1.0:
                slow.append({"frame": slow_from[0], "s": round(time.monotonic() - slow_from[1], 2),
                             "head": slow_from[2]})
            if roll < SHARE_DISPATCHER:
                counts["dispatcher_frames"] += 1
                fr = dispatcher_frame(i)
                slow_from = (i, started, repr(fr[0][:160]))
                front.send_multipart(fr)
                try:
                    reply = json.loads(front.recv_multipart()[0])
                except zmq.Again:
                    counts["dispatcher_missing_replies"] += 1
                    failures.append(f"frame {i}: no reply from the dispatcher within {REPLY_TIMEOUT_MS} ms")
                    if any_dead():
                        break
                    continue
                counts["dispatcher_replies"] += 1
                counts["dispatcher_error_replies" if reply.get("status") == "error" else "dispatcher_ok_replies"] += 1
                if reply.get("status") == "error" and not reply.get("error"):
                    failures.append(f"frame {i}: an error reply without a message: {reply}")
            elif roll < SHARE_DISPATCHER + SHARE_RESULTS:
                counts["result_frames"] += 1
                h = {"v": 1, "t": rng.choice(["result", "error", "data", None]),
                     "rid": rng.choice([FORGED_RID_BASE + i, -i, str(i), None, 1.5]),
                     "x": mut.lie_desc({"dtype": "float32", "shape": [4], "stride": [1], "loc": "bytes"}),
                     "err": mut.weird()}
                fr = mut.mutate(h, b"\x00" * 16, ["t", "rid", "x", "err", "hops"])
                slow_from = (i, started, repr(fr[0][:160]))
                results.send_multipart(fr)
            else:
                rid += 1
                counts["block_frames"] += 1
                fr, expect = block_frame(rid)
                slow_from = (i, started, repr(fr[0][:160]))
                if fr and isinstance(fr, list):
                    push.send_multipart(fr)
                if not expect:
                    barrier()  # nothing at our return address says when the block is done with it
                else:
                    want = _return_address(fr[0])[0]
                    counts["block_expected_replies"] += 1
                    got = wait_block_reply(want)
                    if got is None:
                        counts["block_missing_replies"] += 1
                        failures.append(f"frame {i}: no answer from block {TARGET_BLOCK} for rid {want}")
                        if any_dead():
                            break
                    else:
                        counts["block_replies"] += 1
                        counts["block_error_replies"] += got.get("t") == "error"
                reclaim_refused()
        correct_request(frames)
        barrier()  # whatever block d sent us before it has arrived now
        while pull.poll(200):  # nothing may arrive that nobody asked for
            h = json.loads(pull.recv_multipart()[0])
            release_handle(h)
            if h.get("rid") in maybe_rids:
                counts["block_replies_uncertain"] += 1
                continue
            counts["block_unexpected_replies"] += 1
            failures.append(f"an answer nobody waited for: rid {h.get('rid')!r}")
        rss.append((frames, _rss_mb(proc_pids)))
        fds.append((frames, _fds(proc_pids)))
        fd_kinds.append(_fd_kinds(proc_pids, pipe.shm))

        crashes = []
        for name, p in pipe.procs.items():
            if p.poll() is not None:
                crashes.append(f"{name} exited with {p.returncode}")
                continue
            try:
                pipe.command(name, "ping", timeout=5)
            except Exception as exc:  # a receiver thread that died answers no ping
                crashes.append(f"{name} does not answer a ping: {exc}")
        dstats = pipe.command(DISPATCHER, "ping") if not crashes else {}
        client.close()
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()
        if pool is not None:
            pool.close()
        if mapper is not None:
            mapper.close()
        stopped = pipe.stop()
        pickle_ran = os.path.exists(marker)
        if own:
            shutil.rmtree(base, ignore_errors=True)

    warm = next((v for i, v in rss if i >= frames // 5), rss[0][1])
    warm_at = next((k for k, (i, _) in enumerate(fds) if i >= frames // 5), 0)
    warm_fds, warm_frame = fds[warm_at][1], fds[warm_at][0]
    summary = {
        "seed": seed, "frames": frames, "seconds": round(time.monotonic() - t0, 1), **counts,
        "crashes": len({c.split()[0] for c in crashes} | {n for n, c in stopped["codes"].items() if c != 0}),
        "crash_details": crashes, "exit_codes": stopped["codes"], "left_behind": stopped["left"],
        "pickle_executed": pickle_ran,
        "error_replies_expected": counts["dispatcher_frames"] + counts["block_expected_replies"],
        "error_or_result_replies_received": counts["dispatcher_replies"] + counts["block_replies"],
        "rss_mb": {"warm": round(warm, 1), "end": round(rss[-1][1], 1), "max": round(max(v for _, v in rss), 1),
                   "samples": [(i, round(v, 1)) for i, v in rss]},
        "rss_growth_pct": round((rss[-1][1] - warm) / warm * 100, 2),
        "fds": {"warm": warm_fds, "end": fds[-1][1], "kinds_warm": fd_kinds[warm_at], "kinds_end": fd_kinds[-1]},
        "window": pipe_window, "foreign_hops": len(foreign_hops),
        "foreign_hops_after_warm": sum(1 for last in foreign_hops.values() if last >= warm_frame),
        "dispatcher_stats": dstats, "slow_frames": slow[:20], "slow_count": len(slow), "failures": failures[:20], "failure_count": len(failures),
    }
    return summary


def _format(s: dict) -> str:
    return (f"{s['frames']} frames in {s['seconds']}s (seed {s['seed']}): dispatcher {s['dispatcher_frames']} "
            f"-> {s['dispatcher_replies']} replies ({s['dispatcher_error_replies']} errors), block "
            f"{s['block_frames']} -> {s['block_replies']}/{s['block_expected_replies']} answers due, "
            f"results {s['result_frames']}; correct {s['correct_ok']}/{s['correct_requests']}; crashes "
            f"{s['crashes']}; RSS {s['rss_mb']['warm']} -> {s['rss_mb']['end']} MB "
            f"({s['rss_growth_pct']:+.2f}%); descriptors {s['fds']['warm']} -> {s['fds']['end']} (budget "
            f"{fd_budget(s)}); failures {s['failure_count']}; left {s['left_behind']}; "
            f"pickle executed: {s['pickle_executed']}")


def main(argv=None) -> int:
    from experiments.common import env_info, parser, setup_logging, write_json
    ap = parser("fuzz", __doc__)
    ap.add_argument("--frames", type=int, default=10000, help="frames to send (default 10000)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--every", type=int, default=25, help="a correct request every N frames (default 25)")
    args = ap.parse_args(argv)
    setup_logging(args.verbose)
    frames = 2000 if args.quick and args.frames == 10000 else args.frames
    print(f"fuzz: seed {args.seed}, {frames} frames", file=sys.stderr)

    def progress(i, n):
        if i and i % max(1, n // 10) < max(50, n // 40):
            print(f"fuzz: {i}/{n}", file=sys.stderr, flush=True)

    s = run_fuzz(frames, args.seed, args.every, progress=progress)
    print(_format(s))
    write_json(args.out, "fuzz", {"env": env_info({"frames": frames, "seed": args.seed, "every": args.every}),
                                  "summary": s})
    ok = (s["crashes"] == 0 and s["failure_count"] == 0 and not s["pickle_executed"]
          and s["left_behind"] == {"slots": [], "sockets": []} and s["correct_ok"] == s["correct_requests"]
          and s["fds"]["end"] - s["fds"]["warm"] <= fd_budget(s))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
