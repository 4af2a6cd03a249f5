"""CUDA IPC slots: TensorMQ's zero-copy path between processes on one GPU host.

Note [CUDA IPC slots]
---------------------
Opening a CUDA IPC handle costs milliseconds and PyTorch synchronises every send once more
than 1000 shares are outstanding, so TensorMQ never shares a tensor per message. Instead each
producer registers a window of GPU buffers per edge *once* (``_share_cuda_``) and each
consumer opens each buffer *once* (``_new_shared_cuda``, cached); a message then carries only
the slot's name, generation, offset and the tensor's dtype/shape/stride.

The slot's state and generation live in a small CPU shared-memory header (``tensormq.shm``),
so the ownership rules of Note [TensorMQ slot ownership] apply unchanged: the producer owns
and frees the GPU buffer, the consumer releases the slot after its model ran, a stale or
forged generation is refused, and ``reclaim`` frees the slots of a dead consumer.

Ordering: the producer synchronises its stream after copying into the slot and before the
handle is sent, so the consumer never reads a half-written slot; the consumer synchronises
after its model ran (its inference time is measured that way) before it releases the slot,
so the producer never overwrites memory that is still being read.

Blocks on different GPUs of one host: the producer allocates the edge's slots on the next
hop's device and copies there (thesis Fig. 3.9), so the handle always names memory on the
device the consumer runs on.
"""
from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict

import torch

from .shm import FREE, IN_FLIGHT, SEG_RE as _SEG_RE, HopGone, Slot, SlotMapper, release_slot
from .wire import TensorDesc, WireError

log = logging.getLogger(__name__)


def _round(nbytes: int) -> int:
    cap = 1 << 16
    while cap < nbytes:
        cap <<= 1
    return cap


class CudaSlot:
    """A GPU buffer shared once through CUDA IPC, with its state in a CPU header slot."""

    def __init__(self, directory: str, name: str, capacity: int, device: torch.device):
        self.header = Slot(directory, name, 0)
        self.name = name
        self.capacity = capacity
        self.device = device
        self.buffer = torch.empty(capacity, dtype=torch.uint8, device=device)
        shared = self.buffer.untyped_storage()._share_cuda_()
        # (device, handle, size, offset, ref_counter_handle, ref_counter_offset, event_handle, event_sync)
        self.share = {
            "dev": int(shared[0]), "handle": bytes(shared[1]).hex(), "size": int(shared[2]),
            "soff": int(shared[3]), "rc": bytes(shared[4]).hex(), "rco": int(shared[5]),
        }

    @property
    def state(self) -> int:
        return self.header.state

    @property
    def generation(self) -> int:
        return self.header.generation

    def mark_in_flight(self) -> int:
        return self.header.mark_in_flight()

    def force_free(self) -> None:
        self.header.force_free()

    def close(self) -> None:
        self.header.close()
        self.buffer = None


class CudaSlotPool:
    """Producer side for CUDA tensors: a window of registered GPU slots per edge."""

    def __init__(self, directory: str, owner: str, window: int):
        self.directory, self.owner, self.window = directory, owner, window
        self.edges: dict[str, list[CudaSlot]] = {}
        self._seq = 0

    def _new(self, capacity: int, device: torch.device) -> CudaSlot:
        self._seq += 1
        return CudaSlot(self.directory, f"{self.owner}.{os.getpid()}.c{self._seq}", capacity, device)

    def _try_acquire(self, edge: str, nbytes: int, device: torch.device) -> CudaSlot | None:
        slots = self.edges.setdefault(edge, [])
        free = [s for s in slots if s.state == FREE]
        for s in free:
            if s.capacity >= nbytes and s.device == device:
                return s
        if len(slots) < self.window:
            slots.append(self._new(_round(nbytes), device))
            return slots[-1]
        if free:
            slots.remove(free[0])
            free[0].close()
            slots.append(self._new(_round(nbytes), device))
            return slots[-1]
        return None

    def put(self, edge: str, tensor: torch.Tensor, device: torch.device, timeout: float, give_up=None) -> TensorDesc:
        nbytes = tensor.numel() * tensor.element_size()
        deadline = time.monotonic() + timeout
        while True:
            slot = self._try_acquire(edge, nbytes, device)
            if slot is not None:
                break
            if give_up is not None and give_up():
                raise HopGone(f"{self.owner}: the next hop {edge} was removed while its CUDA slots were full")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self.owner}: all {self.window} CUDA slots towards {edge} are still in "
                                   f"flight after {timeout:.1f}s; the next block is not keeping up or is gone")
            time.sleep(1e-4)
        slot.mark_in_flight()
        dst = slot.buffer[:nbytes].view(tensor.dtype).view(tensor.shape)
        dst.copy_(tensor)  # peer copy when the next hop is on another GPU
        torch.cuda.current_stream(tensor.device).synchronize()
        return TensorDesc.of(dst, "cuda", seg=slot.name, gen=slot.generation, off=0, nbytes=nbytes, **slot.share)

    def reclaim(self, edge: str) -> int:
        slots = self.edges.pop(edge, [])
        for s in slots:
            s.force_free()
            s.close()
        return len(slots)

    def in_flight(self, edge: str | None = None) -> int:
        edges = [edge] if edge else list(self.edges)
        return sum(1 for e in edges for s in self.edges.get(e, []) if s.state == IN_FLIGHT)

    def close(self) -> None:
        for edge in list(self.edges):
            for s in self.edges.pop(edge):
                s.close()


class CudaMapper:
    """Consumer side: opens each producer slot once and rebuilds tensors in place."""

    def __init__(self, directory: str, max_mappings: int = 256):
        self.headers = SlotMapper(directory, max_mappings)
        self.storages: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.max_mappings = max_mappings

    def _storage(self, seg: str, f: dict) -> torch.Tensor:
        buf = self.storages.get(seg)
        if buf is not None:
            self.storages.move_to_end(seg)
            return buf
        try:
            dev = int(f["dev"])
            storage = torch.UntypedStorage._new_shared_cuda(
                dev, bytes.fromhex(f["handle"]), int(f["size"]), int(f["soff"]),
                bytes.fromhex(f["rc"]), int(f["rco"]), b"", False)
        except (KeyError, ValueError, TypeError, RuntimeError) as exc:
            raise WireError(f"x: CUDA IPC handle for {seg} cannot be opened ({exc})") from None
        buf = torch.empty(0, dtype=torch.uint8, device=f"cuda:{dev}").set_(storage)
        self.storages[seg] = buf
        while len(self.storages) > self.max_mappings:
            self.storages.popitem(last=False)
        return buf

    def open(self, desc: TensorDesc):
        f = desc.fields
        seg = f.get("seg")
        if not isinstance(seg, str) or not _SEG_RE.fullmatch(seg):
            raise WireError("x.seg must be a slot name")
        gen = f.get("gen")
        if not isinstance(gen, int) or isinstance(gen, bool) or gen < 0:
            raise WireError("x.gen must be a non-negative integer")
        header = self.headers._open(seg)
        SlotMapper.check_in_flight(header, seg, gen)
        buf = self._storage(seg, f)
        off = f.get("off")
        if not isinstance(off, int) or off < 0 or off % desc.itemsize or off + desc.span_bytes() > buf.numel():
            raise WireError(f"x.off/x.shape describe memory outside CUDA slot {seg}")
        tensor = torch.as_strided(buf.view(desc.dtype), desc.shape, desc.stride, off // desc.itemsize)
        return tensor, CudaLease(header, seg, gen, buf, f)

    def close(self) -> None:
        self.storages.clear()
        self.headers.close()


class CudaLease:
    __slots__ = ("mapped", "seg", "gen", "buf", "fields", "released")

    def __init__(self, mapped, seg, gen, buf, fields):
        self.mapped, self.seg, self.gen, self.buf, self.fields = mapped, seg, gen, buf, fields
        self.released = False

    def contains(self, tensor: torch.Tensor) -> bool:
        if tensor.device != self.buf.device:
            return False
        base, ptr = self.buf.data_ptr(), tensor.data_ptr()
        return base <= ptr and ptr + TensorDesc.of(tensor, "cuda").span_bytes() <= base + self.buf.numel()

    def forward_desc(self, tensor: torch.Tensor) -> TensorDesc:
        self.released = True
        share = {k: self.fields[k] for k in ("dev", "handle", "size", "soff", "rc", "rco")}
        return TensorDesc.of(tensor, "cuda", seg=self.seg, gen=self.gen,
                             off=tensor.data_ptr() - self.buf.data_ptr(),
                             nbytes=TensorDesc.of(tensor, "cuda").span_bytes(), **share)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        release_slot(self.mapped, self.gen)
