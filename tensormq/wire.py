"""TensorMQ wire format: a JSON header frame, then (only where bytes travel) one raw buffer.

No pickle, ever: every frame that reaches a socket is parsed as JSON or used as raw bytes,
and every field is checked before it is trusted (``WireError`` names the field).

A data message between BlockFlow processes is::

    frame 0  header  {"v": 1, "t": "data"|"result"|"error", "rid": int, "task": str,
                      "path": [[name, address], ...],   # hops still to traverse, return address last
                      "hops": [{...per-hop timings...}],
                      "x": tensor descriptor (see below), "err": str (errors only),
                      "trace": W3C traceparent (traced requests only: blockflow/core/tracing.py)}
    frame 1  payload the tensor's raw bytes, only when x["loc"] == "bytes"

A message that carries several tensors (a bundle: tensormq/bundle.py) has ``"xs"``, a list
of 1 to 16 descriptors, instead of ``"x"``, and ``"keys"`` (as many names) when the bundle
is a dict; one payload frame follows the header for each member whose ``loc`` is ``bytes``,
in member order. A header has ``x`` or ``xs``, never both.

A block decodes a data header into ``DataHeader`` (typed fields, Note [Typed header]). A client
and the dispatcher speak ``ClientRequest`` and ``ClientReply`` (Note [Client messages]).

A tensor descriptor always carries ``dtype``, ``shape`` and ``stride`` (in elements) and
says where the memory is (``loc``):

- ``bytes``: frame 1 holds the tensor, C-contiguous.
- ``shm``: a slot of a shared-memory pool (``seg``, ``gen``, ``off``, ``nbytes``); see
  ``tensormq/shm.py`` for who owns it and who releases it.
- ``cuda``: a CUDA IPC slot; see ``tensormq/cuda_ipc.py``.
"""
from __future__ import annotations

import enum
import math
import os
import re
from typing import Annotated, Literal

import msgspec
import torch
from blockflow.core import settings
from blockflow.core.protocol import PROTOCOL_VERSION, decode_frame

from .bundle import KEY_RE, MAX_MEMBERS
# the header codec (torch-free, for the control plane), re-exported: every data-plane module imports it from here
from blockflow.core.header import MAX_HEADER_BYTES, TENSOR_DTYPES, WireError, dumps, loads_header, not_utf8  # noqa: F401

#: Largest tensor accepted, in bytes (payload or shared slot). Override with BLOCKFLOW_MAX_TENSOR_BYTES.
MAX_TENSOR_BYTES = settings.MAX_TENSOR_BYTES
#: Most dimensions a tensor may have.
MAX_DIMS = 8
#: Longest path a message may carry.
MAX_PATH = 64
#: Largest size or stride of one dimension.
_DIM_LIMIT = 1 << 40

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in TENSOR_DTYPES}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

_NAME_RE = re.compile(r"^[A-Za-z0-9_.@:-]{1,128}$")
_ADDR_RE = re.compile(r"^(ipc://[^\x00]{1,200}|tcp://[A-Za-z0-9.\-\[\]:]{1,100}:\d{1,5})$")


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise WireError(f"dtype {dtype} cannot travel; supported: {', '.join(DTYPES)}") from None


def _int(obj: dict, key: str, lo: int = 0, hi: int = 1 << 62, where: str = "x") -> int:
    val = obj.get(key)
    if not isinstance(val, int) or isinstance(val, bool) or not lo <= val <= hi:
        raise WireError(f"{where}.{key} must be an integer in [{lo}, {hi}], got {val!r:.60}")
    return val


#: What every dimension of a valid shape or stride list is: a JSON integer, never a bool or float.
_INT_ONLY = {int}


def _dims(val, key: str) -> None:
    """A shape or stride: a list of at most MAX_DIMS integers in [0, 2**40). Checked with C
    builtins (set, map, min, max), not a Python loop: this runs on every hop, cold."""
    if (type(val) is not list or len(val) > MAX_DIMS
            or (val and (set(map(type, val)) != _INT_ONLY or min(val) < 0 or max(val) >= _DIM_LIMIT))):
        raise WireError(f"x.{key} must be a list of at most {MAX_DIMS} non-negative integers")


# Note [Descriptor memo]
# ~~~~~~~~~~~~~~~~~~~~~~
# A block sees the same few descriptors over and over (one shape per edge), and checking one
# field by field is, after the JSON, the dearest part of a hop when caches are cold (~50 us in
# a block on this VM). So the result of each accepted (dtype, loc, shape, stride) is kept,
# bounded, and a descriptor equal to one of them is not checked again. Equal, in Python's sense:
# a forged ``[1.0, 3]`` or ``[true, 3]`` finds the entry of ``[1, 3]`` -- harmless, since the
# tensor is then built from the memo's own checked integers, never from the message's values;
# every other field (seg, gen, off, nbytes, handle) is checked where it is used, every time.
_ACCEPTED_DESCS: dict[tuple, tuple] = {}
_ACCEPTED_DESCS_MAX = 1024
#: The sending side's memo: (dtype, shape, stride) of a tensor described before -> its dtype's
#: name, numel and span (``TensorDesc.of`` on every hop whose output is a new tensor).
_DESCRIBED: dict[tuple, tuple] = {}


class TensorDesc:
    """What a receiver needs to rebuild a tensor view; validated on construction from a header.
    ``numel`` and the span in bytes are computed once, here (a hop asks for them three times)."""

    __slots__ = ("dtype", "shape", "stride", "loc", "fields", "numel", "_span")

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], stride: tuple[int, ...], loc: str,
                 fields: dict):
        self.dtype, self.shape, self.stride, self.loc = dtype, shape, stride, loc
        self.fields = fields  # the raw descriptor (loc-specific fields: seg, gen, off, nbytes, handle, ...)
        self.numel = numel = math.prod(shape)
        # bytes from the first element to one past the last, following the strides
        self._span = (sum([(s - 1) * st for s, st in zip(shape, stride)]) + 1) * dtype.itemsize if numel else 0

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize  # on every hop: no tensor made to ask

    def span_bytes(self) -> int:
        """Bytes from the first element to one past the last, following the strides."""
        return self._span

    def to_json(self) -> dict:
        return self.fields

    def __repr__(self) -> str:
        return f"TensorDesc({self.fields!r})"

    @staticmethod
    def of(tensor: torch.Tensor, loc: str, **fields) -> "TensorDesc":
        dtype, shape, stride = tensor.dtype, tuple(tensor.shape), tensor.stride()
        key = (dtype, shape, stride)
        known = _DESCRIBED.get(key)
        if known is None:
            probe = TensorDesc(dtype, shape, stride, loc, {})
            if len(_DESCRIBED) >= _ACCEPTED_DESCS_MAX:
                _DESCRIBED.clear()
            known = _DESCRIBED[key] = (dtype_name(dtype), probe.numel, probe._span)
        desc = object.__new__(TensorDesc)
        desc.dtype, desc.shape, desc.stride, desc.loc = dtype, shape, stride, loc
        desc.numel, desc._span = known[1], known[2]
        desc.fields = {"dtype": known[0], "shape": list(shape), "stride": list(stride), "loc": loc, **fields}
        return desc

    @staticmethod
    def parse(x, max_bytes: int = MAX_TENSOR_BYTES) -> "TensorDesc":
        """The descriptor ``x`` checked field by field (WireError names the first bad one).

        A descriptor whose dtype, loc, shape and stride were accepted before is taken from a
        memo (Note [Descriptor memo])."""
        if type(x) is dict:
            shape, stride = x.get("shape"), x.get("stride")
            if type(shape) is list and type(stride) is list:
                try:
                    hit = _ACCEPTED_DESCS.get((x.get("dtype"), x.get("loc"), *shape, None, *stride))
                except TypeError:  # an unhashable element: the checks below name it
                    hit = None
                if hit is not None and hit[4] <= max_bytes:
                    desc = object.__new__(TensorDesc)
                    desc.dtype, desc.shape, desc.stride, desc.numel, desc._span = hit
                    desc.loc, desc.fields = x["loc"], x
                    return desc
        desc = TensorDesc._check(x, max_bytes)
        if len(_ACCEPTED_DESCS) >= _ACCEPTED_DESCS_MAX:
            _ACCEPTED_DESCS.clear()
        key = (x["dtype"], desc.loc, *desc.shape, None, *desc.stride)
        _ACCEPTED_DESCS[key] = (desc.dtype, desc.shape, desc.stride, desc.numel, desc._span)
        return desc

    @staticmethod
    def _check(x, max_bytes: int) -> "TensorDesc":
        if not isinstance(x, dict):
            raise WireError("x (tensor descriptor) must be an object")
        name = x.get("dtype")
        if not isinstance(name, str) or name not in DTYPES:  # a list or object is unhashable
            raise WireError(f"x.dtype {name!r:.40} is not supported; use one of {', '.join(DTYPES)}")
        shape, stride = x.get("shape"), x.get("stride")
        _dims(shape, "shape")
        _dims(stride, "stride")
        if len(shape) != len(stride):
            raise WireError(f"x.shape has {len(shape)} dimensions but x.stride has {len(stride)}")
        # a zero-sized tensor passes the byte limit whatever its other dimensions, but torch
        # computes contiguous strides from them and fails on int64 overflow: bound their product
        if 0 in shape and math.prod([d for d in shape if d]) >= 1 << 62:
            raise WireError(f"x.shape {shape} has dimensions whose product exceeds 2**62")
        loc = x.get("loc")
        if not isinstance(loc, str) or loc not in ("bytes", "shm", "cuda"):
            raise WireError(f"x.loc {loc!r:.40} is not one of bytes, shm, cuda")
        dtype = DTYPES[name]
        if 0 not in shape and math.prod(shape) * dtype.itemsize > max_bytes:  # before any sum of strides
            raise WireError(f"tensor of shape {shape} {name} is larger than the limit of {max_bytes} bytes")
        desc = TensorDesc(dtype, tuple(shape), tuple(stride), loc, x)
        if desc._span > max_bytes:
            raise WireError(f"tensor of shape {shape} {name} is larger than the limit of {max_bytes} bytes")
        return desc


def member_descs(xs, keys, has_x: bool = False) -> tuple[list, list[str] | None]:
    """A bundle's raw member descriptors and keys (None: a tuple), the list and the names
    checked here; each descriptor is checked by ``TensorDesc.parse`` where it is used."""
    if has_x:
        raise WireError("a header has x (one tensor) or xs (several), not both")
    if type(xs) is not list or not 1 <= len(xs) <= MAX_MEMBERS:
        raise WireError(f"xs must be a list of 1 to {MAX_MEMBERS} tensor descriptors")
    if keys is not None:
        if (type(keys) is not list or len(keys) != len(xs) or len(set(map(str, keys))) != len(keys)
                or not all(type(k) is str and KEY_RE.fullmatch(k) for k in keys)):
            raise WireError(f"keys must be {len(xs)} distinct names (letters, digits, _ . -), one per member of xs")
    return xs, keys


# Note [Typed header]
# ~~~~~~~~~~~~~~~~~~~
# A block decodes the data messages it receives into ``DataHeader`` (msgspec.Struct), not
# into dicts: msgspec checks the fields' types and bounds in C while it decodes (t, rid
# below 2**63, path as [name, address] pairs, the lists' lengths), so what is left to check
# in Python is what a schema cannot say: the path's name and address patterns (one set
# operation on its pairs once they were seen: check_path's memo), x or xs but not both, a
# bundle's keys, and each descriptor (TensorDesc.parse and its memo). Descriptors stay dicts:
# the slot mappers read their loc-specific fields, and a descriptor goes on as it came when a
# handle is forwarded. python -m experiments.validation_cost (typed_header) measured this
# against dicts with our checks, on the headers blocks receive: faster with the memos, slower
# without them. What changes for a sender: a field the Struct does not declare is dropped
# where a block writes the header on (a new field must be declared here, in every process
# at once), and a header without v, with a task that is not a string or hops that are not a
# list is refused. A client's request, its reply and an error stay dicts; control messages are the
# Structs of blockflow/core/protocol.py.
_TaskName = Annotated[str, msgspec.Meta(max_length=128)]

#: What a client's datagram inbox may be called: an abstract name (a leading NUL) of BlockFlow's
#: clients only, so that no client can make the dispatcher write to another program's socket.
CLIENT_INBOX_RE = r"^\x00blockflow-client-[0-9]{1,10}-[0-9a-f]{16}$"

#: A request's id: the client's to choose, echoed in the reply (an integer, or a short string).
RequestId = int | Annotated[str, msgspec.Meta(max_length=128)]
#: A client's key (Note [Datagrams to a local client] in dispatcher/lending.py).
ClientKey = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{32}$")]
#: Where the last block may answer a local client itself (Note [A direct answer] in
#: blocks/process.py): the client's datagram inbox, its key, its request's id, and the request's
#: arrival at the dispatcher (CLOCK_MONOTONIC, for the reply's ``ms``). Every hop decodes it, only
#: the last one reads it: ``direct_reply`` checks it there (a pattern checked at every hop's
#: decode cost a chain of four identity blocks 0.18 ms a request on the 2-core VM).
DirectReply = Annotated[list, msgspec.Meta(max_length=4)]
_INBOX_MATCH = re.compile(CLIENT_INBOX_RE).fullmatch
_KEY_MATCH = re.compile(r"^[0-9a-f]{32}$").fullmatch


def direct_reply(reply) -> tuple[str, str, int | str, float] | None:
    """A header's ``reply`` as (inbox, key, request id, arrival), or None where it is not one
    a block may answer (an inbox not named as a BlockFlow client's, a malformed key or id)."""
    if len(reply) != 4:
        return None
    inbox, key, cid, started = reply
    if type(inbox) is not str or not _INBOX_MATCH(inbox) or type(key) is not str or not _KEY_MATCH(key) \
            or not (type(cid) is int or (type(cid) is str and len(cid) <= 128)) or type(started) is not float:
        return None
    return inbox, key, cid, started


class DataHeader(msgspec.Struct, omit_defaults=True):
    """The header of a data message between BlockFlow processes (see the module docstring)."""

    v: Literal[PROTOCOL_VERSION]
    t: Literal["data", "result"]
    rid: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
    path: Annotated[list[tuple[str, str]], msgspec.Meta(min_length=1, max_length=MAX_PATH)]
    task: _TaskName | None = None
    hops: list[dict] = []
    x: dict | None = None
    xs: list[dict] | None = None
    keys: list[str] | None = None
    #: a traced request's W3C traceparent, the dispatcher's span (blockflow/core/tracing.py); absent otherwise
    trace: Annotated[str, msgspec.Meta(max_length=55)] | None = None
    #: set by the dispatcher for a local client that reads its result in slots: the last block
    #: answers it there itself (Note [A direct answer] in blocks/process.py); absent otherwise
    reply: DirectReply | None = None
    #: a result whose client the last block answered itself: the dispatcher only accounts for it
    answered: bool = False


_DATA_DECODER = msgspec.json.Decoder(DataHeader)


class BlockError(msgspec.Struct, omit_defaults=True):
    """A block's answer to a request it cannot run or pass on, sent to the request's return
    address (the dispatcher) instead of a result: the dispatcher answers the client with it."""

    v: int
    t: Literal["error"]
    rid: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
    #: the block that refused or failed, and why
    block: str
    err: str
    #: an ``ErrorCode`` value (blockflow/core/protocol.py); absent: ``error``
    code: str | None = None


def block_error(rid: int, block: str, err: str, code=None) -> BlockError:
    """The error message of ``block`` for request ``rid`` (``code``: an ``ErrorCode``, or None)."""
    return BlockError(PROTOCOL_VERSION, "error", rid, block, err, None if code is None else code.value)


def read_block_error(obj: dict) -> BlockError:
    """A block's error message read from its parsed header, or WireError naming the bad field."""
    try:
        return msgspec.convert(obj, BlockError)
    except msgspec.ValidationError as exc:
        raise WireError(f"error message: {exc}") from None


def loads_data_header(frame, limit: int = MAX_HEADER_BYTES) -> DataHeader:
    """A data message's header, typed and checked (Note [Typed header]), or WireError naming
    the field that is wrong."""
    buf = getattr(frame, "buffer", frame)
    if len(buf) > limit:
        raise WireError(f"header is {len(buf)} bytes, more than the limit of {limit}")
    try:
        header = _DATA_DECODER.decode(buf)
    except msgspec.ValidationError as exc:
        raise WireError(f"header: {exc}") from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise WireError(f"header is not JSON ({exc}); pickles and other formats are refused") from None
    except UnicodeDecodeError as exc:  # only in a field DataHeader has: others are skipped unread
        raise WireError(not_utf8(exc)) from None
    check_path(header.path)
    if header.xs is not None:
        member_descs(header.xs, header.keys, header.x is not None)
    return header


# Note [Client messages]
# ~~~~~~~~~~~~~~~~~~~~~~
# A client and the dispatcher exchange one JSON header per message (tensor frames follow it
# where bytes travel): a ``ClientRequest`` and, for each, one ``ClientReply`` with the same
# ``id``. Both are written only through these Structs (``encode_client``) and read only through
# their decoders, so every field, its type and its bound is here and nowhere else. What the
# dispatcher cannot decode is still answered: it salvages the request's ``id`` from the raw
# JSON (``salvage_id``) so that the client can match the error to its call. A field neither
# side declares is ignored on reading, so an older client keeps working with a newer dispatcher
# as long as ``v`` is the same; a different ``v`` is refused, naming both versions.


class ClientOp(str, enum.Enum):
    """What a client asks the dispatcher (``op`` of a ``ClientRequest``)."""

    INFER = "infer"    #: run ``task`` on the tensor(s) the request carries
    PING = "ping"      #: is the dispatcher there (answered ok, nothing run)
    LEND = "lend"      #: a window of shared-memory slots for a client on this host (dispatcher/lending.py)
    UNLEND = "unlend"  #: the client gives its lent slots back


class ClientRequest(msgspec.Struct, omit_defaults=True):
    """A client's message to the dispatcher (Note [Client messages])."""

    #: the protocol version the client speaks (blockflow/core/protocol.py)
    v: int
    id: RequestId
    op: ClientOp = ClientOp.INFER
    #: the server's token when it has one (``blockflow serve --token``)
    token: str | None = None
    task: str | None = None
    #: one tensor's descriptor (bytes in the next frame, or a lent slot), or ``xs`` (+ ``keys``) for several
    x: dict | None = None
    xs: list[dict] | None = None
    keys: list[str] | None = None
    #: "shm": answer in a slot this client maps (it holds a lease), not in bytes
    out: Literal["shm"] | None = None
    #: seconds the client waits; the dispatcher answers ``timeout`` by then (capped by its own limit)
    timeout: Annotated[float, msgspec.Meta(gt=0)] | None = None
    #: a W3C traceparent: the request joins that trace (blockflow/core/tracing.py)
    traceparent: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    #: ``lend``: the size of the tensors the client will send, and its process id
    nbytes: int | None = None
    pid: int | None = None
    #: ``lend``: the client's datagram inbox, an abstract Unix socket name (Note [Datagrams to a
    #: local client] in dispatcher/lending.py)
    dg: Annotated[str, msgspec.Meta(pattern=CLIENT_INBOX_RE, max_length=100)] | None = None
    #: ``lend`` with ``dg``, and every request sent by datagram: the client's key, which names it
    key: ClientKey | None = None


class ClientReply(msgspec.Struct, omit_defaults=True):
    """The dispatcher's answer to one ``ClientRequest`` (Note [Client messages])."""

    v: int
    #: the request's id; None only when the request had no readable one
    id: RequestId | None
    status: Literal["ok", "error"]
    #: an error's message and its ``ErrorCode`` (blockflow/core/protocol.py)
    error: str | None = None
    code: str | None = None
    #: per-hop timings (client.Result) and ms from arrival at the dispatcher to this reply
    hops: list[dict] | None = None
    ms: float | None = None
    #: the result: as bytes in the frames after this header, or a slot's handle (``out`` "shm")
    x: dict | None = None
    xs: list[dict] | None = None
    keys: list[str] | None = None
    #: the answer to ``lend``: the slots' folder, their names, and how long an unused lease lasts
    shm: str | None = None
    slots: list[str] | None = None
    idle_s: float | None = None
    #: the answer to ``lend`` with ``dg``: the dispatcher's datagram inbox; a reply sent by
    #: datagram carries the client's ``key`` (Note [Datagrams to a local client])
    dg: str | None = None
    key: str | None = None
    #: "block": sent by the request's last block itself (Note [A direct answer] in blocks/process.py)
    by: Literal["block"] | None = None


_CLIENT_ENCODER = msgspec.json.Encoder()
_REQUEST_DECODER = msgspec.json.Decoder(ClientRequest)
_REPLY_DECODER = msgspec.json.Decoder(ClientReply)


def encode_client(msg: ClientRequest | ClientReply) -> bytes:
    """The header frame of a client message."""
    return _CLIENT_ENCODER.encode(msg)


def _decode_client(decoder: msgspec.json.Decoder, frame, limit: int):
    msg = decode_frame(decoder, frame, "header", limit)
    if msg.v != PROTOCOL_VERSION:
        raise WireError(f"protocol version {msg.v!r:.20} is not this server's ({PROTOCOL_VERSION}); "
                        "use a client of the same BlockFlow release as the server")
    return msg


def decode_request(frame, limit: int = MAX_HEADER_BYTES) -> ClientRequest:
    """A client's request, typed and checked, or WireError naming the field that is wrong."""
    return _decode_client(_REQUEST_DECODER, frame, limit)


def decode_reply(frame, limit: int = MAX_HEADER_BYTES) -> ClientReply:
    """The dispatcher's reply, typed and checked, or WireError naming the field that is wrong."""
    return _decode_client(_REPLY_DECODER, frame, limit)


def salvage_id(frame) -> int | str | None:
    """The ``id`` of a request ``decode_request`` refused, when it has a valid one (so that the
    error reaches the call that sent it); None otherwise."""
    try:
        rid = loads_header(frame).get("id")
    except WireError:
        return None
    if isinstance(rid, bool) or not isinstance(rid, (int, str)) or (isinstance(rid, str) and len(rid) > 128):
        return None
    return rid


def contiguous_stride(shape) -> tuple[int, ...]:
    """C-contiguous strides (in elements) of ``shape``, as torch computes them."""
    stride, step = [], 1
    for dim in reversed(shape):
        stride.append(step)
        step *= max(dim, 1)
    return tuple(reversed(stride))


#: [name, address] hops check_path() has accepted in this process: paths repeat on every request,
#: and two regular expressions per hop are the dearest part of a header's checks when cold.
#: Bounded (cleared when full) since paths come from messages.
_ACCEPTED_HOPS: set[tuple[str, str]] = set()
_ACCEPTED_HOPS_MAX = 4096


def check_path(path) -> list:
    """Validate a remaining path: a non-empty list of [name, address] pairs (return address last;
    pairs are lists in a dict header, tuples in a ``DataHeader``)."""
    if not isinstance(path, list) or not 1 <= len(path) <= MAX_PATH:
        raise WireError(f"path must be a list of 1 to {MAX_PATH} hops")
    accepted = _ACCEPTED_HOPS
    if path and type(path[0]) is tuple and accepted.issuperset(path):
        return path  # a typed header's pairs, all seen before: one set operation
    for i, hop in enumerate(path):
        if type(hop) not in (list, tuple) or len(hop) != 2 or type(hop[0]) is not str or type(hop[1]) is not str:
            raise WireError(f"path[{i}] must be [name, 'ipc://...' or 'tcp://host:port'], got {str(hop):.80}")
        pair = (hop[0], hop[1])
        if pair in accepted:
            continue
        if not _NAME_RE.fullmatch(pair[0]) or not _ADDR_RE.fullmatch(pair[1]):
            raise WireError(f"path[{i}] must be [name, 'ipc://...' or 'tcp://host:port'], got {str(hop):.80}")
        if len(accepted) >= _ACCEPTED_HOPS_MAX:
            accepted.clear()
        accepted.add(pair)
    return path


def is_local(address: str) -> bool:
    """True when a hop is on this host, so handles may travel instead of bytes."""
    if address.startswith("ipc://"):
        return True
    host = address[len("tcp://"):].rsplit(":", 1)[0]
    return host in ("127.0.0.1", "localhost", "[::1]") or host.startswith("127.")
