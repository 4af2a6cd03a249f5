"""The client: send a tensor for a task to the dispatcher, get the result tensor back.

    from blockflow import Client
    with Client("tcp://127.0.0.1:5580") as c:
        y = c.infer("classify", x, timeout=5)          # or raises BlockFlowError / TimeoutError
        fut = c.submit("classify", x); y = fut.result()

One I/O thread owns the DEALER socket (ZeroMQ sockets are not thread-safe, see
blockflow/sockthread.py); ``submit`` hands requests to it through a bounded queue, so any
thread may call the client. Every call has a deadline, the default ``timeout`` of the client
or the one given per call, and ends by it whatever the server does (even when none listens).
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future

import torch
import zmq

from blockflow.protocol import PROTOCOL_VERSION, ErrorCode
from blockflow.sockthread import QueueFull, SocketThread
from blockflow.tensormq import bundle
from blockflow.tensormq.transport import bytes_fields, read_bytes_value
from blockflow.tensormq.wire import WireError, dumps, loads_header
from blockflow import settings

log = logging.getLogger(__name__)

#: Seconds a call waits for its reply unless told otherwise.
DEFAULT_TIMEOUT = settings.CLIENT_TIMEOUT
#: Requests a client holds unsent (e.g. while no dispatcher listens) before submit() refuses.
MAX_QUEUED = 1000


class BlockFlowError(RuntimeError):
    """The server answered with an error; ``code`` says which kind (unknown_task, bad_input, ...)."""

    def __init__(self, message: str, code: str = "error", hops=None):
        super().__init__(message)
        self.code = code
        self.hops = hops


class Result:
    """A reply: the tensor plus what the pipeline measured on its way.

    ``hops``: one record per block on the path, in order: ``b`` (its name), ``wait``,
    ``deser``, ``dev``, ``inf``, ``share`` (ms) and ``t_in``, ``t_out`` (seconds on
    CLOCK_MONOTONIC, comparable with this process's ``time.monotonic()`` on the same host;
    Note [Hop timestamps] in blocks/kpilog.py). ``server_ms``: from the request's arrival at the
    dispatcher to its reply (ms)."""

    __slots__ = ("tensor", "hops", "server_ms")

    def __init__(self, tensor, hops, server_ms):
        self.tensor, self.hops, self.server_ms = tensor, hops, server_ms


class Client:
    def __init__(self, address: str = "tcp://127.0.0.1:5580", timeout: float = DEFAULT_TIMEOUT,
                 token: str | None = None, max_queued: int = MAX_QUEUED):
        self.address, self.timeout = address, timeout
        self.token = token if token is not None else settings.TOKEN
        self._ids = itertools.count(1)
        self._waiting: dict[int, tuple[Future, float]] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(address)
        # Connection events tell us when the dispatcher went away: requests it held are then
        # answered at once with a 'disconnected' error instead of waiting for their deadline.
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sent: set[int] = set()
        self._answered: OrderedDict[int, None] = OrderedDict()
        #: replies the server sent twice (must stay 0) or after this client gave up on a request
        self.stats = {"duplicates": 0, "late": 0}
        # one I/O thread owns the socket; requests that cannot be sent before their deadline
        # (no dispatcher listening) are dropped from its queue, and a full queue refuses at once
        self._io = SocketThread(sock, "blockflow-client", self._on_reply, on_tick=self._expire, max_queued=max_queued)
        self._io.watch(self._monitor, self._on_disconnect)
        self._io.start()

    # -- public ------------------------------------------------------------------------------
    def submit(self, task: str, tensor, timeout: float | None = None, details: bool = False,
               traceparent: str | None = None) -> Future:
        """Send one request; the future gives the result tensor (or a ``Result`` with details).

        ``tensor`` is a tensor, or a tuple (list) or flat dict of tensors for a task whose first
        block takes several; the result is a tensor, a tuple or a dict, as the task's last block
        returns it. ``traceparent``: the W3C trace context of the caller's span; with tracing on
        (BLOCKFLOW_OTLP_ENDPOINT), the server's spans of this request join that trace, and its
        sampled flag decides whether the request is traced.

        The future is resolved by its deadline whatever the server does. Raises BlockFlowError
        (code ``overloaded``) at once when ``max_queued`` requests are still waiting to be sent."""
        if self._closed:
            raise RuntimeError("client is closed")
        if not isinstance(tensor, torch.Tensor) and not bundle.is_bundle(tensor):
            raise TypeError(f"tensor must be a torch.Tensor, or a tuple or dict of them, got {type(tensor).__name__}")
        timeout = self.timeout if timeout is None else timeout
        fields, payloads = bytes_fields(tensor)  # a bad member: TypeError/ValueError naming it
        if traceparent is not None:
            fields["traceparent"] = traceparent
        return self._request({"op": "infer", "task": task, **fields, "timeout": timeout},
                             payloads, timeout, details)

    def _request(self, fields: dict, payload: list, timeout: float, details: bool) -> Future:
        rid = next(self._ids)
        header = {"v": PROTOCOL_VERSION, "id": rid, **fields}
        if self.token:
            header["token"] = self.token
        fut: Future = Future()
        fut.details = details
        deadline = time.monotonic() + timeout
        with self._lock:
            self._waiting[rid] = (fut, deadline)
        try:
            self._io.send([dumps(header), *payload], deadline, on_sent=lambda: self._sent.add(rid))
        except QueueFull as exc:
            with self._lock:
                self._waiting.pop(rid, None)
            raise BlockFlowError(f"client for {self.address}: {exc}", ErrorCode.OVERLOADED.value) from None
        return fut

    def infer(self, task: str, tensor, timeout: float | None = None, traceparent: str | None = None):
        """The result (a tensor, or a tuple/dict of them) for ``task``; raises BlockFlowError with the server's message or TimeoutError."""
        return self.submit(task, tensor, timeout, traceparent=traceparent).result()

    def infer_details(self, task: str, tensor: torch.Tensor, timeout: float | None = None,
                      traceparent: str | None = None) -> Result:
        return self.submit(task, tensor, timeout, details=True, traceparent=traceparent).result()

    def ping(self, timeout: float = 5.0) -> bool:
        self._request({"op": "ping"}, [], timeout, False).result()
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._io.stop()
        with self._lock:
            waiting, self._waiting = self._waiting, {}
        for fut, _ in waiting.values():
            if not fut.done():
                fut.set_exception(RuntimeError("client closed before the reply arrived"))
        self._ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- on the I/O thread -------------------------------------------------------------------
    def _on_disconnect(self) -> None:
        from zmq.utils.monitor import recv_monitor_message
        while self._monitor.poll(0):
            recv_monitor_message(self._monitor)
        self._io._receive()  # replies that arrived before the connection dropped still count
        with self._lock:
            lost = [(rid, self._waiting.pop(rid)[0]) for rid in list(self._sent) if rid in self._waiting]
        self._sent.clear()
        for rid, fut in lost:
            fut.set_exception(BlockFlowError(
                f"the connection to the dispatcher at {self.address} dropped while request {rid} was in flight; "
                "it may or may not have run, retry it", ErrorCode.DISCONNECTED.value))

    def _on_reply(self, frames: list) -> None:
        try:
            header = loads_header(frames[0])
        except WireError as exc:
            log.warning("client: dropped an unreadable reply (%s)", exc)
            return
        rid = header.get("id")
        with self._lock:
            entry = self._waiting.pop(rid, None)
        self._sent.discard(rid)
        if rid in self._answered:
            self.stats["duplicates"] += 1  # the server answered this request twice: a bug
            return
        if isinstance(rid, int):
            self._answered[rid] = None
            if len(self._answered) > 100_000:
                self._answered.popitem(last=False)
        if entry is None:
            self.stats["late"] += 1  # answered after we gave up on it (deadline or disconnect)
            return
        fut = entry[0]
        if header.get("status") != "ok":
            fut.set_exception(BlockFlowError(str(header.get("error", "unknown error")),
                                             str(header.get("code", "error")), header.get("hops")))
            return
        if "x" not in header and "xs" not in header:
            fut.set_result(None)
            return
        try:
            tensor = read_bytes_value(header, frames)
        except (WireError, IndexError) as exc:
            fut.set_exception(BlockFlowError(f"unreadable result tensor: {exc}", ErrorCode.BAD_RESULT.value))
            return
        fut.set_result(Result(tensor, header.get("hops"), header.get("ms")) if fut.details else tensor)

    def _expire(self, now: float) -> None:
        """Fail the calls whose deadline is before ``now`` (their messages have left the send queue)."""
        with self._lock:
            late = [rid for rid, (_, deadline) in self._waiting.items() if deadline < now]
            expired = [self._waiting.pop(rid)[0] for rid in late]
        self._sent.difference_update(late)
        for fut in expired:
            fut.set_exception(TimeoutError(f"no reply from {self.address} within the deadline; "
                                           "is `blockflow serve` running and the task deployed?"))
