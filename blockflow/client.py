"""The client: send a tensor for a task to the dispatcher, get the result tensor back.

    from blockflow import Client
    with Client("tcp://127.0.0.1:5580") as c:
        y = c.infer("classify", x, timeout=5)          # or raises BlockFlowError / TimeoutError
        fut = c.submit("classify", x); y = fut.result()

One I/O thread owns the DEALER socket (ZeroMQ sockets are not thread-safe); ``submit`` hands
requests to it through a queue and a wake-up pipe, so any thread may call the client. Every
call has a deadline: the default ``timeout`` of the client or the one given per call.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future

import torch
import zmq

from blockflow.tensormq.transport import decode_bytes, encode_bytes
from blockflow.tensormq.wire import TensorDesc, WireError, dumps, loads_header
from blockflow import settings

log = logging.getLogger(__name__)

#: Seconds a call waits for its reply unless told otherwise.
DEFAULT_TIMEOUT = settings.CLIENT_TIMEOUT


class BlockFlowError(RuntimeError):
    """The server answered with an error; ``code`` says which kind (unknown_task, bad_input, ...)."""

    def __init__(self, message: str, code: str = "error", hops=None):
        super().__init__(message)
        self.code = code
        self.hops = hops


class Result:
    """A reply: the tensor plus what the pipeline measured on its way."""

    __slots__ = ("tensor", "hops", "server_ms")

    def __init__(self, tensor, hops, server_ms):
        self.tensor, self.hops, self.server_ms = tensor, hops, server_ms


class Client:
    def __init__(self, address: str = "tcp://127.0.0.1:5580", timeout: float = DEFAULT_TIMEOUT,
                 token: str | None = None):
        self.address, self.timeout = address, timeout
        self.token = token if token is not None else settings.TOKEN
        self._ids = itertools.count(1)
        self._outbox: queue.Queue = queue.Queue()
        self._waiting: dict[int, tuple[Future, float]] = {}
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        self._closed = False
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.linger = 0
        self._sock.connect(address)
        # Connection events tell us when the dispatcher went away: requests it held are then
        # answered at once with a 'disconnected' error instead of waiting for their deadline.
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sent: set[int] = set()
        self._answered: OrderedDict[int, None] = OrderedDict()
        #: replies the server sent twice (must stay 0) or after this client gave up on a request
        self.stats = {"duplicates": 0, "late": 0}
        self._thread = threading.Thread(target=self._io_loop, name="blockflow-client", daemon=True)
        self._thread.start()

    # -- public ------------------------------------------------------------------------------
    def submit(self, task: str, tensor: torch.Tensor, timeout: float | None = None, details: bool = False) -> Future:
        """Send one request; the future gives the result tensor (or a ``Result`` with details)."""
        if self._closed:
            raise RuntimeError("client is closed")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        timeout = self.timeout if timeout is None else timeout
        rid = next(self._ids)
        desc, payload = encode_bytes(tensor)
        header = {"v": 1, "op": "infer", "id": rid, "task": task, "x": desc.to_json(), "timeout": timeout}
        if self.token:
            header["token"] = self.token
        fut: Future = Future()
        fut.details = details
        with self._lock:
            self._waiting[rid] = (fut, time.monotonic() + timeout)
        self._outbox.put([dumps(header), payload])
        os.write(self._wake_w, b"x")
        return fut

    def infer(self, task: str, tensor: torch.Tensor, timeout: float | None = None) -> torch.Tensor:
        """The result tensor for ``task``; raises BlockFlowError with the server's message or TimeoutError."""
        return self.submit(task, tensor, timeout).result()

    def infer_details(self, task: str, tensor: torch.Tensor, timeout: float | None = None) -> Result:
        return self.submit(task, tensor, timeout, details=True).result()

    def ping(self, timeout: float = 5.0) -> bool:
        rid = next(self._ids)
        fut: Future = Future()
        fut.details = False
        with self._lock:
            self._waiting[rid] = (fut, time.monotonic() + timeout)
        header = {"v": 1, "op": "ping", "id": rid}
        if self.token:
            header["token"] = self.token
        self._outbox.put([dumps(header)])
        os.write(self._wake_w, b"x")
        fut.result()
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- the I/O thread ----------------------------------------------------------------------
    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while not self._closed:
                events = dict(poller.poll(20))
                if self._wake_r in events:
                    os.read(self._wake_r, 4096)
                while True:
                    try:
                        frames = self._outbox.get_nowait()
                    except queue.Empty:
                        break
                    self._sock.send_multipart(frames, copy=len(frames) < 2 or len(memoryview(frames[1]).cast("B")) < 65536)
                    self._sent.add(json.loads(frames[0])["id"])
                if self._sock in events:
                    self._receive()
                if self._monitor in events:
                    self._on_disconnect()
                self._expire()
        finally:
            with self._lock:
                waiting, self._waiting = self._waiting, {}
            for fut, _ in waiting.values():
                if not fut.done():
                    fut.set_exception(RuntimeError("client closed before the reply arrived"))
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._sock.close(linger=0)
            self._ctx.term()

    def _on_disconnect(self) -> None:
        from zmq.utils.monitor import recv_monitor_message
        while self._monitor.poll(0):
            recv_monitor_message(self._monitor)
        self._receive()  # replies that arrived before the connection dropped still count
        with self._lock:
            lost = [(rid, self._waiting.pop(rid)[0]) for rid in list(self._sent) if rid in self._waiting]
        self._sent.clear()
        for rid, fut in lost:
            fut.set_exception(BlockFlowError(
                f"the connection to the dispatcher at {self.address} dropped while request {rid} was in flight; "
                "it may or may not have run, retry it", "disconnected"))

    def _receive(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                header = loads_header(frames[0])
            except WireError as exc:
                log.warning("client: dropped an unreadable reply (%s)", exc)
                continue
            rid = header.get("id")
            with self._lock:
                entry = self._waiting.pop(rid, None)
            self._sent.discard(rid)
            if rid in self._answered:
                self.stats["duplicates"] += 1  # the server answered this request twice: a bug
                continue
            if isinstance(rid, int):
                self._answered[rid] = None
                if len(self._answered) > 100_000:
                    self._answered.popitem(last=False)
            if entry is None:
                self.stats["late"] += 1  # answered after we gave up on it (deadline or disconnect)
                continue
            fut = entry[0]
            if header.get("status") != "ok":
                fut.set_exception(BlockFlowError(str(header.get("error", "unknown error")),
                                                 str(header.get("code", "error")), header.get("hops")))
                continue
            if "x" not in header:
                fut.set_result(None)
                continue
            try:
                tensor = decode_bytes(TensorDesc.parse(header["x"]), frames[1])
            except (WireError, IndexError) as exc:
                fut.set_exception(BlockFlowError(f"unreadable result tensor: {exc}", "bad_result"))
                continue
            fut.set_result(Result(tensor, header.get("hops"), header.get("ms")) if fut.details else tensor)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            late = [rid for rid, (_, deadline) in self._waiting.items() if deadline < now]
            expired = [self._waiting.pop(rid)[0] for rid in late]
        self._sent.difference_update(late)
        for fut in expired:
            fut.set_exception(TimeoutError(f"no reply from {self.address} within the deadline; "
                                           "is `blockflow serve` running and the task deployed?"))
