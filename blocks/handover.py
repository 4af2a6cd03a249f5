"""Hand-overs between blocks of one shared process (blocks/host.py; issue 40 item 4).

Note [Hand-over inside a process]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A block whose next hop runs in its own process gives it the output tensor itself, not a slot
handle over a socket: it puts a ``Handed`` (the tensor or bundle, and what must be given back
with it) on the next block's ``Inbox`` and wakes that block's inference thread::

    block A, inference thread                          block B, inference thread
      model -> y ──Inbox.put(header, Handed(y))──> deque ─┐  (wait: recv on B's data socket)
                 └─ wake: B's inproc wake-up socket ───────┴─> admit_handed: backlog, as a message

Nothing is encoded, copied into a slot, sent over ipc:// or decoded: B's ``deser`` and A's
``share`` and ``fwd`` are what the hand-over costs (a few microseconds), not left out.

What stays as it was, and why:
- The path. A hands over only to the address the message's path names next, exactly where it
  would have sent it: the path still comes from the dispatcher, and a message reaching A with a
  forged path gets no further inside the process than it would over sockets. B admits what it
  is handed with the same queue limit (``max_queue``) as what it receives.
- One member's life. Each block keeps its thread, backlog, KPI log and mailbox. An inbox is
  registered when its block is about to report ready and closed (under its lock) when the block
  stops, before it answers what it holds: a hand-over to a closed inbox raises ``HopGone``
  (the request is answered ``block_failed``, as a send to a removed hop is), one that got in
  is answered by the stopping block. A replaced block's successor has a new address (its
  incarnation is in it), so it gets its own inbox.
- Ownership. The receiver owns what it is handed. A tensor travels by reference and lives
  while someone holds it. A shared-memory slot (the input of A came from another process, and
  A's output is a view of it) travels with its lease, released by B, as a forwarded handle
  would be. A memory the producer reuses for the next request, a CUDA graph's static output
  or a CUDA IPC slot of another process, is never handed over: it is copied first (on the
  producer's stream, one device-to-device copy).
- GPU order. Blocks of one process share one CUDA context: a tensor needs no IPC handle and
  no inter-process event. A records a plain CUDA event on its stream after the output is made;
  B's stream waits for it before B reads the tensor, and ``record_stream`` tells the caching
  allocator that B's stream uses the memory, so A's stream cannot reuse it before B is done.

Only the inference threads of blocks of this process call ``put``; the wake-up socket is the
receiving block's and is used under its ``wake_lock`` (see ``Block.wake``). On a CPU the producer
usually does not wake the receiver at all: it runs the receiver's request on its own thread
(Note [Run to completion] in blocks/process.py).
"""
from __future__ import annotations

import threading
from collections import deque

import torch

from blockflow.tensormq.bundle import apply, assemble, flatten
from blockflow.tensormq.shm import HopGone

#: The inboxes of the blocks of this process, by every address a path may name them by
#: (ipc:// endpoint, and in Ray mode the TCP one). Empty in a process of one block.
INBOXES: dict[str, "Inbox"] = {}


class Handed:
    """A tensor or bundle handed over inside the process, and what its receiver gives back."""

    __slots__ = ("value", "lease", "event")

    def __init__(self, value, lease=None, event=None):
        #: the tensor or bundle, by reference
        self.value = value
        #: the lease of a shared-memory slot the value lives in (released by the receiver), or None
        self.lease = lease
        #: CUDA event on the producer's stream after the value was made, or None on a CPU
        self.event = event

    @classmethod
    def of(cls, y, lease, stream) -> "Handed":
        """What a block hands over for its output ``y``; ``lease`` is its input's lease (the
        caller gives its duty away when this returns), ``stream`` its CUDA stream or None.

        On a GPU every member is copied: a graph's static output is overwritten by the next
        replay, a CUDA IPC slot is given back to its producer once this block is done, and an
        eager output copied once costs less than telling them apart (one device-to-device copy
        on the producer's stream, ordered before the event)."""
        if isinstance(y, torch.Tensor):
            members = [y]
        else:  # a bundle reaches its receiver as it would over the wire: a tuple or a dict
            members, keys = flatten(y, "the block's output")
            y = assemble(members, keys)
        event = None
        if stream is not None and any(t.is_cuda for t in members):
            y = apply(lambda t: t.clone() if t.is_cuda else t, y)
            members = [y] if isinstance(y, torch.Tensor) else flatten(y)[0]
            event = torch.cuda.Event()
            event.record(stream)
        # a host member may still live in the input's shared-memory slot: the slot goes along
        keep = lease is not None and any(lease.contains(t) for t in members)
        return cls(y, lease if keep else None, event)

    def take(self, stream):
        """(value, lease) for the receiving block, whose CUDA stream (or None) is ``stream``."""
        if self.event is not None and stream is not None:
            stream.wait_event(self.event)
            for t in ([self.value] if isinstance(self.value, torch.Tensor) else flatten(self.value, "input")[0]):
                if t.is_cuda:
                    t.record_stream(stream)  # Note [Hand-over inside a process]: GPU order
        elif self.event is not None:
            self.event.synchronize()  # a CPU block reading a GPU block's output
        return self.value, self.lease

    def release(self) -> None:
        """Give back what the value holds (a request refused or answered unread)."""
        if self.lease is not None:
            self.lease.release()
            self.lease = None


class Inbox:
    """What the blocks of this process hand one block: (header, Handed) pairs, in order."""

    def __init__(self, name: str, wake, serve=None):
        self.name = name
        self.items: deque = deque()
        #: ``wake()`` of the receiving block: ends its wait on its data socket
        self.wake = wake
        #: ``serve(home)`` of the receiving block: runs what it was handed on the calling thread,
        #: whose loop is block ``home``'s, and returns the inboxes it handed on to, or None when
        #: it did not (Note [Run to completion] in blocks/process.py); None: only ``wake``
        self.serve = serve
        self.lock = threading.Lock()
        self.closed = False
        self.addresses: list[str] = []

    def open(self, addresses: list[str]) -> None:
        """Register under ``addresses``: hand-overs to them come here from now on."""
        self.addresses = [a for a in addresses if a]
        for a in self.addresses:
            INBOXES[a] = self

    def put(self, header, handed: Handed, wake: bool = True) -> None:
        """Hand a request over (a producer's inference thread); HopGone once the block stops.
        ``wake=False``: the producer will ``serve`` it itself, or ``wake`` the block if it cannot."""
        with self.lock:
            if self.closed:
                raise HopGone(f"block {self.name} stopped before it took the request")
            self.items.append((header, handed))
        if wake:
            self.wake()

    def close(self) -> list:
        """No hand-over comes in any more; returns the ones that did and were not taken."""
        with self.lock:
            self.closed = True
        for a in self.addresses:
            if INBOXES.get(a) is self:
                del INBOXES[a]
        left = list(self.items)
        self.items.clear()
        return left
