"""The block process: one TorchScript model, its sockets, and four threads (thesis 3.5.1, 3.6.1).

Threads and what each owns (ZeroMQ sockets are never shared between threads):

- *receiver* (Algorithm 1): one ``zmq.Poller`` over the data socket (PULL), the control
  socket (DEALER) and an inproc outbox; fills the tensor queue and the control queue, and
  sends whatever the other threads put in the outbox (control replies, overload errors).
- *control* (Algorithm 5): blocks on the control queue, runs each command, answers.
- *monitor*: samples psutil/pynvml every 250 ms while enabled.
- *main* (Algorithm 2): takes a tensor, runs the model, forwards the output to the next hop
  named in the message, records the latency components of eq. 4.1.

Blocks make no routing decision: every message carries its remaining path, return address
last. Shutdown order: stop flag -> main loop ends and answers what is still queued with an
error -> KPI logs flushed -> transport closed (own slots unlinked) -> receiver stops ->
sockets closed -> socket file removed.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

import torch
import zmq

from blockflow.protocol import (EXIT_BOOT_ERROR, EXIT_CRASH, EXIT_OK, EXIT_ORPHANED, RETURN_HOP,
                                identity)
from blockflow.tensormq.shm import HopGone
from blockflow.tensormq.transport import DEFAULT_SEND_TIMEOUT, Transport, receive_limit
from blockflow.tensormq.wire import WireError, check_path, dumps, loads_header

from .kpilog import KpiLog
from .monitor import DEFAULT_INTERVAL, ResourceSampler
from blockflow import settings

log = logging.getLogger("blockflow.block")

#: Tensors a block queues before it answers new ones with an ``overloaded`` error.
DEFAULT_MAX_QUEUE = settings.MAX_QUEUE
#: The inference loop goes around at least this often when idle (its heartbeat, ``beat_age_s``).
BEAT_INTERVAL = 0.5
_STOP = object()


@dataclass
class BlockSpec:
    """Everything a block needs, decided before it is spawned (nothing here touches the process)."""

    name: str
    model: str                      # path relative to repo, e.g. "resnet50/block1.pt"
    repo: str
    run_dir: str                    # KPI logs
    sock_dir: str                   # ipc socket files
    shm_dir: str | None = None      # TensorMQ slots (0700 directory)
    device: str = "cpu"
    transport: str = "tensormq"
    protocol: str = "ipc"
    threads: int | None = None
    cpus: list[int] | None = None
    incarnation: int = 0
    controller: str | None = None   # control endpoint; None: standalone (tests, benchmarks)
    parent_pid: int | None = None   # exit when this process is gone
    window: int = 8
    max_queue: int = DEFAULT_MAX_QUEUE
    send_timeout: float = DEFAULT_SEND_TIMEOUT
    monitor: bool = True
    monitor_interval: float = DEFAULT_INTERVAL
    warmup: bool = True
    #: seconds one inference may take; the manager kills and respawns a block past it (liveness)
    max_inference_s: float = 60.0
    extra: dict = field(default_factory=dict)

    def endpoint_hint(self) -> str:
        if self.protocol == "ipc":
            return f"ipc://{os.path.join(self.sock_dir, f'{self.name}-{self.incarnation}.sock')}"
        return "tcp://127.0.0.1"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> "BlockSpec":
        return BlockSpec(**json.loads(text))


class BootError(RuntimeError):
    """The block cannot start; respawning would fail the same way (EXIT_BOOT_ERROR)."""


class Block:
    def __init__(self, spec: BlockSpec):
        # Pre-spawn: remember the spec only. Sockets, threads and the model come in init_process().
        self.spec = spec
        self.name = spec.name
        self.stopping = threading.Event()
        self.monitor_on = threading.Event()
        self.exit_code = EXIT_OK
        self.endpoint: str | None = None
        self.tensors: queue.Queue = queue.Queue()
        self.controls: queue.Queue = queue.Queue()
        # Liveness, written by the inference thread only, read by the control thread (floats:
        # one assignment each is atomic under the GIL). busy_since is 0.0 while idle.
        self.busy_since = 0.0
        self.beat = time.monotonic()

    # -- start-up ----------------------------------------------------------------------------
    def init_process(self) -> None:
        spec = self.spec
        if spec.cpus:
            os.sched_setaffinity(0, spec.cpus)
        if spec.threads:
            torch.set_num_threads(spec.threads)
        self.device = torch.device(spec.device)
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise BootError(f"block {self.name}: device {spec.device} requested but no GPU is visible")
            torch.cuda.set_device(self.device)
        from .repository import BlockFileError, load_block, verify_block
        try:
            entry = verify_block(spec.repo, spec.model)
            self.model = load_block(spec.repo, spec.model, spec.device)
        except BlockFileError as exc:
            raise BootError(f"block {self.name}: {exc}") from None
        if spec.warmup and entry and entry.get("input_shape"):
            with torch.inference_mode():
                self.model(torch.zeros(entry["input_shape"], dtype=getattr(torch, entry.get("dtype", "float32")),
                                       device=self.device))
        self.kpi = KpiLog(spec.run_dir, self.name)
        self.sampler = ResourceSampler(spec.device)
        if spec.monitor:
            self.monitor_on.set()

        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.linger = 0
        self.pull.rcvhwm = 1000
        self.pull.maxmsgsize = receive_limit()
        try:
            if spec.protocol == "ipc":
                self.endpoint = spec.endpoint_hint()
                path = self.endpoint[len("ipc://"):]
                if os.path.exists(path):
                    os.unlink(path)  # left over by a killed predecessor with the same incarnation
                self.pull.bind(self.endpoint)
            else:
                port = self.pull.bind_to_random_port("tcp://127.0.0.1")
                self.endpoint = f"tcp://127.0.0.1:{port}"
        except zmq.ZMQError as exc:
            raise BootError(f"block {self.name}: cannot bind its data socket ({exc})") from None
        self.ctrl = None
        if spec.controller:
            self.ctrl = self.ctx.socket(zmq.DEALER)
            self.ctrl.linger = 0
            self.ctrl.identity = identity(self.name, spec.incarnation)
            self.ctrl.connect(spec.controller)
        self.outbox_in = self.ctx.socket(zmq.PAIR)
        self.outbox_in.bind(f"inproc://outbox-{id(self)}")
        self.outbox = self.ctx.socket(zmq.PAIR)
        self.outbox.connect(f"inproc://outbox-{id(self)}")
        self.outbox_lock = threading.Lock()
        self.transport = Transport(self.ctx, f"{self.name}-{spec.incarnation}", spec.transport, spec.shm_dir,
                                   window=spec.window, send_timeout=spec.send_timeout)
        self.transport.stopping = self.stopping  # a stopping block waits for no slot
        self.threads = [threading.Thread(target=self.receiver_loop, name=f"{self.name}-receiver", daemon=True),
                        threading.Thread(target=self.control_loop, name=f"{self.name}-control", daemon=True),
                        threading.Thread(target=self.monitor_loop, name=f"{self.name}-monitor", daemon=True)]

    def announce(self) -> None:
        msg = {"t": "ready", "name": self.name, "inc": self.spec.incarnation, "pid": os.getpid(),
               "endpoint": self.endpoint, "device": self.spec.device}
        if self.ctrl is not None:
            self.ctrl.send(dumps(msg))
        log.info("block %s ready on %s (pid %d, %s, %s)", self.name, self.endpoint, os.getpid(),
                 self.spec.device, self.spec.transport)

    # -- threads -----------------------------------------------------------------------------
    def post(self, kind: str, payload: dict, address: str | None = None) -> None:
        """Hand a message to the receiver thread, which owns the sockets that send it."""
        with self.outbox_lock:
            self.outbox.send_multipart([kind.encode(), (address or "").encode(), dumps(payload)])

    def receiver_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        poller.register(self.outbox_in, zmq.POLLIN)
        if self.ctrl is not None:
            poller.register(self.ctrl, zmq.POLLIN)
        errors = Transport(self.ctx, f"{self.name}-err", "zeromq", None, send_timeout=1.0)
        next_parent_check = time.monotonic() + 1.0
        try:
            while not self.stopping.is_set():
                events = dict(poller.poll(100))
                if self.pull in events:
                    try:
                        self.receive_data(errors)
                    except Exception:  # a hostile frame must not end this thread (and the block with it)
                        log.exception("block %s: dropped a message that could not be handled", self.name)
                if self.ctrl is not None and self.ctrl in events:
                    self.receive_control()
                if self.outbox_in in events:
                    kind, address, payload = self.outbox_in.recv_multipart()
                    if kind == b"ctrl" and self.ctrl is not None:
                        self.ctrl.send(payload)
                    elif kind == b"data":
                        self.send_quietly(errors, address.decode(), json.loads(payload))
                if time.monotonic() >= next_parent_check:
                    next_parent_check = time.monotonic() + 1.0
                    if self.spec.parent_pid and not _alive(self.spec.parent_pid):
                        log.warning("block %s: manager pid %d is gone; shutting down", self.name, self.spec.parent_pid)
                        self.exit_code = EXIT_ORPHANED
                        self.request_stop()
        except zmq.ContextTerminated:
            pass
        finally:
            # flush what other threads posted while we were stopping (error replies, last control answer)
            while self.outbox_in.poll(0):
                kind, address, payload = self.outbox_in.recv_multipart()
                if kind == b"ctrl" and self.ctrl is not None:
                    self.ctrl.send(payload)
                elif kind == b"data":
                    self.send_quietly(errors, address.decode(), json.loads(payload))
            errors.close()

    def send_quietly(self, transport: Transport, address: str, header: dict) -> None:
        try:
            transport.send(address, header)
        except (TimeoutError, zmq.ZMQError) as exc:
            log.warning("block %s: could not send %s for request %s to %s: %s",
                        self.name, header.get("t"), header.get("rid"), address, exc)

    def receive_data(self, errors: Transport) -> None:
        """Drain the data socket: validate the envelope, queue the tensor or answer an error."""
        for _ in range(64):
            try:
                frames = self.pull.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            arrival, arrival_wall = time.perf_counter(), time.time()
            try:
                header = loads_header(frames[0])
                path = check_path(header.get("path"))
                if header.get("t") != "data":
                    raise WireError(f"t must be 'data', got {header.get('t')!r:.20}")
                if not isinstance(header.get("rid"), int):
                    raise WireError("rid must be an integer")
            except WireError as exc:
                ret = _return_address(frames[0])
                log.warning("block %s: dropped a malformed message (%s)%s", self.name, exc,
                            f"; error sent to {ret[1]}" if ret else "; no requester named")
                if ret:
                    self.send_quietly(errors, ret[1], {"t": "error", "rid": ret[0], "block": self.name,
                                                       "err": f"block {self.name}: malformed message: {exc}"})
                continue
            if self.tensors.qsize() >= self.spec.max_queue:
                self.send_quietly(errors, path[-1][1], {
                    "t": "error", "rid": header["rid"], "block": self.name, "code": "overloaded",
                    "err": f"block {self.name} is overloaded: {self.spec.max_queue} requests already queued"})
                self.release_unused(header)
                continue
            self.tensors.put((arrival, arrival_wall, header, frames))

    def release_unused(self, header: dict) -> None:
        """A refused request still holds a slot: open the handle only to release it."""
        x = header.get("x")
        if isinstance(x, dict) and x.get("loc") == "shm" and self.transport.mapper is not None:
            try:
                from blockflow.tensormq.wire import TensorDesc
                _t, lease = self.transport.mapper.open(TensorDesc.parse(x))
                lease.release()
            except WireError:
                pass

    def receive_control(self) -> None:
        while True:
            try:
                raw = self.ctrl.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = loads_header(raw)
            except WireError as exc:
                log.warning("block %s: ignored a malformed control message (%s)", self.name, exc)
                continue
            self.controls.put(msg)

    def control_loop(self) -> None:
        while True:
            msg = self.controls.get()
            if msg is _STOP:
                return
            cmd, args = msg.get("cmd"), msg.get("args") or {}
            try:
                result = self.handle_command(cmd, args)
                reply = {"t": "reply", "id": msg.get("id"), "ok": True, "result": result}
            except Exception as exc:  # a bad command must not kill the block
                reply = {"t": "reply", "id": msg.get("id"), "ok": False, "error": f"{type(exc).__name__}: {exc}"}
            self.post("ctrl", reply)

    def handle_command(self, cmd: str, args: dict):
        if cmd == "ping":
            now, busy_since = time.monotonic(), self.busy_since
            return {"pid": os.getpid(), "queue": self.tensors.qsize(), "served": self.kpi.count,
                    "in_flight": self.transport.in_flight(),
                    "busy_s": now - busy_since if busy_since else 0.0, "beat_age_s": now - self.beat}
        if cmd == "store":
            return {"written": self.kpi.flush(), "paths": self.kpi.paths}
        if cmd == "monitor":
            (self.monitor_on.set if args.get("enabled", True) else self.monitor_on.clear)()
            return {"enabled": self.monitor_on.is_set()}
        if cmd == "update":
            # tell the inference thread now which hops are gone, so that a wait for a dead
            # consumer's slots ends at once instead of holding this update for send_timeout
            self.transport.mark_live(args.get("live", []))
            done = threading.Event()
            box = {}
            self.tensors.put(("topology", args, done, box))  # applied by the main thread, which owns the sockets
            if not done.wait(10):
                raise TimeoutError("the inference thread did not apply the topology within 10 s")
            return box
        if cmd == "stop":
            self.request_stop()
            return {"stopping": True}
        raise ValueError(f"unknown command {cmd!r}")

    def monitor_loop(self) -> None:
        while not self.stopping.wait(self.spec.monitor_interval):
            if self.monitor_on.is_set():
                try:
                    rec = self.sampler.sample()
                    rec["queue"] = self.tensors.qsize()
                    self.kpi.add("resources", rec)
                except Exception as exc:  # psutil races at exit are not worth dying for
                    log.debug("block %s: sample failed: %s", self.name, exc)

    def request_stop(self) -> None:
        self.stopping.set()
        self.tensors.put(_STOP)

    # -- the inference loop (Algorithm 2) ------------------------------------------------------
    def run(self) -> int:
        for t in self.threads:
            t.start()
        self.announce()
        try:
            while True:
                self.beat = time.monotonic()
                try:
                    item = self.tensors.get(timeout=BEAT_INTERVAL)
                except queue.Empty:
                    continue
                if item is _STOP:
                    break
                if item[0] == "topology":
                    _, args, done, box = item
                    box["dropped"] = self.transport.set_topology(args.get("live", []), args.get("devices"))
                    done.set()
                    continue
                self.busy_since = time.monotonic()
                try:
                    self.infer(*item)
                finally:
                    self.busy_since = 0.0
        finally:
            self.shutdown()
        return self.exit_code

    def infer(self, arrival: float, arrival_wall: float, header: dict, frames: list) -> None:
        path = header["path"]
        rid = header["rid"]
        ret = path[-1][1]
        t0 = time.perf_counter()
        lease = None
        x_desc = None  # the handle of a message not sent yet: its slot is ours to give back
        try:
            x, lease = self.transport.decode(header.get("x"), frames)
            t1 = time.perf_counter()
            if x.device != self.device:
                x = x.to(self.device)
            t2 = time.perf_counter()
            with torch.inference_mode():
                y = self.model(x)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
            if not isinstance(y, torch.Tensor):
                raise TypeError(f"model returned {type(y).__name__}, not a tensor")
            t3 = time.perf_counter()
            next_name, next_addr = path[0]
            if lease is not None and not lease.contains(y):
                lease.release()  # done with the input: free its slot before we wait for ours
            hop = {"b": self.name, "wait": (t0 - arrival) * 1e3, "deser": (t1 - t0) * 1e3,
                   "dev": (t2 - t1) * 1e3, "inf": (t3 - t2) * 1e3}
            out = {"v": 1, "t": "result" if next_name == RETURN_HOP else "data", "rid": rid,
                   "task": header.get("task"), "path": path[1:] if next_name != RETURN_HOP else path,
                   "hops": (header.get("hops") or [])[:63] + [hop]}
            x_desc, payload = self.transport.encode(y, next_addr, lease)
            if lease is not None:
                lease.release()  # no-op when the handle was forwarded: the duty went with it
            t4 = time.perf_counter()
            hop["share"] = (t4 - t3) * 1e3
            out["x"] = x_desc
            self.transport.send(next_addr, out, payload)
            x_desc = None
            t5 = time.perf_counter()
        except Exception as exc:
            if x_desc is not None:
                self.transport.discard(x_desc)
            if lease is not None:
                lease.release()
            msg = f"block {self.name}: {type(exc).__name__}: {exc}"
            log.warning("%s (request %s)", msg, rid)
            err = {"t": "error", "rid": rid, "block": self.name, "err": msg}
            if isinstance(exc, HopGone):
                err["code"] = exc.code  # block_failed: the next hop was removed under this request
            self.post("data", err, ret)
            return
        self.kpi.add("latency", {"ts": arrival_wall, "rid": rid, "task": header.get("task"),
                                 "wait": hop["wait"], "deser": hop["deser"], "dev": hop["dev"],
                                 "inf": hop["inf"], "share": hop["share"], "fwd": (t5 - t4) * 1e3,
                                 "total": (t5 - arrival) * 1e3, "queue": self.tensors.qsize(),
                                 "batch": int(y.shape[0]) if y.dim() else 1})

    def shutdown(self) -> None:
        self.stopping.set()
        # answer what is still queued: nothing is dropped silently
        while True:
            try:
                item = self.tensors.get_nowait()
            except queue.Empty:
                break
            if item is _STOP or item[0] == "topology":
                continue
            header = item[2]
            self.release_unused(header)
            self.post("data", {"t": "error", "rid": header["rid"], "block": self.name,
                               "err": f"block {self.name} is shutting down"}, header["path"][-1][1])
        self.kpi.flush()
        self.controls.put(_STOP)
        for t in self.threads:
            t.join(timeout=2)
        self.transport.close()
        for sock in (self.pull, self.ctrl, self.outbox, self.outbox_in):
            if sock is not None:
                sock.close(linger=0)
        self.ctx.term()
        if self.endpoint and self.endpoint.startswith("ipc://"):
            try:
                os.unlink(self.endpoint[len("ipc://"):])
            except FileNotFoundError:
                pass
        log.info("block %s stopped (exit %d)", self.name, self.exit_code)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _return_address(raw) -> tuple[int, str] | None:
    """Best effort: who to tell that a malformed message was dropped."""
    try:
        header = json.loads(bytes(getattr(raw, "bytes", raw)))
        rid, path = header["rid"], check_path(header["path"])
        return (rid, path[-1][1]) if isinstance(rid, int) else None
    except Exception:
        return None


def serve_block(spec: BlockSpec) -> int:
    """Entry point of a block process (spawned by the manager or run by hand)."""
    logging.basicConfig(level=settings.LOG_LEVEL,
                        format=f"%(asctime)s %(levelname)s [{spec.name}] %(message)s")
    stop_signals = {}
    block = Block(spec)

    def on_term(signum, frame):  # only record it; the main loop does the work
        stop_signals["sig"] = signum
        block.request_stop()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle, in order
    try:
        block.init_process()
    except BootError as exc:
        log.error("%s", exc)
        _report_boot_error(spec, str(exc))
        return EXIT_BOOT_ERROR
    try:
        return block.run()
    except Exception:
        log.exception("block %s crashed", spec.name)
        return EXIT_CRASH


def _report_boot_error(spec: BlockSpec, message: str) -> None:
    """Tell the controller why we cannot start, so the REST answer can say it."""
    if not spec.controller:
        return
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 1000
    sock.identity = identity(spec.name, spec.incarnation)
    sock.connect(spec.controller)
    sock.send(dumps({"t": "boot_error", "name": spec.name, "inc": spec.incarnation, "pid": os.getpid(),
                     "error": message}))
    sock.close()
    ctx.term()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="blockflow block", description=(
        "Run one block process: load a TorchScript block, bind its data socket, serve until stopped. "
        "The manager starts blocks itself; run one by hand for tests or debugging."))
    parser.add_argument("--spec", required=True, help="the block spec as JSON (see blocks.process.BlockSpec)")
    args = parser.parse_args(argv)
    return serve_block(BlockSpec.from_json(args.spec))


if __name__ == "__main__":
    sys.exit(main())
