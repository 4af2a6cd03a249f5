"""The controller: a ZeroMQ ROUTER that carries control messages to every block (thesis 3.5).

Each block and the dispatcher connect a DEALER with identity ``<name>#<incarnation>`` and
announce READY (or why they cannot start). The controller's own thread owns the ROUTER;
other threads call ``request()``, which queues the message, wakes the thread through a pipe
and waits on a future for the reply with a deadline. ``cast()`` sends without waiting (the
health pings), and ``last_seen`` records when each process last answered anything.
"""
from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout

import msgspec
import zmq

from blockflow.core import protocol
from blockflow.core.protocol import PROTOCOL_VERSION, BootFailure, Cmd, Gone, Ready, Reply
from blockflow.core.curve import ClusterKeys, authenticator, make_server
from blockflow.core.header import WireError

log = logging.getLogger("blockflow.controller")


class ControlError(RuntimeError):
    """A process answered a command with an error, or could not be reached."""


class Controller:
    def __init__(self, ctx: zmq.Context, endpoint: str, notify=None):
        #: called from the controller's thread with the identity of a process that reported
        #: READY or a boot error (the manager's supervisor loop wakes up on it); must not block
        self.notify = notify
        self.ctx = ctx
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.router_mandatory = 1  # a send to a process that is gone raises instead of vanishing
        self.sock.bind(endpoint)
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.auth = None  # the ZAP handler, once listening between nodes
        self._ids = itertools.count(1)
        self._out: queue.Queue = queue.Queue()
        self._futures: dict[int, Future] = {}
        self._asked: dict[int, bytes] = {}  # request id -> the process it went to (forget() fails them)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self.ready: dict[bytes, dict] = {}
        self.boot_errors: dict[bytes, dict] = {}
        self.last_seen: dict[bytes, float] = {}
        #: hosted blocks whose thread ended in their shared process: identity -> crashed (blocks/host.py)
        self.gone: dict[bytes, bool] = {}
        self._wake_r, self._wake_w = os.pipe()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="controller", daemon=True)

    def listen_between_nodes(self, host: str, keys: ClusterKeys) -> str:
        """Ray mode (issue 30): also listen on TCP at ``host``, as a CURVE server admitting the
        cluster's client key only, for processes on other nodes; the ipc:// endpoint keeps
        serving this host's children without CURVE (options apply to later binds only). Call
        before start(): the socket is the controller thread's from then on. Returns the endpoint."""
        self.auth = authenticator(self.ctx, keys.client_public.encode(), "controller")
        make_server(self.sock, keys.server_secret.encode())
        port = self.sock.bind_to_random_port(f"tcp://{host}")
        return f"tcp://{host}:{port}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._stop:
            return
        self._stop = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        if self.auth is not None:
            self.auth.stop()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- API for other threads ---------------------------------------------------------------
    def cast(self, ident: bytes, cmd: Cmd | str, args: msgspec.Struct | dict | None = None) -> Future:
        """Send command ``cmd`` (its ``args``: its Struct in protocol.ARGS, or a dict of its
        fields, checked here: ValueError naming the field) without waiting for the reply."""
        rid = next(self._ids)
        msg = protocol.command(rid, cmd, args)
        fut: Future = Future()
        with self._lock:
            self._futures[rid] = fut
            self._asked[rid] = ident
        self._out.put((ident, rid, msg))
        os.write(self._wake_w, b"x")
        return fut

    def request(self, ident: bytes, cmd: Cmd | str, args: msgspec.Struct | dict | None = None, timeout: float = 5.0):
        fut = self.cast(ident, cmd, args)
        try:
            return fut.result(timeout)
        except FutureTimeout:
            with self._lock:
                for rid, f in list(self._futures.items()):
                    if f is fut:
                        self._pop(rid)
            raise TimeoutError(f"{ident.decode()} did not answer {str(cmd)!r} within {timeout:.1f}s") from None

    def wait_ready(self, ident: bytes, timeout: float, alive=lambda: True) -> dict:
        """The READY message of ``ident``; raises ControlError with the boot error if it sent one."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if ident in self.ready:
                    return self.ready[ident]
                if ident in self.boot_errors:
                    raise ControlError(self.boot_errors[ident]["error"])
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{ident.decode()} did not report READY within {timeout:.0f}s")
                if not alive():
                    raise ControlError(f"{ident.decode()} exited before it was ready")
                self._cond.wait(min(left, 0.1))

    def forget(self, ident: bytes) -> None:
        """``ident`` is gone (dead, killed or stopped): its pending requests fail now, so that
        nothing waits for an answer that cannot come (an update's acknowledgements)."""
        with self._lock:
            self.ready.pop(ident, None)
            self.boot_errors.pop(ident, None)
            self.last_seen.pop(ident, None)
            rids = [rid for rid, who in self._asked.items() if who == ident]
            pending = [self._pop(rid) for rid in rids]
        for fut in pending:
            if fut is not None and not fut.done():
                fut.set_exception(ControlError(f"{ident.decode()} is gone"))

    def _pop(self, rid: int) -> Future | None:
        """Forget request ``rid`` (call with the lock held)."""
        self._asked.pop(rid, None)
        return self._futures.pop(rid, None)

    # -- the thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._stop:
                events = dict(poller.poll(100))
                if self._wake_r in events:
                    os.read(self._wake_r, 4096)
                self._send_queued()
                if self.sock in events:
                    self._receive()
        finally:
            self.sock.close(linger=0)
            with self._lock:
                futures, self._futures, self._asked = self._futures, {}, {}
            for f in futures.values():
                if not f.done():
                    f.set_exception(ControlError("controller stopped"))

    def _send_queued(self) -> None:
        while True:
            try:
                ident, rid, msg = self._out.get_nowait()
            except queue.Empty:
                return
            try:
                self.sock.send_multipart([ident, protocol.encode(msg)])
            except zmq.ZMQError as exc:  # EHOSTUNREACH: not connected (yet, or any more)
                with self._lock:
                    fut = self._pop(rid)
                if fut is not None and not fut.done():
                    fut.set_exception(ControlError(f"{ident.decode()} is not connected to the controller ({exc})"))

    def _receive(self) -> None:
        while True:
            try:
                ident, raw = self.sock.recv_multipart(zmq.NOBLOCK)[:2]
            except zmq.Again:
                return
            except ValueError:
                continue
            try:
                msg = protocol.decode_control(raw)
            except WireError as exc:
                log.warning("controller: ignored a malformed message from %r (%s)", ident[:64], exc)
                continue
            if isinstance(msg, (Ready, BootFailure)) and msg.v != PROTOCOL_VERSION:
                # e.g. a node of a Ray cluster running another BlockFlow: it cannot be told anything
                msg = BootFailure(msg.name, msg.inc, msg.pid, f"{ident.decode()} speaks protocol version {msg.v}; "
                                  f"this manager speaks {PROTOCOL_VERSION}: run one BlockFlow version everywhere")
            now = time.monotonic()
            with self._cond:
                self.last_seen[ident] = now
                if isinstance(msg, (Ready, BootFailure)):
                    (self.ready if isinstance(msg, Ready) else self.boot_errors)[ident] = msgspec.structs.asdict(msg)
                    self._cond.notify_all()
                elif isinstance(msg, Gone):
                    self.gone[msg.member.encode()] = msg.crashed
                fut = self._pop(msg.id) if isinstance(msg, Reply) else None
            if not isinstance(msg, Reply) and self.notify is not None:
                self.notify(ident)
            if fut is None or fut.done():
                continue
            if msg.ok:
                fut.set_result(msg.result)
            else:
                fut.set_exception(ControlError(f"{ident.decode()}: {msg.error}"))
