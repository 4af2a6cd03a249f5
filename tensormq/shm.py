"""Shared-memory slots: TensorMQ's zero-copy path between processes on one host, CPU side.

Note [TensorMQ slot ownership]
------------------------------
Every producer (a block or the dispatcher) owns a *pool* of slots per outgoing edge. A slot
is one file in the instance's private shared-memory directory (``0700``, under /dev/shm)::

    +---------+----------+------------+----------+--------+-- padding --+------------------+
    | magic   | capacity | generation | released | kind   |             | data (capacity)  |
    | u64     | u64      | u64        | u64      | u64    |             |                  |
    +---------+----------+------------+----------+--------+-------------+------------------+
    0         8          16           24         32       40            64

    kind       0: the data area holds the tensor (host memory, handles with loc "shm");
               1: the tensor lives on a GPU and the data area holds the producer's CUDA IPC
               share record (handles with loc "cuda", see Note [CUDA IPC slots]). A mapper
               refuses a handle whose loc does not match the slot's kind.

    FREE       released == generation
    IN_FLIGHT  released <  generation: the producer acquired it (generation += 1) and the
               holder of that generation has not released it yet (released = generation)

- Every header word has one writer, and every write is one aligned 8-byte store (an item
  of a ``memoryview`` cast to native ``Q``, which CPython stores with one 8-byte copy; never
  ``struct.pack_into``): ``generation`` is the producer's, ``released`` is the consumer's. A release therefore cannot undo a later acquire. (It could when both wrote
  one ``state`` word: a consumer that read IN_FLIGHT, was preempted inside its write --
  ``pack_into`` zeroes the field and then stores it, two stores -- and finished after the
  producer had reused the slot freed a message still in flight: the rare "generation N is
  stale" errors the soak saw.)
- Only the producer creates, grows (a new file, new name) and unlinks slot files; it unlinks
  them all in ``SlotPool.close()``. Consumers only map them (``SlotMapper``).
- The handle (segment name, generation, offset, nbytes) travels in the message header. The
  obligation to release travels with it: the consumer releases after its model has run. A
  block whose output is a view of its input (identity, reshape) forwards the same handle
  and hands the obligation on; nothing is copied.
- A release only succeeds when the generation in the slot still matches the handle, so a
  stale or forged handle can neither free a slot that was reused nor read its new data.
- A producer may lend FREE slots to PyTorch's allocator for its model's output (Note [Outputs
  made in a slot] in outalloc.py): a slot whose memory a tensor still holds is never filled,
  lent or unmapped; it is retired from its edge and its mapping kept until the process ends.
- Back-pressure: at most ``window`` slots per edge are in flight; ``acquire`` waits for a
  free one and raises ``TimeoutError`` after its deadline.
- An edge's whole window is created on its first use, sized for that tensor (rounded up to
  a power of two), where it fits in ``BLOCKFLOW_WINDOW_UPFRONT`` bytes (Note [A window made at
  once, up to a budget]): its memory is committed when the topology starts serving, not at
  some later burst, so shared memory does not creep up over hours (the 10-minute soak saw
  +10% with slots made one at a time) and bursts do not pay for file creation and page
  faults. A larger tensor later replaces free slots one at a time. Cost: ``window`` x slot
  size per edge, e.g. 8 x 4 MiB after ResNet50's block1 at batch 1.
- If the consumer dies, its slots stay IN_FLIGHT. The control plane tells the producer that
  the hop is gone (``reclaim(edge)``): the producer bumps every slot's generation, which
  invalidates any handle still queued towards the dead consumer, and frees the slots.
- If the whole server is killed, the directory is removed by the next ``blockflow serve``
  (see manager/state.py).
- Error paths: a slot acquired by ``put`` whose copy fails is given back at once (no handle
  left the process). A message whose handle was never sent, or a request a block refused,
  releases its slot through the header alone (``release_handle``): neither needs to map the
  data, which for a CUDA slot would mean opening one's own IPC handle (CUDA refuses that).
- A slot's memory is reserved when its file is made (``posix_fallocate``), never on a first
  touch: a shared-memory filesystem that is too small then fails that reservation with
  ``ShmExhausted`` (one request gets a ``no_shared_memory`` error naming the directory, its
  size and the settings to change) instead of killing the process with SIGBUS on a write.
- Slot files are created ``O_EXCL|O_NOFOLLOW`` and opened ``O_NOFOLLOW``, and a mapper maps
  only a regular file of this user: see Note [Nothing planted in /tmp or /dev/shm is
  followed] in manager/state.py.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import re
import stat
import sys
import time
from collections import OrderedDict

import torch

from . import outalloc
# a slot file's size (header + capacity), its name and the filesystem's room: torch-free, for the manager
from .sizing import HEADER, round_capacity, shm_space, slot_name
from .wire import TensorDesc, WireError, dtype_name
from blockflow.core import settings

log = logging.getLogger(__name__)

MAGIC = 0x4C534642  # "BFSL"


class HopGone(ConnectionError):
    """The next hop was removed (or this process is stopping) while we waited to send to it."""

    code = "block_failed"


class ShmExhausted(MemoryError):
    """The shared-memory filesystem cannot hold a new slot: one request fails, the process lives."""

    code = "no_shared_memory"


def _exhausted(directory: str, nbytes: int, exc: OSError) -> ShmExhausted:
    try:
        size, free = shm_space(directory)
        room = f"{size / 2**20:.0f} MiB in all, {free / 2**20:.1f} MiB free"
    except OSError:
        room = "size unknown"
    return ShmExhausted(
        f"shared memory is full: a {nbytes / 2**20:.1f} MiB TensorMQ slot does not fit in {directory} ({room}; "
        f"{exc.strerror}). Give the container a larger /dev/shm (docker --shm-size), point BLOCKFLOW_SHM_DIR "
        "at a larger tmpfs, or lower BLOCKFLOW_WINDOW (serve --window) or the batch size")


FREE, IN_FLIGHT = 0, 1
#: Header words (uint64, little-endian, 8-byte aligned at the start of a page).
W_MAGIC, W_CAPACITY, W_GENERATION, W_RELEASED, W_KIND = 0, 1, 2, 3, 4
#: What a slot's data area holds (header word W_KIND); the handle's ``loc`` must match.
KIND_HOST, KIND_CUDA = 0, 1
KIND_OF_LOC = {"shm": KIND_HOST, "cuda": KIND_CUDA}
_SEG_RE = re.compile(r"^[A-Za-z0-9_.-]{1,120}$")
#: What a slot or segment name may be; public because cuda_ipc.py checks its names with it too.
SEG_RE = _SEG_RE

#: Mappings of closed slots that a model-made storage still held (Note [Outputs made in a slot]).
_KEPT_MAPPINGS: list = []

#: Slots a producer keeps in flight per edge before it waits (back-pressure).
DEFAULT_WINDOW = settings.WINDOW
#: Mappings a consumer keeps open; older ones are closed (slots that grew get new names).
MAX_MAPPINGS = 256


if sys.byteorder != "little":  # the header words are little-endian u64 on every host that shares them
    raise ImportError("TensorMQ's shared-memory slots need a little-endian host")


def _header(mm: mmap.mmap) -> memoryview:
    """The slot's header words; reads and writes of one element are single aligned accesses.
    A memoryview, not a numpy array: reading a word gives a Python int at once (a numpy
    scalar and its int() cost ten times more, and the slot's words are read on every hop)."""
    return memoryview(mm)[:HEADER].cast("Q")


def _map_file(path: str, size: int | None, create: bool) -> mmap.mmap:
    """Map a slot file; ``create``: make it (never through a link) and reserve its memory.
    ``size`` None: map the whole existing file."""
    flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise WireError(f"{os.path.basename(path)} is not a slot file of this user")
        if create:
            try:
                # blocks are reserved now: a full filesystem is an error here, not a SIGBUS later
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                    raise
                os.close(fd)
                fd = -1
                os.unlink(path)
                raise _exhausted(os.path.dirname(path), size, exc) from None
        else:
            size = st.st_size if size is None else size
            if size < HEADER:
                raise WireError(f"{os.path.basename(path)} is not a TensorMQ slot")
        return mmap.mmap(fd, size)
    finally:
        if fd >= 0:
            os.close(fd)


class Slot:
    """One producer-owned slot: a mapped file and a uint8 tensor over its data area."""

    #: the ``loc`` of the handles this kind of slot travels as
    loc = "shm"
    kind = KIND_HOST

    def __init__(self, directory: str, name: str, capacity: int):
        self.name = name
        self.path = os.path.join(directory, name)
        self.capacity = capacity
        self.mm = _map_file(self.path, HEADER + capacity, create=True)
        self.hdr = _header(self.mm)
        self.hdr[W_CAPACITY] = capacity  # the file is zero-filled: generation == released == 0, FREE
        self.hdr[W_KIND] = self.kind
        self.hdr[W_MAGIC] = MAGIC  # last: a mapper accepts the slot only once it is complete
        if capacity:
            self.data = torch.frombuffer(self.mm, dtype=torch.uint8, offset=HEADER, count=capacity)
            self.data.zero_()  # fault the pages in now, not on the first send
        else:  # a header-only slot (CUDA slots keep their data on the GPU)
            self.data = torch.empty(0, dtype=torch.uint8)
        #: the data area's address, for ``SlotPool.put``'s copy (Note [One copy, no views])
        self.ptr = self.data.data_ptr()
        self.generation = 0
        #: armed for an output at least once (Note [Outputs made in a slot]): the extension
        #: knows this slot's data area and may have given it to a storage
        self.lent = False

    @property
    def state(self) -> int:
        return FREE if int(self.hdr[W_RELEASED]) == self.generation else IN_FLIGHT

    def mark_in_flight(self) -> int:
        self.generation += 1
        self.hdr[W_GENERATION] = self.generation
        return self.generation

    def give_back(self, gen: int) -> bool:
        """Free generation ``gen`` of this slot, acquired here and never handed to anyone (the
        copy into it failed, or the message naming it could not be sent). True if it was."""
        if self.hdr is None or gen != self.generation or int(self.hdr[W_RELEASED]) == gen:
            return False
        self.hdr[W_RELEASED] = gen
        return True

    def fill(self, tensor: torch.Tensor, nbytes: int) -> torch.Tensor:
        """Copy ``tensor`` into the data area; returns the view that the handle describes."""
        dst = self.data[:nbytes].view(tensor.dtype).view(tensor.shape)
        dst.copy_(tensor)  # a CUDA tensor is copied to the host here (GPU -> CPU hop)
        return dst

    def force_free(self) -> None:
        """Invalidate every outstanding handle (new generation) and free the slot. Only for a
        slot that is then closed: a late release by the old holder may still store its
        (older) generation into ``released``."""
        self.generation += 1
        self.hdr[W_GENERATION] = self.generation
        self.hdr[W_RELEASED] = self.generation

    def held(self) -> bool:
        """Whether a storage made by the model still holds this slot's data area."""
        lender = outalloc.active() if self.lent else None
        return lender is not None and self.data is not None and lender.held(self.data.data_ptr())

    def close(self) -> None:
        if self.lent and self.data is not None:
            lender = outalloc.active()
            if lender is not None and not lender.forget(self.data.data_ptr()):
                # a tensor still lives in this memory: unmapping it would leave that tensor
                # pointing at nothing, so the mapping stays until the process ends
                _KEPT_MAPPINGS.append((self.mm, self.data))
                self.data = self.hdr = None
                self._unlink()
                return
        self.data = None
        self.hdr = None
        try:
            self.mm.close()
        except BufferError:  # a tensor still views it; the mapping goes when that tensor does
            pass
        self._unlink()

    def _unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class SlotPool:
    """The producer side: a window of slots per outgoing edge (keyed by the hop's address)."""

    def __init__(self, directory: str, owner: str, window: int = DEFAULT_WINDOW):
        if not _SEG_RE.fullmatch(owner):
            raise ValueError(f"pool owner {owner!r} must match {_SEG_RE.pattern}")
        self.directory = directory
        self.owner = owner
        self.window = window
        self.edges: dict[str, list[Slot]] = {}
        #: slots taken off their edge because a storage kept their memory (closed with the pool)
        self.retired: list[Slot] = []
        self._seq = 0
        #: before the sequence number in a slot's name: one process may own several pools (a
        #: transport has one for host memory and one per GPU), whose names must never meet
        self.seq_prefix = ""
        self._closed = False

    def _new_slot(self, capacity: int) -> Slot:
        self._seq += 1
        try:
            return self._make_slot(slot_name(self.owner, os.getpid(), f"{self.seq_prefix}{self._seq}"), capacity)
        except ShmExhausted as exc:
            raise ShmExhausted(f"{self.owner}: {exc}; each edge keeps a window of {self.window} slots") from None

    def _make_slot(self, name: str, capacity: int) -> Slot:
        """The kind of memory this pool hands out; tensormq.cuda_ipc.CudaSlotPool overrides it."""
        return Slot(self.directory, name, capacity)

    def _try_acquire(self, edge: str, nbytes: int) -> Slot | None:
        slots = self.edges.get(edge)
        if slots is None:
            slots = self.edges[edge] = []
        if outalloc.holding():
            self._retire_held(slots)
        small = None
        for s in slots:  # the first free slot that is large enough: in a steady chain, the first one
            if s.state == FREE:
                if s.capacity >= nbytes:
                    return s
                if small is None:
                    small = s
        if len(slots) < self.window:  # the edge's first use, or a window not made whole yet
            cap = round_capacity(nbytes)
            fresh = []
            try:
                for _ in range(self.slots_to_make(slots, cap)):
                    fresh.append(self._new_slot(cap))
            except ShmExhausted:
                if not fresh:
                    raise
                log.warning("%s: shared memory holds only %d of %d slots of %d KiB towards %s", self.owner,
                            len(fresh), self.window - len(slots), cap >> 10, edge)
            slots.extend(fresh)
            return fresh[0]
        if small is not None:  # every free slot is too small: grow one
            return self._grow(slots, small, nbytes)
        return None

    # Note [A window made at once, up to a budget]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # Making an edge's whole window at its first use commits its memory once (see the module
    # docstring), which for the tensors most edges carry is a few MB. For a large one it is a
    # lot, and it is slow: ResNet50's block1 output at batch 32 (103 MB, slots of 128 MiB) made
    # a window of 1 GiB per edge, every page reserved and faulted in, in the thread that needs
    # the slot. A dispatcher lending a client slots for it and making its own towards the first
    # block, beside four blocks doing the same on two cores, went more than 3 s without
    # answering the controller's ping and was killed as hung, three times in 24 requests, each
    # time with a request lost. So the first use makes as much of the window as fits in
    # WINDOW_UPFRONT_BYTES (256 MiB: the whole window of 8 for tensors up to 32 MiB), at least
    # one slot; later acquires that find every slot in flight make one more each, up to the
    # window. Back-pressure is unchanged (never more than ``window`` slots in flight), and an
    # edge's shared memory still never exceeds its window: it only reaches it later, and only
    # where traffic needs it.
    def slots_to_make(self, slots: list[Slot], cap: int) -> int:
        """How many new slots of ``cap`` bytes an edge with ``slots`` makes now (Note [A window
        made at once, up to a budget]): the rest of its window where that fits in
        ``settings.WINDOW_UPFRONT_BYTES`` with the slots it has, else one."""
        room = settings.WINDOW_UPFRONT_BYTES - sum(s.capacity for s in slots)
        return max(1, min(self.window - len(slots), room // cap if cap else self.window))

    def _grow(self, slots: list[Slot], small: Slot, nbytes: int) -> Slot:
        """Replace the free slot ``small`` of an edge's ``slots`` by one that holds ``nbytes``:
        a new file under a new name, so handles of the old one stay invalid. The old one is
        closed first, since its memory may be what the new one needs; ShmExhausted leaves the
        edge one slot short (the window refills on a later acquire)."""
        slots.remove(small)
        small.close()
        slot = self._new_slot(round_capacity(nbytes))
        slots.append(slot)
        return slot

    def _retire_held(self, slots: list[Slot]) -> None:
        """Retire the free slots whose memory a storage still holds: the model kept its output
        or an intermediate made in the slot, and writing there would change that tensor."""
        for s in list(slots):
            if s.lent and s.state == FREE and s.held():
                slots.remove(s)
                self.retired.append(s)
                log.warning("%s: slot %s is still held by a tensor the model kept; it is retired from its edge "
                            "(see Note [Outputs made in a slot]; BLOCKFLOW_OUTPUT_IN_SLOT=0 turns lending off)",
                            self.owner, s.name)

    def lend(self, edge: str, nbytes: int, count: int = 1) -> list[Slot]:
        """Up to ``count`` free slots of ``edge`` for the model to make an ``nbytes`` output in,
        not in flight yet (none when every slot is in flight: the output is copied later, after
        a wait). Several when a model makes tensors of its output's size one after the other and
        the output is not the first: with ResNet's blocks three are alive at once (the identity
        branch, the last convolution's output and its batch norm's), and the output comes last."""
        if self._closed or not nbytes:
            return []
        first = self._try_acquire(edge, nbytes)
        if first is None:
            return []
        first.lent = True
        lent = [first]
        if count > 1:
            slots, holding = self.edges[edge], outalloc.holding()
            free = [s for s in slots if s is not first and s.state == FREE and not (holding and s.held())]
            # slots already large enough first: after a new, larger size only the missing ones
            # grow (a new file each, whose pages the model then faults in), not every slot in turn
            free.sort(key=lambda s: s.capacity < nbytes)
            for s in free[:count - 1]:
                if s.capacity < nbytes:  # a larger tensor than before: grow this one too
                    try:
                        s = self._grow(slots, s, nbytes)
                    except ShmExhausted:
                        break  # the send after the model reports it if even one slot is missing
                s.lent = True
                lent.append(s)
            # a window not made whole yet (Note [A window made at once, up to a budget]): the
            # model needs this many slots to make its output in one, so this edge's traffic does
            while len(lent) < count and len(slots) < self.window:
                try:
                    s = self._new_slot(round_capacity(nbytes))
                except ShmExhausted:
                    break
                slots.append(s)
                s.lent = True
                lent.append(s)
        return lent

    def prepare(self, edge: str, nbytes: int) -> int:
        """Make ``edge``'s window of slots for ``nbytes`` tensors now, before its first message
        (Note [Ready to serve] in blocks/process.py); returns how many slots the edge has."""
        if self._closed or nbytes <= 0:
            return 0
        self._try_acquire(edge, nbytes)  # nothing goes in flight: the slot it finds stays free
        return len(self.edges.get(edge, ()))

    @staticmethod
    def holder(lent: list[Slot], tensor: torch.Tensor) -> int:
        """The index of the lent slot ``tensor`` lives in, -1 if none. Memory inside a slot is
        reachable only through the storage the allocator made there (the pool's own view of it
        never leaves this module), so an address inside one is a tensor made there."""
        ptr = tensor.data_ptr()
        for i, slot in enumerate(lent):
            data = slot.data
            if data is not None:
                base = data.data_ptr()
                if base <= ptr < base + slot.capacity:
                    return i
        return -1

    def adopt(self, slot: Slot, tensor: torch.Tensor) -> TensorDesc | None:
        """The handle of ``tensor``, which the model made in the lent ``slot`` (``holder``): the
        slot goes in flight and nothing is copied. None if the slot is not free after all."""
        data = slot.data
        if data is None or slot.state != FREE:
            return None
        off = tensor.data_ptr() - data.data_ptr()
        desc = TensorDesc.of(tensor, slot.loc, seg=slot.name, off=off)
        span = desc.span_bytes()
        if not 0 <= off <= off + span <= slot.capacity:
            return None
        desc.fields["gen"], desc.fields["nbytes"] = slot.mark_in_flight(), span
        return desc

    def acquire(self, edge: str, nbytes: int, timeout: float, give_up=None) -> Slot:
        """A free slot of at least ``nbytes`` on ``edge``; waits while the window is full.

        ``give_up()`` is asked while waiting: True (the hop was removed, we are stopping) ends
        the wait at once with HopGone, since a dead consumer never frees its slots."""
        if self._closed:
            raise RuntimeError(f"slot pool of {self.owner} is closed")
        deadline = time.monotonic() + timeout
        pause = 20e-6
        while True:
            slot = self._try_acquire(edge, nbytes)
            if slot is not None:
                slot.mark_in_flight()
                return slot
            if give_up is not None and give_up():
                raise HopGone(f"{self.owner}: the next hop {edge} was removed while its slots were full")
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{self.owner}: all {self.window} slots towards {edge} are still in flight after "
                    f"{timeout:.1f}s; the next block is not keeping up or is gone")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    # Note [One copy, no views]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A contiguous host tensor goes into a host slot with one memmove, and its handle is built
    # from the tensor itself (its dtype, shape and strides are the bytes' as they now lie in the
    # slot), not from a typed view of the slot. Measured on the 2-core VM with a BERT block's
    # output (a [1, 128, 256] float32 and a [1, 1, 128, 128] bool): warm, the three views and
    # copy_ that Slot.fill makes cost ~33 us against ~6 us for the memmove; in a process that slept
    # while a model ran (every block, every request), 195 us against 58 us, and encode_value of
    # the pair 318 us against 86 us. Each torch call is paid afresh when the process's caches
    # went cold; a Python-level memmove is not a torch call. Other tensors (not contiguous, on a
    # GPU) and CUDA slots still go through ``Slot.fill``.
    def put(self, edge: str, tensor: torch.Tensor, timeout: float, give_up=None) -> TensorDesc:
        """Copy ``tensor`` into a slot on ``edge`` and return the handle that travels."""
        dtype_name(tensor.dtype)  # refuse what cannot travel before a slot is taken
        nbytes = tensor.nbytes
        slot = self.acquire(edge, nbytes, timeout, give_up)
        gen = slot.generation
        if slot.kind == KIND_HOST and tensor.is_cpu and tensor.is_contiguous():
            # Note [One copy, no views]: the bytes as they lie, described by the tensor itself
            ctypes.memmove(slot.ptr, tensor.data_ptr(), nbytes)
            return TensorDesc.of(tensor, slot.loc, seg=slot.name, gen=gen, off=0, nbytes=nbytes)
        try:
            dst = slot.fill(tensor, nbytes)
            return TensorDesc.of(dst, slot.loc, seg=slot.name, gen=gen, off=0, nbytes=nbytes)
        except BaseException:
            slot.give_back(gen)  # no handle left this process: the slot is ours to free
            raise

    def slot_named(self, seg: str) -> Slot | None:
        """The slot of this pool called ``seg`` (None: not one of ours, or closed)."""
        for slots in self.edges.values():
            for s in slots:
                if s.name == seg:
                    return s
        return None

    def in_flight(self, edge: str | None = None) -> int:
        edges = [edge] if edge else list(self.edges)
        return sum(1 for e in edges for s in self.edges.get(e, []) if s.state == IN_FLIGHT)

    def reclaim(self, edge: str) -> int:
        """The consumer on ``edge`` is gone: invalidate its handles and free its slots."""
        slots = self.edges.pop(edge, [])
        for s in slots:
            s.force_free()
            s.close()
        if slots:
            log.info("%s: reclaimed %d slots towards %s", self.owner, len(slots), edge)
        return len(slots)

    def close(self) -> None:
        self._closed = True
        for edge in list(self.edges):
            for s in self.edges.pop(edge):
                s.close()
        while self.retired:
            self.retired.pop().close()


class Mapped:
    """One slot mapped by a consumer, with the views every handle of it reuses: its header
    words and its data area (as uint8 and per dtype). Made once per slot, not per message.
    ``drop()`` lets go of the views before it closes the mapping (a view would keep it open)."""

    __slots__ = ("mm", "hdr", "data", "cap", "base", "typed")

    def __init__(self, mm: mmap.mmap, data: torch.Tensor):
        self.mm = mm
        self.hdr = _header(mm)
        self.data = data  # uint8 over the data area
        self.cap = data.numel()  # its bytes
        self.base = data.data_ptr()  # its address, asked of torch once (Note [One copy, no views])
        self.typed: dict[torch.dtype, torch.Tensor] = {}

    def as_dtype(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The data area viewed as ``dtype`` (None when its size is not a multiple of the item)."""
        typed = self.typed.get(dtype)
        if typed is None:
            if self.cap % dtype.itemsize:
                return None
            typed = self.typed[dtype] = self.data.view(dtype)
        return typed

    def drop(self) -> None:
        self.data = self.hdr = None
        self.typed = {}
        try:
            self.mm.close()
        except BufferError:  # a tensor still views it; the mapping goes when that tensor does,
            self.hdr = _header(self.mm)  # and until then that tensor's lease still releases through it


class SlotMapper:
    """The consumer side: opens slots named in handles (cached) and rebuilds tensors in place."""

    def __init__(self, directory: str, max_mappings: int = MAX_MAPPINGS):
        self.directory = directory
        self.max_mappings = max_mappings
        self.maps: OrderedDict[str, Mapped] = OrderedDict()

    def _open(self, seg: str) -> Mapped:
        m = self.maps.get(seg)
        if m is not None:
            self.maps.move_to_end(seg)
            return m
        path = os.path.join(self.directory, seg)
        try:
            mm = _map_file(path, None, create=False)
        except WireError as exc:
            raise WireError(f"x.seg {seg}: {exc}") from None
        except OSError as exc:
            raise WireError(f"x.seg {seg} cannot be opened ({exc.strerror}); stale or forged handle") from None
        size = len(mm)
        hdr = _header(mm)
        magic, cap = int(hdr[W_MAGIC]), int(hdr[W_CAPACITY])
        del hdr
        if magic != MAGIC or cap + HEADER > size:
            mm.close()
            raise WireError(f"x.seg {seg} is not a TensorMQ slot")
        data = (torch.frombuffer(mm, dtype=torch.uint8, offset=HEADER, count=cap) if cap
                else torch.empty(0, dtype=torch.uint8))
        m = Mapped(mm, data)
        self.maps[seg] = m
        while len(self.maps) > self.max_mappings:
            _, old = self.maps.popitem(last=False)
            old.drop()
        return m

    def map(self, seg) -> Mapped:
        """The slot ``seg`` of the directory, mapped (cached): for a process that fills slots
        it was lent (Note [Lent slots] in dispatcher/lending.py). WireError for a name that
        is not a slot's or a file that is not a slot."""
        if not isinstance(seg, str) or not _SEG_RE.fullmatch(seg):
            raise WireError(f"{str(seg)!r:.60} is not a slot name")
        return self._open(seg)

    def forget_unlinked(self) -> int:
        """Close the mappings of slot files that no longer exist: their producer exited (a
        retired or dead block's slots are unlinked) or grew the slot under a new name. Kept,
        each would pin the pages this consumer read until the LRU evicted it (256 mappings:
        hundreds of MB of a retired producer's memory after enough updates). A mapping a tensor
        still views closes when that tensor goes (``Mapped.drop``). Returns how many went."""
        gone = [seg for seg in self.maps if not os.path.exists(os.path.join(self.directory, seg))]
        for seg in gone:
            self.maps.pop(seg).drop()
        return len(gone)

    def release(self, seg, gen) -> bool:
        """Release generation ``gen`` of slot ``seg`` through its header alone (the data is
        never mapped as a tensor, whatever its kind). True if the slot was freed."""
        if not isinstance(seg, str) or not _SEG_RE.fullmatch(seg):
            raise WireError("x.seg must be a slot name")
        if not isinstance(gen, int) or isinstance(gen, bool) or gen < 0:
            raise WireError("x.gen must be a non-negative integer")
        m = self._open(seg)
        hdr = m.hdr
        freed = int(hdr[W_GENERATION]) == gen and int(hdr[W_RELEASED]) != gen
        if freed:
            release_slot(m, gen)
        return freed

    @staticmethod
    def check_kind(m: Mapped, seg: str, loc: str) -> None:
        """Refuse a handle whose loc does not match what the slot's data area holds."""
        kind = int(m.hdr[W_KIND])
        if kind != KIND_OF_LOC.get(loc):
            raise WireError(f"x.seg {seg} is not a {loc} slot; handle refused")

    @staticmethod
    def check_in_flight(m: Mapped, seg: str, gen: int) -> None:
        """Refuse a handle whose generation is not the one the slot is in flight with."""
        hdr = m.hdr
        cur_gen, released = int(hdr[W_GENERATION]), int(hdr[W_RELEASED])
        if cur_gen != gen or released == cur_gen:
            state = "free" if released == cur_gen else "in flight"
            raise WireError(f"x.seg {seg} generation {gen} is stale (slot is at {cur_gen}, {state}); handle refused")

    def open(self, desc: TensorDesc) -> tuple[torch.Tensor, "ShmLease"]:
        """The tensor the handle names, viewed in place, and the lease to release it with."""
        m, off, lease = self.locate(desc)
        return self.view(m, off, desc, lease.seg), lease

    @staticmethod
    def view(m: Mapped, off: int, desc: TensorDesc, seg: str) -> torch.Tensor:
        """The tensor ``desc`` describes at byte ``off`` of a located slot (``locate``), in place."""
        typed = m.as_dtype(desc.dtype)
        if typed is None:
            raise WireError(f"slot {seg} is not aligned for {dtype_name(desc.dtype)}")
        return torch.as_strided(typed, desc.shape, desc.stride, off // desc.dtype.itemsize)

    def locate(self, desc: TensorDesc) -> tuple[Mapped, int, "ShmLease"]:
        """Where the handle's tensor lies, checked as ``open`` checks it: (the mapped slot, the
        byte offset in its data area, the lease), for a reader that copies the bytes out
        without a tensor over them (Note [One copy, no views])."""
        f = desc.fields
        seg = f.get("seg")
        m = self.maps.get(seg) if type(seg) is str else None  # a mapped slot's name was checked once
        if m is not None:
            self.maps.move_to_end(seg)
        else:
            if not isinstance(seg, str) or not _SEG_RE.fullmatch(seg):
                raise WireError("x.seg must be a slot name")
            m = self._open(seg)
        gen = f.get("gen")
        off = f.get("off")
        nbytes = f.get("nbytes")
        if type(gen) is not int or type(off) is not int or type(nbytes) is not int or min(gen, off, nbytes) < 0:
            for key, val in (("gen", gen), ("off", off), ("nbytes", nbytes)):
                if type(val) is not int or val < 0:
                    raise WireError(f"x.{key} must be a non-negative integer")
        hdr = m.hdr  # the checks of check_kind() and check_in_flight(), inline: once per hop
        if hdr[W_KIND] != KIND_HOST:
            self.check_kind(m, seg, "shm")
        if hdr[W_GENERATION] != gen or hdr[W_RELEASED] == gen:
            self.check_in_flight(m, seg, gen)
        span = desc._span
        itemsize = desc.dtype.itemsize
        if off % itemsize or off + max(nbytes, span) > m.cap or span > nbytes:
            raise WireError(f"x.off/x.nbytes/x.shape describe memory outside slot {seg}")
        return m, off, ShmLease(m, seg, gen, f)

    def close(self) -> None:
        for m in self.maps.values():
            m.drop()
        self.maps.clear()


class ShmLease:
    """The right (and duty) to release one in-flight slot."""

    __slots__ = ("mapped", "seg", "gen", "fields", "released")

    def __init__(self, mapped: Mapped, seg: str, gen: int, fields: dict):
        self.mapped, self.seg, self.gen, self.fields = mapped, seg, gen, fields
        self.released = False

    def contains(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives inside this slot (so it can be forwarded without a copy).
        Two torch calls for the usual answer: each costs tens of microseconds in a process
        whose caches a model's run has just emptied (Note [One copy, no views])."""
        m = self.mapped
        if m.data is None or not tensor.is_cpu:
            return False
        base, ptr = m.base, tensor.data_ptr()
        if not base <= ptr < base + m.cap:
            return False  # the usual answer (a new output tensor), found without a descriptor
        span = TensorDesc.of(tensor, "shm").span_bytes()
        return ptr + span <= base + m.cap

    def forward_desc(self, tensor: torch.Tensor) -> TensorDesc:
        """Handle for a view of this slot; the release duty moves to whoever receives it."""
        desc = TensorDesc.of(tensor, "shm", seg=self.seg, gen=self.gen, off=tensor.data_ptr() - self.mapped.base)
        desc.fields["nbytes"] = desc.span_bytes()
        self.released = True  # no longer ours to release
        return desc

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        release_slot(self.mapped, self.gen)


def release_slot(mapped: Mapped, gen: int) -> None:
    """Store ``gen`` as released, unless the producer has moved the slot on (reclaimed it).

    One aligned store into a word only consumers write: the producer cannot reuse the slot
    until it sees this exact generation, so no interleaving makes it free a later one."""
    hdr = mapped.hdr
    if hdr is None:  # mapping closed under us (evicted, or the block is stopping)
        return
    if int(hdr[W_GENERATION]) == gen:
        hdr[W_RELEASED] = gen
