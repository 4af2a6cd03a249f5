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


class QueueFull(RuntimeError):
    """More messages wait to be sent than the queue holds; the caller should retry later."""


class SocketThread:
    """Owns ``sock`` from ``start()`` on; ``on_message`` runs on the owner thread for every
    message received, ``on_tick(now)`` after every poll (at least every ``poll_ms``), once the
    messages whose deadline is before ``now`` (time.monotonic()) have left the queue."""

    def __init__(self, sock: zmq.Socket, name: str, on_message: Callable[[list], None],
                 on_tick: Callable[[float], None] | None = None, max_queued: int = 1000, poll_ms: int = 20,
                 copy_threshold: int = 64 * 1024):
        self.sock, self.name = sock, name
        self.on_message, self.on_tick = on_message, on_tick
        self.max_queued, self.poll_ms, self.copy_threshold = max_queued, poll_ms, copy_threshold
        self._queue: deque = deque()  # (frames, deadline, on_sent); appended by any thread, popped by the owner
        self._lock = threading.Lock()
        self._watched: list[tuple[zmq.Socket, Callable[[], None]]] = []
        self._wake_r, self._wake_w = os.pipe()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def watch(self, sock: zmq.Socket, handler: Callable[[], None]) -> None:
        """Poll another socket the owner thread also owns (e.g. a monitor socket); before start()."""
        self._watched.append((sock, handler))

    def start(self) -> None:
        self._thread.start()

    def queued(self) -> int:
        return len(self._queue)

    def send(self, frames: list, deadline: float | None = None, on_sent: Callable[[], None] | None = None) -> None:
        """Queue ``frames`` for the owner thread to send before ``deadline`` (time.monotonic())."""
        if self._closed:
            raise RuntimeError(f"{self.name} is closed")
        with self._lock:
            if len(self._queue) >= self.max_queued:
                raise QueueFull(f"{self.name}: {self.max_queued} messages are already waiting to be sent; "
                                "the peer is not taking them (is it running?); retry later")
            self._queue.append((frames, deadline, on_sent))
        os.write(self._wake_w, b"x")

    def stop(self, timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        os.write(self._wake_w, b"x")
        if self._thread.is_alive():
            self._thread.join(timeout)
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- the owner thread --------------------------------------------------------------------
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        for sock, _ in self._watched:
            poller.register(sock, zmq.POLLIN)
        blocked = False  # the socket refused a message: wait for POLLOUT before the next try
        try:
            while not self._closed:
                events = dict(poller.poll(self.poll_ms))
                if self._wake_r in events:
                    os.read(self._wake_r, 4096)
                if self._queue and (not blocked or events.get(self.sock, 0) & zmq.POLLOUT):
                    blocked = self._flush()
                poller.modify(self.sock, zmq.POLLIN | (zmq.POLLOUT if blocked else 0))
                if events.get(self.sock, 0) & zmq.POLLIN:
                    self._receive()
                for sock, handler in self._watched:
                    if sock in events:
                        handler()
                # one instant for both: a caller whose wait expires at this tick (on_tick) never
                # finds its message still queued
                now = time.monotonic()
                self._drop_expired(now)
                if self.on_tick is not None:
                    self.on_tick(now)
        except zmq.ContextTerminated:
            pass
        finally:
            for sock, _ in self._watched:
                sock.close(linger=0)
            self.sock.close(linger=0)

    def _flush(self) -> bool:
        """Send what is queued; True when the socket refused a message (it stays first in line)."""
        while self._queue:
            frames, deadline, on_sent = self._queue[0]
            if deadline is not None and deadline < time.monotonic():
                self._queue.popleft()
                continue
            copy = len(frames) < 2 or len(memoryview(frames[-1]).cast("B")) < self.copy_threshold
            try:
                self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy)
            except zmq.Again:
                return True
            self._queue.popleft()
            if on_sent is not None:
                on_sent()
        return False

    def _receive(self) -> None:
        for _ in range(1000):  # then give the send queue a turn
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
