"""Transports: how a tensor crosses a PUSH/PULL edge.

``zeromq``   the thesis baseline: the tensor's bytes travel in frame 1 (``copy=False``); a
             CUDA tensor is copied to the host before sending and back after receiving.
``tensormq`` handles instead of bytes to hops on this host: shared-memory slots for CPU
             tensors and for any tensor towards a CPU hop (tensormq/shm.py), CUDA IPC
             slots for GPU tensors towards GPU hops (tensormq/cuda_ipc.py; its Note [CUDA
             IPC slots] has the table of hops). A hop that leaves the host carries bytes.

Either way a one-frame message (a handle's header, an error) to a process on this host goes
by a Unix datagram first, ZeroMQ taking whatever it refuses (tensormq/datagram.py).

The receiving side does not need to know the sender's mode: the descriptor's ``loc`` says
how to rebuild the tensor. ``Transport`` is owned by one thread (ZeroMQ sockets are not
thread-safe): in a block, the inference thread.
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections import OrderedDict

import torch
import zmq

from .shm import DEFAULT_WINDOW, HopGone, SlotMapper, SlotPool
from .bundle import assemble, flatten
from .datagram import Sender
from blockflow.core.curve import client_of
from blockflow.core.protocol import canonical_device
from .wire import (DTYPES, MAX_HEADER_BYTES, MAX_TENSOR_BYTES, TensorDesc, WireError, contiguous_stride, dumps, is_local,
                   member_descs)
from blockflow.core import settings

log = logging.getLogger(__name__)

MODES = ("tensormq", "zeromq")
#: Payloads smaller than this are copied into the ZeroMQ message (cheaper than tracking).
ZERO_COPY_THRESHOLD = 64 * 1024
#: How long a send may wait for a free slot or a full socket before the request fails.
DEFAULT_SEND_TIMEOUT = settings.SEND_TIMEOUT
#: Next hops that the last topology update did not list (or all of them, before the first
#: one) keep a socket and slots only up to this many; the least recently used goes first.
#: Paths come from messages, so without a bound every forged hop would cost a socket.
MAX_UNLISTED_HOPS = 64


def receive_limit(max_tensor_bytes: int = MAX_TENSOR_BYTES, max_header_bytes: int = MAX_HEADER_BYTES) -> int:
    """ZMQ_MAXMSGSIZE for sockets that receive tensors: a frame up to twice the limits is
    still read and answered with an error that names the limit; a larger one is cut off by
    ZeroMQ before it is buffered (the sender is disconnected and gets no answer)."""
    return 2 * (max_tensor_bytes + max_header_bytes)


#: File in the socket directory with the CURVE keys of the dispatcher's TCP result socket.
RESULT_KEYS = "results.curve"


def read_result_keys(path: str) -> dict | None:
    """The CURVE keys of the dispatcher's TCP result socket (dispatcher/process.py writes them
    into the 0700 socket directory), or None when there are none. Never follows a link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd) as f:
        try:
            keys = json.load(f)
        except ValueError:
            return None
    return keys if isinstance(keys, dict) and {"endpoint", "server", "public", "secret"} <= set(keys) else None


def recv_message(sock: zmq.Socket, flags: int = 0) -> list:
    """One message's frames (zmq.Frame, zero-copy), as ``recv_multipart(copy=False)`` gives them,
    for one call less per frame: a frame says itself whether more follow (``Frame.more``), where
    recv_multipart asks the socket (getsockopt RCVMORE), on every hop."""
    frame = sock.recv(flags, copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(flags, copy=False)
        frames.append(frame)
    return frames


def decode_bytes(desc: TensorDesc, frame) -> torch.Tensor:
    """Rebuild a tensor over a received frame's memory (no copy)."""
    expected = desc.numel * desc.itemsize
    buf = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
    if buf.ndim != 1 or buf.format != "B":
        buf = buf.cast("B")
    if len(buf) != expected:
        raise WireError(f"payload is {len(buf)} bytes but x.shape {list(desc.shape)} "
                        f"{desc.fields['dtype']} needs {expected}")
    if desc.numel and tuple(desc.stride) != contiguous_stride(desc.shape):
        raise WireError("x.stride must be C-contiguous when bytes travel")
    if expected == 0:
        return torch.empty(desc.shape, dtype=desc.dtype)
    return torch.frombuffer(buf, dtype=desc.dtype).view(desc.shape)  # two torch calls: each counts when cold


#: dtypes numpy has: their payload is the tensor's own array (one call); the others go as uint8
_NUMPY_DTYPES = frozenset(DTYPES.values()) - {torch.bfloat16}


def encode_bytes(tensor: torch.Tensor):
    """Descriptor and payload for a tensor whose bytes travel (the payload is an array over
    the tensor's memory: ZeroMQ copies or references it when the message is sent)."""
    t = tensor.detach() if tensor.requires_grad else tensor
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    desc = TensorDesc.of(t, "bytes")
    if not t.numel():
        return desc, b""
    if desc.stride != (canonical := contiguous_stride(desc.shape)):
        # contiguous, yet a dimension of size 1 has another stride (e.g. x[:, 0]): the bytes are
        # the same, and the receiver takes C-contiguous strides only
        desc.stride, desc.fields["stride"] = canonical, list(canonical)
    return desc, (t.numpy() if t.dtype in _NUMPY_DTYPES else t.view(torch.uint8).reshape(-1).numpy())


def bytes_fields(value) -> tuple[dict, list]:
    """(header fields, payload frames) of a tensor or a bundle whose bytes travel: ``{"x": ...}``
    and one frame, or ``{"xs": [...], "keys": [...]}`` and a frame per member (what clients
    send to the dispatcher and get back)."""
    if isinstance(value, torch.Tensor):
        desc, payload = encode_bytes(value)
        return {"x": desc.to_json()}, [payload]
    members, keys = flatten(value)
    encoded = [encode_bytes(t) for t in members]
    fields = {"xs": [d.to_json() for d, _ in encoded]}
    if keys is not None:
        fields["keys"] = keys
    return fields, [p for _, p in encoded]


def read_bytes_value(msg, frames: list, max_bytes: int = MAX_TENSOR_BYTES, check=None):
    """The tensor or bundle of a message (a ``ClientRequest`` or ``ClientReply``: its ``x``, or
    ``xs`` and ``keys``) whose every member travelled as bytes (the inverse of ``bytes_fields``),
    over the frames' memory; WireError names what does not fit. ``check(descs, keys)``, when
    given, sees the checked descriptors before any is read (keys None: one tensor, or a tuple)."""
    bundled = msg.xs is not None
    xs, keys = member_descs(msg.xs, msg.keys, msg.x is not None) if bundled else ([msg.x], None)
    descs = [TensorDesc.parse(x, max_bytes) for x in xs]
    if any(d.loc != "bytes" for d in descs) or len(frames) != 1 + len(descs):
        raise WireError(f"{'xs' if bundled else 'x'} must have loc 'bytes', each tensor in its own frame after "
                        "the header")
    if bundled and sum(d.numel * d.itemsize for d in descs) > max_bytes:
        raise WireError(f"the tensors of xs are larger than the limit of {max_bytes} bytes together")
    if check is not None:
        check(descs if bundled else descs[0], keys)
    tensors = [decode_bytes(d, f) for d, f in zip(descs, frames[1:])]
    return assemble(tensors, keys) if bundled else tensors[0]


class LeaseSet:
    """The slots a bundle's members came in, held and released together (a block keeps its
    input's lease until its output is sent: see ``Transport.encode_value``)."""

    __slots__ = ("leases",)

    def __init__(self):
        self.leases: list = []

    def add(self, lease) -> None:
        self.leases.append(lease)

    @property
    def released(self) -> bool:
        return all(le.released for le in self.leases)

    def contains(self, tensor: torch.Tensor) -> bool:
        return any(le.contains(tensor) for le in self.leases)

    def release(self) -> None:
        for le in self.leases:
            le.release()


def payload_frames(payload) -> list:
    """The frames of a message's payload as ``encode``/``encode_value`` give it: None (a handle),
    one buffer (a tensor's bytes: a numpy array, which has no truth value) or a list of buffers."""
    if type(payload) is list:  # a bundle's bytes members, or none
        return payload
    return [] if payload is None else [payload]


class Transport:
    """Sockets, slot pools and mappers of one process, for one thread."""

    def __init__(self, ctx: zmq.Context, owner: str, mode: str = "tensormq", shm_dir: str | None = None,
                 window: int = DEFAULT_WINDOW, send_timeout: float = DEFAULT_SEND_TIMEOUT,
                 max_tensor_bytes: int = MAX_TENSOR_BYTES, cuda_handles: bool = True):
        if mode not in MODES:
            raise ValueError(f"transport must be one of {MODES}, got {mode!r}")
        if mode == "tensormq" and not shm_dir:
            raise ValueError("the tensormq transport needs a shared-memory directory")
        self.ctx, self.owner, self.mode = ctx, owner, mode
        self.shm_dir, self.window, self.send_timeout = shm_dir, window, send_timeout
        self.max_tensor_bytes = max_tensor_bytes
        self.pushers: OrderedDict[str, zmq.Socket] = OrderedDict()  # least recently used first
        self.listed: frozenset[str] | None = None  # the hops of the last topology update
        self.devices: dict[str, str] = {}  # next hop address -> device it runs on (Algorithm 4)
        self.pool = SlotPool(shm_dir, owner, window) if shm_dir else None
        self.mapper = SlotMapper(shm_dir) if shm_dir else None
        self._cuda_pools: dict[str, SlotPool] = {}  # device of the next hops -> CUDA slots there
        self._cuda_mapper = None
        #: False in processes that never run a model on a GPU (the dispatcher): a CUDA handle
        #: sent to them is refused instead of costing them a CUDA context
        self.cuda_handles = cuda_handles
        #: hops a topology update removed, set by whichever thread hears of it first (mark_live)
        #: so that a wait for a dead consumer's slots or socket ends at once; see abandoned()
        self._gone: frozenset[str] = frozenset()
        #: set by the owner when it stops: every wait gives up
        self.stopping = None
        #: where the dispatcher's CURVE keys are (set by blocks): a PUSH socket to the TCP
        #: endpoint they name authenticates with them (see dispatcher/process.py)
        self.result_keys: str | None = None
        #: outputs sent from the slot the model made them in, uncopied (Note [Outputs made in a slot])
        self.made_in_slot = 0
        #: Ray mode (issue 30), set with ``curve``, the cluster's keys (blockflow/core/curve.py): paths
        #: name every receiver by its TCP endpoint, and a hop is sent bytes over CURVE TCP there,
        #: unless ``near`` lists it: a receiver on this node, by the endpoint it has for this
        #: node's processes, which get handles. The manager decides ``near`` by the nodes'
        #: identities, never by addresses (every node of a test cluster is 127.0.0.1). A hop it
        #: has not told us of yet gets bytes over TCP: slower, never lost.
        self.near: dict[str, str] = {}
        self.curve = None
        #: tensors received, by how they came (``bytes``, ``shm``, ``cuda``): GET /blocks/NAME/ping
        self.received: dict[str, int] = {}
        #: one-frame messages to processes on this host go by datagram first (tensormq/datagram.py)
        self.datagrams = Sender()

    # -- receiving ---------------------------------------------------------------------------
    def decode(self, x, frames: list):
        """(tensor, lease) for a descriptor; lease is None when the bytes came in the message."""
        desc = TensorDesc.parse(x, self.max_tensor_bytes)
        self.received[desc.loc] = self.received.get(desc.loc, 0) + 1
        if desc.loc == "bytes":
            if len(frames) != 2:
                raise WireError(f"x.loc is bytes but the message has {len(frames)} frames, not 2")
            return decode_bytes(desc, frames[1]), None
        if len(frames) != 1:
            raise WireError(f"x.loc is {desc.loc} but the message has {len(frames)} frames, not 1")
        return self._open_handle(desc)

    def _open_handle(self, desc: TensorDesc):
        if desc.loc == "shm":
            if self.mapper is None:
                raise WireError("this process has no shared-memory directory; handles are refused")
            return self.mapper.open(desc)
        return self.cuda_mapper().open(desc)

    def decode_value(self, x, xs, keys, frames: list):
        """(value, lease) for a message's tensor (descriptor ``x``) or bundle (descriptors ``xs``
        and ``keys``: tensormq/bundle.py). For a bundle the lease is a ``LeaseSet`` of its
        members' slots (None when all came as bytes); a member that cannot be opened gives back
        the slots opened before it."""
        if xs is None:
            return self.decode(x, frames)
        xs, keys = member_descs(xs, keys, x is not None)
        members, leases, frame = [], LeaseSet(), 1
        try:
            for i, x in enumerate(xs):
                desc = TensorDesc.parse(x, self.max_tensor_bytes)
                self.received[desc.loc] = self.received.get(desc.loc, 0) + 1
                if desc.loc == "bytes":
                    if frame >= len(frames):
                        raise WireError(f"xs[{i}].loc is bytes but the message has no frame left for it")
                    members.append(decode_bytes(desc, frames[frame]))
                    frame += 1
                else:
                    tensor, lease = self._open_handle(desc)
                    members.append(tensor)
                    leases.add(lease)
            if frame != len(frames):
                raise WireError(f"xs has {frame - 1} bytes members but the message has {len(frames) - 1} payload frames")
        except BaseException:
            leases.release()
            raise
        return assemble(members, keys), (leases if leases.leases else None)

    def leases_of(self, x, xs, keys, frames: list):
        """The lease of a message's tensor, or the ``LeaseSet`` of its bundle, when every member
        is a host slot's handle, checked as ``decode_value`` checks them but with no tensor made
        over the slots (each view is a torch call: Note [One copy, no views] in shm.py); None
        when a member is not (then ``decode_value``)."""
        if len(frames) != 1 or self.mapper is None:
            return None
        descs = [x] if xs is None else member_descs(xs, keys, x is not None)[0]
        parsed = [TensorDesc.parse(d, self.max_tensor_bytes) for d in descs]
        if any(desc.loc != "shm" for desc in parsed):
            return None
        leases = LeaseSet()
        try:
            for desc in parsed:
                leases.add(self.mapper.locate(desc)[2])
        except BaseException:
            leases.release()
            raise
        self.received["shm"] = self.received.get("shm", 0) + len(parsed)
        return leases.leases[0] if xs is None else leases

    def cuda_mapper(self):
        if self._cuda_mapper is None:
            if not self.cuda_handles:
                raise WireError(f"x.loc is cuda but {self.owner} runs on the CPU; CUDA handles are refused")
            if not torch.cuda.is_available():
                raise WireError("x.loc is cuda but this process has no GPU")
            from .cuda_ipc import CudaMapper
            self._cuda_mapper = CudaMapper(self.shm_dir)
        return self._cuda_mapper

    # -- sending -----------------------------------------------------------------------------
    def lend(self, address: str, nbytes: int, count: int = 1) -> list:
        """Up to ``count`` free slots towards ``address`` for the model to make an ``nbytes``
        output in (Note [Outputs made in a slot]); none where outputs travel otherwise (bytes)
        or none is free."""
        if self.mode != "tensormq" or self.pool is None or not self.handles_to(address):
            return []
        return self.pool.lend(address, nbytes, count)

    def encode(self, tensor: torch.Tensor, address: str, lease=None, timeout: float | None = None,
               same_as: dict | None = None, made_in=None):
        """(descriptor dict, payload or None) to send ``tensor`` to ``address``.

        ``lease`` is the slot the input came in: an output that is a view of it is forwarded
        by handle and the lease's release duty goes along with it. ``same_as`` is the input's
        descriptor when ``tensor`` is the input itself: it is forwarded as it came, with no
        new descriptor built. ``made_in`` is the lent slot (``lend``) the model made ``tensor`` in:
        it travels with that slot's handle, uncopied.
        """
        if self.mode == "zeromq" or not self.handles_to(address) or self.pool is None:
            if lease is not None and lease.contains(tensor):
                tensor = tensor.clone()  # ZeroMQ reads the bytes later; the slot is released now
            desc, payload = encode_bytes(tensor)
            return desc.to_json(), payload
        target = self.hop_device(address)
        # a shared-memory slot can be forwarded to any hop; a CUDA slot only to one on its device
        forwardable = lease is not None and (getattr(lease, "loc", "shm") == "shm" or target == str(tensor.device))
        if forwardable and same_as is not None:
            lease.released = True  # no longer ours to release: the duty travels with the handle
            return same_as, None
        if forwardable and lease.contains(tensor):
            return lease.forward_desc(tensor).to_json(), None
        if made_in is not None:
            desc = self.pool.adopt(made_in, tensor)
            if desc is not None:
                self.made_in_slot += 1
                return desc.to_json(), None
        timeout = self.send_timeout if timeout is None else timeout
        give_up = lambda: self.abandoned(address)  # noqa: E731
        if tensor.is_cuda and target.startswith("cuda"):
            return self.cuda_pool(target).put(address, tensor.detach(), timeout, give_up).to_json(), None
        # a CPU tensor to any hop (a GPU consumer moves it), or a GPU tensor to a CPU hop (copied to the host)
        return self.pool.put(address, tensor.detach(), timeout, give_up).to_json(), None

    def encode_value(self, value, address: str, lease=None, same_as: dict | None = None,
                     timeout: float | None = None):
        """(header fields, payload frames) to send a tensor or a bundle to ``address``: for a
        tensor ``{"x": ...}`` (``encode``; ``same_as`` is the input's header when the tensor is
        the input itself), for a bundle ``{"xs": [...], "keys": [...]}`` with one payload frame
        per member that travels as bytes.

        ``lease`` is what the input came in (a lease, or a ``LeaseSet`` for a bundle): a member
        that is an input member itself, or a view of one's slot, travels by that slot's handle,
        and the slot's release duty goes with it (once: a second member in the same slot is
        copied). If a member cannot be placed (no free slot before ``timeout``), the slots of
        the members placed before it are given back and the error is raised."""
        inputs = lease.leases if isinstance(lease, LeaseSet) else ([lease] if lease is not None else [])
        if isinstance(value, torch.Tensor):
            if isinstance(lease, LeaseSet):
                lease, same_as = next((le for le in inputs if not le.released and le.contains(value)), None), None
            x, payload = self.encode(value, address, lease, timeout=timeout, same_as=same_as)
            return {"x": x}, ([] if payload is None else [payload])
        members, keys = flatten(value, "the block's output")
        descs, payloads = [], []
        try:
            for t in members:
                owner = next((le for le in inputs if not le.released and le.contains(t)), None)
                x, payload = self.encode(t, address, owner, timeout=timeout)
                descs.append(x)
                if payload is not None:
                    payloads.append(payload)
        except BaseException:
            for x in descs:
                self.discard(x)
            raise
        fields = {"xs": descs}
        if keys is not None:
            fields["keys"] = keys
        return fields, payloads

    def prepare(self, address: str, nbytes: int = 0, device: str = "cpu") -> int:
        """Connect the socket to ``address`` and, where tensors may go to it by handle, make its
        slots for ``nbytes`` tensors made on ``device``, so that its first message waits for
        neither (Note [Ready to serve] in blocks/process.py). Slots are made whatever ``mode``
        is now: an update may change it with the same switch. Returns the slots of the edge."""
        self.socket(address)
        if not nbytes or self.pool is None or not self.handles_to(address):
            return 0
        target = self.hop_device(address)
        gpu = device.startswith("cuda") and target.startswith("cuda")
        return (self.cuda_pool(target) if gpu else self.pool).prepare(address, nbytes)

    def handles_to(self, address: str) -> bool:
        """Whether tensors to ``address`` may travel as handles: in Ray mode only to a hop on
        this node (``near``); else to one on this host (an ipc:// or loopback address)."""
        if self.curve is not None:
            return address in self.near or address.startswith("ipc://")
        return is_local(address)

    def hop_device(self, address: str) -> str:
        """The device the next hop runs on, from the device map; a hop the map does not name
        (the dispatcher's return address, any hop before the first update) is a CPU hop:
        shared memory works for every consumer, a CUDA handle only for one on a GPU."""
        return self.devices.get(address, "cpu")

    def cuda_pool(self, device: str) -> SlotPool:
        pool = self._cuda_pools.get(device)
        if pool is None:
            from .cuda_ipc import CudaSlotPool
            pool = self._cuda_pools[device] = CudaSlotPool(self.shm_dir, self.owner, self.window, device)
        return pool

    def pools(self) -> list[SlotPool]:
        return [p for p in (self.pool, *self._cuda_pools.values()) if p is not None]

    def socket(self, address: str) -> zmq.Socket:
        """The PUSH socket to ``address``, opened on first use (thesis Algorithm 3)."""
        sock = self.pushers.get(address)
        if sock is not None:
            self.pushers.move_to_end(address)
        else:
            self._limit_unlisted(address)
            sock = self.ctx.socket(zmq.PUSH)
            sock.linger = 0
            sock.sndhwm = 1000
            near = self.near.get(address)
            if near is not None or (self.curve is not None and address.startswith("tcp://")):
                if near is None:
                    client_of(sock, self.curve)  # another node, or one we have not heard of yet
                sock.connect(near or address)
                self.pushers[address] = sock
                return sock
            if address.startswith("tcp://") and self.result_keys:
                keys = read_result_keys(self.result_keys)
                if keys is not None and keys["endpoint"] == address:
                    sock.curve_serverkey = keys["server"].encode()
                    sock.curve_publickey = keys["public"].encode()
                    sock.curve_secretkey = keys["secret"].encode()
            sock.connect(address)
            self.pushers[address] = sock
        return sock

    def send(self, address: str, header: dict, payload=None, timeout: float | None = None) -> None:
        """Send one message; raises TimeoutError instead of blocking forever on a dead peer.
        ``payload``: None, one buffer, or a list of buffers (a bundle's bytes members)."""
        payloads = payload_frames(payload)
        if not payloads:  # a handle or an error: one frame, a datagram on this host or a socket with room
            data = dumps(header)
            # Ray mode sends a hop on this node to the endpoint it has there (``near``)
            if self.datagrams.send(self.near.get(address, address) if self.near else address, data):
                return
            sock = self.socket(address)
            try:
                sock.send(data, zmq.NOBLOCK)
                return
            except zmq.Again:
                frames, copy = [data], True
        else:
            sock = self.socket(address)
            frames = [dumps(header), *payloads]
            # zero-copy unless every payload is small (a small one is cheaper copied than tracked)
            copy = max(len(memoryview(p).cast("B")) for p in payloads) < ZERO_COPY_THRESHOLD
        deadline = time.monotonic() + (self.send_timeout if timeout is None else timeout)
        while True:
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy)
                return
            except zmq.Again:
                if self.abandoned(address):
                    raise HopGone(f"{self.owner}: the next hop {address} was removed before it took the message")
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{self.owner}: {address} has not taken a message for "
                                       f"{self.send_timeout:.1f}s; is the next hop running?") from None
                time.sleep(5e-4)

    def send_tensor(self, address: str, header: dict, tensor: torch.Tensor, lease=None) -> None:
        x, payload = self.encode(tensor, address, lease)
        header["x"] = x
        self.send(address, header, payload)

    def discard(self, x) -> None:
        """Give back the slot that the descriptor of a message never sent names: one of ours,
        or the input's when its handle was being forwarded. Nobody else holds it. A list is
        a bundle's descriptors: each is given back."""
        if type(x) is list:
            for member in x:
                self.discard(member)
            return
        try:
            self.release_handle(x)
        except WireError as exc:
            log.warning("%s: could not give back the slot of an unsent message: %s", self.owner, exc)

    def forget_unlinked(self) -> int:
        """Close the host mappings of slots whose producer is gone (``SlotMapper.forget_unlinked``)."""
        return self.mapper.forget_unlinked() if self.mapper is not None else 0

    def release_handle(self, x) -> bool:
        """Release the slot a handle names through the slot's header alone, never mapping its
        memory: the handle of a message never sent (our own slot: opening one's own CUDA IPC
        handle fails) or of a request refused unread. True if a slot was freed."""
        if not isinstance(x, dict) or x.get("loc") not in ("shm", "cuda") or self.mapper is None:
            return False
        seg, gen = x.get("seg"), x.get("gen")
        for pool in self.pools():
            slot = pool.slot_named(seg) if isinstance(seg, str) else None
            if slot is not None:
                return isinstance(gen, int) and not isinstance(gen, bool) and slot.give_back(gen)
        return self.mapper.release(seg, gen)

    def _limit_unlisted(self, address: str) -> None:
        unlisted = [a for a in self.pushers if self.listed is None or a not in self.listed]
        while len(unlisted) >= MAX_UNLISTED_HOPS:
            old = unlisted.pop(0)
            log.warning("%s: more than %d next hops that no topology update listed; closing the one "
                        "used least recently (%s)", self.owner, MAX_UNLISTED_HOPS, old)
            self.drop_hop(old)

    def drop_hop(self, address: str) -> None:
        """Close the socket to ``address`` and reclaim the slots it held (queued messages are
        dropped; their handles go stale)."""
        sock = self.pushers.pop(address, None)
        if sock is not None:
            sock.close(linger=0)
        self.datagrams.forget(address)
        for pool in self.pools():
            pool.reclaim(address)

    # -- topology ----------------------------------------------------------------------------
    def abandoned(self, address: str) -> bool:
        return address in self._gone or (self.stopping is not None and self.stopping.is_set())

    def mark_live(self, live: list[str]) -> None:
        """Thread-safe early notice of a topology update: the hops we know that are not in
        ``live`` are gone. The owning thread reclaims them later in set_topology()."""
        live_set = set(live)
        for _ in range(10):  # the owning thread may add an edge while we look
            try:
                known = set(self.pushers).union(*(p.edges for p in self.pools()))
                break
            except RuntimeError:
                continue
        else:
            return
        self._gone = frozenset((self._gone | known) - live_set)

    def set_topology(self, live: list[str], devices: dict[str, str] | None = None,
                     near: dict[str, str] | None = None) -> list[str]:
        """Close sockets to hops that are gone and reclaim the slots they held (Algorithm 3's
        update_connection); ``near``: Ray mode's hops on this node now (``self.near``): a hop
        that joins it is reconnected (it got bytes over TCP until now). Returns the addresses
        dropped."""
        live_set = set(live)
        if near is not None:
            for addr in [a for a in set(self.near) | set(near) if self.near.get(a) != near.get(a)]:
                sock = self.pushers.pop(addr, None)  # queued messages still go: linger
                if sock is not None:
                    sock.close(linger=int(self.send_timeout * 1000))
            self.near = dict(near)
        self.listed = frozenset(live_set)
        self._gone = frozenset(a for a in self._gone if a not in live_set)
        if devices is not None:  # one spelling per device ('cuda' is 'cuda:0'), so that they compare
            self.devices = {addr: canonical_device(dev) for addr, dev in devices.items()}
        known = set(self.pushers).union(*(p.edges for p in self.pools()))
        gone = [a for a in known if a not in live_set]
        for addr in gone:
            self.drop_hop(addr)
        return gone

    def in_flight(self) -> int:
        return sum(p.in_flight() for p in self.pools())

    def close(self) -> None:
        for sock in self.pushers.values():
            sock.close(linger=0)
        self.pushers.clear()
        self.datagrams.close()
        for part in (*self.pools(), self.mapper, self._cuda_mapper):
            if part is not None:
                part.close()
