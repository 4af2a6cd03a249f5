"""One thread that owns a ZeroMQ socket, with a bounded send queue that any thread may feed.

ZeroMQ sockets are not thread-safe, so a socket that several threads send on gets one owner
thread; the others hand it frames through ``send()``. The pattern -- a socket, a queue, a
wake-up pipe, a poll loop, deadlines -- was written three times (client, controller, block
outbox); this is it, once::

    any thread --send(frames, deadline)--> [bounded deque] --wake pipe--> owner thread
                                                                           | send NOBLOCK
                                                                           v
                                                                       ZeroMQ socket
                                                                           | POLLIN
                                                                           v
                                                               on_message(frames) (owner)

Promises:

- ``send()`` never blocks: it raises ``QueueFull`` at once when ``max_queued`` messages wait.
- The owner thread never blocks in a send either: a socket that cannot take a message now
  (no peer connected, high-water mark reached) keeps it queued and is retried on POLLOUT.
- A queued message whose deadline passes is dropped unsent, so the queue drains even when
  the peer never comes; whoever waits for its answer learns of the deadline on its own.
- ``stop()`` asks, the loop closes the socket with ``linger=0`` on its way out.

Note [A caller that waits holds the socket]: a caller that sends one message and then only
waits for its answer (``Client.infer``) pays two thread hand-overs a round trip if the owner
thread sends and receives for it: each wakes a sleeping thread, which on the 2-core VM costs
~0.17 ms at the median (hop_budget's "thread hand-over, one way"), against the ~0.3 ms a whole
ZeroMQ crossing costs there. So the socket is *held* rather than owned: the owner thread holds
it while messages are queued or answers are awaited (``busy()``), and lets go when neither is
so. A caller that finds it let go holds it itself (``call``): it sends its message and polls
the socket on its own thread until its answer is in (``done()``), handling every message that
arrives meanwhile as the owner thread would, and any message other threads queue; then it lets
go, and wakes the owner thread if there is work left for it. One thread holds the socket at a
time (the lock below is the full memory barrier ZeroMQ asks for when a socket changes threads),
so a caller that finds it held -- by the owner or by another caller -- queues its message as
before. Work that needs the socket from the owner thread's watched sockets (``with_socket``)
runs where the socket is held, on the caller's thread if it holds it.

A message may also go another way than the socket (``send(..., other=fn)``: ``fn(frames)``
sends it and says whether it did, tried by the holder first), and answers may come another
way (``inbox(fd, handler)``: a file descriptor polled, and ``handler()`` run, wherever the
socket is held): a local client's datagrams (Note [Datagrams to a local client] in
dispatcher/lending.py).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import Callable

import zmq

log = logging.getLogger(__name__)


#: Holders of the socket (Note [A caller that waits holds the socket]).
IO, CALLER = "io", "caller"


class QueueFull(RuntimeError):
    """More messages wait to be sent than the queue holds; the caller should retry later."""


class SocketThread:
    """Looks after ``sock`` from ``start()`` on; ``on_message`` runs where the socket is held
    (the owner thread, or a caller in ``call``) for every message received, ``on_tick(now)`` on
    the owner thread after every poll (at least every ``poll_ms``), once the messages whose
    deadline is before ``now`` (time.monotonic()) have left the queue."""

    def __init__(self, sock: zmq.Socket, name: str, on_message: Callable[[list], None],
                 on_tick: Callable[[float], None] | None = None, max_queued: int = 1000, poll_ms: int = 20,
                 copy_threshold: int = 64 * 1024, busy: Callable[[], bool] | None = None):
        """``busy()``: whether answers are awaited (the owner thread then keeps the socket
        polled); None: always (no caller ever holds the socket)."""
        self.sock, self.name = sock, name
        self.on_message, self.on_tick = on_message, on_tick
        self.max_queued, self.poll_ms, self.copy_threshold = max_queued, poll_ms, copy_threshold
        self._busy = busy or (lambda: True)
        self._queue: deque = deque()  # (frames, deadline, on_sent, other); appended by any thread, popped by the holder
        self._lock = threading.Lock()
        self._let_go = threading.Condition(self._lock)
        #: who holds the socket (Note [A caller that waits holds the socket]): None, IO or CALLER
        self._holder: str | None = None
        self._deferred: list[Callable[[], None]] = []  # with_socket work for the holder
        self._watched: list[tuple[zmq.Socket, Callable[[], None]]] = []
        self._wake_r, self._wake_w = os.pipe()
        self._caller_r, self._caller_w = os.pipe()  # wakes the caller that holds the socket
        self._caller_poller = zmq.Poller()
        self._caller_poller.register(sock, zmq.POLLIN)
        self._caller_poller.register(self._caller_r, zmq.POLLIN)
        self._inbox: tuple[int, Callable[[], None]] | None = None
        self.held = 0  # messages a caller sent holding the socket itself
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def watch(self, sock: zmq.Socket, handler: Callable[[], None]) -> None:
        """Poll another socket the owner thread also owns (e.g. a monitor socket); before start()."""
        self._watched.append((sock, handler))

    def inbox(self, fd: int, handler: Callable[[], None]) -> None:
        """Poll ``fd`` too wherever the socket is held, and run ``handler()`` there when it is
        readable (answers that come another way than the socket); before start()."""
        self._inbox = (fd, handler)
        self._caller_poller.register(fd, zmq.POLLIN)

    def start(self) -> None:
        self._thread.start()

    def queued(self) -> int:
        return len(self._queue)

    def send(self, frames: list, deadline: float | None = None, on_sent: Callable[[], None] | None = None,
             other: Callable[[list], bool] | None = None) -> None:
        """Queue ``frames`` for the owner thread to send before ``deadline`` (time.monotonic());
        ``other(frames)`` is tried first and says whether it sent them another way."""
        if self._closed:
            raise RuntimeError(f"{self.name} is closed")
        with self._lock:
            if len(self._queue) >= self.max_queued:
                raise QueueFull(f"{self.name}: {self.max_queued} messages are already waiting to be sent; "
                                "the peer is not taking them (is it running?); retry later")
            self._queue.append((frames, deadline, on_sent, other))
            self._wake_holder()

    def _wake_holder(self) -> None:
        """Under the lock: wake whoever will handle new work (the caller holding the socket, or the owner)."""
        os.write(self._caller_w if self._holder == CALLER else self._wake_w, b"x")

    def call(self, frames: list, deadline: float | None, on_sent: Callable[[], None] | None,
             done: Callable[[], bool], other: Callable[[list], bool] | None = None) -> bool:
        """Send ``frames`` and handle what arrives on this thread until ``done()`` (Note [A
        caller that waits holds the socket]); False, having done nothing, when the socket is
        held or work is queued: then ``send()`` instead. True once ``done()``, once the thread
        is stopping, or once the message is queued for the owner thread because the socket
        cannot take it now; the caller then waits as after ``send()`` (its deadline is its own:
        the owner thread still ticks)."""
        with self._lock:
            if self._closed or self._holder is not None or self._queue or self._deferred:
                return False
            self._holder = CALLER
        poller, blocked = self._caller_poller, False  # one caller at a time: theirs to share
        inbox = self._inbox
        try:
            if other is None or not other(frames):
                copy = len(frames) < 2 or len(memoryview(frames[-1]).cast("B")) < self.copy_threshold
                try:
                    self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy)
                except zmq.Again:  # no peer yet, or the high-water mark: the owner thread waits for POLLOUT
                    with self._lock:
                        self._queue.appendleft((frames, deadline, on_sent, None))
                    return True
            if on_sent is not None:
                on_sent()
            self.held += 1
            while not done() and not self._closed:
                events = dict(poller.poll(self.poll_ms))
                if self._caller_r in events:
                    os.read(self._caller_r, 4096)
                if events.get(self.sock, 0) & zmq.POLLIN:
                    # one message, then the question: another recv would mostly raise zmq.Again
                    self._receive(1)
                if inbox is not None and inbox[0] in events:
                    self._run(inbox[1])
                if self._queue or self._deferred or blocked:
                    blocked = self._work(events, blocked)
                    poller.modify(self.sock, zmq.POLLIN | (zmq.POLLOUT if blocked else 0))
            return True
        finally:
            if blocked:  # the next caller waits for its answer, not for room to send
                poller.modify(self.sock, zmq.POLLIN)
            with self._lock:
                self._holder = None
                if self._queue or self._deferred or self._busy():
                    os.write(self._wake_w, b"x")  # the owner thread takes over
                self._let_go.notify_all()

    def with_socket(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (from the owner thread, e.g. a watched socket's handler) where the socket is
        held: next round on the owner thread, or on the caller's thread that holds it."""
        with self._lock:
            self._deferred.append(fn)
            self._wake_holder()

    def stop(self, timeout: float = 5.0) -> None:
        if self._closed:
            return
        with self._lock:
            self._closed = True
            os.write(self._wake_w, b"x")
            os.write(self._caller_w, b"x")
        if self._thread.is_alive():
            self._thread.join(timeout)
        for fd in (self._wake_r, self._wake_w, self._caller_r, self._caller_w):
            os.close(fd)

    # -- the owner thread --------------------------------------------------------------------
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        for sock, _ in self._watched:
            poller.register(sock, zmq.POLLIN)
        blocked = False  # the socket refused a message: wait for POLLOUT before the next try
        polled = False  # the socket is in the poller (while this thread holds it)
        try:
            while not self._closed:
                with self._lock:
                    if self._holder is None and (self._queue or self._deferred or self._busy()):
                        self._holder = IO
                    mine = self._holder == IO
                if mine:
                    poller.register(self.sock, zmq.POLLIN | (zmq.POLLOUT if blocked else 0))
                    if self._inbox is not None and not polled:
                        poller.register(self._inbox[0], zmq.POLLIN)
                elif polled:
                    poller.unregister(self.sock)
                    if self._inbox is not None:
                        poller.unregister(self._inbox[0])
                polled = mine
                # work taken on just now (the wake-up that brought it was read last round) is done at once
                events = dict(poller.poll(0 if mine and (self._queue or self._deferred) else self.poll_ms))
                if self._wake_r in events:
                    os.read(self._wake_r, 4096)
                if mine:
                    if events.get(self.sock, 0) & zmq.POLLIN:
                        self._receive()
                    if self._inbox is not None and self._inbox[0] in events:
                        self._run(self._inbox[1])
                    blocked = self._work(events, blocked)
                for sock, handler in self._watched:
                    if sock in events:
                        handler()
                # one instant for both: a caller whose wait expires at this tick (on_tick) never
                # finds its message still queued
                now = time.monotonic()
                if mine:
                    self._drop_expired(now)
                if self.on_tick is not None:
                    self.on_tick(now)
                if mine:
                    with self._lock:
                        if not (self._queue or self._deferred or self._busy()):
                            self._holder = None  # a waiting caller may hold it now
        except zmq.ContextTerminated:
            pass
        finally:
            with self._lock:  # a caller holding the socket sees _closed and lets go
                self._let_go.wait_for(lambda: self._holder != CALLER, timeout=5.0)
            for sock, _ in self._watched:
                sock.close(linger=0)
            self.sock.close(linger=0)

    def _work(self, events: dict, blocked: bool) -> bool:
        """The holder's round: the queue (retried on POLLOUT once refused), then the deferred
        work; returns whether the socket still refuses."""
        if self._queue and (not blocked or events.get(self.sock, 0) & zmq.POLLOUT):
            blocked = self._flush()
        while self._deferred:
            with self._lock:
                todo, self._deferred = self._deferred, []
            for fn in todo:
                try:
                    fn()
                except Exception:
                    log.exception("%s: work that needed the socket failed", self.name)
        return blocked

    def _flush(self) -> bool:
        """Send what is queued; True when the socket refused a message (it stays first in line)."""
        while self._queue:
            frames, deadline, on_sent, other = self._queue[0]
            if deadline is not None and deadline < time.monotonic():
                self._queue.popleft()
                continue
            if other is None or not other(frames):
                copy = len(frames) < 2 or len(memoryview(frames[-1]).cast("B")) < self.copy_threshold
                try:
                    self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy)
                except zmq.Again:
                    return True
            self._queue.popleft()
            if on_sent is not None:
                on_sent()
        return False

    def _run(self, handler: Callable[[], None]) -> None:
        try:
            handler()
        except Exception:  # as _receive: the thread serves every other message too
            log.exception("%s: what came in could not be handled", self.name)

    def _receive(self, most: int = 1000) -> None:
        for _ in range(most):  # then give the send queue a turn
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self.on_message(frames)
            except Exception:  # one bad message must not end the thread that serves all the others
                log.exception("%s: a received message could not be handled", self.name)

    def _drop_expired(self, now: float) -> None:
        """Messages whose deadline passed while the socket refused them go, wherever they are queued."""
        if not self._queue:
            return
        with self._lock:  # senders append concurrently: iterate under the lock
            keep = [item for item in self._queue if item[1] is None or item[1] >= now]
            if len(keep) != len(self._queue):
                self._queue.clear()
                self._queue.extend(keep)
