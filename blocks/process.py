"""The block process: one TorchScript model, its sockets, and three threads (thesis 3.5.1, 3.6.1).

Threads and what each owns (ZeroMQ sockets are never shared between threads)::

    upstream PUSH ──> [PULL] inference thread (main) ──[PUSH per next hop]──> next hop
                        │  ^ mailbox (inproc PAIR): topology updates, stop
                        v  │
    controller ROUTER <─> [DEALER] control thread          monitor thread (psutil/pynvml)

- *inference* (Algorithm 2, the process's main thread): owns the data socket it receives on
  (PULL), the ``Transport`` (one PUSH socket and one slot pool per next hop) and one end of
  the mailbox. It blocks in a receive on the data socket alone, takes a message, runs the
  model and sends the output itself: one thread wake-up per hop, and no poll set to build or
  socket events to ask on the way (Note [One wait per hop]). Between two requests it looks at
  the mailbox flag, so a topology update never waits behind queued tensors.
- *control* (Algorithm 5): owns the DEALER socket to the controller, the other end of the
  mailbox and the wake-up socket; answers ``ping`` (with the inference thread's heartbeat),
  ``store``, ``monitor`` itself, hands ``update`` and ``stop`` to the inference thread through
  the mailbox, and watches the parent process. It never waits for the inference thread: an
  update is answered when the mailbox answers (``Later``), and pings are answered meanwhile,
  so a block finishing a long inference before it applies an update is not taken for hung,
  and a block that is hung is (the manager's hang check needs no exemption).
- *monitor*: samples psutil/pynvml every 250 ms while enabled.

Queueing and ``max_queue``: a message waits first in the PULL socket's ZeroMQ buffer (RCVHWM
``RECEIVE_HWM``) while the model runs. Between two requests the inference thread takes what
waits there (up to ``DRAIN_LIMIT`` messages a round) into its backlog (a deque only it
touches) up to ``max_queue`` messages; anything beyond is answered ``overloaded`` at once and
its slot released (a block that was idle and woken by a message runs it without looking for
more first: see ``WOKEN_AFTER_S``). So at most ``max_queue`` requests are accepted and
waiting, and a refusal comes at most one inference late.

Blocks make no routing decision: every message carries its remaining path, return address
last.

Note [Ready to serve]
~~~~~~~~~~~~~~~~~~~~~
What a first request would pay is done before a block serves, in two steps. Before READY, the
warm-up (``BlockRunner.warm_up``) runs the model on every declared input shape as often as
TorchScript's profiling executor needs to have optimised it (``warm_calls``), and remembers the
size of what it made, so the output lender (Note [Outputs made in a slot]) lends a slot to the
first request too. Once every new block of an update is READY and before the manager switches
tasks to them (``Manager.prepare``), each process that is to send to a new block, and each new
block, is sent a topology update with ``prepare``: its next hops under the new tasks. It connects
a PUSH socket to each and, where tensors go by handle, makes that edge's window of slots, sized
by its warm-up's output (the dispatcher by the task's input). Where tensors arrive as bytes
(ZeroMQ), a block receives two messages of its input's size from itself before READY
(``warm_receive``), so its I/O thread's receive buffers exist before a request needs them.
experiments/first_request.py measures the first request after an update against a steady one.

Note [One wait per hop]
~~~~~~~~~~~~~~~~~~~~~~~
An idle block waits in ``recv`` on its data socket (timeout ``BEAT_INTERVAL``, its heartbeat),
the way the bare pyzmq relay of experiments/hop_overhead.py does, not in a poll over the data
socket and the mailbox: on this 2-core VM a block's caches are cold when a request wakes it,
and every call on the way (building the poll set, asking each socket for its events) cost
tens of microseconds there. The mailbox is still checked between any two requests, through a
flag: the control thread (1) sends the command into the mailbox, (2) sets the mailbox's ``waiting``,
(3) sends an empty message into the data socket through an inproc endpoint that only this
process knows, which ends a wait at once. The inference thread clears the flag before it
reads the mailbox dry, so a command sent while it reads is seen by the next round. An empty
message on the data socket is that wake-up and nothing else: it is never answered.

A TensorMQ block also has a datagram socket beside its data socket (Note [A datagram beside
the socket] in tensormq/datagram.py), where every header from a process on this host comes
while its queue has room; it then waits in one poll over both. The poll's cost (~15-30 us a
hop on this VM, measured against a blocking receive on the datagram socket alone) is far less
than what the datagram saves: a request's hop between two identity blocks fell from about
0.34 to 0.23 ms in an interleaved run of the twenty-second session.

Note [A direct answer]
~~~~~~~~~~~~~~~~~~~~~~
A local client that reads its results in slots (``out`` "shm", Note [Lent slots] in
dispatcher/lending.py) waited for two wake-ups after its last block: the dispatcher's, which
turned the result's header into a reply, then its own. So the dispatcher names the client's
datagram inbox, key and request id in the header it sends down the path (``reply``), and the
last block, whose result lies in host slots, sends the client its ``ClientReply`` by datagram
itself (``answer_client``, ``by: "block"``), then the result's header to the dispatcher as
before, marked ``answered``. The dispatcher stays the authority: it chose the path, admitted
the request and named the client; for an answered result it does what a reply would have done
but the send (the request leaves ``outstanding``, the slots are kept under the client's lease
until it releases them, the counts, the KPI record, the span). Only the bytes of one reply
skip it.

Whatever the datagram refuses (no inbox, a full one, a reply too large, a result that is not
all in host slots: bytes, CUDA slots, another node) goes the dispatcher's way, unmarked. A
client takes one answer per request: one that comes after a direct answer (the dispatcher's
error when the block died between its two sends, or its timeout racing the block) or a direct
answer after the dispatcher's is counted as ``late``, not as a duplicate. The key travels only
between the server's processes, in their 0700 socket directory, and the inbox must be named as
a BlockFlow client's (``DirectReply``), so a forged header cannot make a block write to any
other program's socket.

Note [Run to completion]
~~~~~~~~~~~~~~~~~~~~~~~~
Blocks of one shared process hand over by reference (Note [Hand-over inside a process] in
blocks/handover.py). Woken by a queue, the receiver's thread would start on another core or
after a switch, with the caches the producer's thread just warmed of no use to it: five
ResNet50 blocks each on a thread of its own cost 1.03-1.05x the same five on one thread (the
thirty-fourth session, experiments/results/profiles/README.md). So on a CPU the producer runs the
receiver's request itself, on its own thread, once its own request is done and logged
(``hand_on``): the whole group's path then runs on the thread of the block it entered by, as a
fused block would, while each member keeps its own model, KPI log, queue limit, errors and updates.

Each block's state is guarded by its ``run_lock``: its own inference thread holds it except
while it waits for a message, and a neighbour's thread takes it, without waiting, to run the
block's handed requests (``serve_handed``). What a neighbour does not take is left to the
block's own thread, woken as before: when the lock is held (the block is busy), when the block
has an update or a stop waiting, and when the thread that would run it has a request of its own
waiting (so that under load the members still run side by side, each on its thread). A member
whose code fails unexpectedly on another's thread ends its own thread with that error (its
``crashed``), as it would have on its own. GPU members, batching and a block cache keep the
queue and the wake-up (their streams, batch windows and residency belong to their own thread).

Measured (`python -m experiments.fused --series "one group" --n 60`, 2-core VM, the code before
and after in turn, twice): the group against the same blocks as five processes in the same
rounds 0.978x and 0.965x before, 0.906x and 0.919x run to completion.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import threading
import time
from collections import deque

import torch
import zmq

from blockflow.core import settings
from blockflow.core.childproc import BootError, ChildProcess, Later, Mailbox, exit_with, serve, spec_from_argv
from blockflow.core.protocol import RETURN_HOP, ErrorCode, Monitor, NoArgs, Ready, Topology
from blockflow.tensormq.shm import HopGone, ShmExhausted, SlotPool
from blockflow.core.curve import ClusterKeys, authenticator, make_server
from blockflow.tensormq.transport import RESULT_KEYS, Transport, payload_frames, receive_limit, recv_message
from blockflow.tensormq.bundle import first
from blockflow.tensormq.sizing import slot_files_of
from blockflow.tensormq.datagram import Receiver
from blockflow.tensormq.wire import (PROTOCOL_VERSION, ClientReply, DataHeader, WireError, block_error, check_path,
                                     direct_reply, encode_client, loads_data_header)

from .batching import DelayController, plan_batches, run_batch
from .handover import INBOXES, Handed, Inbox
from .heap import keep_freed_memory
from .kpilog import LATENCY_FIELDS, LATENCY_ROW, KpiLog
from .monitor import ResourceSampler
from .runner import BlockRunner, bucket_shapes, warmup_shapes
from .spec import BlockSpec

log = logging.getLogger("blockflow.block")

#: The inference loop goes around at least this often when idle (its heartbeat, ``beat_age_s``).
BEAT_INTERVAL = 0.5
#: Messages ZeroMQ buffers in the data socket while the model runs (see "Queueing" above).
RECEIVE_HWM = 1000
#: Messages the inference thread takes off its data socket between two requests, at most.
DRAIN_LIMIT = 256
#: A receive that took longer than this waited for its message: the block was idle.
WOKEN_AFTER_S = 100e-6
#: Slots lent at most for one output (Note [Outputs made in a slot]): ResNet's blocks need three.
MAX_LENT = 4
#: Seconds between two looks for mappings of slots whose producer is gone (a retired block's
#: files are unlinked; the consumer's mapping would pin their pages: SlotMapper.forget_unlinked).
SWEEP_INTERVAL = 2.0
#: Input buffers warmed before READY in ZeroMQ mode (warm_receive): a request's input is still
#: held while the next one is received, so the I/O thread allocates two.
RECEIVE_BUFFERS = 2
#: How long warm_receive waits for each of its own messages (milliseconds).
WARM_RECEIVE_TIMEOUT_MS = 2000


class _Request:
    """One request inside a block, from its input to its output (timestamps: perf_counter,
    CLOCK_MONOTONIC on Linux: see Note [Hop timestamps] in blocks/kpilog.py)."""

    __slots__ = ("arrival", "arrival_wall", "header", "x_in", "x", "lease", "t0", "t1", "t2", "batch_wait", "key",
                 "lend_ms")

    def __init__(self, arrival: float, arrival_wall: float, header: DataHeader):
        self.arrival, self.arrival_wall, self.header = arrival, arrival_wall, header
        self.x_in = self.x = self.lease = None
        self.t0 = self.t1 = self.t2 = arrival
        self.batch_wait = 0.0
        self.key = None  # (dtype, shape) of the input, where the block looked for a slot to lend
        self.lend_ms = 0.0  # time spent lending a slot before the model ran


class Block(ChildProcess):
    def __init__(self, spec: BlockSpec):
        # Pre-spawn: remember the spec only. Sockets, threads and the model come in init_process().
        super().__init__(spec, spec.name, f"block {spec.name}", spec.name)
        self.monitor_on = threading.Event()
        self.endpoint: str | None = None
        #: accepted requests not started yet; only the inference thread appends and pops
        self.backlog: deque = deque()
        # Liveness, written by the inference thread only, read by the control thread (floats:
        # one assignment each is atomic under the GIL). busy_since is 0.0 while idle.
        self.busy_since = 0.0
        self.beat = time.monotonic()
        #: dynamic batching across tasks (blocks/batching.py); None: one request at a time
        self.batching = spec.batching
        self.batcher = DelayController(self.batching, spec.max_inference_s / 4) if self.batching else None
        #: the output-in-slot extension (tensormq/outalloc.py), None where outputs are copied
        self.lender = None
        #: (dtype, input shape) -> bytes of the new tensor the model made from such an input last
        #: time (0: it returned a view of its input)
        self.outputs: dict[tuple, int] = {}
        #: how many slots to lend for an output: learnt once for the model, whatever the shape
        self.lend_count = 1
        #: a block in a shared process: what its neighbours there hand it, and their inboxes by
        #: address (Note [Hand-over inside a process] in blocks/handover.py); a block of its own
        #: process has no neighbour
        self.inbox: Inbox | None = None
        self.neighbours: dict[str, Inbox] = {}
        #: Note [Run to completion]: held by whichever thread runs this block's requests; its own
        #: inference thread lets go of it only while it waits for a message
        self.run_lock = threading.Lock()
        #: whether a neighbour's thread may run this block's handed requests, and this block run
        #: its neighbours' (hosted, on a CPU, no batching, no block cache); set by init_process
        self.runs_handed = False
        #: the inboxes the request being run was handed on to, for ``hand_on``
        self.handed_on: list[Inbox] = []
        #: requests of this block a neighbour's thread ran (its ping's ``run_by_neighbour``)
        self.run_by_neighbour = 0
        #: an unexpected error this block's code raised on a neighbour's thread: its own
        #: thread raises it (the member crashed)
        self.failed_elsewhere: BaseException | None = None
        #: the inference thread's wait over the data and datagram sockets (None: the data socket alone)
        self.waiter: zmq.Poller | None = None
        #: the wake-up socket is the control thread's, and the neighbours' inference threads' in
        #: a shared process: each use holds this lock (ZeroMQ sockets are not thread-safe)
        self.wake_lock = threading.Lock()
        #: a block of a shared process with a memory budget: the process's block cache (set by
        #: blocks/host.py before it starts) and this block's entry in it; None elsewhere
        self.cache = None
        self.cache_entry = None
        #: milliseconds the request (or batch) being run waited for its weights to swap in
        self.swap_ms = 0.0
        #: results this block, last on their path, answered their local client with itself
        #: (Note [A direct answer])
        self.answered = 0
        #: the short errors whose model traceback was logged (``fail``), bounded
        self.errors_logged: set[str] = set()

    # -- start-up ----------------------------------------------------------------------------
    def init_process(self) -> None:
        spec = self.spec
        if not spec.hosted:  # process-wide: a shared process sets them once (blocks/host.py)
            if spec.cpus:
                os.sched_setaffinity(0, spec.cpus)
            if spec.threads:
                torch.set_num_threads(spec.threads)
            keep_freed_memory(spec.malloc_trim)  # before the model loads: see blocks/heap.py
        from blockflow.core.protocol import canonical_device
        from blockflow.core.schema import block_and_replica
        self.device = torch.device(canonical_device(spec.device))  # set_device refuses a bare "cuda"
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise BootError(f"block {self.name}: device {spec.device} requested but no GPU is visible")
            if self.device.index >= torch.cuda.device_count():
                raise BootError(f"block {self.name}: device {spec.device} requested but only "
                                f"{torch.cuda.device_count()} GPU(s) are visible")
            torch.cuda.set_device(self.device)
        if self.device.type == "cuda":
            from .runner import trim_cuda_context
            log.info("block %s: CUDA context on %s: %s", self.name, self.device, trim_cuda_context(self.device))
        # a shared process's budget: its blocks start one at a time, each placed (resident or
        # parked) before the next one loads, so loading never holds more than the budget and one block
        with self.cache.starting if self.cache is not None else contextlib.nullcontext():
            self.load_model()
        if spec.transport == "tensormq" and self.device.type == "cpu":
            from blockflow.tensormq import outalloc
            self.lender = outalloc.load()  # after the model: its weights are never made in a slot
            if self.lender is None:
                log.info("block %s: outputs are copied into slots (%s)", self.name, outalloc.why_not())
            else:  # the first request lends a slot too: its output's size is known (Note [Ready to serve])
                self.outputs.update((k, n) for k, n in self.runner.outputs.items() if n)
        self.kpi = KpiLog(spec.run_dir, self.name)
        from blockflow.core.tracing import tracer_for
        #: OpenTelemetry spans of traced requests (blockflow/core/tracing.py); None when tracing is off
        self.tracer = tracer_for("blockflow")
        self.block, self.replica = block_and_replica(self.name)
        self.sampler = ResourceSampler(spec.device)
        if spec.monitor:
            self.monitor_on.set()

        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.linger = 0
        self.pull.rcvhwm = RECEIVE_HWM
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
        #: headers from processes on this host come by datagram (Note [A datagram beside the socket]
        #: in tensormq/datagram.py); a block that starts with bytes for tensors (zeromq) waits on ZeroMQ alone
        self.datagrams = (Receiver.beside(self.endpoint, f"block {self.name}")
                          if spec.transport == "tensormq" else None)
        self.mailbox = Mailbox(self.ctx, self.label, "inference thread")
        # the wake-up: the data socket also listens in-process, for the control thread only
        self.pull.bind(f"inproc://wake-{id(self)}")
        self.waker = self.ctx.socket(zmq.PUSH)
        self.waker.linger = 0
        self.waker.sndhwm = 4  # one pending wake-up is enough; more are dropped (send NOBLOCK)
        self.waker.connect(f"inproc://wake-{id(self)}")
        self.transport = Transport(self.ctx, f"{self.name}-{spec.incarnation}", spec.transport, spec.shm_dir,
                                   window=spec.window, send_timeout=spec.send_timeout)
        self.transport.stopping = self.stopping  # a stopping block waits for no slot
        self.tcp_endpoint = self.listen_between_nodes() if spec.bind_host else None
        self.transport.result_keys = os.path.join(spec.sock_dir, RESULT_KEYS)  # results over TCP: CURVE
        if spec.transport == "zeromq":
            self.warm_receive(max((k[0].itemsize * math.prod(k[1]) for k in self.runner.outputs), default=0))
        self.threads = [self.control_thread(),
                        threading.Thread(target=self.monitor_loop, name=f"{self.name}-monitor", daemon=True)]
        if spec.hosted:  # its neighbours hand over by reference from now on (blocks/handover.py)
            self.runs_handed = self.device.type == "cpu" and self.batching is None and self.cache is None
            self.inbox = Inbox(self.name, self.wake, self.serve_handed if self.runs_handed else None)
            self.inbox.open([self.endpoint, self.tcp_endpoint])
            self.neighbours = INBOXES
        self.open_control()  # last: see ChildProcess.open_control

    def load_model(self) -> None:
        """Load the model, warm it up (capturing its CUDA graphs on a GPU) and, in a shared
        process with a budget, place it in the process's block cache (blocks/cache.py)."""
        spec = self.spec
        from .repository import BlockFileError, open_block
        try:
            self.model, entry = open_block(spec.repo, spec.model, str(self.device), spec.verified)
        except BlockFileError as exc:
            raise BootError(f"block {self.name}: {exc}") from None
        #: what runs a request: the model, its CUDA graphs and the GPU clock (blocks/runner.py)
        self.runner = BlockRunner(self.model, self.device, self.name, cuda_graphs=spec.cuda_graphs,
                                  shared_process=spec.hosted)
        if spec.warmup:  # before ready: no request pays a first call or a graph capture
            entry = entry or {}
            # a batch size is a shape: a GPU block captures one graph per size it may run
            # declared dynamic dimensions: their buckets (on a GPU, a graph captured per bucket)
            shapes = warmup_shapes(entry.get("input_shapes") or entry.get("input_shape"),
                                   spec.warmup_shapes or bucket_shapes(entry),
                                   self.batching if self.runner.on_gpu else None)
            try:
                # one dtype, or one per member (a bundle of ids and a mask, of a mask and floats)
                dtype = spec.input_dtype or entry.get("input_dtypes") or entry.get("dtype", "float32")
                ran = self.runner.warm_up(shapes, [getattr(torch, d) for d in dtype] if isinstance(dtype, list)
                                          else getattr(torch, dtype))
                log.info("block %s: warmed up on %d input shape(s)%s", self.name, ran,
                         f" (the buckets of {entry['dim_buckets']})" if shapes and not spec.warmup_shapes
                         and entry.get("dim_buckets") else "")
            except Exception as exc:
                raise BootError(f"block {self.name}: warm-up on input shapes {shapes} failed: "
                                f"{type(exc).__name__}: {exc}") from None
        if self.cache is not None:
            self.join_cache()

    def join_cache(self) -> None:
        """Measure the block's weights and place it in its shared process's cache: resident
        where the budget has room, else parked until its first request (blocks/cache.py)."""
        from .cache import Entry, Weights
        weights = Weights(self.model, self.device,
                          os.path.join(self.spec.sock_dir, f"{self.name}-{self.spec.incarnation}.parked"))
        if weights.nbytes > self.cache.budget:
            raise BootError(f"block {self.name}: its weights are {weights.nbytes / 2**20:.1f} MB, more than its shared "
                            f"process's memory_budget_mb ({self.cache.budget / 2**20:.1f} MB); raise the budget or "
                            f"give the block a process of its own")
        self.cache_entry = Entry(self.name, weights, weights.nbytes, self.spec.pinned,
                                 on_park=self.runner.drop_graphs, on_restore=self.runner.recapture)
        self.cache.add(self.cache_entry)

    def warm_receive(self, nbytes: int) -> None:
        """ZeroMQ mode, before READY: receive ``RECEIVE_BUFFERS`` messages of ``nbytes`` (the
        largest warm-up input) from this block itself and drop them. A tensor that arrives as
        bytes lands in a buffer that the context's I/O thread allocates from its own malloc
        arena, which held nothing yet: without this the first requests fault those pages in
        (Note [Ready to serve])."""
        if not nbytes or self.endpoint is None:
            return
        push = self.ctx.socket(zmq.PUSH)
        push.linger = 0
        try:
            push.connect(self.endpoint)
            payload = bytes(nbytes)
            for _ in range(RECEIVE_BUFFERS):
                push.send(payload, copy=False)
            held = []  # every buffer alive at once, as a request's input is while the next one arrives
            for _ in range(RECEIVE_BUFFERS):
                if not self.pull.poll(WARM_RECEIVE_TIMEOUT_MS):
                    break
                held.append(self.pull.recv(copy=False))
        finally:
            push.close(linger=0)

    def listen_between_nodes(self) -> str:
        """Ray mode: the data socket also listens on TCP at this node's address, as a CURVE
        server that admits the cluster's client key only, for producers on other nodes (their
        tensors come as bytes); paths name the block by it. The ipc:// endpoint bound before
        stays without CURVE, for producers on this node (handles): libzmq takes a socket's
        security options into each listener when it binds. Producers here send to peers on
        other nodes with the same keys (Transport.curve)."""
        keys = ClusterKeys.from_json(self.spec.curve)
        if keys is None:
            raise BootError(f"block {self.name}: bind_host {self.spec.bind_host} needs the cluster's CURVE keys")
        self.auth = authenticator(self.ctx, keys.client_public.encode(), "block")
        make_server(self.pull, keys.server_secret.encode())
        try:
            port = self.pull.bind_to_random_port(f"tcp://{self.spec.bind_host}")
        except zmq.ZMQError as exc:
            raise BootError(f"block {self.name}: cannot listen on {self.spec.bind_host} for other nodes ({exc})") from None
        self.transport.curve = keys
        return f"tcp://{self.spec.bind_host}:{port}"

    def ready_info(self) -> dict:
        if self.tcp_endpoint:  # Ray mode: paths name it by its TCP endpoint; its node's producers use ``near``
            return {"endpoint": self.tcp_endpoint, "near": self.endpoint, "device": self.spec.device}
        return {"endpoint": self.endpoint, "device": self.spec.device}

    def announce(self) -> Ready:
        """READY to the controller; sent before the control thread starts, which then owns ctrl."""
        msg = super().announce()
        log.info("block %s ready on %s (pid %d, %s, %s)", self.name, self.endpoint, os.getpid(),
                 self.spec.device, self.spec.transport)
        return msg

    # -- the control thread (ChildProcess.control_loop) ---------------------------------------
    def control_ended(self) -> None:
        with self.wake_lock:
            self.waker.close(linger=0)

    # commands the control thread answers itself (ChildProcess answers "ping" and "stop" too)
    def cmd_ping(self, args: NoArgs) -> dict:
        now, busy_since = time.monotonic(), self.busy_since
        return {**super().cmd_ping(args), "queue": len(self.backlog), "served": self.kpi.count,
                "in_flight": self.transport.in_flight(), "outputs_made_in_slot": self.transport.made_in_slot,
                "received": dict(self.transport.received), "answered_clients": self.answered,
                "run_by_neighbour": self.run_by_neighbour,
                "datagrams": {**(self.datagrams.stats() if self.datagrams is not None else {}),
                              **self.transport.datagrams.stats()},
                "busy_s": now - busy_since if busy_since else 0.0, "beat_age_s": now - self.beat,
                "torch_threads": torch.get_num_threads(), "runner": self.runner.stats(),
                **({"cache": self.cache_stats()} if self.cache_entry is not None else {})}

    def cache_stats(self) -> dict:
        """This block's residency and counters, and its shared process's budget (blocks/cache.py)."""
        return {**self.cache_entry.stats(), "budget_bytes": self.cache.budget,
                "group_resident_bytes": self.cache.used(), "policy": self.cache.policy.name}

    def cmd_store(self, args: NoArgs) -> dict:
        return {"written": self.kpi.flush(), "paths": self.kpi.paths}

    def cmd_monitor(self, args: Monitor) -> dict:
        (self.monitor_on.set if args.enabled else self.monitor_on.clear)()
        return {"enabled": self.monitor_on.is_set()}

    def cmd_update(self, args: Topology) -> Later:
        # tell the inference thread now which hops are gone, so that a wait for a dead
        # consumer's slots ends at once instead of holding this update for send_timeout
        self.transport.mark_live(args.live)
        if args.tasks is not None and self.cache is not None:
            self.cache.set_tasks(self.name, args.tasks)  # the policy's sharing weight
        return self.on_main_thread("topology", self.apply_topology, args)

    def cmd_stop(self, args: NoArgs) -> dict:
        answer = super().cmd_stop(args)
        # the inference thread sees stopping within BEAT_INTERVAL (its receive timeout); a
        # wake-up makes that at once
        self.wake()
        return answer

    def wake_main(self) -> None:
        self.wake()

    def wake(self) -> None:
        """End the inference thread's wait on its data socket now (control thread, and in a
        shared process the inference threads that hand this block a request)."""
        with self.wake_lock:
            if self.waker.closed:
                return  # stopping: the inference thread answers what it holds without waiting
            try:
                self.waker.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass  # wake-ups already pending: the inference thread is about to go around anyway

    def monitor_loop(self) -> None:
        while not self.stopping.wait(self.spec.monitor_interval):
            if self.monitor_on.is_set():
                try:
                    rec = self.sampler.sample()
                    rec["queue"] = len(self.backlog)
                    self.kpi.add("resources", rec)
                except Exception as exc:  # psutil races at exit are not worth dying for
                    log.debug("block %s: sample failed: %s", self.name, exc)

    # -- the inference thread (Algorithm 2) ----------------------------------------------------
    def loop(self) -> None:
        # once for the thread, not per request (entering it costs more than an identity model)
        with torch.inference_mode(), self.runner.on_stream():  # a GPU block's own stream: blocks/runner.py
            self.inference_loop()

    def inference_loop(self) -> None:
        lock = self.run_lock  # Note [Run to completion]: held but while waiting for a message
        lock.acquire()
        try:
            self.serve_loop(lock)
        finally:
            lock.release()

    def serve_loop(self, lock: threading.Lock) -> None:
        poller = zmq.Poller()  # the batcher's wait only (fill_batch)
        poller.register(self.pull, zmq.POLLIN)
        poller.register(self.mailbox.loop_end, zmq.POLLIN)
        pull, backlog, admit, datagrams = self.pull, self.backlog, self.admit, self.datagrams
        pull.rcvtimeo = int(BEAT_INTERVAL * 1e3)
        if datagrams is not None:
            poller.register(datagrams.fileno(), zmq.POLLIN)
            waiter = self.waiter = zmq.Poller()  # Note [One wait per hop]: the datagram socket and the data socket
            waiter.register(pull, zmq.POLLIN)
            waiter.register(datagrams.fileno(), zmq.POLLIN)
        next_sweep = time.monotonic() + SWEEP_INTERVAL
        while not self.stopping.is_set():
            self.beat = time.monotonic()
            if self.failed_elsewhere is not None:  # Note [Run to completion]: this member crashed
                raise self.failed_elsewhere
            if self.beat >= next_sweep:  # busy or idle: a loaded block never times out its receive
                next_sweep = self.beat + SWEEP_INTERVAL
                self.transport.forget_unlinked()
            if self.mailbox.waiting:
                self.mailbox.serve()
            drain = DRAIN_LIMIT
            if not backlog:
                t_wait = time.perf_counter()
                if datagrams is not None:
                    lock.release()
                    try:
                        ready = waiter.poll(BEAT_INTERVAL * 1e3)
                    finally:
                        lock.acquire()
                    if not ready:
                        continue  # idle: the loop still goes around, so beat_age_s stays below BEAT_INTERVAL
                    came = datagrams.drain(DRAIN_LIMIT)
                    for data in came:
                        admit([data])
                    if came and len(ready) == 1 and time.perf_counter() - t_wait > WOKEN_AFTER_S \
                            and self.batching is None:
                        drain = 0  # woken by a datagram alone: as below
                else:
                    lock.release()
                    try:  # Note [One wait per hop]
                        frames = recv_message(pull)
                    except zmq.Again:
                        continue  # idle: the loop still goes around, so beat_age_s stays below BEAT_INTERVAL
                    finally:
                        lock.acquire()
                    if time.perf_counter() - t_wait > WOKEN_AFTER_S and self.batching is None:
                        # woken by this message: nothing else waited a moment ago, and asking the
                        # socket for more would cost a round of socket events (~35 us in a block on
                        # this VM) to find none. A burst behind it is taken next round, one inference
                        # later at most (a batcher's block always asks: it waits for more anyway).
                        drain = 0
                    admit(frames)
            elif datagrams is not None:
                for data in datagrams.drain(DRAIN_LIMIT):
                    admit([data])
            for _ in range(drain):  # bounded: a flood must not keep the model from running
                # asked, not tried: a zmq.Again raised per request costs more than the question
                if not pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    break
                try:
                    frames = recv_message(pull, zmq.NOBLOCK)
                except zmq.Again:  # POLLIN, yet no message: seen in Ray mode (the socket also bound to CURVE TCP)
                    break
                admit(frames)
            if self.mailbox.waiting:
                continue  # a topology update goes before the next request
            if backlog and self.batching is not None:
                waited = self.fill_batch(poller)
                items = [backlog.popleft() for _ in range(self.batcher.take(len(backlog)))]
                self.busy_since = time.monotonic()
                try:
                    if self.cache is None:
                        self.infer_batch(items, waited)
                    else:
                        self.infer_cached(items, lambda: self.infer_batch(items, waited))
                finally:
                    self.busy_since = 0.0
            elif backlog:
                item = backlog.popleft()
                self.busy_since = time.monotonic()
                try:
                    if self.cache is None:
                        self.infer(*item)
                    else:
                        self.infer_cached([item], lambda: self.infer(*item))
                finally:
                    self.busy_since = 0.0
                if self.handed_on:
                    self.hand_on()

    def infer_cached(self, items: list, run) -> None:
        """``run()`` the request (or batch) ``items`` with the block's weights resident: a hit
        holds them for it, a miss swaps them in first (blocks/cache.py; the swap's time is the
        request's ``swap``, part of its ``wait``). Past the block's bound with no room in the
        budget, each request is answered ``overloaded``."""
        from .cache import CacheWaitTimeout
        try:
            self.swap_ms = self.cache.acquire(self.name, min(settings.CACHE_WAIT_S, self.spec.max_inference_s / 2),
                                              self.touch_beat)
        except CacheWaitTimeout as exc:
            log.warning("%s", exc)
            for _arrival, arrival_wall, header, frames in items:
                if type(frames) is Handed:
                    frames.release()
                else:
                    self.release_unused(header)
                self.send_error(header.path[-1][1], header.rid, str(exc), ErrorCode.OVERLOADED)
                self.kpi.add("latency", {"ts": arrival_wall, "rid": header.rid, "task": header.task,
                                         "error": ErrorCode.OVERLOADED.value})
            return
        try:
            run()
        finally:
            self.cache.release(self.name)
            self.swap_ms = 0.0

    def touch_beat(self) -> None:
        """The inference thread is alive while it waits for room in the cache (``beat_age_s``)."""
        self.beat = time.monotonic()

    def fill_batch(self, poller: zmq.Poller) -> tuple[float, float]:
        """Wait up to the batcher's delay for more requests (fewer than max_batch are waiting);
        a mailbox message (topology, stop) ends the wait. Returns the wait window."""
        t_start = time.perf_counter()
        delay = self.batcher.delay(len(self.backlog))
        deadline = t_start + delay
        while delay > 0 and len(self.backlog) < self.batching.max_batch and not self.stopping.is_set():
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            events = dict(poller.poll(max(left * 1e3, 0.05)))
            if self.mailbox.loop_end in events:
                break  # the loop reads the mailbox right after this batch
            if self.pull not in events and (self.datagrams is None or self.datagrams.fileno() not in events):
                break
            if self.datagrams is not None:
                for data in self.datagrams.drain(self.batching.max_batch - len(self.backlog)):
                    self.admit([data])
            while self.pull.getsockopt(zmq.EVENTS) & zmq.POLLIN and len(self.backlog) < self.batching.max_batch:
                try:
                    frames = recv_message(self.pull, zmq.NOBLOCK)
                except zmq.Again:  # as in inference_loop
                    break
                self.admit(frames)
        return t_start, time.perf_counter()

    def apply_topology(self, args: Topology) -> dict:
        """A topology update, between two requests (inference thread, from the mailbox)."""
        answer = {"dropped": self.transport.set_topology(args.live, args.devices, args.near)}
        if args.prepare:
            answer["prepared"] = self.prepare_hops(args.prepare)
        return answer

    def prepare_hops(self, hops: dict) -> list[str]:
        """Open the sockets and slots towards the next hops an update is about to send this
        block's outputs to (Note [Ready to serve]); slots (TensorMQ) are sized by the largest
        output the warm-up made (``hops`` maps each address to None). Returns the addresses."""
        nbytes = max(self.runner.outputs.values(), default=0) if self.spec.transport == "tensormq" else 0
        device = str(self.device)
        for address in hops:
            self.transport.prepare(address, nbytes, device)
        return list(hops)

    def admit(self, frames: list) -> None:
        """Check one message's envelope once; accept it into the backlog, or answer an error."""
        arrival, arrival_wall = time.perf_counter(), time.time()
        if len(frames) == 1 and not len(frames[0]):
            if self.inbox is not None and self.inbox.items:  # a neighbour handed a request over
                self.admit_handed(arrival, arrival_wall)
            return  # the control thread's wake-up (Note [One wait per hop])
        try:
            header = loads_data_header(frames[0])  # typed and checked: Note [Typed header] in wire.py
            if header.t != "data":
                raise WireError(f"t must be 'data', got {header.t!r}")
        except WireError as exc:
            ret = _return_address(frames[0])
            log.warning("block %s: dropped a malformed message (%s)%s", self.name, exc,
                        f"; error sent to {ret[1]}" if ret else "; no requester named")
            if ret:
                self.send_error(ret[1], ret[0], f"block {self.name}: malformed message: {exc}")
            return
        except Exception:  # a hostile frame must not end this thread (and the block with it)
            log.exception("block %s: dropped a message that could not be handled", self.name)
            return
        self.enqueue(arrival, arrival_wall, header, frames, self.release_unused)

    def admit_handed(self, arrival: float, arrival_wall: float) -> None:
        """Accept what neighbours in this process handed over (blocks/handover.py), with the
        same queue limit as messages: their headers were checked by the block that received them."""
        items = self.inbox.items
        while items:
            header, handed = items.popleft()
            self.enqueue(arrival, arrival_wall, header, handed, lambda _header, h=handed: h.release())

    def hand_on(self) -> None:
        """Run what the request just done was handed on to, and what that hands on, on this
        thread (Note [Run to completion]); each receiver that does not take it is woken."""
        todo, self.handed_on = self.handed_on, []
        while todo:
            inbox = todo.pop(0)
            more = inbox.serve(self) if inbox.serve is not None else None
            if more is None:
                inbox.wake()
            else:
                todo.extend(more)

    def has_waiting(self) -> bool:
        """Whether this block (its own inference thread calling) has a request or a command
        waiting: its backlog, its mailbox, a message on its data or datagram socket."""
        if self.backlog or self.mailbox.waiting:
            return True
        if self.waiter is not None:
            return bool(self.waiter.poll(0))
        return bool(self.pull.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def serve_handed(self, home: "Block") -> list | None:
        """Run this block's handed requests on the calling thread, the inference thread of
        ``home`` (Note [Run to completion]); returns the inboxes they were handed on to, or
        None, having run nothing, when this block's own thread must take them."""
        if home.has_waiting() or not self.run_lock.acquire(blocking=False):
            return None
        backlog, handed_on = self.backlog, []
        try:
            if self.stopping.is_set() or self.mailbox.waiting or self.failed_elsewhere is not None:
                return None
            self.beat = time.monotonic()
            self.admit_handed(time.perf_counter(), time.time())
            while backlog:
                item = backlog.popleft()
                self.busy_since = time.monotonic()
                self.run_by_neighbour += 1
                try:
                    self.infer(*item)
                finally:
                    self.busy_since = 0.0
                handed_on += self.handed_on
                self.handed_on = []
            return handed_on
        except Exception as exc:  # a bug of this block's must not end its neighbour's thread
            log.exception("block %s: failed on the thread of block %s", self.name, home.name)
            self.failed_elsewhere = exc
            self.wake()
            handed_on += self.handed_on  # what it handed on before it failed still goes on
            self.handed_on = []
            return handed_on
        finally:
            self.run_lock.release()

    def enqueue(self, arrival: float, arrival_wall: float, header: DataHeader, frames, give_back) -> None:
        """Queue one admitted request, or answer it ``overloaded`` when ``max_queue`` are waiting
        (``give_back(header)`` then releases what it holds: its slot, or a handed tensor's lease)."""
        if len(self.backlog) >= self.spec.max_queue:
            give_back(header)
            self.send_error(header.path[-1][1], header.rid,
                            f"block {self.name} is overloaded: {self.spec.max_queue} requests already queued",
                            ErrorCode.OVERLOADED)
            return
        self.backlog.append((arrival, arrival_wall, header, frames))
        if self.batcher is not None:
            self.batcher.arrived(arrival)

    def send_error(self, address: str, rid: int, err: str, code: ErrorCode | None = None) -> None:
        """Answer request ``rid`` with an error (``BlockError``, no tensor) at ``address``, its
        return address: best effort, a short wait, never raises."""
        try:
            self.transport.send(address, block_error(rid, self.name, err, code), timeout=1.0)
        except (TimeoutError, ConnectionError, zmq.ZMQError) as exc:
            log.warning("block %s: could not send the error for request %s to %s: %s",
                        self.name, rid, address, exc)

    def release_unused(self, header: DataHeader) -> None:
        """A refused request still holds a slot (shared memory or CUDA): release it through
        the slot's header, without mapping the tensor."""
        try:
            for x in (header.xs if header.xs is not None else [header.x]):
                self.transport.release_handle(x)
        except WireError as exc:
            log.info("block %s: could not release the slot of refused request %s: %s",
                     self.name, header.rid, exc)

    def infer(self, arrival: float, arrival_wall: float, header: DataHeader, frames: list) -> None:
        """One request: its input, the model, its output on to the next hop (Algorithm 2)."""
        if self.runner.stream_ordered:
            return self.infer_ordered(arrival, arrival_wall, header, frames)
        req = self.take_input(arrival, arrival_wall, header, frames)
        if req is None:
            return
        lent, takes, t_inf = (), 0, req.t2
        if self.outputs:  # lending is transport work: its time goes to "share", not "inf"
            lent = self.lend_output(req)
            t_inf = time.perf_counter()
            req.lend_ms = (t_inf - req.t2) * 1e3
        try:
            try:
                y = self.runner(req.x)  # inference mode: entered once by run()
            finally:
                if lent:
                    takes = self.lender.disarm()
        except Exception as exc:
            self.fail(req, exc)
            return
        self.send_output(req, y, t_inf, time.perf_counter(), 1, lent, takes)

    def infer_ordered(self, arrival: float, arrival_wall: float, header: DataHeader, frames: list) -> None:
        """One request on a GPU, stream-ordered (Note [GPU hand-over order] in blocks/runner.py):
        the input's producer event, the model (its CUDA graph) and the copy into the next hop's
        slot are queued, the handle is sent, and only then does the block wait for its GPU,
        release the input and read its stage times from the CUDA events."""
        clock = self.runner.clock
        clock.reset()
        clock.mark("queued")
        req = self.take_input(arrival, arrival_wall, header, frames)
        if req is None:
            return
        t_inf = time.perf_counter()
        try:
            y = self.runner(req.x)
            clock.mark("inferred")
        except Exception as exc:
            self.fail(req, exc)
            return
        self.send_output(req, y, t_inf, time.perf_counter(), 1, ordered=True)

    def lend_output(self, req: "_Request") -> list:
        """Free slots of the next hop, armed for the model to make its output in (Note [Outputs
        made in a slot] in tensormq/outalloc.py), when an input like this one gave a new tensor
        before; how many is learnt (``made_in``)."""
        x = req.x
        req.key = key = (x.dtype, x.shape)
        nbytes = self.outputs.get(key)
        if not nbytes or req.header.path[0][1] in self.neighbours:  # a neighbour takes the tensor itself
            return []
        try:
            lent = self.transport.lend(req.header.path[0][1], nbytes, self.lend_count)
        except Exception:  # no slot could be made (shared memory full): the send after the model says why
            return []
        if lent:
            self.lender.arm([s.data.data_ptr() for s in lent], [s.capacity for s in lent], nbytes)
        return lent

    def made_in(self, req: "_Request", y: torch.Tensor, lent: list, takes: int):
        """The lent slot the model made ``y`` in, or None. When it made it elsewhere although
        tensors of its size took every lent slot, the next request gets one more: how many
        tensors of the output's size a model keeps alive at once is a matter of its structure,
        not of the input's shape, so one count serves every shape (a new batch size copies its
        first output only)."""
        i = SlotPool.holder(lent, y)
        if i >= 0:
            return lent[i]
        if takes >= len(lent) >= self.lend_count and self.lend_count < MAX_LENT:  # not a slot short
            self.lend_count += 1
        return None

    def learn_output(self, req: "_Request", y: torch.Tensor, new: bool) -> None:
        """Remember what the model made from an input like ``req.x``: the size of a new tensor,
        or 0 (a view of its input: nothing to lend). A block whose outputs were all views never
        lends (``outputs`` stays empty)."""
        if new and y.is_cpu and y.is_contiguous():
            x = req.x
            if len(self.outputs) >= 1024:
                self.outputs.clear()
            self.outputs[(x.dtype, x.shape)] = y.numel() * y.element_size()
        elif req.key is not None:
            self.outputs[req.key] = 0

    def infer_batch(self, items: list, waited: tuple[float, float]) -> None:
        """Several requests as few inferences as their shapes allow (blocks/batching.py): each
        request's output goes on along its own remaining path. ``waited`` is the batcher's wait
        window (perf_counter start, end), recorded per request as ``batch_wait``."""
        reqs = [r for r in (self.take_input(*item) for item in items) if r is not None]
        if not reqs:
            return
        xs = [r.x for r in reqs]
        for group in plan_batches(xs, self.batching):
            t_inf = time.perf_counter()
            with torch.inference_mode():
                outs = run_batch(self.runner, [xs[i] for i in group],
                                 inputs_copied=lambda g=group: self.release_inputs([reqs[i] for i in g]))
                self.runner.finish()  # a GPU batch is timed to its end (its own stream only)
            t_done = time.perf_counter()
            self.batcher.served(len(group), t_done - t_inf)
            for i, y in zip(group, outs):
                r = reqs[i]
                r.batch_wait = max(0.0, waited[1] - max(r.arrival, waited[0])) * 1e3
                if isinstance(y, Exception):
                    self.fail(r, y)
                else:
                    self.send_output(r, y, t_inf, t_done, len(group))

    def release_inputs(self, reqs: list) -> None:
        """The batch copied these requests' inputs: give their slots back to the block upstream
        now, not after the batch's inference and sends (it would wait for them meanwhile)."""
        self.runner.finish()  # the copy is queued on the GPU: done before the slot goes
        for r in reqs:
            if r.lease is not None:
                r.lease.release()
                r.lease = None

    def take_input(self, arrival: float, arrival_wall: float, header: DataHeader, frames: list) -> "_Request | None":
        """Rebuild a request's tensor on this block's device; None after answering an error."""
        req = _Request(arrival, arrival_wall, header)
        req.t0 = time.perf_counter()
        runner = self.runner
        try:
            if type(frames) is Handed:  # from a neighbour in this process: a reference (blocks/handover.py)
                req.x_in, req.lease = frames.take(runner.stream)
                self.transport.received["local"] = self.transport.received.get("local", 0) + 1
            elif header.xs is not None:  # several tensors (tensormq/bundle.py): the slower, general way
                req.x_in, req.lease = self.transport.decode_value(header.x, header.xs, header.keys, frames)
            else:
                req.x_in, req.lease = self.transport.decode(header.x, frames)
            runner.mark("ready")  # on a GPU: once the stream waited for the input's producer
            req.t1 = time.perf_counter()
            req.x = runner.to_device(req.x_in)
            runner.mark("on_device")
            req.t2 = time.perf_counter()
        except Exception as exc:
            self.fail(req, exc)
            return None
        return req

    def send_output(self, req: "_Request", y, t_inf: float, t_done: float, batch: int, lent=(),
                    takes: int = 0, ordered: bool = False) -> None:
        """Send ``y`` on along the request's path, by handle where it is a view of the input or
        was made in one of the ``lent`` slots (``takes``: how many times the model's tensors took
        one), else copied into a slot (or as bytes). ``ordered``: the GPU work is still queued
        (``infer_ordered``): the input is released, and the stage times read, after the send."""
        header, lease, x_in = req.header, req.lease, req.x_in
        path = header.path
        x_desc = None  # the handle of a message not sent yet: its slot is ours to give back
        try:
            # one tensor in and out: the fast path (a bundle goes the general way, tensormq/bundle.py)
            single = isinstance(y, torch.Tensor) and header.xs is None
            # "share" starts where "inf" ended, so that the stages cover the block's clock with no
            # gap (a thread preempted right after the model returned lost milliseconds to no stage
            # on the loaded 2-core VM); a batch's later members waited for the earlier sends, in "wait"
            t3 = t_done if batch == 1 else time.perf_counter()
            next_name, next_addr = path[0]
            # a bundle's members may forward the input's slots: it is released after the encode
            new = single and y is not x_in and (lease is None or not lease.contains(y))
            if lease is not None and new and not ordered:
                lease.release()  # done with the input: free its slot before we wait for ours
            made_in = self.made_in(req, y, lent, takes) if lent and new else None
            if self.lender is not None and single and (new or req.key is not None):
                self.learn_output(req, y, new)
            inf = (t_done - t_inf) * 1e3
            hop = {"b": self.name, "wait": (req.t0 - req.arrival) * 1e3, "deser": (req.t1 - req.t0) * 1e3,
                   "dev": (req.t2 - req.t1) * 1e3, "inf": inf, "t_in": round(req.arrival, 6)}
            # the received header goes on: only t, path, hops and x change
            header.hops = header.hops[:63] + [hop]
            if next_name == RETURN_HOP:
                header.t = "result"
            else:
                header.path = path[1:]
            neighbour = self.neighbours.get(next_addr) if self.neighbours else None
            if neighbour is not None:  # in this process: the tensor itself (blocks/handover.py)
                handed = Handed.of(y, lease, self.runner.stream)
                header.x, header.keys = None, None
                header.xs = None if isinstance(handed.value, torch.Tensor) else []  # [] : a bundle
                if handed.lease is not None:
                    lease = None  # its release duty goes with the tensor (req's too, once it is handed)
            elif single:
                # an output that is the input itself keeps the input's handle as it came
                x_desc, payload = self.transport.encode(y, next_addr, lease,
                                                        same_as=header.x if y is x_in else None, made_in=made_in)
            else:  # a bundle in or out (tensormq/bundle.py): one descriptor per member
                fields, payload = self.transport.encode_value(y, next_addr, lease)
                x_desc = fields.get("x") or fields["xs"]
                header.x, header.xs, header.keys = fields.get("x"), fields.get("xs"), fields.get("keys")
            if lease is not None and not ordered:
                lease.release()  # no-op when the handle was forwarded: the duty went with it
            self.runner.mark("shared")
            t4 = time.perf_counter()
            hop["share"] = (t4 - t3) * 1e3 + req.lend_ms
            hop["t_out"] = round(t4, 6)  # Note [Hop timestamps] in blocks/kpilog.py
            if neighbour is not None:
                if self.runs_handed and neighbour.serve is not None:  # Note [Run to completion]
                    neighbour.put(header, handed, wake=False)
                    self.handed_on.append(neighbour)
                else:
                    neighbour.put(header, handed)
                if handed.lease is not None:
                    req.lease = None
            else:
                if single:
                    header.x = x_desc
                if header.reply is not None and next_name == RETURN_HOP:  # Note [A direct answer]
                    header.answered = not payload_frames(payload) and self.answer_client(header)
                    header.reply = None
                self.transport.send(next_addr, header, payload)
                x_desc = None
            t5 = time.perf_counter()
        except Exception as exc:
            self.fail(req, exc, x_desc)
            return
        if ordered:
            self.finish_ordered(req, header, hop, t4, t5, y)
            return
        total = (t5 - req.arrival) * 1e3
        if self.batching is None:  # the common case, in LATENCY_ROW's order (see KpiLog.add_row)
            row = (req.arrival_wall, header.rid, header.task, hop["wait"], hop["deser"], hop["dev"], inf,
                   hop["share"], (t5 - t4) * 1e3, total, hop["t_in"], hop["t_out"], len(self.backlog), _rows(y))
            self.log_row(row, header)
            return
        rec = {"ts": req.arrival_wall, "rid": header.rid, "task": header.task,
               "wait": hop["wait"], "deser": hop["deser"], "dev": hop["dev"], "inf": inf, "share": hop["share"],
               "fwd": (t5 - t4) * 1e3, "total": total, "t_in": hop["t_in"], "t_out": hop["t_out"],
               "queue": len(self.backlog),
               "batch": _rows(y)}
        # in a batch the request also waited for its batch-mates' inputs (and earlier groups)
        # before the model ran, and for their sends after it: measured here, both are part of
        # "wait", so the stages add up to "total" where nothing is lost or counted twice (the
        # check of tests/process/test_metrics.py against the independently timed "total")
        rec["wait"] = hop["wait"] + ((t_inf - req.t2) + (t3 - t_done)) * 1e3
        rec["requests_in_batch"] = batch
        rec["batch_wait"] = req.batch_wait
        if self.swap_ms:
            rec["swap"] = self.swap_ms  # Note [Swap time] in blocks/kpilog.py
        self.kpi.add("latency", rec)
        if header.trace is not None and self.tracer is not None:
            self.trace(header.trace, rec)

    def answer_client(self, header: DataHeader) -> bool:
        """Send a local client its result's reply by datagram (Note [A direct answer]): True
        when it went, False when the dispatcher must answer (a member not in a host slot, the
        datagram refused)."""
        members = header.xs if header.xs is not None else [header.x]
        reply = direct_reply(header.reply)
        if reply is None or not all(type(m) is dict and m.get("loc") == "shm" for m in members):
            return False
        inbox, key, cid, started = reply
        answer = ClientReply(PROTOCOL_VERSION, cid, "ok", hops=header.hops, ms=(time.monotonic() - started) * 1e3,
                             x=header.x, xs=header.xs, keys=header.keys, key=key, by="block")
        if not self.transport.datagrams.send_to(inbox, encode_client(answer)):
            return False
        self.answered += 1
        return True

    def finish_ordered(self, req: "_Request", header: DataHeader, hop: dict, t4: float, t5: float, y) -> None:
        """After the send of a stream-ordered request: wait for the GPU, give the input back,
        log the request's stages. GPU work is timed by its CUDA events (``GpuClock``), host
        work by the host clock, and ``total`` is their sum: ``wait`` (queue, then the stream's
        wait for the input's producer), ``deser`` (host), ``dev``, ``inf`` and ``share`` (GPU),
        ``fwd`` (host). The hop record that travelled in the header was written before the GPU
        ran, with host times (the launch, not the kernels)."""
        self.runner.finish()
        if req.lease is not None:
            req.lease.release()  # nothing queued here reads it any more; no-op when forwarded
        clock = self.runner.clock
        wait = hop["wait"] + clock.between("queued", "ready")
        dev, inf = clock.between("ready", "on_device"), clock.between("on_device", "inferred")
        share, fwd = clock.between("inferred", "shared"), (t5 - t4) * 1e3
        row = (req.arrival_wall, header.rid, header.task, wait, hop["deser"], dev, inf, share, fwd,
               wait + hop["deser"] + dev + inf + share + fwd, hop["t_in"], hop["t_out"], len(self.backlog), _rows(y))
        self.log_row(row, header)

    def log_row(self, row: tuple, header: DataHeader) -> None:
        """One request's KPI record (and its span, when traced); a request that paid a swap-in
        also records it (``swap``: Note [Swap time] in blocks/kpilog.py)."""
        if self.swap_ms:
            rec = dict(zip(LATENCY_ROW, row))
            rec["swap"] = self.swap_ms
            self.kpi.add("latency", rec)
        else:
            self.kpi.add_row(row)
        if header.trace is not None and self.tracer is not None:
            self.trace(header.trace, dict(zip(LATENCY_ROW, row)))

    def trace(self, parent: str, rec: dict, error: str | None = None) -> None:
        """This block's span of a traced request, from its KPI record (blockflow/core/tracing.py)."""
        attributes = {"blockflow.block": self.block, "blockflow.process": self.name, "blockflow.replica": self.replica, "blockflow.device": str(self.device),
                      "blockflow.rid": str(rec["rid"])}
        if error is None:
            attributes.update({f"blockflow.{k}_ms": rec[k] for k in LATENCY_FIELDS})
            attributes["blockflow.batch"] = rec["batch"]
            attributes["blockflow.requests_in_batch"] = rec.get("requests_in_batch", 1)
        self.tracer.record_hop(parent, self.name, rec["ts"], rec.get("total", 0.0), attributes, error)

    def fail(self, req: "_Request", exc: Exception, x_desc: dict | None = None) -> None:
        """Answer the request with the error, give back what it holds, count it."""
        header = req.header
        rid = header.rid
        if x_desc is not None:
            self.transport.discard(x_desc)
        if req.lease is not None:
            req.lease.release()
        short, full = model_error(exc)
        msg = f"block {self.name}: {short}"
        if full is not None and short not in self.errors_logged:  # its TorchScript traceback, once per error
            if len(self.errors_logged) < 64:
                self.errors_logged.add(short)
            log.warning("%s (request %s); the model's traceback (logged once for this error):\n%s", msg, rid, full)
        else:
            log.warning("%s (request %s)", msg, rid)
        # block_failed: the next hop was removed; no_shared_memory
        code = ErrorCode(exc.code) if isinstance(exc, (HopGone, ShmExhausted)) else ErrorCode.ERROR
        self.send_error(header.path[-1][1], rid, msg, code)
        self.kpi.add("latency", {"ts": req.arrival_wall, "rid": rid, "task": header.task,
                                 "error": code.value})  # counted by GET /metrics
        if header.trace is not None and self.tracer is not None:
            self.trace(header.trace, {"ts": req.arrival_wall, "rid": rid,
                                      "total": (time.perf_counter() - req.arrival) * 1e3}, error=msg)

    # -- shutdown: ChildProcess.shutdown() runs these steps in its order ------------------------
    def answer_held(self) -> None:
        """Every request accepted or still waiting in the data socket is answered with an error
        and its slot released."""
        if self.inbox is not None:  # first: a neighbour's hand-over from now on fails at once (HopGone)
            with self.run_lock:  # no neighbour runs this block's requests any more (Note [Run to completion])
                self.backlog.extend((0.0, 0.0, header, handed) for header, handed in self.inbox.close())
        if self.datagrams is not None:  # unlinked first: a sender then goes the ZeroMQ way, read below
            self.datagrams.unlink()
            for data in self.datagrams.drain(1 << 30):
                self.admit([data])
        while self.pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                frames = recv_message(self.pull, zmq.NOBLOCK)
            except zmq.Again:  # as in inference_loop
                break
            self.admit(frames)
        while self.backlog:
            _, _, header, frames = self.backlog.popleft()
            if type(frames) is Handed:
                frames.release()
            self.release_unused(header)
            self.send_error(header.path[-1][1], header.rid, f"block {self.name} is shutting down", ErrorCode.SHUTDOWN)

    def flush(self) -> None:
        self.kpi.flush()
        if self.tracer is not None:
            self.tracer.flush()

    def close_sockets(self) -> None:
        for sock in (self.pull, self.mailbox.loop_end):  # the control thread closed ctrl and its end
            sock.close(linger=0)
        if getattr(self, "datagrams", None) is not None:
            self.datagrams.close()
        if getattr(self, "auth", None) is not None:
            self.auth.stop()

    def files_to_remove(self) -> list[str]:
        if self.cache_entry is not None:  # its park file (CPU) goes with it
            self.cache.remove(self.name)
        return self.socket_files()

    def socket_files(self) -> list[str]:
        files = [self.endpoint[len("ipc://"):]] if self.endpoint and self.endpoint.startswith("ipc://") else []
        datagrams = getattr(self, "datagrams", None)
        return files + ([datagrams.path] if datagrams is not None else [])

    def owns_process(self) -> bool:
        return not self.spec.hosted

    def abandoned_files(self) -> list[str]:
        return self.socket_files() + (slot_files_of(self.spec.shm_dir, os.getpid()) if self.spec.shm_dir else [])


_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception): ", re.M)


def model_error(exc: Exception) -> tuple[str, str | None]:
    """(what a request's error says, the full text when that is shorter). A model that fails
    inside TorchScript raises its whole interpreter traceback as the message (3 KB for one
    convolution given the wrong channels), which the client's error was cut off in before it got
    to the cause; the cause is its last ``SomeError: ...`` line, to the end."""
    text = str(exc)
    if "Traceback of TorchScript" in text:
        found = list(_EXCEPTION_LINE.finditer(text))
        if found:
            return text[found[-1].start():].strip(), text
    return f"{type(exc).__name__}: {text}", None


def _rows(y) -> int:
    """Rows of an output (its first member's, for a bundle): a KPI row's batch column."""
    t = first(y)
    return int(t.shape[0]) if t.dim() else 1


def _return_address(raw) -> tuple[int, str] | None:
    """Who a message's answer goes to, error or result: the return address of the header as
    ``admit`` decodes it (DataHeader skips fields it does not have, unread), else, for a header
    it refuses, the best effort of a plain JSON parse; None when neither names a requester."""
    try:
        header = loads_data_header(raw)
        return header.rid, header.path[-1][1]
    except Exception:
        pass
    try:
        header = json.loads(bytes(getattr(raw, "bytes", raw)))
        rid, path = header["rid"], check_path(header["path"])
        return (rid, path[-1][1]) if isinstance(rid, int) else None
    except Exception:
        return None


def serve_block(spec: BlockSpec) -> None:
    """Entry point of a block process the manager forks from the forkserver: ends it with its exit code."""
    exit_with(serve(Block, spec, forked=True))


def main(argv: list[str] | None = None) -> int:
    return serve(Block, spec_from_argv(BlockSpec, argv, "blockflow block", (
        "Run one block process: load a TorchScript block, bind its data socket, serve until stopped. "
        "The manager starts blocks itself; run one by hand for tests or debugging.")))


if __name__ == "__main__":
    exit_with(main())
