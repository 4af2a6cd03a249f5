"""The client: send a tensor for a task to the dispatcher, get the result tensor back.

    from blockflow import Client
    with Client("tcp://127.0.0.1:5580") as c:
        y = c.infer("classify", x, timeout=5)          # or raises BlockFlowError / TimeoutError
        fut = c.submit("classify", x); y = fut.result()

One I/O thread looks after the DEALER socket (ZeroMQ sockets are not thread-safe, see
blockflow/sockthread.py); ``submit`` hands requests to it through a bounded queue, so any
thread may call the client. ``infer`` sends and waits on its own thread when nothing else is
in flight, sparing a round trip two thread hand-overs (Note [A caller that waits holds the
socket] in blockflow/sockthread.py). Every call has a deadline, the default ``timeout`` of the client
or the one given per call, and ends by it whatever the server does (even when none listens).

A client whose dispatcher is on its host (an ipc:// or loopback address) asks it for a window
of shared-memory slots on its first tensor request, then writes each request's tensor into a
free one and sends only a header; results come back as a slot handle it copies the tensor
out of (Note [Lent slots] in dispatcher/lending.py); a bundle takes a slot per member. Until
the slots come, for a tensor larger than a slot, when too few slots are free, or with
``shared_memory=False``, the bytes travel in the message as they do from another host. Such a client also has a
datagram inbox: a request in a slot goes to the dispatcher by Unix datagram, and replies of
one frame come back the same way (Note [Datagrams to a local client] there).
"""
from __future__ import annotations

import ctypes
import itertools
import logging
import math
import os
import secrets
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future

import torch
import zmq

from blockflow.core.protocol import PROTOCOL_VERSION, ErrorCode
from blockflow.sockthread import QueueFull, SocketThread
from blockflow.tensormq import bundle
from blockflow.tensormq.datagram import Receiver, Sender
from blockflow.tensormq.shm import W_GENERATION, W_RELEASED, SlotMapper
from blockflow.tensormq.transport import bytes_fields, read_bytes_value
from blockflow.tensormq.wire import (ClientOp, ClientRequest, TensorDesc, WireError, contiguous_stride, decode_reply,
                                    dtype_name, encode_client, is_local, member_descs)
from blockflow.core import settings

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


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` on this thread alone: torch would split a copy of a few MB over an
    OpenMP team, whose workers then spin on the cores the dispatcher and blocks need (Note [The
    dispatcher copies on one thread] in dispatcher/process.py); numpy's copy is one memcpy."""
    if src.device.type != "cpu" or not src.is_contiguous():
        dst.copy_(src)
        return
    dst.view(torch.uint8).reshape(-1).numpy()[:] = src.view(torch.uint8).reshape(-1).numpy()


class LentSlots:
    """The slots a dispatcher on this host lent this client (Note [Lent slots]), mapped here.

    A slot is ours to fill when no request of ours holds it and its header says FREE
    (``released == generation``): the dispatcher puts it in flight when it accepts the request
    and the path releases it when done. A request that ended without a reply (deadline,
    disconnect) keeps its slot until the header shows a later generation released."""

    def __init__(self, shm_dir: str, names: list, idle_s: float, inbox: str | None = None):
        #: the dispatcher's datagram inbox (Note [Datagrams to a local client]); None: ZeroMQ only
        self.inbox = inbox
        self.mapper = SlotMapper(shm_dir)  # the lent slots, never evicted: the window is small
        self.mapped = {name: self.mapper.map(name) for name in names}  # WireError: not this host's slots
        self.results = SlotMapper(shm_dir)  # the slots results come in (the last blocks')
        self.idle_s, self.last_used = idle_s, time.monotonic()
        self.busy: dict[str, tuple[int, bool]] = {}  # slot -> (generation when filled, request ended unanswered)

    def _free(self, name: str) -> bool:
        hdr = self.mapped[name].hdr
        gen = int(hdr[W_GENERATION])
        if gen != int(hdr[W_RELEASED]):
            return False
        held = self.busy.get(name)
        return held is None or (held[1] and gen > held[0])

    def stale(self) -> bool:
        """Unused for half the dispatcher's idle limit: the lease may end before a request
        reaches it, so the client asks for a new one instead."""
        return time.monotonic() - self.last_used > self.idle_s / 2

    def fill(self, tensor: torch.Tensor) -> tuple[str, dict] | None:
        """Copy ``tensor`` into a free slot: (slot name, descriptor); None when none is free and
        large enough (the bytes travel)."""
        now = time.monotonic()
        nbytes = tensor.nbytes
        for name, m in self.mapped.items():
            if m.cap >= nbytes and self._free(name):
                self.busy[name] = (int(m.hdr[W_GENERATION]), False)
                self.last_used = now
                shape = tuple(tensor.shape)
                # as few torch calls as may be: each is slow in a process whose caches went cold
                if nbytes and tensor.is_cpu and tensor.is_contiguous():
                    # one memmove, no views of the slot (Note [One copy, no views] in tensormq/shm.py)
                    ctypes.memmove(m.base, tensor.data_ptr(), nbytes)
                elif nbytes:
                    _copy(m.data[:nbytes].view(tensor.dtype).view(shape), tensor.detach())
                return name, {"dtype": dtype_name(tensor.dtype), "shape": list(shape),
                              "stride": list(contiguous_stride(shape)), "loc": "shm", "seg": name, "off": 0,
                              "nbytes": nbytes}
        return None

    def fill_all(self, value) -> tuple[list[str], dict] | None:
        """``fill`` for a tensor or every member of a bundle, each in a slot of its own: (slot
        names, the request's header fields); None, with no slot kept, when they do not all fit."""
        if isinstance(value, torch.Tensor):
            placed = self.fill(value)
            return None if placed is None else ([placed[0]], {"x": placed[1]})
        members, keys = bundle.flatten(value)
        names, descs = [], []
        for t in members:
            placed = self.fill(t)
            if placed is None:
                for name in names:  # never sent: free again
                    self.busy.pop(name, None)
                return None
            names.append(placed[0])
            descs.append(placed[1])
        return names, ({"xs": descs, "keys": keys} if keys is not None else {"xs": descs})

    def done(self, name: str, answered: bool) -> None:
        """The request that filled ``name`` ended: with a reply, or without (keep it until it is seen free)."""
        if answered:
            self.busy.pop(name, None)
        elif name in self.busy:
            self.busy[name] = (self.busy[name][0], True)

    def read_all(self, header) -> torch.Tensor | tuple | dict:
        """``read`` for a reply's result: its tensor (``x``) or every member of its bundle
        (``xs``, ``keys``); a member that cannot be read still has the others released."""
        if header.xs is None:
            return self.read(header.x)
        xs, keys = member_descs(header.xs, header.keys, header.x is not None)
        out, error = [], None
        for x in xs:
            try:
                out.append(self.read(x))
            except WireError as exc:
                error = error or exc
        if error is not None:
            raise error
        return bundle.assemble(out, keys)

    def read(self, x) -> torch.Tensor:
        """A copy of the result the handle ``x`` names, then the slot released (WireError: refused
        or reclaimed before the copy was whole)."""
        desc = TensorDesc.parse(x)
        m, off, lease = self.results.locate(desc)
        try:
            out = torch.empty(desc.shape, dtype=desc.dtype)
            if desc.stride == contiguous_stride(desc.shape):  # one memmove, no tensor over the slot
                ctypes.memmove(out.data_ptr(), m.base + off, desc.numel * desc.dtype.itemsize)
            else:
                _copy(out, self.results.view(m, off, desc, lease.seg))
            hdr = lease.mapped.hdr
            if hdr is None or int(hdr[W_GENERATION]) != lease.gen or int(hdr[W_RELEASED]) == lease.gen:
                raise WireError(f"the result's slot {lease.seg} was reclaimed while it was read")
        finally:
            lease.release()
        return out

    def close(self) -> None:
        self.mapped = {}
        self.mapper.close()
        self.results.close()


#: how a client reaches a dispatcher (ZeroMQ transports)
ADDRESS_SCHEMES = ("tcp://", "ipc://", "inproc://")
_WHERE = "the dispatcher's ZeroMQ address, such as tcp://127.0.0.1:5580 (GET /system shows it as dispatcher.endpoint)"


def check_address(address) -> None:
    """A ValueError that says what to write, for an address ZeroMQ would refuse with a bare
    'Invalid argument' or 'Protocol not supported' (``localhost:5580``, the REST URL)."""
    if isinstance(address, str) and address.startswith(ADDRESS_SCHEMES):
        return
    if isinstance(address, str) and address.startswith(("http://", "https://")):
        raise ValueError(f"{address!r} is a REST URL: a client needs {_WHERE}")
    if isinstance(address, str) and "://" not in address and address.rpartition(":")[2].isdigit():
        raise ValueError(f"{address!r} names no transport: write tcp://{address}. A client needs {_WHERE}")
    raise ValueError(f"{address!r} is not a ZeroMQ address: a client needs {_WHERE}")


class Client:
    def __init__(self, address: str = "tcp://127.0.0.1:5580", timeout: float = DEFAULT_TIMEOUT,
                 token: str | None = None, max_queued: int = MAX_QUEUED, shared_memory: bool = True):
        """``shared_memory``: requests and results go through slots the dispatcher lends when it is
        on this host (False: their bytes always travel in the messages)."""
        check_address(address)
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
        self._answered: OrderedDict[int, str | None] = OrderedDict()
        #: replies the server sent twice (must stay 0) or after this client gave up on a request;
        #: requests written into a lent slot and results read from a slot (Note [Lent slots])
        self.stats = {"duplicates": 0, "late": 0, "in_slot": 0, "out_slot": 0,
                      # requests sent and replies taken by datagram, and datagrams dropped for a
                      # key not ours (Note [Datagrams to a local client] in dispatcher/lending.py)
                      "datagrams_out": 0, "datagrams_in": 0, "foreign_datagrams": 0}
        #: slots lent by a dispatcher on this host, once it has answered; None: the bytes travel
        self.lent: LentSlots | None = None
        self._lend_at = 0.0 if shared_memory and is_local(address) else math.inf  # when to ask next
        self._slot_of: dict[int, list[str]] = {}  # request id -> the lent slots it was written in
        # a datagram inbox and the key our datagrams carry, for a dispatcher that lends slots
        self._inbox = self._sender = self._key = None
        if self._lend_at == 0.0 and settings.DATAGRAMS:
            try:
                self._inbox = Receiver.unnamed("blockflow-client")
            except OSError as exc:
                log.info("client for %s: no datagram inbox (%s); replies come by ZeroMQ", address, exc)
            else:
                self._sender, self._key = Sender(), secrets.token_hex(16)
        # one I/O thread owns the socket; requests that cannot be sent before their deadline
        # (no dispatcher listening) are dropped from its queue, and a full queue refuses at once
        self._io = SocketThread(sock, "blockflow-client", self._on_reply, on_tick=self._expire, max_queued=max_queued,
                                busy=lambda: bool(self._waiting))
        self._io.watch(self._monitor, self._on_disconnect)
        if self._inbox is not None:
            self._io.inbox(self._inbox.fileno(), self._on_datagrams)
        self._io.start()

    # -- public ------------------------------------------------------------------------------
    def submit(self, task: str, tensor, timeout: float | None = None, details: bool = False,
               traceparent: str | None = None, _wait: bool = False) -> Future:
        """Send one request; the future gives the result tensor (or a ``Result`` with details).

        ``tensor`` is a tensor, or a tuple (list) or flat dict of tensors for a task whose first
        block takes several; the result is a tensor, a tuple or a dict, as the task's last block
        returns it. ``traceparent``: the W3C trace context of the caller's span; with tracing on
        (BLOCKFLOW_OTLP_ENDPOINT), the server's spans of this request join that trace, and its
        sampled flag decides whether the request is traced.

        The future is resolved by its deadline whatever the server does. Raises BlockFlowError
        (code ``overloaded``) at once when ``max_queued`` requests are still waiting to be sent.
        ``_wait``: the caller waits for the result next (``infer``): this thread may send and
        receive itself."""
        if self._closed:
            raise RuntimeError("client is closed")
        if not isinstance(tensor, torch.Tensor) and not bundle.is_bundle(tensor):
            raise TypeError(f"tensor must be a torch.Tensor, or a tuple or dict of them, got {type(tensor).__name__}")
        timeout = self.timeout if timeout is None else timeout
        placed = None
        with self._lock:  # a tensor or a bundle: either may travel in lent slots
            if self.lent is not None and self.lent.stale():
                self._drop_lease()
            ask = self._lend_at <= time.monotonic()
            if ask:
                self._lend_at = time.monotonic() + 10.0  # one question at a time, at most every 10 s
        if ask:
            self._ask_for_slots(tensor)
        rid = next(self._ids)
        if self.lent is not None:
            with self._lock:
                placed = self.lent.fill_all(tensor) if self.lent is not None else None
                if placed is not None:
                    self._slot_of[rid] = placed[0]
                    self.stats["in_slot"] += 1
        if placed is not None:
            fields, payloads = placed[1], []
        else:
            fields, payloads = bytes_fields(tensor)  # a bad member: TypeError/ValueError naming it
        msg = ClientRequest(PROTOCOL_VERSION, rid, ClientOp.INFER, task=task, out="shm" if self.lent is not None else None,
                            timeout=timeout if 0 < timeout < math.inf else None, traceparent=traceparent, **fields)
        if placed is not None and self._key is not None:
            msg.key = self._key  # one frame: it may go by datagram (``_by_datagram``)
        return self._request(msg, payloads, timeout, details, wait=_wait)

    def _ask_for_slots(self, tensor) -> None:
        """Ask the dispatcher for a window of slots for tensors like ``tensor`` (a bundle's
        largest member); until the answer comes (and if none does) requests carry their bytes.
        Asked again when the lease may have ended (``LentSlots.stale``, a disconnect), at most
        every 10 s."""
        try:
            members = [tensor] if isinstance(tensor, torch.Tensor) else bundle.flatten(tensor)[0]
        except (TypeError, ValueError):
            return  # the request itself says what is wrong with it
        nbytes = max(max(t.numel() * t.element_size() for t in members), 1)
        inbox = self._inbox.path if self._inbox is not None else None
        fut = self._request(ClientRequest(PROTOCOL_VERSION, next(self._ids), ClientOp.LEND, nbytes=nbytes,
                                          pid=os.getpid(), dg=inbox, key=self._key if inbox else None),
                            [], self.timeout, False, keep=True)
        fut.add_done_callback(self._lent)

    def _lent(self, fut: Future) -> None:
        try:
            header = fut.result()
        except Exception as exc:  # an older dispatcher, no shared memory, no answer yet: bytes travel
            log.info("client for %s: no shared-memory slots (%s); tensors travel as bytes", self.address, exc)
            if isinstance(exc, BlockFlowError) and exc.code == ErrorCode.BAD_REQUEST.value:
                self._lend_at = math.inf  # a dispatcher that does not lend: never ask again
            return
        try:
            lent = LentSlots(header.shm, header.slots, header.idle_s, header.dg if self._inbox is not None else None)
        except Exception as exc:  # not this host's files after all (a forwarded port): give them back
            log.info("client for %s: cannot map the lent slots (%s); tensors travel as bytes", self.address, exc)
            self._lend_at = math.inf
            self._request(self._simple(ClientOp.UNLEND), [], self.timeout, False)
            return
        with self._lock:
            self._drop_lease()
            self.lent, self._lend_at = lent, math.inf

    def _drop_lease(self) -> None:
        """Forget the lent slots (under the lock; on the I/O thread or before the next request):
        the dispatcher ended the lease, or will. The next tensor request asks for new ones."""
        if self.lent is not None:
            self.lent.close()
            self.lent, self._lend_at = None, 0.0
            self._slot_of.clear()

    def _simple(self, op: ClientOp) -> ClientRequest:
        """A request with no more than its op (ping, unlend)."""
        return ClientRequest(PROTOCOL_VERSION, next(self._ids), op)

    def _request(self, msg: ClientRequest, payload: list, timeout: float, details: bool,
                 keep: bool = False, wait: bool = False) -> Future:
        """Send ``msg`` (its ``id`` from ``self._ids``). ``keep``: the future gets the whole
        reply (the lend answer), not a tensor. ``wait``: the caller waits for the future next,
        so this thread may hold the socket until the reply is in (``SocketThread.call``)."""
        rid = msg.id
        if self.token:
            msg.token = self.token
        fut: Future = Future()
        fut.details, fut.keep = details, keep
        deadline = time.monotonic() + timeout
        with self._lock:
            self._waiting[rid] = (fut, deadline)
        frames, on_sent = [encode_client(msg), *payload], lambda: self._sent.add(rid)
        other = self._by_datagram if msg.key is not None and msg.op is ClientOp.INFER else None
        if wait and self._io.call(frames, deadline, on_sent, fut.done, other):
            return fut
        try:
            self._io.send(frames, deadline, on_sent=on_sent, other=other)
        except QueueFull as exc:
            with self._lock:
                self._waiting.pop(rid, None)
                self._end_slot(rid, True)  # never sent: nobody put it in flight
            raise BlockFlowError(f"client for {self.address}: {exc}", ErrorCode.OVERLOADED.value) from None
        return fut

    def infer(self, task: str, tensor, timeout: float | None = None, traceparent: str | None = None):
        """The result (a tensor, or a tuple/dict of them) for ``task``; raises BlockFlowError with the server's message or TimeoutError."""
        return self.submit(task, tensor, timeout, traceparent=traceparent, _wait=True).result()

    def infer_details(self, task: str, tensor: torch.Tensor, timeout: float | None = None,
                      traceparent: str | None = None) -> Result:
        return self.submit(task, tensor, timeout, details=True, traceparent=traceparent, _wait=True).result()

    def ping(self, timeout: float = 5.0) -> bool:
        self._request(self._simple(ClientOp.PING), [], timeout, False, wait=True).result()
        return True

    def close(self) -> None:
        if self._closed:
            return
        if self.lent is not None:  # the dispatcher reclaims the slots now rather than when this process exits
            try:
                self._request(self._simple(ClientOp.UNLEND), [], 1.0, False).result(2.0)
            except Exception:
                pass  # it reclaims them on its own (this process gone, or the lease unused)
        self._closed = True
        self._io.stop()
        with self._lock:
            waiting, self._waiting = self._waiting, {}
        for fut, _ in waiting.values():
            if not fut.done():
                fut.set_exception(RuntimeError("client closed before the reply arrived"))
        if self.lent is not None:
            self.lent.close()
        for dg in (self._inbox, self._sender):
            if dg is not None:
                dg.close()
        self._ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- where the socket is held: the I/O thread, or a caller waiting in infer() ---------------
    def _on_disconnect(self) -> None:
        from zmq.utils.monitor import recv_monitor_message
        while self._monitor.poll(0):
            recv_monitor_message(self._monitor)
        self._io.with_socket(self._connection_lost)

    def _connection_lost(self) -> None:
        """Where the socket is held, after a disconnect: what was in flight fails, the lease goes."""
        self._io._receive()  # replies that arrived before the connection dropped still count
        with self._lock:
            lost = [(rid, self._waiting.pop(rid)[0]) for rid in list(self._sent) if rid in self._waiting]
            self._drop_lease()  # a new dispatcher (or the same one, restarted) lends new slots
        self._sent.clear()
        for rid, fut in lost:
            fut.set_exception(BlockFlowError(
                f"the connection to the dispatcher at {self.address} dropped while request {rid} was in flight; "
                "it may or may not have run, retry it", ErrorCode.DISCONNECTED.value))

    def _by_datagram(self, frames: list) -> bool:
        """Send a one-frame request to the dispatcher's datagram inbox; False: it goes by
        ZeroMQ (no inbox, or the datagram refused). Where the socket is held."""
        lent = self.lent
        if lent is None or lent.inbox is None or len(frames) != 1 or not self._sender.send_to(lent.inbox, frames[0]):
            return False
        self.stats["datagrams_out"] += 1
        return True

    def _on_datagrams(self) -> None:
        """Replies that came by datagram: those with our key, as from the socket (where it is held)."""
        for data in self._inbox.drain(64):
            try:
                header = decode_reply(data)
            except WireError as exc:
                log.warning("client: dropped an unreadable datagram (%s)", exc)
                continue
            if header.key is None or not secrets.compare_digest(header.key, self._key):
                self.stats["foreign_datagrams"] += 1  # not from our dispatcher on our behalf
                continue
            self.stats["datagrams_in"] += 1
            self._on_reply([data], header)

    def _on_reply(self, frames: list, header=None) -> None:
        """One reply (``header``: already decoded, a datagram's)."""
        if header is None:
            try:
                header = decode_reply(frames[0])
            except WireError as exc:
                log.warning("client: dropped an unreadable reply (%s)", exc)
                return
        rid = header.id
        with self._lock:
            entry = self._waiting.pop(rid, None)
            if entry is not None:
                self._end_slot(rid, True)
        self._sent.discard(rid)
        if rid in self._answered:
            if header.by == "block" or self._answered[rid] == "block":
                # a last block's answer and the dispatcher's for one request, the block's first or
                # second (Note [A direct answer] in blocks/process.py): the first one counts
                self.stats["late"] += 1
            else:
                self.stats["duplicates"] += 1  # the server answered this request twice: a bug
            return
        if isinstance(rid, int):
            self._answered[rid] = header.by
            if len(self._answered) > 100_000:
                self._answered.popitem(last=False)
        if entry is None:
            self.stats["late"] += 1  # answered after we gave up on it (deadline or disconnect)
            return
        fut = entry[0]
        if header.status != "ok":
            fut.set_exception(BlockFlowError(header.error or "unknown error", header.code or "error", header.hops))
            return
        if fut.keep:
            fut.set_result(header)
            return
        if header.x is None and header.xs is None:
            fut.set_result(None)
            return
        try:
            x = header.x
            if len(frames) == 1 and (x is not None and x.get("loc") == "shm" or header.xs is not None):
                with self._lock:
                    lent = self.lent
                if lent is None:
                    raise WireError("the result came in a slot but this client maps none")
                tensor = lent.read_all(header)
                self.stats["out_slot"] += 1
            else:
                tensor = read_bytes_value(header, frames)
        except (WireError, IndexError) as exc:
            fut.set_exception(BlockFlowError(f"unreadable result tensor: {exc}", ErrorCode.BAD_RESULT.value))
            return
        fut.set_result(Result(tensor, header.hops, header.ms) if fut.details else tensor)

    def _end_slot(self, rid, answered: bool) -> None:
        """The request ``rid`` ended; its lent slots, if any, may be filled again (under the lock)."""
        names = self._slot_of.pop(rid, ())
        if self.lent is not None:
            for name in names:
                self.lent.done(name, answered)

    def _expire(self, now: float) -> None:
        """Fail the calls whose deadline is before ``now`` (their messages have left the send queue)."""
        with self._lock:
            late = [rid for rid, (_, deadline) in self._waiting.items() if deadline < now]
            expired = [self._waiting.pop(rid)[0] for rid in late]
            for rid in late:
                self._end_slot(rid, False)
        self._sent.difference_update(late)
        for fut in expired:
            fut.set_exception(TimeoutError(f"no reply from {self.address} within the deadline; "
                                           "is `blockflow serve` running and the task deployed?"))
