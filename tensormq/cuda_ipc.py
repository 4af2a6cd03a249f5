"""CUDA IPC slots: TensorMQ's zero-copy path between processes on one GPU host.

Note [CUDA IPC slots]
---------------------
Opening a CUDA IPC handle costs milliseconds and PyTorch synchronises every send once more
than 1000 shares are outstanding, so TensorMQ never shares a tensor per message. Instead each
producer registers a window of GPU buffers per edge *once* (``_share_cuda_``) and each
consumer opens each buffer *once* (``_new_shared_cuda``, cached); a message then carries only
the slot's name, generation, offset and the tensor's dtype/shape/stride, exactly as a
shared-memory handle does.

One pool, two kinds of memory. A CUDA slot is a ``tensormq.shm.Slot`` of kind ``cuda``: its
file in the instance's shared-memory directory holds the usual header (state, generation:
Note [TensorMQ slot ownership] applies unchanged) and, in its data area, the producer's
*share record* instead of the tensor::

    header (64 B, kind = 1) | share record (RECORD_BYTES)
    record words (u64):  version | device | size | storage offset | ref-counter offset |
                         handle length | ref-counter name length | event handle length
    then the IPC handle (at HANDLE_AT), the ref-counter file name (at RC_AT) and the
    inter-process event's handle (at EVENT_AT; empty when the producer synchronises instead)

``CudaSlotPool`` is ``SlotPool`` (its window on first use up to a budget, back-off wait, growth, reclaim)
with ``CudaSlot`` as its memory. The consumer takes the handle, the storage size and offset
from this record, never from the message, and checks the handle's length and kind and the
ref-counter name before torch sees them: a forged message cannot make torch open arbitrary
memory or decrement a counter in an arbitrary /dev/shm file.

How a tensor crosses each kind of hop (the device map, thesis Algorithm 4, says where the next
hop runs; a hop it does not name -- the dispatcher's return address -- is a CPU hop):

=========  =========  ==================================================================
tensor     next hop   what travels
=========  =========  ==================================================================
CPU        CPU        shared-memory slot (tensormq/shm.py)
CPU        GPU        shared-memory slot; the consumer moves it to its device (it would
                      copy host->device anyway, and the producer needs no CUDA context)
GPU        CPU        shared-memory slot filled by a device->host copy in the producer
                      (the consumer, e.g. the dispatcher, never initialises CUDA)
GPU        GPU        CUDA slot allocated *on the next hop's device* (peer copy when the
                      producer runs on another GPU, thesis Fig. 3.9)
view of    any        the input's handle is forwarded when its memory suits the next hop
input                 (a host slot always does; a CUDA slot only towards its own device)
=========  =========  ==================================================================

Ordering (Note [GPU hand-over order]): by default no host waits on a GPU-to-GPU hop. The
producer queues its copy into the slot on its current stream and records the slot's
inter-process CUDA event after it (``CudaSlot.fill``), then sends the handle at once; the
consumer makes its current stream wait on that event (``CudaMapper.open``) before it queues
anything that reads the slot. The event is created once per slot and its IPC handle travels in
the share record, so the consumer opens it once per slot, never per message. The release stays
a host write into the slot header, but a consumer writes it only after the GPU work that read
the slot has completed (the block process synchronises on its own completion event *after* it
has sent its output on, blocks/runner.py), so the producer never overwrites memory that is
still being read, and a dead consumer's slots are reclaimed as before. With
``BLOCKFLOW_CUDA_HANDOVER=sync`` the producer synchronises its stream before it sends instead
(the record then carries no event): the path of earlier releases, kept to compare against.

PyTorch's reference count. ``_share_cuda_`` puts the buffer behind a counter (set to 1) in a
``/dev/shm/torch_<pid>_<n>`` file; when the producer frees a buffer whose counter is still
above 0, torch keeps the memory in "limbo" until consumers decrement it. BlockFlow's own slot
header already says when a slot's memory may be reused, so the producer is the authority:
``CudaSlot.close()`` gives back the count the share took (``_release_ipc_counter``, as torch's
``rebuild_cuda_tensor`` does for a storage it already holds) before it drops the buffer. The
memory then returns to the producer's caching allocator at once, whether the consumer is
alive, dead (``kill -9``: its decrement never comes) or never opened the slot. A consumer
that still maps a closed slot never reads it again: its handles went stale with the header.

Slots of this process. CUDA refuses to open an IPC handle in the process that exported it
(``cudaIpcOpenMemHandle``: invalid device context), and blocks that share a process
(blocks/host.py) hand over to each other through the same slots as any two blocks. So every
``CudaSlot`` enters its buffer and event in ``LOCAL_SLOTS`` (by slot name; the name carries the
pid) for as long as it is open, and a consumer takes them from there when the slot is its own
process's: same memory, same event, no IPC (and no share record to read: it describes that
very buffer). The slot header is checked exactly as for another process's slot, so a stale
generation or a forged name is refused the same way. The
consumer does not cache a local buffer: once its producer closes the slot, the name is gone
from the table and the memory goes back to this process's allocator at once.

Multi-GPU: handles name devices by index, so every process of an instance must see the same
``CUDA_VISIBLE_DEVICES`` (the manager passes its environment to every block).
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from .shm import HEADER, MAX_MAPPINGS, SEG_RE as _SEG_RE, Mapped, Slot, SlotMapper, SlotPool, release_slot, KIND_CUDA
from .wire import TensorDesc, WireError

log = logging.getLogger(__name__)

#: Bytes of a CUDA slot's share record (the data area of its header file).
RECORD_BYTES = 512
RECORD_VERSION = 2
#: Where the IPC handle, the ref-counter file name and the event handle start inside the record.
HANDLE_AT, RC_AT, EVENT_AT = 64, 256, 384
MAX_HANDLE, MAX_RC = RC_AT - HANDLE_AT, EVENT_AT - RC_AT
#: Bytes of a cudaIpcEventHandle_t, what ``torch.cuda.Event.ipc_handle()`` returns.
CUDA_IPC_EVENT_SIZE = 64
#: slot name -> (buffer, event or None) of the CUDA slots this process holds open ("Slots of
#: this process" above). Written by ``CudaSlot`` only; a dict's get, set and pop are atomic,
#: which is all the threads of a shared process do with it.
LOCAL_SLOTS: dict[str, tuple[torch.Tensor, "torch.cuda.Event | None"]] = {}


def handover_mode() -> str:
    """How a GPU-to-GPU hop is ordered (Note [GPU hand-over order]): ``event`` (default) or
    ``sync``: ``BLOCKFLOW_CUDA_HANDOVER``, read by blockflow/core/settings.py."""
    from blockflow.core import settings
    return settings.CUDA_HANDOVER
#: A versioned torch handle: version byte, type byte, then cudaIpcMemHandle_t (64 bytes).
CUDA_IPC_HANDLE_SIZE = 64
#: Type byte of a plain cudaMalloc block (c10's SHAREABLE_CUDA_MALLOC). The other type, 'e'
#: (expandable segments), makes the consumer fetch file descriptors from the producer's pid:
#: slots are never allocated that way, and such a handle is refused.
HANDLE_TYPE_CUDA_MALLOC = ord("c")
#: Ref-counter files torch creates (CudaIPCTypes.cpp): "/torch_<pid>_<random>", and since torch
#: 2.11 "/torch_<pid>_<random>_<file number>" (seen on an H200 with torch 2.11.0+cu130).
_RC_RE = re.compile(rb"^/torch_[0-9]{1,10}_[0-9]{1,20}(?:_[0-9]{1,20})?$")
#: Counters per ref-counter file (torch::CUDA_IPC_REF_COUNTER_FILE_SIZE).
RC_FILE_SLOTS = 10000
#: Largest CUDA slot a record may describe (a slot is a power of two above the tensor limit).
MAX_SLOT_BYTES = 1 << 40


@dataclass(frozen=True)
class ShareRecord:
    """What ``_share_cuda_`` returned for a slot's buffer; written once by the producer."""

    dev: int
    handle: bytes
    size: int
    soff: int
    rc: bytes
    rco: int
    event: bytes = b""  #: the slot's inter-process event; empty: the producer synchronises before it sends

    @staticmethod
    def of(buffer: torch.Tensor, event: bytes = b"") -> "ShareRecord":
        # (device, handle, size, offset, ref_counter_handle, ref_counter_offset, event_handle, event_sync)
        shared = buffer.untyped_storage()._share_cuda_()
        return ShareRecord(int(shared[0]), bytes(shared[1]), int(shared[2]), int(shared[3]),
                           bytes(shared[4]), int(shared[5]), bytes(event))

    def pack(self) -> bytes:
        if len(self.handle) > MAX_HANDLE or len(self.rc) > MAX_RC:
            raise ValueError(f"CUDA share record does not fit: handle {len(self.handle)} B, counter name {len(self.rc)} B")
        out = bytearray(RECORD_BYTES)
        if len(self.event) > RECORD_BYTES - EVENT_AT:
            raise ValueError(f"CUDA share record does not fit: event handle {len(self.event)} B")
        out[:64] = np.array([RECORD_VERSION, self.dev, self.size, self.soff, self.rco, len(self.handle), len(self.rc),
                             len(self.event)], dtype="<u8").tobytes()
        out[HANDLE_AT:HANDLE_AT + len(self.handle)] = self.handle
        out[RC_AT:RC_AT + len(self.rc)] = self.rc
        out[EVENT_AT:EVENT_AT + len(self.event)] = self.event
        return bytes(out)

    @staticmethod
    def unpack(raw: bytes, seg: str) -> "ShareRecord":
        """Parse and check a record read from a slot file; WireError names what is wrong."""
        if len(raw) != RECORD_BYTES:
            raise WireError(f"x.seg {seg}: CUDA share record is {len(raw)} bytes, not {RECORD_BYTES}")
        version, dev, size, soff, rco, hlen, rclen, evlen = (int(v) for v in np.frombuffer(raw[:64], dtype="<u8"))
        if version != RECORD_VERSION:
            raise WireError(f"x.seg {seg}: CUDA share record version {version} is not {RECORD_VERSION}")
        if hlen > MAX_HANDLE or rclen > MAX_RC or evlen not in (0, CUDA_IPC_EVENT_SIZE):
            raise WireError(f"x.seg {seg}: CUDA share record lengths are out of range")
        rec = ShareRecord(dev, raw[HANDLE_AT:HANDLE_AT + hlen], size, soff, raw[RC_AT:RC_AT + rclen], rco,
                          raw[EVENT_AT:EVENT_AT + evlen])
        rec.check(seg)
        return rec

    def check(self, seg: str) -> None:
        check_ipc_handle(self.handle, seg)
        check_ref_counter(self.rc, self.rco, seg)
        if not 0 <= self.dev < 64:
            raise WireError(f"x.seg {seg}: CUDA device {self.dev} is out of range")
        if not 0 < self.size <= MAX_SLOT_BYTES or self.size % 8:
            raise WireError(f"x.seg {seg}: CUDA slot size {self.size} is not a valid slot size")
        if not 0 <= self.soff < MAX_SLOT_BYTES:
            raise WireError(f"x.seg {seg}: CUDA storage offset {self.soff} is out of range")


def check_ipc_handle(handle, seg: str = "?") -> bytes:
    """The bytes of a torch CUDA IPC handle of a plain cudaMalloc block, or WireError.

    torch's format (CUDACachingAllocator.cpp): one version byte, one type byte, then the
    64-byte cudaIpcMemHandle_t. A handle of another length or type never reaches torch."""
    if not isinstance(handle, (bytes, bytearray)):
        raise WireError(f"x.seg {seg}: CUDA IPC handle must be bytes, got {type(handle).__name__}")
    if len(handle) != 2 + CUDA_IPC_HANDLE_SIZE:
        raise WireError(f"x.seg {seg}: CUDA IPC handle is {len(handle)} bytes, not {2 + CUDA_IPC_HANDLE_SIZE}")
    if not 1 <= handle[0] <= 32:
        raise WireError(f"x.seg {seg}: CUDA IPC handle version {handle[0]} is not one torch writes")
    if handle[1] != HANDLE_TYPE_CUDA_MALLOC:
        raise WireError(f"x.seg {seg}: CUDA IPC handle type {chr(handle[1])!r} is refused; only plain "
                        f"cudaMalloc blocks ('c') are shared")
    return bytes(handle)


def check_ref_counter(name, offset, seg: str = "?") -> None:
    """torch decrements ``*(int64*)(file + 8*offset)`` in the named /dev/shm file: only a
    torch ref-counter file name and an offset inside it are accepted."""
    if not isinstance(name, (bytes, bytearray)) or not _RC_RE.fullmatch(bytes(name)):
        raise WireError(f"x.seg {seg}: {name!r:.60} is not a torch ref-counter file name")
    if not isinstance(offset, int) or isinstance(offset, bool) or not 0 <= offset < RC_FILE_SLOTS:
        raise WireError(f"x.seg {seg}: ref-counter offset {offset!r} is outside [0, {RC_FILE_SLOTS})")


def release_ipc_counter(rec: ShareRecord) -> None:
    """Give back the count ``_share_cuda_`` took, so that freeing the buffer frees its memory
    instead of parking it in torch's limbo (best effort, like torch: never raises)."""
    try:
        torch.UntypedStorage._release_ipc_counter(rec.rc, rec.rco, device=torch.device("cuda", rec.dev))
    except Exception as exc:  # the counter file is gone (torch is shutting down): nothing to free
        log.debug("could not release the IPC counter %s[%d]: %s", rec.rc, rec.rco, exc)


def init_cuda() -> None:
    """Initialise CUDA before opening a handle: ``_new_shared_cuda`` in a process that never
    touched CUDA crashes (torch's own rebuild_cuda_tensor calls _lazy_init() first)."""
    if not torch.cuda.is_initialized():
        torch.cuda.init()


def _expandable_segments_on() -> bool:
    conf = ",".join(os.environ.get(k, "") for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    return "expandable_segments:true" in conf.replace(" ", "").lower()


@contextlib.contextmanager
def plain_cuda_malloc():
    """Allocate with expandable segments off: their IPC handles ('e') need the consumer to
    take file descriptors from the producer (pidfd_getfd), which containers usually forbid.
    Torch's Note [Expandable Segments] recommends exactly this for memory shared between processes."""
    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is None or not _expandable_segments_on():
        yield
        return
    setter("expandable_segments:False")
    try:
        yield
    finally:
        setter("expandable_segments:True")


class CudaSlot(Slot):
    """A GPU buffer shared once through CUDA IPC; its header file holds state and share record."""

    loc = "cuda"
    kind = KIND_CUDA

    def __init__(self, directory: str, name: str, capacity: int, device: torch.device):
        super().__init__(directory, name, RECORD_BYTES)
        try:
            self.device = device
            with plain_cuda_malloc():
                buffer = torch.empty(capacity, dtype=torch.uint8, device=device)
            #: recorded after every copy into the slot; its IPC handle travels in the share record
            self.event = None
            if handover_mode() == "event":
                with torch.cuda.device(device):
                    self.event = torch.cuda.Event(interprocess=True)  # timing off: IPC events cannot time
                    self.event.record()
            self.record = ShareRecord.of(buffer, bytes(self.event.ipc_handle()) if self.event is not None else b"")
            self.record.check(name)  # what the consumer will check; fails here, loudly, first
            self.capacity = capacity
            self.data = buffer
            record = np.frombuffer(self.mm, dtype=np.uint8, count=RECORD_BYTES, offset=HEADER)
            record[:] = np.frombuffer(self.record.pack(), dtype=np.uint8)
            del record
            LOCAL_SLOTS[name] = (buffer, self.event)
        except BaseException:
            rec = getattr(self, "record", None)
            if rec is not None:
                release_ipc_counter(rec)
            Slot.close(self)
            raise

    def fill(self, tensor: torch.Tensor, nbytes: int) -> torch.Tensor:
        dst = self.data[:nbytes].view(tensor.dtype).view(tensor.shape)
        peer = tensor.device != self.device and tensor.device.type == "cuda"
        stream = torch.cuda.current_stream(self.device)
        if peer:  # the peer copy runs on the slot device's stream: it waits for the producer's kernels
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(stream):
                dst.copy_(tensor)
        else:
            dst.copy_(tensor)  # device to device, on the current stream (the slot's device's)
        if self.event is not None:
            self.event.record(stream)  # Note [GPU hand-over order]: the consumer's stream waits on it
            if peer:  # the source GPU must not reuse the tensor's memory before the copy read it
                torch.cuda.current_stream(tensor.device).wait_event(self.event)
        else:
            stream.synchronize()
        return dst

    def close(self) -> None:
        LOCAL_SLOTS.pop(self.name, None)
        rec, self.record = getattr(self, "record", None), None
        if rec is not None:
            release_ipc_counter(rec)  # before the buffer goes: see "PyTorch's reference count" above
        super().close()


class CudaSlotPool(SlotPool):
    """``SlotPool`` whose slots live on ``device`` (the next hops' GPU), shared by CUDA IPC."""

    def __init__(self, directory: str, owner: str, window: int, device: str | torch.device):
        super().__init__(directory, owner, window)
        self.device = torch.device(device)
        if self.device.type != "cuda" or self.device.index is None:
            raise ValueError(f"a CUDA slot pool needs a device with an index ('cuda:N'), got {device!r}")
        self.seq_prefix = f"cuda{self.device.index}-"  # <owner>.<pid>.cuda<N>-<seq>: apart from the host pool's

    def _make_slot(self, name: str, capacity: int) -> CudaSlot:
        return CudaSlot(self.directory, name, capacity, self.device)


def read_record(m: Mapped, seg: str) -> ShareRecord:
    data = m.data
    if data is None or data.numel() != RECORD_BYTES:
        raise WireError(f"x.seg {seg} is not a CUDA slot")
    return ShareRecord.unpack(data.numpy().tobytes(), seg)


class CudaMapper:
    """Consumer side: opens each producer slot once and rebuilds tensors in place."""

    def __init__(self, directory: str, max_mappings: int = MAX_MAPPINGS):
        self.headers = SlotMapper(directory, max_mappings)
        #: seg -> (the slot's buffer, its producer's event or None), opened once per slot
        self.storages: OrderedDict[str, tuple[torch.Tensor, torch.cuda.Event | None]] = OrderedDict()
        self.max_mappings = max_mappings

    def _storage(self, seg: str, m: Mapped) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
        got = self.storages.get(seg)
        if got is not None:
            self.storages.move_to_end(seg)
            return got
        local = LOCAL_SLOTS.get(seg)
        if local is not None:  # "Slots of this process": its own memory, never opened by IPC
            return local  # per message (never cached): no record to read, the buffer is the slot itself
        rec = read_record(m, seg)
        init_cuda()
        if rec.dev >= torch.cuda.device_count():
            raise WireError(f"x.seg {seg} is on cuda:{rec.dev}, which this process does not see "
                            f"({torch.cuda.device_count()} visible); every process needs the same CUDA_VISIBLE_DEVICES")
        try:
            storage = torch.UntypedStorage._new_shared_cuda(rec.dev, rec.handle, rec.size, rec.soff,
                                                            rec.rc, rec.rco, b"", False)
        except RuntimeError as exc:
            raise WireError(f"x: CUDA IPC handle of {seg} cannot be opened ({str(exc).strip()[:200]})") from None
        buf = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", rec.dev)).set_(storage)
        event = None
        if rec.event:
            try:
                event = torch.cuda.Event.from_ipc_handle(torch.device("cuda", rec.dev), rec.event)
            except RuntimeError as exc:
                raise WireError(f"x: the CUDA event of {seg} cannot be opened ({str(exc).strip()[:200]})") from None
        self.storages[seg] = (buf, event)
        while len(self.storages) > self.max_mappings:
            self.storages.popitem(last=False)
        return buf, event

    def open(self, desc: TensorDesc):
        f = desc.fields
        seg, gen, off, nbytes = f.get("seg"), f.get("gen"), f.get("off"), f.get("nbytes")
        if not isinstance(seg, str) or not _SEG_RE.fullmatch(seg):
            raise WireError("x.seg must be a slot name")
        for key, val in (("gen", gen), ("off", off), ("nbytes", nbytes)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 0:
                raise WireError(f"x.{key} must be a non-negative integer")
        header = self.headers._open(seg)
        SlotMapper.check_kind(header, seg, "cuda")
        SlotMapper.check_in_flight(header, seg, gen)
        buf, event = self._storage(seg, header)
        span = desc.span_bytes()
        if off % desc.itemsize or off + max(nbytes, span) > buf.numel() or span > nbytes:
            raise WireError(f"x.off/x.nbytes/x.shape describe memory outside CUDA slot {seg}")
        if event is not None:  # Note [GPU hand-over order]: what reads the slot is queued after the producer's copy
            torch.cuda.current_stream(buf.device).wait_event(event)
        tensor = torch.as_strided(buf.view(desc.dtype), desc.shape, desc.stride, off // desc.itemsize)
        return tensor, CudaLease(header, seg, gen, buf)

    def close(self) -> None:
        self.storages.clear()  # each storage gives its IPC count back to its producer
        self.headers.close()


class CudaLease:
    """The right (and duty) to release one in-flight CUDA slot."""

    __slots__ = ("mapped", "seg", "gen", "buf", "released")
    loc = "cuda"

    def __init__(self, mapped: Mapped, seg: str, gen: int, buf: torch.Tensor):
        self.mapped, self.seg, self.gen, self.buf = mapped, seg, gen, buf
        self.released = False

    def contains(self, tensor: torch.Tensor) -> bool:
        if tensor.device != self.buf.device:
            return False
        base, ptr = self.buf.data_ptr(), tensor.data_ptr()
        return base <= ptr and ptr + TensorDesc.of(tensor, "cuda").span_bytes() <= base + self.buf.numel()

    def forward_desc(self, tensor: torch.Tensor) -> TensorDesc:
        """Handle for a view of this slot; the release duty moves to whoever receives it."""
        self.released = True
        span = TensorDesc.of(tensor, "cuda").span_bytes()
        return TensorDesc.of(tensor, "cuda", seg=self.seg, gen=self.gen,
                             off=tensor.data_ptr() - self.buf.data_ptr(), nbytes=span)

    def release(self) -> None:
        """Give the slot back. Work queued on this device may still read it (stream-ordered
        hand-over): the release waits for the stream first, so the producer can never overwrite
        what is being read (a block calls this after it has synchronised anyway: then it is free)."""
        if self.released:
            return
        self.released = True
        torch.cuda.current_stream(self.buf.device).synchronize()
        release_slot(self.mapped, self.gen)
