"""The dispatcher process: the clients' single entry point (thesis 3.5.2, 3.6.2).

A client sends ``[header, tensor bytes]`` to the frontend (ROUTER, default
tcp://127.0.0.1:5580). The dispatcher translates the task id into its path (Algorithm 6),
puts the tensor into a shared slot for the first block when that block is on this host
(TensorMQ), and sends it on with the remaining path and its own result address last. The last
block sends the output back to that address; the dispatcher answers the client that asked.
A client on this host sends a handle to a slot the dispatcher lent it instead of the bytes, and
may get the result's slot handle back (Note [Lent slots] in dispatcher/lending.py).

Every request gets exactly one reply. The dispatcher remembers each request it sent into the
pipeline until its result or error arrives, its deadline passes, or the manager reports that a
block on its path died (``fail``); then it answers the client with an error. A result that
arrives for a request already answered is dropped (and its slot released), never delivered
twice.

Results come only from the deployment's own blocks (issue 12): the result socket blocks on
this host reach is an ipc:// socket in the ``0700`` socket directory; for paths whose blocks
use TCP, a second result socket on loopback TCP requires ZeroMQ CURVE, and its ZAP handler
admits only the client key written (``0600``) into that directory (``RESULT_KEYS``), which
the blocks read. Request ids inside the pipeline are 63-bit random numbers, so a message that
does get in cannot name a request in flight. Log lines that such junk causes are rate-limited.

The main thread owns every data socket and all the dispatcher's state: it moves requests and
results, and applies the commands that change its state (task table, topology, a block's
failure) between two of them, from the mailbox (Note [Commands for the main loop] in
blockflow/core/childproc.py). A control thread owns the control socket and answers pings
itself, with the main loop's heartbeat (``beat_age_s``): copying a 100 MB tensor into a slot,
or making a window of slots for it, can take the main thread seconds on a loaded machine, and
a dispatcher whose only thread answered its pings was killed as hung then, with the requests it
held (three times in 24 requests of 103 MB beside four blocks on two cores). The manager kills a
dispatcher whose loop has not gone around for ``BLOCKFLOW_LOOP_STALL``. Nothing here ever blocks
on a full window (requests wait in a bounded pending queue instead), so results keep draining
and the pipeline cannot deadlock on its own back-pressure.

Note [A failed block takes no new request]
------------------------------------------
When a block dies the manager tells the dispatcher first (``Cmd.FAIL``, naming the instance)
and a task table without it comes later, once the replacement is started. The failure answers
every request in flight through the instance at once; a request sent between the two would go
to the dead block's socket, where libzmq keeps it for a peer that never comes back, and its
client heard only at the deadline (30 s: seen in test_block_cache's mid-swap kill, one request
in 48, on an idle machine). So ``fail`` also remembers the instance: a request whose path
runs through one is answered ``unavailable`` at once (the client may retry), a replicated hop
picks among its other replicas, and a task table that no longer lists the instance forgets it.
"""
from __future__ import annotations

import hmac
import json
import logging
import math
import os
import secrets
import time
from collections import deque
from dataclasses import dataclass

import torch
import zmq
from blockflow.core.curve import ClusterKeys, authenticator, make_server

from blockflow.core.ratelog import RateLimitedLog
from blockflow.core.childproc import BootError, ChildProcess, Later, Mailbox, exit_with, serve, spec_from_argv
from blockflow.core.protocol import (DISPATCHER, PROTOCOL_VERSION, RETURN_HOP, ErrorCode, Fail, NoArgs, Outstanding, Ready,
                                Tasks, Topology)
from blockflow.dispatcher.lending import LEASE_IDLE_S, Lender
from blockflow.dispatcher.requestlog import RequestLog
from blockflow.dispatcher.spec import DispatcherSpec
from blockflow.tensormq.bundle import apply as bundle_apply
from blockflow.tensormq.datagram import Receiver, Sender
from blockflow.tensormq.shm import ShmExhausted
from blockflow.tensormq.transport import (RESULT_KEYS, Transport, bytes_fields, read_bytes_value, read_result_keys,
                                          receive_limit)
from blockflow.tensormq.wire import (DTYPES, ClientOp, ClientReply, ClientRequest, DataHeader, TensorDesc, WireError,
                                    decode_request, encode_client, loads_header, member_descs, read_block_error,
                                    salvage_id)

log = logging.getLogger("blockflow.dispatcher")


class ResultKeys:
    """The CURVE keys of one dispatcher incarnation's TCP result socket: its server pair and the
    one client pair its blocks use. Fresh for each incarnation on one host; in Ray mode the
    cluster's keys (blockflow/core/curve.py), which blocks on other nodes got from the manager."""

    def __init__(self, cluster: ClusterKeys | None = None):
        if cluster is None:
            cluster = ClusterKeys.generate()
        self.server_public, self.server_secret = cluster.server_public.encode(), cluster.server_secret.encode()
        self.client_public, self.client_secret = cluster.client_public.encode(), cluster.client_secret.encode()

    def write(self, sock_dir: str, endpoint: str) -> None:
        """For the blocks: 0600 in the 0700 socket directory, created new (never through a link)."""
        path = os.path.join(sock_dir, RESULT_KEYS)
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"endpoint": endpoint, "server": self.server_public.decode(),
                       "public": self.client_public.decode(), "secret": self.client_secret.decode()}, f)
        os.replace(tmp, path)


@dataclass
class Request:
    client: bytes          # ROUTER identity
    cid: object            # the client's own request id
    task: str
    blocks: tuple          # block names on the path (to fail it when one dies)
    started: float
    deadline: float
    tensor: object = None  # kept only while the request waits for a slot
    frames: list | None = None
    #: the lent slots the client wrote its tensor (or bundle) in, as the header names them
    #: (``{"x": handle}`` or ``{"xs": handles, "keys": ...}``; Note [Lent slots])
    lent: dict | None = None
    out_shm: bool = False  # the client reads a result in a host slot itself
    span: object = None    # a traced request's root span, and its traceparent for the blocks
    trace: str | None = None


class Dispatcher(ChildProcess):
    def __init__(self, spec: DispatcherSpec):
        super().__init__(spec, DISPATCHER, "dispatcher", "dispatcher")
        self.tasks: dict[str, dict] = dict(spec.tasks)
        self.table_version = 0
        self.outstanding: dict[int, Request] = {}
        self.turn = 0  # round robin among equally loaded replicas (route)
        self.pending: deque[tuple[int, Request]] = deque()
        #: block instances the manager said failed (``fail``): nothing more is sent through them
        #: until a task table without them arrives (Note [A failed block takes no new request])
        self.failed: set[str] = set()
        # what junk on the result sockets may log: a few lines, then a count
        self.junk_log = RateLimitedLog(log)
        self.stats = {"requests": 0, "ok": 0, "errors": 0, "late": 0, "answered_by_blocks": 0}
        #: when the main loop last went around (monotonic; written by it, read by the control thread)
        self.beat = time.monotonic()
        #: client requests and replies that went by datagram; datagrams dropped for an unknown key
        self.client_datagrams = {"requests": 0, "replies": 0, "unknown_key": 0}

    def init_process(self) -> None:
        spec = self.spec
        # Note [The dispatcher copies on one thread]: the dispatcher's only tensor work is copying
        # a client's bytes into a slot (and a result out). With PyTorch's default of one thread
        # per core, a copy of more than a few hundred KB is split over an OpenMP team: the
        # dispatcher wakes a worker for a fraction of a millisecond of work, and the worker then
        # spins for milliseconds, on the core the block it has just sent to needs. Measured on
        # the 2-core VM (strace, one fused ResNet50 block): the forward to the block waited
        # 4.6 ms for a core after the worker woke, and the worker burnt ~6 ms of CPU a request.
        torch.set_num_threads(1)
        self.ctx = zmq.Context()
        self.front = self.ctx.socket(zmq.ROUTER)
        self.front.linger = 0
        self.front.router_mandatory = 0
        self.front.maxmsgsize = receive_limit(spec.max_tensor_bytes)
        try:
            self.front.bind(spec.address)
        except zmq.ZMQError as exc:
            raise BootError(f"dispatcher cannot bind {spec.address}: {exc}") from None
        if spec.address.endswith(":0") or spec.address.endswith(":*"):
            self.address = self.front.getsockopt(zmq.LAST_ENDPOINT).decode()
        else:
            self.address = spec.address
        self.results = self.ctx.socket(zmq.PULL)
        self.results.linger = 0
        self.results.maxmsgsize = receive_limit(spec.max_tensor_bytes)
        self.result_ipc = f"ipc://{os.path.join(spec.sock_dir, f'dispatcher-{spec.incarnation}.sock')}"
        path = self.result_ipc[len("ipc://"):]
        if os.path.exists(path):
            os.unlink(path)
        try:
            self.results.bind(self.result_ipc)
        except zmq.ZMQError as exc:
            raise BootError(f"dispatcher cannot bind its result socket {self.result_ipc}: {exc}") from None
        # results from blocks on this host come by datagram (Note [A datagram beside the socket])
        self.result_datagrams = Receiver.beside(self.result_ipc, "dispatcher") if spec.transport == "tensormq" else None
        # TCP results only through CURVE, from the client key the blocks read in the 0700 dir
        cluster = ClusterKeys.from_json(spec.curve)
        keys = ResultKeys(cluster)
        self.auth = authenticator(self.ctx, keys.client_public, "dispatcher")
        self.results_tcp = self.ctx.socket(zmq.PULL)
        self.results_tcp.linger = 0
        self.results_tcp.maxmsgsize = receive_limit(spec.max_tensor_bytes)
        make_server(self.results_tcp, keys.server_secret)  # before bind: they apply from then on
        port = self.results_tcp.bind_to_random_port(f"tcp://{spec.bind_host}")
        self.result_tcp = f"tcp://{spec.bind_host}:{port}"
        keys.write(spec.sock_dir, self.result_tcp)
        # the dispatcher is a CPU process: its result addresses are CPU hops (no device map
        # names them), so the last block sends a host copy, and a CUDA handle sent here anyway
        # is refused rather than making the clients' entry point create a CUDA context
        self.transport = Transport(self.ctx, f"dispatcher-{spec.incarnation}", spec.transport, spec.shm_dir,
                                   window=spec.window, max_tensor_bytes=spec.max_tensor_bytes, cuda_handles=False)
        self.transport.curve = cluster  # to first blocks on other nodes (Ray mode)
        self.kpi = RequestLog(spec.run_dir) if spec.run_dir else None
        from blockflow.core.tracing import tracer_for
        self.tracer = tracer_for("blockflow")  # None when tracing is off (blockflow/core/tracing.py)
        # slots for clients on this host (Note [Lent slots] in dispatcher/lending.py)
        self.lender = Lender(spec.shm_dir, f"dispatcher-{spec.incarnation}-lent", spec.window) if spec.shm_dir else None
        # their requests and replies by datagram (Note [Datagrams to a local client] there)
        self.client_inbox = self.client_sender = None
        if self.lender is not None and spec.transport == "tensormq":
            inbox = f"ipc://{os.path.join(spec.sock_dir, f'dispatcher-{spec.incarnation}-clients')}"
            self.client_inbox = Receiver.beside(inbox, "dispatcher")
            self.client_sender = Sender() if self.client_inbox is not None else None
        self.mailbox = Mailbox(self.ctx, "the dispatcher", "main loop")
        self.threads = [self.control_thread()]
        self.open_control()  # last: see ChildProcess.open_control

    def ready_info(self) -> dict:
        return {"endpoint": self.address, "results": [self.result_ipc, self.result_tcp]}

    def announce(self) -> Ready:
        msg = super().announce()
        log.info("dispatcher ready on %s (pid %d, %s)", self.address, os.getpid(), self.spec.transport)
        return msg

    # -- the loop ----------------------------------------------------------------------------
    def loop(self) -> None:
        poller = zmq.Poller()
        for sock in (self.front, self.results, self.results_tcp, self.mailbox.loop_end):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        datagrams, inbox = self.result_datagrams, self.client_inbox
        for dg in (datagrams, inbox):
            if dg is not None:
                poller.register(dg.fileno(), zmq.POLLIN)
        next_sweep = next_flush = time.monotonic()
        while not self.stopping.is_set():
            self.beat = time.monotonic()
            events = dict(poller.poll(1 if self.pending else 50))
            if datagrams is not None and datagrams.fileno() in events:
                for data in datagrams.drain(64):
                    try:
                        self.handle_result([data])
                    except Exception:  # a forged result must not take the dispatcher down
                        self.junk_log.exception("dispatcher: dropped a result that could not be handled")
            if self.results in events:
                self.receive_results(self.results)
            if self.results_tcp in events:
                self.receive_results(self.results_tcp)
            if self.front in events:
                self.receive_requests()
            if inbox is not None and inbox.fileno() in events:
                for data in inbox.drain(64):
                    self.receive_datagram_request(data)
            if self.mailbox.loop_end in events:
                self.mailbox.serve()
            if self.pending:
                self.flush_pending()
            now = time.monotonic()
            if now >= next_sweep:
                next_sweep = now + 0.05
                self.expire(now)
            if now >= next_flush:
                next_flush = now + 1.0
                if self.kpi is not None:
                    self.kpi.flush()  # /metrics reads the log: at most a second behind
                # results of a retired last block: their slot files are unlinked, our maps pin them
                self.transport.forget_unlinked()
                if self.lender is not None:
                    self.lender.sweep(now)

    # -- clients -----------------------------------------------------------------------------
    def answer(self, req: Request, status: str, **kw) -> None:
        """Reply to the client of a request the dispatcher accepted (its task and age are known)."""
        self.reply(req.client, req.cid, status, task=req.task, since=req.started, **kw)
        if req.span is not None:
            code = kw.get("code")
            self.tracer.end_request(req.span, status, code.value if code is not None else None, kw.get("error"))

    def reply(self, client: bytes, cid, status: str, *, error: str | None = None, code: ErrorCode | None = None,
              tensor=None, hops=None, started: float | None = None, task: str | None = None,
              since: float | None = None, handle: dict | None = None, lent: tuple | None = None,
              counted: bool = True) -> None:
        """``handle``: the header fields that name the result's slots (``x``, or ``xs`` and
        ``keys``), which the client reads itself (Note [Lent slots]);
        ``lent``: the answer to ``lend`` (folder, slot names, idle limit, our datagram inbox and
        the lease's key). ``counted``: False for the answers to ``lend``/``unlend``, which are
        no requests of a task (``stats`` and the request log count those) and always go by
        ZeroMQ; another reply of one frame goes by datagram to a client with an inbox (Note
        [Datagrams to a local client])."""
        header = ClientReply(PROTOCOL_VERSION, cid, status, hops=hops, **(handle or {}))
        if error is not None:
            header.error, header.code = error, (code or ErrorCode.ERROR).value
        if started is not None:
            header.ms = (time.monotonic() - started) * 1e3
        if lent is not None:
            header.shm, header.slots, header.idle_s, header.dg = lent
        payloads = ()
        if tensor is not None:  # a tensor or a bundle (tensormq/bundle.py), as bytes
            fields, payloads = bytes_fields(tensor)
            header.x, header.xs, header.keys = fields.get("x"), fields.get("xs"), fields.get("keys")
        inbox = self.lender.inbox_of(client) if counted and not payloads and self.client_sender is not None else None
        if inbox is not None:
            header.key = inbox[1]
            sent = self.client_sender.send_to(inbox[0], encode_client(header))
            if sent:
                self.client_datagrams["replies"] += 1
            else:
                header.key = None
        if inbox is None or not sent:
            try:
                # copy=True: the result may live in a slot that is released right after this call
                self.front.send_multipart([client, encode_client(header), *payloads], copy=True)
            except zmq.ZMQError as exc:
                log.warning("dispatcher: could not answer request %r: %s", cid, exc)
        if counted:
            self.stats["ok" if status == "ok" else "errors"] += 1
        if self.kpi is not None and task is not None:
            self.kpi.record(task, "ok" if status == "ok" else header.code, since, hops)

    def receive_requests(self) -> None:
        for _ in range(64):
            try:
                frames = self.front.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            client = frames[0].bytes
            try:
                self.handle_request(client, frames[1:])
            except Exception as exc:  # one hostile frame must not take the clients' entry point down
                log.exception("dispatcher: request from client %r failed unexpectedly", client[:16])
                self.reply(client, salvage_id(frames[1]) if len(frames) > 1 else None, "error",
                           code=ErrorCode.BAD_REQUEST, error=f"bad request: {type(exc).__name__}")

    def receive_datagram_request(self, data: bytes) -> None:
        """A request a local client sent by datagram (Note [Datagrams to a local client]): from
        the client whose lease has its key, as if it had come over ZeroMQ; dropped (and counted)
        when no lease has that key, since nobody could be answered."""
        try:
            header = decode_request(data)
        except WireError as exc:
            self.junk_log.warning("dispatcher: dropped an unreadable datagram request (%s)", exc)
            return
        client = self.lender.client_of(header.key)
        if client is None:
            self.client_datagrams["unknown_key"] += 1
            self.junk_log.warning("dispatcher: dropped a datagram request whose key names no lease (the lease "
                                  "ended, or the sender never had one)")
            return
        self.client_datagrams["requests"] += 1
        try:
            self.handle_request(client, [data], header)
        except Exception as exc:  # as receive_requests: one hostile message must not end the dispatcher
            log.exception("dispatcher: request from client %r failed unexpectedly", client[:16])
            self.reply(client, header.id, "error", code=ErrorCode.BAD_REQUEST, error=f"bad request: {type(exc).__name__}")

    def handle_request(self, client: bytes, frames: list, header: ClientRequest | None = None) -> None:
        """One request of ``client`` (its ROUTER identity); ``header``: already decoded (a datagram)."""
        self.stats["requests"] += 1
        cid, task = None, RequestLog.UNKNOWN_TASK
        try:
            if not frames:
                raise WireError("empty message; send [header, tensor bytes]")
            if header is None:
                try:
                    header = decode_request(frames[0])
                except WireError:
                    cid = salvage_id(frames[0])
                    raise
            cid = header.id
            # compared as bytes: compare_digest raises TypeError on non-ASCII str
            if self.spec.token and not hmac.compare_digest((header.token or "").encode(), self.spec.token.encode()):
                self.reply(client, cid, "error", error="unauthorized: a valid token is required",
                           code=ErrorCode.UNAUTHORIZED,
                           task=RequestLog.UNKNOWN_TASK)
                return
            op = header.op
            if op is ClientOp.PING:
                self.reply(client, cid, "ok")
                return
            if op is not ClientOp.INFER:
                self.lend(client, cid, op, header)
                return
            if self.lender is not None:  # before any refusal: Note [A lease's idle clock] in dispatcher/lending.py
                self.lender.touch(client)
            task = header.task
            entry = self.tasks.get(task) if task is not None else None
            if entry is None:
                known = ", ".join(sorted(self.tasks)) or "none"
                self.reply(client, cid, "error", code=ErrorCode.UNKNOWN_TASK, task=RequestLog.UNKNOWN_TASK,
                           error=f"unknown task {str(task)!r:.60}; tasks served now: {known}")
                return
            if entry.get("unavailable"):
                self.reply(client, cid, "error", code=ErrorCode.UNAVAILABLE, task=task,
                           error=f"task {task} cannot be served now: {entry['unavailable']}")
                return
            lent = None
            x = header.x
            if len(frames) == 1 and (x is not None and x.get("loc") == "shm" or header.xs is not None and x is None):
                tensor, lent = self.read_lent(client, task, entry, header)
            else:
                tensor = self.read_input(task, entry, header, frames)
        except WireError as exc:
            self.reply(client, cid, "error", error=f"bad request: {exc}", code=ErrorCode.BAD_REQUEST,
                       task=RequestLog.UNKNOWN_TASK)
            return
        except ValueError as exc:
            self.reply(client, cid, "error", error=str(exc), code=ErrorCode.BAD_INPUT, task=task)
            return
        if len(self.pending) >= self.spec.max_pending:
            if lent is not None:
                self.lender.give_back_all(lent)
            self.reply(client, cid, "error", code=ErrorCode.OVERLOADED, task=task,
                       error=f"dispatcher is overloaded: {self.spec.max_pending} requests are waiting; retry later")
            return
        now = time.monotonic()
        timeout = min(header.timeout or self.spec.request_timeout, self.spec.request_timeout)
        req = Request(client, cid, task, tuple(entry["blocks"]), now, now + timeout,
                      tensor, frames, lent, header.out == "shm")
        rid = secrets.randbits(63)  # unguessable: a forged result cannot name a request in flight
        while rid in self.outstanding:
            rid = secrets.randbits(63)
        if self.tracer is not None:
            req.span, req.trace = self.tracer.start_request(header.traceparent, task, rid)
        if self.pending or not self.forward(rid, req):
            self.pending.append((rid, req))

    def read_input(self, task: str, entry: dict, header: ClientRequest, frames: list):
        """A client's tensor, or its bundle (``xs``: tensormq/bundle.py), every member sent as
        bytes and checked against what the task's first block takes before it is read."""
        return read_bytes_value(header, frames, self.spec.max_tensor_bytes, self.input_check(task, entry))

    def read_lent(self, client: bytes, task: str, entry: dict, header: ClientRequest):
        """A client's tensor, or every member of its bundle, in slots the dispatcher lent it
        (Note [Lent slots]), checked as ``read_input`` checks bytes: (None, the header fields
        that travel on); ``forward`` makes the tensors over the slots only where their bytes
        must travel (``Lender.value_of``)."""
        if self.lender is None:
            raise WireError("x.loc is shm but this dispatcher has no shared-memory directory; send bytes")
        check = self.input_check(task, entry)
        if header.xs is None:
            return None, {"x": self.lender.take(client, header.x, self.spec.max_tensor_bytes,
                                                lambda desc: check(desc, None))}
        xs, keys = member_descs(header.xs, header.keys, False)
        fields = {"xs": self.lender.take_all(client, xs, self.spec.max_tensor_bytes, lambda descs: check(descs, keys))}
        if keys is not None:
            fields["keys"] = keys
        return None, fields

    def lend(self, client: bytes, cid, op: ClientOp, header: ClientRequest) -> None:
        """``lend``: a window of slots for a client on this host; ``unlend``: it gives them back."""
        if op is ClientOp.UNLEND:
            if self.lender is not None:
                self.lender.end(client)
            self.reply(client, cid, "ok", counted=False)
            return
        if self.lender is None:
            raise WireError("this dispatcher has no shared-memory directory; send bytes")
        if self.transport.mode != "tensormq":  # every hop carries bytes, the client's too (asked again later)
            self.reply(client, cid, "error", code=ErrorCode.UNAVAILABLE, counted=False,
                       error=f"transport {self.transport.mode}: requests carry their bytes, no slots are lent")
            return
        try:
            local = self.lender.lend(client, header.nbytes, header.pid, *(
                (header.dg, header.key) if self.client_inbox is not None else ()))
        except ShmExhausted as exc:
            self.reply(client, cid, "error", code=ErrorCode.NO_SHARED_MEMORY, error=str(exc), counted=False)
            return
        inbox = self.client_inbox.path if local.inbox is not None else None
        self.reply(client, cid, "ok", lent=(self.spec.shm_dir, list(local.slots), LEASE_IDLE_S, inbox), counted=False)

    def input_check(self, task: str, entry: dict):
        """``check(descs, keys)``: refuses (ValueError) what the task's first block does not take."""
        spec = entry.get("input") or {}
        shapes = spec.get("shapes")

        def check(descs, keys) -> None:
            if isinstance(descs, TensorDesc):
                if shapes:
                    raise ValueError(f"task {task} takes {len(shapes)} tensors (a tuple or dict), got one")
                self.check_input(task, dict(spec, dims=(spec.get("dims") or [None])[0]), descs)
                return
            if spec and not shapes:
                raise ValueError(f"task {task} takes one tensor, got {len(descs)}")
            if shapes and len(shapes) != len(descs):
                raise ValueError(f"task {task} takes {len(shapes)} tensors, got {len(descs)}")
            names, dtypes, dims = spec.get("names") or [], spec.get("dtypes") or [], spec.get("dims") or []
            for i, desc in enumerate(descs):
                member = {"dtype": dtypes[i] if i < len(dtypes) else spec.get("dtype"), "shape": shapes[i],
                          "dims": dims[i] if i < len(dims) else None, "bounds": spec.get("bounds")} if shapes else {}
                self.check_input(task, member, desc, f" ({names[i]})" if i < len(names) else f"[{i}]")

        return check

    @staticmethod
    def check_input(task: str, spec: dict, desc: TensorDesc, member: str = "") -> None:
        if not spec:
            return
        if spec.get("dtype") and desc.fields["dtype"] != spec["dtype"]:
            raise ValueError(f"task {task} takes {spec['dtype']} tensors, got {desc.fields['dtype']}{member}; send "
                             f"{spec['dtype']} (tensor.to(torch.{spec['dtype']})), or export again with --input "
                             f"declaring {desc.fields['dtype']}")
        shape = spec.get("shape")
        if shape and (len(desc.shape) != len(shape) or any(
                want is not None and want != got for want, got in zip(shape[1:], desc.shape[1:]))):
            want = ["N"] + list(shape[1:])
            got = list(desc.shape)
            # one sample sent without its batch dimension: say how to add it
            hint = "; add the batch dimension (tensor.unsqueeze(0))" if len(got) == len(shape) - 1 and all(
                w is None or w == g for w, g in zip(shape[1:], got)) else ""
            raise ValueError(f"task {task} takes tensors of shape {want}{member}, got {got}{hint}")
        for named, got in zip((spec.get("dims") or [])[1:], desc.shape[1:]):
            low, high = (spec.get("bounds") or {}).get(named, (None, None)) if isinstance(named, str) else (None, None)
            if low is not None and not low <= got <= high:
                raise ValueError(f"task {task} takes dimension {named} between {low} and {high}{member}, got "
                                 f"{got} (shape {list(desc.shape)}); send {named} in those bounds, or export "
                                 f"again with --input ...{named}={min(low, got)}..{max(high, got)}")

    def route(self, replicas: list) -> tuple[list, tuple]:
        """A path through replicated blocks: per hop, the replica with the fewest of our
        requests in flight through it, ties taken in turn (round robin). Returns the path's
        [name, endpoint] pairs and the processes on it (to fail the request when one dies).
        Only tasks with a replicated block pay for the count."""
        load: dict[str, int] = {}
        for r in self.outstanding.values():
            for inst in r.blocks:
                load[inst] = load.get(inst, 0) + 1
        self.turn += 1
        path, blocks = [], []
        for hop in replicas:
            hop = [r for r in hop if r[2] not in self.failed] or hop  # a failed replica takes no more
            k = len(hop)
            name, endpoint, inst = hop[min(range(k), key=lambda i: (load.get(hop[i][2], 0), (i - self.turn) % k))]
            path.append([name, endpoint])
            blocks.append(inst)
        return path, tuple(blocks)

    def forward(self, rid: int, req: Request) -> bool:
        """Send a request into its path; False when the first hop's window is full (try later)."""
        entry = self.tasks.get(req.task)
        if entry is None:
            self.drop_lent(req)
            self.answer(req, "error", code=ErrorCode.UNKNOWN_TASK,
                       error=f"task {req.task} was removed by a system update before it could start")
            return True
        path = entry["path"]
        if "replicas" in entry:
            path, req.blocks = self.route(entry["replicas"])
        if self.failed and not self.failed.isdisjoint(req.blocks):
            self.drop_lent(req)
            down = ", ".join(b for b in req.blocks if b in self.failed)
            self.answer(req, "error", code=ErrorCode.UNAVAILABLE,
                        error=f"task {req.task} cannot be served now: block {down} failed and is being replaced; "
                              "retry shortly")
            return True
        first = path[0][1]
        # the last block reaches us the way it is reached itself
        ret = self.result_tcp if path[-1][1].startswith("tcp://") else self.result_ipc
        if req.lent is not None and self.transport.mode == "tensormq" and self.transport.handles_to(first):
            fields, payload = req.lent, []  # the client's slots go on by handle, uncopied
        elif req.lent is not None:  # bytes (or our own slots) towards this hop: the lent slots are free at once
            req.tensor = bundle_apply(torch.Tensor.clone, self.lender.value_of(req.lent))
            self.drop_lent(req)
        if req.lent is None:
            try:
                fields, payload = self.transport.encode_value(req.tensor, first, timeout=0)
            except TimeoutError:
                return False
            except ShmExhausted as exc:  # this request fails; the others (and the dispatcher) go on
                self.answer(req, "error", code=ErrorCode(exc.code), error=f"task {req.task}: {exc}")
                return True
            except OSError as exc:  # e.g. the slot directory was deleted under us: answer, never go silent
                log.error("dispatcher: cannot place request %s in shared memory: %s", rid, exc)
                self.answer(req, "error", code=ErrorCode.UNAVAILABLE,
                            error=f"task {req.task}: the dispatcher cannot write its shared-memory slot "
                                  f"({exc.strerror}: {exc.filename}); was {self.spec.shm_dir} removed? "
                                  "restart `blockflow serve`")
                return True
        header = DataHeader(PROTOCOL_VERSION, "data", rid, [*map(tuple, path[1:]), (RETURN_HOP, ret)], req.task,
                            trace=req.trace, reply=self.direct_reply(req, path), **fields)
        try:
            self.transport.send(first, header, payload, timeout=1.0)
        except TimeoutError as exc:
            self.transport.discard(fields.get("x") or fields["xs"])  # a lent slot too: its handle names it
            self.answer(req, "error", code=ErrorCode.UNAVAILABLE, error=f"task {req.task}: {exc}")
            return True
        req.tensor = req.frames = req.lent = None  # a lent slot's release duty went with the handle
        self.outstanding[rid] = req
        return True

    def direct_reply(self, req: Request, path: list) -> list | None:
        """Where the last block of ``path`` may answer ``req``'s client itself (Note [A direct
        answer] in blocks/process.py): a client on this host with a datagram inbox that reads
        its result in slots, a last block on this host too; None otherwise."""
        if not req.out_shm or self.client_sender is None or self.transport.mode != "tensormq" \
                or not path[-1][1].startswith("ipc://"):
            return None
        inbox = self.lender.inbox_of(req.client)
        return None if inbox is None else [inbox[0], inbox[1], req.cid, req.started]

    def drop_lent(self, req: Request) -> None:
        """Give back the lent slot of a request that will not be forwarded with it."""
        if req.lent is not None:
            self.lender.give_back_all(req.lent)
            req.lent = None

    def flush_pending(self) -> None:
        while self.pending:
            rid, req = self.pending[0]
            if time.monotonic() > req.deadline:
                self.pending.popleft()
                self.drop_lent(req)
                self.answer(req, "error", code=ErrorCode.TIMEOUT,
                           error=f"task {req.task}: no free slot towards its first block before the deadline")
                continue
            if not self.forward(rid, req):
                return
            self.pending.popleft()

    # -- results -----------------------------------------------------------------------------
    def receive_results(self, sock: zmq.Socket) -> None:
        for _ in range(64):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self.handle_result(frames)
            except Exception:  # a forged result must not take the dispatcher down
                self.junk_log.exception("dispatcher: dropped a result that could not be handled")

    def handle_result(self, frames: list) -> None:
        """One message from the last block of a path: answer the client that asked."""
        try:
            header = loads_header(frames[0])
        except WireError as exc:
            self.junk_log.warning("dispatcher: dropped a malformed result (%s)", exc)
            return
        rid = header.get("rid")
        req = self.outstanding.pop(rid, None) if isinstance(rid, int) else None
        kind = header.get("t")
        if req is None:
            self.stats["late"] += 1
            if kind == "result" and (isinstance(header.get("x"), dict) or "xs" in header):
                try:
                    _t, lease = self.transport.decode_value(header.get("x"), header.get("xs"), header.get("keys"),
                                                            frames)
                    if lease is not None:
                        lease.release()
                except WireError:
                    pass
            self.junk_log.info("dispatcher: dropped a %s for request %.20s that is not in flight (answered, "
                               "timed out, or never sent)", kind, rid)
            return
        if kind == "error":
            try:
                err = read_block_error(header)
            except WireError as exc:
                self.answer(req, "error", code=ErrorCode.BAD_RESULT, started=req.started,
                            error=f"a block sent an unreadable error: {exc}")
                return
            self.answer(req, "error", error=err.err[:2000], code=ErrorCode.of(err.code), started=req.started)
            return
        lease = None
        if header.get("answered") is True and kind == "result":
            self.answered_directly(req, header, frames)
            return
        try:
            fields = header.get("x"), header.get("xs"), header.get("keys")
            if req.out_shm and self.lender.holds(req.client):  # no tensors made: the client reads the slots
                lease = self.transport.leases_of(*fields, frames)
                if lease is not None and self.lender.hand_out(req.client, lease, header.get("xs")):
                    # the client copies the result out of its slots and releases them (Note [Lent slots])
                    lease = None
                    self.answer(req, "ok", hops=header.get("hops"), started=req.started,
                                handle={k: header[k] for k in ("x", "xs", "keys") if header.get(k) is not None})
                    return
                lease = None  # not handed out: read below (one release, by the lease decode_value makes)
            tensor, lease = self.transport.decode_value(*fields, frames)
            self.answer(req, "ok", tensor=tensor, hops=header.get("hops"), started=req.started)
        except Exception as exc:  # the request is ours to answer now: never drop it silently
            self.answer(req, "error", code=ErrorCode.BAD_RESULT,
                        error=f"the last block sent an unreadable result: {exc}")
        finally:
            if lease is not None:
                lease.release()

    def answered_directly(self, req: Request, header: dict, frames: list) -> None:
        """A result the last block answered ``req``'s client with itself (Note [A direct answer]
        in blocks/process.py): everything a reply does but the send. Its slots stay under the
        client's lease until it releases them (``hand_out``, whether it has already or not);
        with no lease left to keep them under they are released now (a copy under way then
        fails its generation check, never reads torn bytes)."""
        fields = header.get("x"), header.get("xs"), header.get("keys")
        try:
            lease = self.transport.leases_of(*fields, frames)
        except WireError as exc:  # mostly: the client read and released them before this came
            log.debug("dispatcher: no slots to keep for the answered result of request %s: %s", req.cid, exc)
            lease = None
        if lease is not None and not self.lender.hand_out(req.client, lease, header.get("xs")):
            lease.release()
        self.stats["ok"] += 1
        self.stats["answered_by_blocks"] += 1
        if self.kpi is not None:
            self.kpi.record(req.task, "ok", req.started, header.get("hops"))
        if req.span is not None:
            self.tracer.end_request(req.span, "ok", None, None)

    def expire(self, now: float) -> None:
        late = [rid for rid, r in self.outstanding.items() if r.deadline < now]
        for rid in late:
            req = self.outstanding.pop(rid)
            self.answer(req, "error", code=ErrorCode.TIMEOUT,
                       error=f"task {req.task}: no result within {req.deadline - req.started:.1f}s "
                             f"(path {' -> '.join(req.blocks)})")

    def fail(self, blocks: list[str], reason: str) -> int:
        """Answer with an error every request whose path runs through one of ``blocks``, and
        send no more through them (Note [A failed block takes no new request])."""
        dead = set(blocks)
        self.failed |= dead
        hit = [rid for rid, r in self.outstanding.items() if dead & set(r.blocks)]
        for rid in hit:
            req = self.outstanding.pop(rid)
            self.answer(req, "error", code=ErrorCode.BLOCK_FAILED, error=f"task {req.task}: {reason}")
        return len(hit)

    # -- control: the control thread answers ping and stop (ChildProcess) itself ----------------
    # and hands the others to the main loop (Note [Commands for the main loop])
    def cmd_ping(self, args: NoArgs) -> dict:
        return {**super().cmd_ping(args), "beat_age_s": time.monotonic() - self.beat,
                "outstanding": len(self.outstanding), "pending": len(self.pending),
                "torch_threads": torch.get_num_threads(), **self.stats,
                "local_clients": len(self.lender.clients) if self.lender is not None else 0,
                "lent_slots": self.lender.lent_slots() if self.lender is not None else 0,
                "client_datagrams": dict(self.client_datagrams)}

    def cmd_tasks(self, args: Tasks) -> Later:
        return self.on_main_thread("task table", self.set_tasks, args)

    def set_tasks(self, args: Tasks) -> dict:
        self.tasks = args.tasks  # replaced atomically: one thread reads it
        if self.failed:
            self.failed &= {inst for entry in args.tasks.values()
                            for inst in [*entry.get("blocks", ()), *(r[2] for hop in entry.get("replicas", ())
                                                                    for r in hop)]}
        self.table_version = self.table_version + 1 if args.version is None else args.version
        return {"tasks": len(args.tasks), "version": self.table_version}

    def cmd_update(self, args: Topology) -> Later:
        return self.on_main_thread("topology", self.apply_topology, args)

    def apply_topology(self, args: Topology) -> dict:
        if args.transport is not None:
            self.transport.mode = args.transport  # how requests reach their first block
        answer = {"dropped": self.transport.set_topology(args.live, args.devices, args.near)}
        if args.prepare:  # Note [Ready to serve] in blocks/process.py
            answer["prepared"] = self.prepare_hops(args.prepare)
        return answer

    def prepare_hops(self, hops: dict) -> list[str]:
        """Connect to the first blocks of tasks an update is about to switch to, and make their
        slots for the tasks' inputs: ``hops`` maps each address to the input it will get
        (``{"dtype", "shape"}``, as the task table's ``input``), or None to connect only."""
        for address, spec in hops.items():
            self.transport.prepare(address, _input_bytes(spec))
        return list(hops)

    def cmd_fail(self, args: Fail) -> Later:
        return self.on_main_thread("failure", self.fail_requests, args)

    def fail_requests(self, args: Fail) -> dict:
        return {"failed": self.fail(args.blocks, args.reason)}

    def cmd_outstanding(self, args: Outstanding) -> Later:
        return self.on_main_thread("count of outstanding requests", self.count_outstanding, args)

    def count_outstanding(self, args: Outstanding) -> dict:
        names = set(args.blocks)
        return {"outstanding": sum(1 for r in self.outstanding.values() if not names or names & set(r.blocks))}

    # -- shutdown: ChildProcess.shutdown() runs these steps in its order ------------------------
    def answer_held(self) -> None:
        """Everyone still waiting is answered; nothing is dropped silently."""
        inbox = getattr(self, "client_inbox", None)
        if inbox is not None:  # requests that came by datagram and were not read yet
            inbox.unlink()  # from now on a client's datagram is refused: it goes by ZeroMQ
            for data in inbox.drain(1 << 16):
                try:
                    header = decode_request(data)
                except WireError:
                    continue
                client = self.lender.client_of(header.key)
                if client is not None:
                    self.reply(client, header.id, "error", code=ErrorCode.SHUTDOWN,
                               error="the dispatcher is shutting down")
        for rid, req in list(self.pending):
            self.drop_lent(req)
            self.answer(req, "error", code=ErrorCode.SHUTDOWN, error="the dispatcher is shutting down")
        self.pending.clear()
        for rid, req in list(self.outstanding.items()):
            self.answer(req, "error", code=ErrorCode.SHUTDOWN, error="the dispatcher is shutting down")
        self.outstanding.clear()

    def flush(self) -> None:
        if self.kpi is not None:
            self.kpi.flush()
        if self.tracer is not None:
            self.tracer.flush()

    def close_sockets(self) -> None:
        for sock in (self.front, self.results, self.results_tcp, self.mailbox.loop_end):
            if sock is not None:  # the control thread closed ctrl and its end of the mailbox
                sock.close(linger=0)
        for dg in (getattr(self, "result_datagrams", None), getattr(self, "client_inbox", None),
                   getattr(self, "client_sender", None)):
            if dg is not None:
                dg.close()
        self.auth.stop()
        if self.lender is not None:  # after the last reply: the lent slots' files go
            self.lender.close()

    def files_to_remove(self) -> list[str]:
        files = [self.result_ipc[len("ipc://"):]]
        for dg in (getattr(self, "result_datagrams", None), getattr(self, "client_inbox", None)):
            if dg is not None:
                files.append(dg.path)
        keys = os.path.join(self.spec.sock_dir, RESULT_KEYS)
        if (read_result_keys(keys) or {}).get("endpoint") == self.result_tcp:  # not a successor's
            files.append(keys)
        return files

    def summary(self) -> str:
        return f" {self.stats}"


def _input_bytes(spec) -> int:
    """Bytes of one input like ``spec`` (a task's ``input``); 0 when it is not one tensor of a
    known dtype and shape."""
    if not isinstance(spec, dict) or spec.get("shapes") or spec.get("dtype") not in DTYPES:
        return 0
    shape = spec.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d > 0 for d in shape):
        return 0
    return math.prod(shape) * DTYPES[spec["dtype"]].itemsize


def serve_dispatcher(spec: DispatcherSpec) -> None:
    """Entry point of the dispatcher process the manager forks from the forkserver: ends it with its exit code."""
    exit_with(serve(Dispatcher, spec, forked=True))


def main(argv: list[str] | None = None) -> int:
    return serve(Dispatcher, spec_from_argv(DispatcherSpec, argv, "blockflow dispatcher", (
        "Run the dispatcher by hand (the server starts it itself): the clients' entry point that maps "
        "task ids to paths through blocks and returns the results.")))


if __name__ == "__main__":
    exit_with(main())
