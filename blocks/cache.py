"""The block cache of a shared process with a memory budget (issue 44, the block fields
``memory_budget_mb`` and ``pinned``).

A shared process (blocks/host.py) may host more blocks than its device's memory holds at once.
Its blocks' weights then live in two places: **resident** on the device, where the model runs,
or **parked** in a warm copy off it -- pinned host memory on a GPU (a swap-in is one
asynchronous copy over PCIe), a file in the run directory on a CPU (the weights leave the
process's memory for the page cache, which the kernel keeps warm while it has room). A parked
block is still a block of the topology: routable, supervised, answering pings.

    request for b ──> BlockCache.acquire(b) ──resident──> run ──> release(b)
                          │ parked
                          └─> one swap at a time per device: park victims (the policy's order, never a
                              pinned block, never one with a request in flight), restore b's
                              weights (and on a GPU re-capture its CUDA graphs), then run

``Weights`` moves one block's tensors; ``BlockCache`` decides, under one condition variable,
which block is where; ``EvictionPolicy`` orders the candidates (``LruPolicy``, and the default
``SharingLruPolicy`` that evicts a block on the path of several tasks only after every block of
one task). The manager refuses a budget its pinned blocks and its largest other block do not fit
in (manager/models.py ``check_budgets``), so every acquire can be served once the blocks in
flight finish; a request that still waits longer than its block's bound is answered
``overloaded`` (blocks/process.py).

What counts against the budget is the blocks' weights: their parameters and buffers (unique
storages), as measured when the block loads. Activations come and go with each request; on a GPU
a parked block's CUDA graphs (their static buffers and memory pools) are dropped with its
weights and captured again when it comes back.
"""
from __future__ import annotations

import bisect
import enum
import fcntl
import logging
import os
import threading
import time

import torch

log = logging.getLogger("blockflow.cache")

#: Upper bounds (ms) of the swap-in histogram's buckets (``/metrics``: seconds).
SWAP_BUCKETS_MS = (0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0)


class Residency(enum.Enum):
    RESIDENT = "resident"   # weights on the device: requests run at once
    PARKED = "parked"       # weights in the warm copy: a request swaps it in first
    MOVING = "moving"       # being parked or swapped in (one swap at a time per device)


class CacheWaitTimeout(Exception):
    """A block could not get room in its process's budget within its bound: every block that
    could make room had a request in flight (answered ``overloaded``)."""


class Weights:
    """One block's weights on its device, and their warm copy while it is parked.

    Every parameter and buffer keeps its ``Tensor`` object (the module's slots hold it, TorchScript
    and ``.pt2`` alike); parking points it at an empty tensor (``.data``), so a parked model that
    ran by mistake fails with a shape error instead of reading freed memory, and a swap-in points
    it at a new storage with the same offset, sizes and strides. Tensors sharing one storage (tied
    weights) are moved together: the storage is moved once."""

    def __init__(self, model: torch.nn.Module, device: torch.device, park_path: str):
        self.device, self.park_path = device, park_path
        seen: dict[int, torch.Tensor] = {}
        for t in [*model.parameters(), *model.buffers()]:
            seen.setdefault(id(t), t)
        self.tensors = list(seen.values())
        #: storage key -> index into ``storages``; each tensor's (storage index, offset, size, stride, dtype)
        keys: dict[int, int] = {}
        self.storages: list[int] = []  # nbytes of each unique storage
        self.layout: list[tuple] = []
        for t in self.tensors:
            st = t.untyped_storage()
            k = keys.setdefault(st.data_ptr(), len(self.storages))
            if k == len(self.storages):
                self.storages.append(st.nbytes())
            self.layout.append((k, t.storage_offset(), tuple(t.size()), tuple(t.stride()), t.dtype))
        self.nbytes = sum(self.storages)
        #: GPU: one pinned host buffer per storage; CPU: (offset, nbytes) in the park file
        self.warm: list | None = None
        self.parked = False

    def park(self) -> None:
        """Free the weights' device memory; the warm copy is made the first time (the weights of
        an inference server do not change)."""
        if self.parked:
            return
        with torch.inference_mode(False), torch.no_grad():
            if self.warm is None:
                self.warm = self._copy_out()
            for t in self.tensors:
                t.data = torch.empty(0, dtype=t.dtype, device=self.device)
        self.parked = True

    def restore(self) -> None:
        """Put the weights back on the device from the warm copy; returns once they are there."""
        if not self.parked:
            return
        with torch.inference_mode(False), torch.no_grad():
            if self.device.type == "cuda":
                stream = torch.cuda.default_stream(self.device)  # one allocator pool for every swap
                with torch.cuda.stream(stream):
                    storages = []
                    for host in self.warm:
                        dev = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
                        dev.copy_(host, non_blocking=True)
                        storages.append(dev.untyped_storage())
                stream.synchronize()
            else:
                storages = []
                with open(self.park_path, "rb", buffering=0) as f:
                    for nbytes in self.storages:
                        st = torch.UntypedStorage(nbytes)
                        view = memoryview(torch.empty(0, dtype=torch.uint8).set_(st).numpy())
                        got = f.readinto(view) if nbytes else 0
                        if got != nbytes:
                            raise OSError(f"{self.park_path}: {got} bytes read of {nbytes}")
                        storages.append(st)
            for t, (k, offset, size, stride, dtype) in zip(self.tensors, self.layout):
                t.data = torch.empty(0, dtype=dtype, device=self.device).set_(storages[k], offset, size, stride)
        self.parked = False

    def _copy_out(self) -> list:
        storages = {}
        for t, (k, *_rest) in zip(self.tensors, self.layout):
            storages.setdefault(k, t.untyped_storage())
        ordered = [storages[k] for k in range(len(self.storages))]
        as_bytes = [torch.empty(0, dtype=torch.uint8, device=self.device).set_(st) for st in ordered]
        if self.device.type == "cuda":
            warm = []
            for b in as_bytes:
                host = torch.empty(b.numel(), dtype=torch.uint8, pin_memory=True)
                host.copy_(b)
                warm.append(host)
            return warm
        fd = os.open(self.park_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            for b in as_bytes:
                f.write(memoryview(b.numpy()))
        return [len(as_bytes)]

    def remove(self) -> None:
        """Remove the park file (CPU), if one was written."""
        if self.device.type != "cuda":
            try:
                os.unlink(self.park_path)
            except FileNotFoundError:
                pass


class DeviceLock:
    """One swap at a time per device, across the shared processes of a server: an exclusive
    ``flock`` on a file in the server's socket directory, held while a swap parks and restores
    (two groups on one GPU never copy weights over PCIe at once). Only a miss takes it."""

    def __init__(self, path: str | None):
        self.path, self.fd = path, None

    def __enter__(self):
        if self.path is not None:
            if self.fd is None:
                self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)


class Entry:
    """What the cache knows of one block: where its weights are, its use, its counters."""

    def __init__(self, name: str, weights: Weights | None, nbytes: int, pinned: bool,
                 on_park=None, on_restore=None):
        self.name, self.weights, self.nbytes, self.pinned = name, weights, nbytes, pinned
        #: called (from whichever thread swaps) after the weights left / before they came back:
        #: the block drops its CUDA graphs / captures them again (blocks/runner.py)
        self.on_park, self.on_restore = on_park, on_restore
        self.state = Residency.RESIDENT
        self.in_flight = 0
        self.tasks = 0          # tasks whose path goes through the block (the manager's topology)
        self.last_used = 0.0
        self.hits = self.misses = self.evictions = 0
        self.swap_counts = [0] * (len(SWAP_BUCKETS_MS) + 1)
        self.swap_sum_ms = 0.0
        self.last_swap_ms: float | None = None

    def observe_swap(self, ms: float) -> None:
        self.swap_counts[bisect.bisect_left(SWAP_BUCKETS_MS, ms)] += 1
        self.swap_sum_ms += ms
        self.last_swap_ms = ms

    def stats(self) -> dict:
        return {"state": self.state.value, "bytes": self.nbytes, "pinned": self.pinned, "tasks": self.tasks,
                "hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                "swap_in_ms": {"buckets": list(SWAP_BUCKETS_MS), "counts": list(self.swap_counts),
                               "sum": round(self.swap_sum_ms, 3), "last": self.last_swap_ms}}


class EvictionPolicy:
    """Which resident blocks to park to make room: ``order`` ranks the candidates, first evicted
    first. Candidates are never pinned and have no request in flight (the cache sees to that)."""

    name = "policy"

    def order(self, candidates: list[Entry]) -> list[Entry]:
        raise NotImplementedError

    def victims(self, candidates: list[Entry], need: int) -> list[Entry] | None:
        """The fewest candidates, in ``order``, whose bytes make ``need``; None when all of them do not."""
        if need <= 0:
            return []
        out, freed = [], 0
        for e in self.order(candidates):
            out.append(e)
            freed += e.nbytes
            if freed >= need:
                return out
        return None


class LruPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def order(self, candidates: list[Entry]) -> list[Entry]:
        return sorted(candidates, key=lambda e: e.last_used)


class SharingLruPolicy(EvictionPolicy):
    """Least recently used first among the blocks of one task (or none); a block on the path of
    several tasks only after all of those, least recently used first among them. A shared block
    is the one whose swap every one of its tasks would pay."""

    name = "sharing"

    def order(self, candidates: list[Entry]) -> list[Entry]:
        return sorted(candidates, key=lambda e: (e.tasks > 1, e.last_used))


POLICIES = {p.name: p for p in (LruPolicy, SharingLruPolicy)}


class BlockCache:
    """The blocks of one shared process and its budget: who is resident, who swaps in next."""

    def __init__(self, budget_bytes: int, policy: EvictionPolicy | None = None, device_lock: str | None = None):
        self.budget = int(budget_bytes)
        #: held around every swap: one at a time per device (None: this process's swaps only)
        self.device_lock = DeviceLock(device_lock)
        self.policy = policy or SharingLruPolicy()
        self.cond = threading.Condition()
        self.entries: dict[str, Entry] = {}
        self.swapping = False
        #: serialises the members' start-up (load, warm-up, place) so loading never exceeds the budget
        self.starting = threading.Lock()

    # -- membership ---------------------------------------------------------------------------
    def used(self) -> int:
        """Bytes of the blocks resident, being parked (still there) or being swapped in (a swap
        parks its victims before it restores: the budget holds throughout)."""
        return sum(e.nbytes for e in self.entries.values() if e.state is not Residency.PARKED)

    def add(self, entry: Entry, timeout: float = 10.0) -> None:
        """Place a block that has just loaded (its weights are on the device): it stays resident
        where it fits; a pinned block makes room (waiting up to ``timeout`` for blocks with a
        request in flight); any other block that does not fit is parked at once."""
        deadline = time.monotonic() + timeout
        with self.cond:
            entry.last_used = time.monotonic()
            entry.state = Residency.MOVING  # counted from now on, but not a candidate
            self.entries[entry.name] = entry
            while True:
                while self.swapping:
                    self.cond.wait(0.1)
                room = self.budget - (self.used() - entry.nbytes)
                if entry.nbytes <= room:
                    victims = []
                elif entry.pinned:
                    victims = self.policy.victims(self._candidates(entry), entry.nbytes - room)
                else:
                    victims = None
                if victims is not None or not entry.pinned or time.monotonic() >= deadline:
                    break
                self.cond.wait(0.1)
            for v in victims or []:
                v.state = Residency.MOVING
            self.swapping = True
        parked = []
        try:
            for v in ([entry] if victims is None else victims):
                self._park(v)
                parked.append(v)
        finally:
            with self.cond:
                for v in victims or []:
                    v.state = Residency.PARKED if v in parked else Residency.RESIDENT
                    v.evictions += v in parked
                entry.state = Residency.PARKED if victims is None else Residency.RESIDENT
                self.swapping = False
                self.cond.notify_all()
        if victims is None and entry.pinned:
            log.warning("cache: pinned block %s found no room within %.0fs (blocks with requests in flight hold "
                        "it): parked until its first request", entry.name, timeout)
        log.info("cache: block %s (%.1f MB%s) is %s; %.1f of %.1f MB resident", entry.name, entry.nbytes / 2**20,
                 ", pinned" if entry.pinned else "", entry.state.value, self.used() / 2**20, self.budget / 2**20)

    def remove(self, name: str) -> None:
        with self.cond:
            entry = self.entries.pop(name, None)
            self.cond.notify_all()
        if entry is not None and entry.weights is not None:
            entry.weights.remove()

    def set_tasks(self, name: str, tasks: int) -> None:
        with self.cond:
            e = self.entries.get(name)
            if e is not None:
                e.tasks = int(tasks)

    # -- the request path ---------------------------------------------------------------------
    def acquire(self, name: str, timeout: float, beat=None) -> float:
        """Hold block ``name`` resident for one request (or batch): returns the milliseconds of
        the swap it paid (0.0 for a hit). ``beat()`` is called while it waits (the block's
        liveness). Raises CacheWaitTimeout after ``timeout`` seconds without room."""
        e = self.entries[name]
        with self.cond:
            if e.state is Residency.RESIDENT:  # a hit: the common case, one lock round
                e.in_flight += 1
                e.hits += 1
                e.last_used = time.monotonic()
                return 0.0
            deadline = time.monotonic() + timeout
            while True:
                if e.state is Residency.RESIDENT:  # another thread swapped it in meanwhile (cannot happen
                    e.in_flight += 1             # for a block's own thread, kept for safety)
                    e.hits += 1
                    e.last_used = time.monotonic()
                    return 0.0
                if not self.swapping and e.state is Residency.PARKED:
                    victims = self.policy.victims(self._candidates(e), e.nbytes - (self.budget - self.used()))
                    if victims is not None:
                        break
                left = deadline - time.monotonic()
                if left <= 0:
                    busy = sorted(x.name for x in self.entries.values() if x.in_flight)
                    raise CacheWaitTimeout(
                        f"block {name} waited {timeout:.1f}s for {e.nbytes / 2**20:.1f} MB of its shared process's "
                        f"memory budget ({self.budget / 2**20:.1f} MB): blocks with requests in flight hold it "
                        f"({', '.join(busy) or 'none'}); raise memory_budget_mb or send fewer requests at once")
                self.cond.wait(min(left, 0.1))
                if beat is not None:
                    beat()
            self.swapping = True  # e stays PARKED (uncounted) until the victims' memory is free
            for v in victims:
                v.state = Residency.MOVING
        t0 = time.perf_counter()
        parked = []
        try:
            with self.device_lock:
                for v in victims:
                    self._park(v)
                    parked.append(v)
                with self.cond:
                    for v in victims:
                        v.state = Residency.PARKED
                        v.evictions += 1
                    e.state = Residency.MOVING
                self._restore(e)
        except BaseException:
            with self.cond:
                for v in victims:
                    if v.state is Residency.MOVING:
                        v.state = Residency.PARKED if v in parked else Residency.RESIDENT
                e.state = Residency.PARKED
                self.swapping = False
                self.cond.notify_all()
            raise
        ms = (time.perf_counter() - t0) * 1e3
        with self.cond:
            e.state = Residency.RESIDENT
            e.in_flight += 1
            e.misses += 1
            e.last_used = time.monotonic()
            e.observe_swap(ms)
            self.swapping = False
            self.cond.notify_all()
        log.debug("cache: %s swapped in (%.2f ms), parked %s", name, ms, [v.name for v in victims])
        return ms

    def release(self, name: str) -> None:
        """The request (or batch) that ``acquire`` held the block for is done with its weights."""
        with self.cond:
            e = self.entries[name]
            e.in_flight -= 1
            e.last_used = time.monotonic()
            if e.in_flight == 0:
                self.cond.notify_all()

    # -- internals ----------------------------------------------------------------------------
    def _candidates(self, wanted: Entry) -> list[Entry]:
        return [x for x in self.entries.values() if x is not wanted and x.state is Residency.RESIDENT
                and not x.pinned and x.in_flight == 0]

    @staticmethod
    def _park(e: Entry) -> None:
        if e.weights is not None:
            e.weights.park()
        if e.on_park is not None:
            e.on_park()

    @staticmethod
    def _restore(e: Entry) -> None:
        if e.weights is not None:
            e.weights.restore()
        if e.on_restore is not None:
            e.on_restore()

    def stats(self) -> dict:
        with self.cond:
            return {"budget_bytes": self.budget, "resident_bytes": self.used(), "policy": self.policy.name,
                    "blocks": {n: e.stats() for n, e in self.entries.items()}}
