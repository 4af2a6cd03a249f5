"""Slots the dispatcher lends to clients on its host: the way in and out without the bytes.

Note [Lent slots]
-----------------
A client on the dispatcher's host (blockflow/client.py) may skip the two libzmq I/O threads
that a request's bytes cross on the way in (client, dispatcher) and the two on the way out.

- ``{"op": "lend", "nbytes": N, "pid": P}``: the dispatcher makes a window of slots for this
  client (its ROUTER identity), in its own pool, and answers with their names and the
  shared-memory directory. The dispatcher owns the files; the client only maps them.
- A request ``{"op": "infer", "x": {..., "loc": "shm", "seg": S, "off": 0, "nbytes": n}}`` with
  no payload frame names one of them, which the client filled while the slot was FREE (the
  header's ``released == generation``). The dispatcher checks that S was lent to *this*
  client, that it is FREE (not in flight with an earlier request) and that the tensor fits
  in it and is what the task takes; then it puts the slot in flight (a new generation) and
  forwards the handle to the first block, as it would its own slot. The release duty goes
  with the handle, so the slot is FREE again once the path is done with it. The dispatcher
  stays the one that maps the task to its path and admits or refuses the request: the
  client only saves the copy of its bytes.
- With ``"out": "shm"`` in the request, a result that reaches the dispatcher in a host slot
  is answered with that slot's handle instead of its bytes: the client copies the tensor out,
  checks the slot is still at that generation (so the copy is whole) and releases it. The
  dispatcher remembers each handle it answered with until the slot moves on, and releases
  the ones the client has not within ``RESULT_GRACE_S``.
- A lease ends with ``{"op": "unlend"}``, when the client's process is gone (its pid, checked
  every second) or when the client has sent no request for ``LEASE_IDLE_S``: the slots are
  reclaimed (a new generation invalidates every handle still travelling, the files are
  unlinked) and the results it still held are released. A client that dies mid-request
  therefore leaks neither the dispatcher's slots nor the blocks'.

Note [A lease's idle clock]
---------------------------
The client drops its lease itself once it has filled no slot for half of ``LEASE_IDLE_S``
(``LentSlots.stale`` in blockflow/client.py) and asks for a new one, so the dispatcher must
never end a lease sooner than that by its own clock. It did: its clock counted only the
requests it put into a slot, so a client whose requests were all refused (its task unavailable
while a node was lost and its blocks came back: a minute on the loaded 2-core VM, or an unknown
task) kept filling slots and sending them by datagram while the dispatcher, seeing them unused,
ended the lease; the next request's datagram then carried a key no lease had, was dropped, and
the caller waited for its whole deadline (tests/cluster/test_cluster.py's node-loss test, one run
in ten under load). Now every request of the client's counts (``touch``, before any refusal), so
the dispatcher's clock is never older than the client's.

Note [Datagrams to a local client]
----------------------------------
A request in a lent slot is one small frame each way, yet through ZeroMQ it still crosses
four threads each way (the caller, the client's I/O thread, the dispatcher's I/O thread, the
dispatcher's loop), and each crossing is a wake-up: on the 2-core VM ~0.7 ms from the client's
call to the dispatcher's loop, and as much back, where a Unix datagram wakes the receiving
thread itself (Note [A datagram beside the socket] in tensormq/datagram.py). So:

- A client that asks for a lease binds a datagram inbox under an abstract name (no file: it
  goes with the client, killed or not) and sends it as ``dg``; only names of BlockFlow clients
  are taken (``CLIENT_INBOX_RE``), so no client can make the dispatcher write to another
  program's socket, with a random ``key`` the client draws once and every datagram of its
  lease carries. The answer gives the dispatcher's own inbox (``dg``, in its 0700 socket
  directory). The key is the client's, not the lease's, so a reply to a request made under an
  earlier lease still reaches it; a key another client's lease holds is refused.
- The client sends a request whose tensors are all in lent slots (one frame) to the
  dispatcher's inbox with the key; the dispatcher takes it as a request from the client that
  holds the lease with that key (a datagram with an unknown key is dropped and counted: it
  cannot be answered). Every check of a request over ZeroMQ applies, the token's included.
- A reply of one frame to a client with an inbox goes to it by datagram, with the key; the
  client drops a datagram whose key is not its lease's (so a client that named another
  client's inbox cannot answer in its name).
- Whatever a datagram refuses (a full inbox, none bound, too large) goes by ZeroMQ as before,
  and the client polls both: a reply is taken once, whichever way it came.

The check is by ownership, not by trust: a handle to a slot of another client, of a block, or
of an earlier generation is refused with ``bad_request`` before anything is read, and a
client can never make the dispatcher release or read a slot it was not lent. (A process of
the server's user can map the 0700 directory's files anyway; the check keeps the protocol
from lending it anything more.)
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable

import torch

from blockflow.core import settings
from blockflow.tensormq.bundle import assemble
from blockflow.tensormq.shm import FREE, W_GENERATION, W_RELEASED, ShmLease, SlotPool
from blockflow.tensormq.wire import TensorDesc, WireError, contiguous_stride

log = logging.getLogger("blockflow.dispatcher")

#: Clients on this host that may hold slots at once; the next one is refused and sends bytes.
MAX_LOCAL_CLIENTS = 64
#: Seconds a client may send no request before its lease ends (the client asks again after half):
#: every request counts, a refused one too (Note [A lease's idle clock]).
LEASE_IDLE_S = settings.LEASE_IDLE_S
#: Seconds a client has to copy a result out of its slot before the dispatcher releases it.
RESULT_GRACE_S = 10.0


class LocalClient:
    """One client's lease: its slots by name, the result slots it holds, when it last used them."""

    __slots__ = ("edge", "pid", "slots", "results", "last_used", "inbox", "key")

    def __init__(self, edge: str, pid: int | None, slots: dict, inbox: str | None = None, key: str | None = None):
        self.edge, self.pid, self.slots = edge, pid, slots
        #: the client's datagram inbox, and the key its datagrams carry (Note [Datagrams to a local client])
        self.inbox, self.key = (inbox, key) if inbox is not None and key is not None else (None, None)
        self.results: list[tuple[object, float]] = []  # (lease of a result slot, release deadline)
        self.last_used = time.monotonic()


def _alive(pid: int | None) -> bool:
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


class Lender:
    """The dispatcher's lent slots and who holds them (Note [Lent slots]); one thread owns it."""

    def __init__(self, shm_dir: str, owner: str, window: int, max_clients: int = MAX_LOCAL_CLIENTS):
        self.shm_dir, self.window, self.max_clients = shm_dir, window, max_clients
        self.pool = SlotPool(shm_dir, owner, window)
        self.clients: dict[bytes, LocalClient] = {}
        self.keys: dict[str, bytes] = {}  # a lease's key -> its client

    def lend(self, client: bytes, nbytes, pid, inbox: str | None = None, key: str | None = None) -> LocalClient:
        """A fresh lease of slots of at least ``nbytes`` for ``client`` (an earlier lease of it
        ends), with its datagram ``inbox`` and ``key`` if it has them; WireError names what is
        refused."""
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 < nbytes:
            raise WireError("nbytes must be a positive integer")
        if pid is not None and (not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0):
            raise WireError("pid must be a positive integer")
        if inbox is not None and (key is None or self.keys.get(key, client) != client):
            raise WireError("dg needs a key of 32 hex digits that no other client's lease holds")
        self.end(client)
        if len(self.clients) >= self.max_clients:
            raise WireError(f"{self.max_clients} clients on this host hold slots already; send bytes")
        edge = f"client-{client.hex()}"
        self.pool.prepare(edge, nbytes)  # ShmExhausted when the filesystem is full
        slots = {s.name: s for s in self.pool.edges.get(edge, ())}
        local = self.clients[client] = LocalClient(edge, pid, slots, inbox, key)
        if local.key is not None:
            self.keys[local.key] = client
        return local

    def touch(self, client: bytes) -> None:
        """``client`` sent a request: its lease, if it holds one, is in use (Note [A lease's idle clock])."""
        local = self.clients.get(client)
        if local is not None:
            local.last_used = time.monotonic()

    def client_of(self, key) -> bytes | None:
        """The client whose lease has the key ``key`` (a request that came by datagram)."""
        return self.keys.get(key) if isinstance(key, str) else None

    def inbox_of(self, client: bytes) -> tuple[str, str] | None:
        """(inbox, key) of a client that has a datagram inbox, else None."""
        local = self.clients.get(client)
        return (local.inbox, local.key) if local is not None and local.inbox is not None else None

    def take(self, client: bytes, x, max_bytes: int, check: Callable[[TensorDesc], None]):
        """A request's handle to a lent slot, checked (``check`` sees the descriptor before the
        slot is taken); the slot goes in flight. Returns the handle that travels on. No tensor
        is made over the slot: a first block on this host takes the handle as it is, and the
        three views a tensor costs are paid cold in the dispatcher (Note [One copy, no views] in
        tensormq/shm.py); ``tensor_of`` makes one where the bytes must travel."""
        slot, desc = self._claim(client, x, max_bytes)
        check(desc)
        return self._in_flight(client, slot, x, desc)

    def take_all(self, client: bytes, xs, max_bytes: int, check: Callable[[list], None]) -> list[dict]:
        """``take`` for a bundle's members, each in its own lent slot: every one is checked
        (``check`` sees all the descriptors) before any slot is taken."""
        if not isinstance(xs, list) or not xs:
            raise WireError("xs must be a list of descriptors")
        claimed = [self._claim(client, x, max_bytes, f"xs[{i}]") for i, x in enumerate(xs)]
        if len({slot.name for slot, _ in claimed}) != len(claimed):
            raise WireError("each member of a bundle in lent slots needs a slot of its own")
        check([desc for _, desc in claimed])
        return [self._in_flight(client, slot, x, desc) for (slot, desc), x in zip(claimed, xs)]

    def _claim(self, client: bytes, x, max_bytes: int, what: str = "x"):
        """(slot, descriptor) of a handle to a slot lent to ``client`` that is FREE and holds the
        tensor it describes; WireError names what is wrong."""
        local = self.clients.get(client)
        if local is None:
            raise WireError("x.loc is shm but this client holds no lent slots (ask with op 'lend'; a lease "
                            f"ends after {LEASE_IDLE_S:.0f}s unused)")
        seg = x.get("seg") if isinstance(x, dict) else None
        slot = local.slots.get(seg) if isinstance(seg, str) else None
        if slot is None:
            raise WireError(f"{what}.seg {str(seg)!r:.60} is not a slot lent to this client")
        desc = TensorDesc.parse(x, max_bytes)
        nbytes = desc.numel * desc.itemsize
        if desc.loc != "shm" or x.get("off") != 0 or tuple(desc.stride) != contiguous_stride(desc.shape):
            raise WireError(f"a tensor in a lent slot must be C-contiguous at offset 0 ({what}.off 0, loc shm)")
        if nbytes > slot.capacity:
            raise WireError(f"{what}.shape needs {nbytes} bytes but slot {seg} holds {slot.capacity}")
        if slot.state != FREE:
            raise WireError(f"{what}.seg {seg} is still in flight with an earlier request; wait for its reply")
        return slot, desc

    def _in_flight(self, client: bytes, slot, x: dict, desc: TensorDesc) -> dict:
        gen = slot.mark_in_flight()
        self.clients[client].last_used = time.monotonic()
        return {"dtype": x["dtype"], "shape": list(desc.shape), "stride": list(desc.stride), "loc": "shm",
                "seg": slot.name, "gen": gen, "off": 0, "nbytes": desc.numel * desc.itemsize}

    def value_of(self, fields: dict):
        """The tensor, or the bundle, over the lent slots a request's ``fields`` name (``{"x":
        handle}`` or ``{"xs": handles, "keys": ...}`` from ``take``/``take_all``)."""
        if "x" in fields:
            return self.tensor_of(fields["x"])
        return assemble([self.tensor_of(h) for h in fields["xs"]], fields.get("keys"))

    def give_back_all(self, fields: dict) -> None:
        """``give_back`` for every slot a request's ``fields`` name."""
        for handle in ([fields["x"]] if "x" in fields else fields["xs"]):
            self.give_back(handle)

    def tensor_of(self, handle: dict) -> torch.Tensor:
        """The tensor over the lent slot a handle from ``take`` names (still in flight)."""
        desc = TensorDesc.parse(handle)
        slot = self.pool.slot_named(handle["seg"])
        return slot.data[:handle["nbytes"]].view(desc.dtype).view(desc.shape)

    def give_back(self, handle: dict) -> None:
        """Free a taken slot whose handle never left the dispatcher (the request was refused)."""
        slot = self.pool.slot_named(handle["seg"])
        if slot is not None:
            slot.give_back(handle["gen"])

    def holds(self, client: bytes) -> bool:
        return client in self.clients

    def hand_out(self, client: bytes, lease, xs: list | None = None) -> bool:
        """Whether ``client`` is answered with the handles of a result's host slots instead of
        its bytes: ``lease`` is the slot's (``ShmLease``), or a bundle's (``LeaseSet``, one per
        member of ``xs``: none came as bytes). The dispatcher keeps the leases to release them
        if the client does not."""
        local = self.clients.get(client)
        leases = [lease] if type(lease) is ShmLease else getattr(lease, "leases", None)
        if local is None or not leases or not all(type(le) is ShmLease for le in leases) \
                or (xs is not None and len(leases) != len(xs)):
            return False
        deadline = time.monotonic() + RESULT_GRACE_S
        local.results.extend((le, deadline) for le in leases)
        return True

    def sweep(self, now: float) -> None:
        """Forget the results clients released, release the ones past their grace, end the leases
        of clients that are gone or idle."""
        for client, local in list(self.clients.items()):
            keep = []
            for lease, deadline in local.results:
                hdr = lease.mapped.hdr
                if hdr is None or int(hdr[W_GENERATION]) != lease.gen or int(hdr[W_RELEASED]) == lease.gen:
                    continue  # released by the client (or the slot was reclaimed)
                if deadline < now:
                    lease.release()
                    continue
                keep.append((lease, deadline))
            local.results = keep
            if not _alive(local.pid):
                log.info("dispatcher: local client pid %s is gone; reclaiming its %d slots", local.pid,
                         len(local.slots))
                self.end(client)
            elif now - local.last_used > LEASE_IDLE_S and not local.results:
                self.end(client)

    def end(self, client: bytes) -> None:
        local = self.clients.pop(client, None)
        if local is None:
            return
        if local.key is not None:
            self.keys.pop(local.key, None)
        self.pool.reclaim(local.edge)
        for lease, _ in local.results:
            lease.release()

    def lent_slots(self) -> int:
        return sum(len(c.slots) for c in list(self.clients.values()))  # list(): the ping's thread reads it too

    def close(self) -> None:
        for client in list(self.clients):
            self.end(client)
        self.pool.close()
