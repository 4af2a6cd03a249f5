"""Issue 11's "measure and decide": hand-written checks against pydantic and msgspec.

    python -m experiments.validation_cost [--quick] [--n N] [--out DIR]

Two jobs are validated the three ways, with the same rules (types, bounds, name patterns):

* the **wire header** every hop parses (``tensormq/wire.py``: ``loads_header``, ``check_path``,
  ``TensorDesc.parse``): a data header of the 5-block ResNet50 path, a shared-memory descriptor and
  the hops' KPI records, as a block receives it at its third hop;
* the **system update** the REST API takes (``blockflow/core/schema.py``: ``validate_update``), here
  ``configs/resnet50_shared.json`` (7 blocks, 2 tasks).

The figure is the median time of one parse-and-validate, in microseconds, back to back
(``header_us``, caches warm) and after a 2 ms sleep before each call (``header_slept_us``: what
a block of a synchronous pipeline sees; on this VM its caches are cold then). The hand-written
checks parse with msgspec's schema-less JSON decoder (Note [Header JSON] in tensormq/wire.py);
the two "alone" rows are the bare codecs, json and msgspec, without checks. A library that is not
installed is reported as skipped (``pip install pydantic msgspec``; both are in the ``bench`` extra).
Field-named errors matter as much as speed: each library's message for a bad ``x.shape`` is kept
beside its time, so the table shows what a client would read.

**The typed header** (issue 29: "type the wire header with msgspec structs, or keep the
hand-written checks where they measure faster"): ``typed_header`` in the JSON. The headers a
block receives now (``v``, an integer ``rid``, the remaining path, the hop records of two blocks
before it) are decoded two ways, for one tensor (``x``) and for a bundle of three (``xs``):

* *dicts* (what blocks did until they decoded into ``DataHeader``): msgspec to dicts, then the
  block's own checks as ``admit`` and ``take_input`` made them (``check_path``, ``t``, ``rid``, ``member_descs``, ``TensorDesc.parse``) with the
  path and descriptor memos (Note [Descriptor memo]) warm, as they are in a running block;
  also with both memos emptied before each call;
* *struct*: ``msgspec.json.Decoder(Header)`` with ``msgspec.Struct`` classes for the header and
  the descriptor (dtype and loc as ``Literal``, shape and stride ``list[int]`` with ``Meta``
  bounds, path items ``tuple[str, str]``, keys with their pattern), then what a schema cannot say,
  still checked by hand: ``x`` or ``xs`` but not both, keys as many as members and distinct,
  shape and stride of one length, the byte limit and the strided span, the zero-size product
  bound, the path's name and address patterns. *struct + memos* keeps the two memos (the path's
  pairs, decoded as tuples, are checked with one ``set.issuperset``); *struct, no memos* puts the
  path patterns and the slot name's pattern in the schema and checks every descriptor every time;
* *blocks now*: what a block does since this measurement decided it (Note [Typed header] in
  tensormq/wire.py): ``loads_data_header`` (a Struct header whose descriptors stay dicts, the path
  memo on tuples), then ``TensorDesc.parse`` and its memo for each descriptor.

**The update, declared once** (issue 41: "a msgspec Struct or a pydantic model: measure which
validates an update faster"): ``update_validation`` in the JSON times, interleaved, what
``POST /system/update`` runs on ``configs/resnet50_shared.json`` -- ``validate_update``, which
converts each block into ``BlockDecl`` with msgspec and then checks what a type cannot say --
beside a pydantic model of the same blocks (types and bounds only: no device, node, CPU or
replica-name checks, no paths) and msgspec's conversion alone; ``--compare-schema PATH`` adds
the ``validate_update`` of another checkout's ``blockflow/core/schema.py`` (``blockflow/schema.py``
before the layers; e.g. the hand-written validator before BlockDecl) to the same rounds.

The bare decoders (msgspec to dicts; the typed decode without the checks after it) are the
floors. ``hop`` columns time what a block does with the header per hop: parse and check it,
append its hop record, drop the first path entry and write it again (a dict with ``dumps``, a
Struct with its encoder). Every column is the median of calls interleaved over all variants, in
an order shuffled each round (a loaded machine's drift falls on all alike); ``_slept`` columns
sleep 2 ms before each call. ``differences`` lists crafted headers and what each path answers: where the two refuse or
accept differently, and the messages a sender would read.
"""


import json
import math
import os
import statistics
import sys
import time

from blockflow.core.schema import validate_update
from blockflow.tensormq.wire import TensorDesc, WireError, check_path, loads_data_header, loads_header, member_descs

from . import common

NAME_PATTERN = r"^[A-Za-z0-9_.@:-]{1,128}$"
ADDR_PATTERN = r"^(ipc://[^\x00]{1,200}|tcp://[A-Za-z0-9.\-\[\]:]{1,100}:\d{1,5})$"


def sample_header() -> bytes:
    run = "/tmp/blockflow-run-3f9c2a/sock"
    path = [[b, f"ipc://{run}/{b}"] for b in ("b3", "b4", "h")] + [["@r", f"ipc://{run}/dispatcher-results"]]
    hops = [{"b": b, "w": 0.00012, "d": 0.00009, "i": 0.0188, "s": 0.00004, "f": 0.00007} for b in ("b1", "b2")]
    x = {"dtype": "float32", "shape": [1, 512, 28, 28], "stride": [401408, 784, 28, 1], "loc": "shm",
         "seg": "e-b2-b3-4", "gen": 1187, "off": 0, "nbytes": 1605632}
    return json.dumps({"t": "data", "rid": "c7f1a2:1187", "task": "classify", "path": path, "x": x,
                       "hops": hops}, separators=(",", ":")).encode()


def handwritten_header(raw: bytes):
    header = loads_header(raw)
    check_path(header.get("path"))
    if header.get("t") != "data":
        raise WireError("t must be 'data'")
    return TensorDesc.parse(header.get("x"))


def pydantic_header():
    from typing import Annotated, Literal

    from pydantic import BaseModel, Field, StringConstraints

    Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]
    Addr = Annotated[str, StringConstraints(pattern=ADDR_PATTERN)]
    Dim = Annotated[int, Field(ge=0, lt=1 << 40, strict=True)]

    class Desc(BaseModel):
        dtype: Literal["float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"]
        shape: Annotated[list[Dim], Field(max_length=8)]
        stride: Annotated[list[Dim], Field(max_length=8)]
        loc: Literal["bytes", "shm", "cuda"]
        model_config = {"extra": "allow"}

    class Header(BaseModel):
        t: Literal["data"]
        rid: str
        task: Name | None = None
        path: Annotated[list[tuple[Name, Addr]], Field(min_length=1, max_length=64)]
        x: Desc
        hops: list[dict] = []

    return lambda raw: Header.model_validate_json(raw)


def msgspec_header():
    from typing import Annotated, Literal

    import msgspec

    Name = Annotated[str, msgspec.Meta(pattern=NAME_PATTERN)]
    Addr = Annotated[str, msgspec.Meta(pattern=ADDR_PATTERN)]
    Dim = Annotated[int, msgspec.Meta(ge=0, lt=1 << 40)]

    class Desc(msgspec.Struct, forbid_unknown_fields=False):
        dtype: Literal["float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"]
        shape: Annotated[list[Dim], msgspec.Meta(max_length=8)]
        stride: Annotated[list[Dim], msgspec.Meta(max_length=8)]
        loc: Literal["bytes", "shm", "cuda"]

    class Header(msgspec.Struct):
        t: Literal["data"]
        rid: str
        path: Annotated[list[tuple[Name, Addr]], msgspec.Meta(min_length=1, max_length=64)]
        x: Desc
        task: Name | None = None
        hops: list[dict] = []

    decoder = msgspec.json.Decoder(Header)
    return decoder.decode


def pydantic_update():
    from typing import Annotated, Literal

    from pydantic import BaseModel, Field, StringConstraints

    Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]

    class Block(BaseModel, extra="forbid", strict=True):  # strict: no "1" for 1, as msgspec's strict conversion
        name: Name
        model: str | Annotated[list[str], Field(min_length=1, max_length=16)]
        device: str = "cpu"
        transport: Literal["zeromq", "tensormq"] | None = None
        protocol: Literal["ipc", "tcp"] | None = None
        cpus: list[Annotated[int, Field(ge=0)]] | None = None
        threads: Annotated[int, Field(ge=1, le=256)] | None = None
        max_inference_s: Annotated[float, Field(gt=0, le=86400)] = 60.0
        batching: dict | None = None
        replicas: Annotated[int, Field(ge=1, le=16)] = 1
        process: Name | None = None
        cuda_graphs: bool = True
        warmup_shapes: Annotated[list[Annotated[list[Annotated[int, Field(ge=1, le=65536)]],
                                                Field(min_length=1, max_length=8)]], Field(max_length=16)] | None = None
        node: Name | None = None
        input_dtype: Literal["float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8",
                             "bool"] | None = None

    class Task(BaseModel, extra="forbid"):
        id: Name
        path: Annotated[list[Name], Field(min_length=1, max_length=32)]

    class Update(BaseModel, extra="forbid"):
        blocks: list[Block]
        tasks: list[Task] = []
        transport: Literal["zeromq", "tensormq"] = "tensormq"
        protocol: Literal["ipc", "tcp"] = "ipc"

    return lambda raw: Update.model_validate_json(raw)  # cross-field checks (paths name blocks) not included


#: The pause before each call of the ``header_slept_us`` column.
GAP_S = 0.002


def _msgspec_decode():
    import msgspec
    return msgspec.json.Decoder().decode


def time_us(fn, arg, n: int, gap_s: float = 0.0) -> float:
    """Median microseconds of one call; ``gap_s``: sleep that long before each call, as a block
    does between two requests of a synchronous client (its caches are then cold on this VM)."""
    for _ in range(min(200, n)):
        fn(arg)
    samples = []
    for _ in range(n):
        if gap_s:
            time.sleep(gap_s)
        t0 = time.perf_counter_ns()
        fn(arg)
        samples.append((time.perf_counter_ns() - t0) / 1e3)
    return statistics.median(samples)


# -- the typed header (issue 29): msgspec Structs against today's dicts and hand-written checks ----

RUN = "/tmp/bfs-3f9c2a1b/sock"
#: Where a bundle's members come from: the stage's channels split 2:1:1 (as experiments/hop_overhead.py).
BUNDLE_SHAPES = ([1, 256, 28, 28], [1, 128, 28, 28], [1, 128, 28, 28])


def _contiguous(shape):
    from blockflow.tensormq.wire import contiguous_stride
    return list(contiguous_stride(shape))


def _hop_record(name: str, t: float) -> dict:
    """A hop record as blocks/process.py writes it (full float precision; t_in, t_out rounded)."""
    return {"b": name, "wait": 0.03814697265625 + t / 1e4, "deser": 0.012874603271484375, "dev": 0.0007152557373046875,
            "inf": 18.80335807800293 + t, "t_in": round(28312.4181236 + t, 6), "share": 0.0629425048828125,
            "t_out": round(28312.4372139 + t, 6)}


def current_header(bundle: bool = False, **change) -> dict:
    """The header block b3 of the 5-block ResNet50 path receives (tensormq), as the dispatcher and
    blocks b1, b2 wrote it: the remaining path, b2's output as one tensor or as a bundle of three
    (the same bytes, BUNDLE_SHAPES), b1's and b2's hop records. ``change``: fields replaced."""
    def desc(shape, k):
        return {"dtype": "float32", "shape": shape, "stride": _contiguous(shape), "loc": "shm",
                "seg": f"b2.28312.{k}", "gen": 1187, "off": 0, "nbytes": 4 * math.prod(shape)}
    path = [[b, f"ipc://{RUN}/{b}-0.sock"] for b in ("b4", "h")] + [["@dispatcher", f"ipc://{RUN}/dispatcher-0.sock"]]
    value = {"xs": [desc(sh, k) for k, sh in enumerate(BUNDLE_SHAPES)]} if bundle else {"x": desc([1, 512, 28, 28], 0)}
    header = {"v": 1, "t": "data", "rid": 4611686018427388091, "task": "classify", "path": path, **value,
              "hops": [_hop_record("b1", 0.0), _hop_record("b2", 1.0)]}
    header.update(change)
    return header


def typed_schema(patterns: bool):
    """(Header, Desc) Struct classes of a data header. ``patterns``: the path's name and address
    patterns and the slot name's are in the schema (checked on every decode); without, they are
    plain strings, checked after the decode through a memo (``struct_path``)."""
    from typing import Annotated, Literal, Optional

    import msgspec

    from blockflow.tensormq.bundle import KEY_RE, MAX_MEMBERS
    from blockflow.tensormq.wire import MAX_DIMS, MAX_PATH, _DIM_LIMIT
    Dim = Annotated[int, msgspec.Meta(ge=0, lt=_DIM_LIMIT)]
    Dims = Annotated[list[Dim], msgspec.Meta(max_length=MAX_DIMS)]
    Count = Annotated[int, msgspec.Meta(ge=0)]
    if patterns:
        Seg = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,120}$")]
        Hop = tuple[Annotated[str, msgspec.Meta(pattern=NAME_PATTERN)],
                    Annotated[str, msgspec.Meta(pattern=ADDR_PATTERN)]]
    else:
        Seg, Hop = str, tuple[str, str]
    Key = Annotated[str, msgspec.Meta(pattern=KEY_RE.pattern)]

    class Desc(msgspec.Struct, omit_defaults=True, gc=False):
        dtype: Literal["float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"]
        shape: Dims
        stride: Dims
        loc: Literal["bytes", "shm", "cuda"]
        seg: Optional[Seg] = None
        gen: Optional[Count] = None
        off: Optional[Count] = None
        nbytes: Optional[Count] = None

    class Header(msgspec.Struct, omit_defaults=True):
        v: int
        t: Literal["data", "result", "error"]
        rid: int
        path: Annotated[list[Hop], msgspec.Meta(min_length=1, max_length=MAX_PATH)]
        task: Optional[str] = None
        x: Optional[Desc] = None
        xs: Optional[Annotated[list[Desc], msgspec.Meta(min_length=1, max_length=MAX_MEMBERS)]] = None
        keys: Optional[Annotated[list[Key], msgspec.Meta(max_length=MAX_MEMBERS)]] = None
        hops: list[dict] = []

    return Header, Desc


def today_path(raw: bytes):
    """What a block checked of a data header before it decoded into ``DataHeader`` (the dicts
    way): ``admit`` (loads_header, check_path, t, rid) and ``take_input`` (member_descs and
    TensorDesc.parse of each member, or of x)."""
    header = loads_header(raw)
    check_path(header.get("path"))
    if header.get("t") != "data":
        raise WireError(f"t must be 'data', got {header.get('t')!r:.20}")
    rid = header.get("rid")
    if not isinstance(rid, int) or isinstance(rid, bool):
        raise WireError("rid must be an integer")
    if "xs" in header:
        xs, _keys = member_descs(header["xs"], header.get("keys"), "x" in header)
        return header, [TensorDesc.parse(x) for x in xs]
    return header, TensorDesc.parse(header.get("x"))


def blocks_path(raw: bytes):
    """What a block checks of a data header now: ``loads_data_header`` (Note [Typed header] in
    tensormq/wire.py) in ``admit``, then TensorDesc.parse of each descriptor in ``take_input``."""
    h = loads_data_header(raw)
    if h.t != "data":
        raise WireError(f"t must be 'data', got {h.t!r}")
    if h.xs is not None:
        return h, [TensorDesc.parse(x) for x in h.xs]
    return h, TensorDesc.parse(h.x)


def forget_memos() -> None:
    """Empty the descriptor and path memos of tensormq/wire.py (a block's first request)."""
    from blockflow.tensormq import wire
    wire._ACCEPTED_DESCS.clear()
    wire._ACCEPTED_HOPS.clear()


def struct_path(patterns: bool, memo: bool):
    """A Struct-typed header's parse: the typed decode, then every check a schema cannot express
    (the ones of today_path's checks that are left), with the path and descriptor memos or not.
    Returns ``parse(raw) -> (header, desc or [descs])`` and its Header class."""
    import msgspec

    from blockflow.tensormq.wire import _NAME_RE, _ADDR_RE, DTYPES, MAX_HEADER_BYTES, MAX_TENSOR_BYTES
    Header, _ = typed_schema(patterns)
    decode = msgspec.json.Decoder(Header).decode
    hops_seen: set = set()
    descs_seen: dict = {}
    new = object.__new__

    def desc_of(d, where: str):
        shape, stride = d.shape, d.stride
        if memo:
            hit = descs_seen.get((d.dtype, d.loc, *shape, None, *stride))
            if hit is not None:
                desc = new(TensorDesc)
                desc.dtype, desc.shape, desc.stride, desc.numel, desc._span = hit
                desc.loc, desc.fields = d.loc, d
                return desc
        if len(shape) != len(stride):
            raise WireError(f"{where}.shape has {len(shape)} dimensions but {where}.stride has {len(stride)}")
        if 0 in shape and math.prod([v for v in shape if v]) >= 1 << 62:
            raise WireError(f"{where}.shape {shape} has dimensions whose product exceeds 2**62")
        dtype = DTYPES[d.dtype]
        if 0 not in shape and math.prod(shape) * dtype.itemsize > MAX_TENSOR_BYTES:
            raise WireError(f"tensor of shape {shape} {d.dtype} is larger than the limit of {MAX_TENSOR_BYTES} bytes")
        desc = TensorDesc(dtype, tuple(shape), tuple(stride), d.loc, d)
        if desc._span > MAX_TENSOR_BYTES:
            raise WireError(f"tensor of shape {shape} {d.dtype} is larger than the limit of {MAX_TENSOR_BYTES} bytes")
        if memo:
            if len(descs_seen) >= 1024:
                descs_seen.clear()
            descs_seen[(d.dtype, d.loc, *shape, None, *stride)] = (dtype, desc.shape, desc.stride, desc.numel,
                                                                   desc._span)
        return desc

    def parse(raw):
        if len(raw) > MAX_HEADER_BYTES:
            raise WireError(f"header is {len(raw)} bytes, more than the limit of {MAX_HEADER_BYTES}")
        try:
            h = decode(raw)
        except msgspec.ValidationError as exc:
            raise WireError(f"header: {exc}") from None
        except (msgspec.DecodeError, RecursionError) as exc:
            raise WireError(f"header is not JSON ({exc}); pickles and other formats are refused") from None
        if not patterns and not hops_seen.issuperset(h.path):  # the memo of check_path, on tuples
            for i, (name, addr) in enumerate(h.path):
                if not _NAME_RE.fullmatch(name) or not _ADDR_RE.fullmatch(addr):
                    raise WireError(f"path[{i}] must be [name, 'ipc://...' or 'tcp://host:port'], "
                                    f"got {[name, addr]!s:.80}")
            if len(hops_seen) >= 4096:
                hops_seen.clear()
            if memo:
                hops_seen.update(h.path)
        if h.t != "data":
            raise WireError(f"t must be 'data', got {h.t!r:.20}")
        if h.xs is not None:
            if h.x is not None:
                raise WireError("a header has x (one tensor) or xs (several), not both")
            if h.keys is not None and (len(h.keys) != len(h.xs) or len(set(h.keys)) != len(h.keys)):
                raise WireError(f"keys must be {len(h.xs)} distinct names (letters, digits, _ . -), "
                                "one per member of xs")
            return h, [desc_of(d, f"xs[{i}]") for i, d in enumerate(h.xs)]
        if h.x is None:
            raise WireError("x (tensor descriptor) must be an object")
        return h, desc_of(h.x, "x")

    return parse, Header


def _hop_after(parse, write, record: dict):
    """What a block does with a header per hop: parse and check it, add its hop record, drop the
    first path entry, write it (the tensor's descriptor forwarded as it came)."""
    def hop_dict(raw):
        header, _desc = parse(raw)
        hops = header.get("hops")
        header["hops"] = (hops[:63] if isinstance(hops, list) else []) + [record]
        header["path"] = header["path"][1:]
        return write(header)

    def hop_struct(raw):
        h, _desc = parse(raw)
        h.hops = h.hops[:63] + [record]
        h.path = h.path[1:]
        return write(h)
    return hop_dict, hop_struct


def time_interleaved(cases: dict, n: int, gap_s: float = 0.0) -> dict:
    """Median microseconds of each case's ``fn(arg)`` (``cases``: name -> (fn, arg[, setup])), every
    case once per round, in an order shuffled each round (seeded): drift on a shared machine
    (another process, frequency) falls on all of them alike, and no case always follows the same
    one (what ran before sets the caches). ``setup`` runs before the sleep, untimed."""
    import random
    names = list(cases)
    for name in names:
        fn, arg, *_ = cases[name]
        for _ in range(min(200, n)):
            fn(arg)
    samples: dict = {name: [] for name in names}
    clock = time.perf_counter_ns
    rng = random.Random(29)
    order = list(names)
    for _ in range(n):
        rng.shuffle(order)
        for name in order:
            fn, arg, *setup = cases[name]
            if setup:
                setup[0]()
            if gap_s:
                time.sleep(gap_s)
            t0 = clock()
            fn(arg)
            samples[name].append((clock() - t0) / 1e3)
    return {name: statistics.median(v) for name, v in samples.items()}


def _cases_for_differences() -> list[tuple[str, bytes]]:
    """Crafted headers (one tensor unless said): where a typed decode and today's checks may part."""
    def raw(obj) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()
    good = current_header()
    x = good["x"]
    bundle = current_header(bundle=True)
    cases = [("a valid header, one tensor", raw(good)),
             ("a valid header, bundle of three", raw(bundle)),
             ("a valid header, bundle of three with keys", raw({**bundle, "keys": ["feat", "skip1", "skip2"]}))]
    cases += [
        ("shape with a bool (true for 1)", raw(current_header(x={**x, "shape": [True, 512, 28, 28]}))),
        ("shape with a float (1.0 for 1)", raw(current_header(x={**x, "shape": [1.0, 512, 28, 28]}))),
        ("shape with a negative size", raw(current_header(x={**x, "shape": [1, -512, 28, 28]}))),
        ("shape of 9 dimensions", raw(current_header(x={**x, "shape": [1] * 9, "stride": [1] * 9}))),
        ("shape and stride of different lengths", raw(current_header(x={**x, "stride": [784, 28, 1]}))),
        ("a size of 2**40", raw(current_header(x={**x, "shape": [1 << 40, 1, 1, 1]}))),
        ("a tensor over the byte limit", raw(current_header(x={**x, "shape": [64, 512, 128, 128],
                                                                 "stride": _contiguous([64, 512, 128, 128])}))),
        ("strides spanning past the byte limit", raw(current_header(x={**x, "shape": [2, 512, 28, 28],
                                                                         "stride": [1 << 29, 784, 28, 1]}))),
        ("dtype not supported (complex64)", raw(current_header(x={**x, "dtype": "complex64"}))),
        ("loc not known (gpu)", raw(current_header(x={**x, "loc": "gpu"}))),
        ("gen as a bool", raw(current_header(x={**x, "gen": True}))),
        ("gen negative", raw(current_header(x={**x, "gen": -1}))),
        ("seg not a slot name", raw(current_header(x={**x, "seg": "../../etc/passwd"}))),
        ("rid as a bool", raw(current_header(rid=True))),
        ("rid as a string", raw(current_header(rid="4611686018427388091"))),
        ("rid of 100 bits", raw(good).replace(b'"rid":4611686018427388091', b'"rid":' + b"9" * 30)),
        ("rid of 5000 digits", raw(good).replace(b'"rid":4611686018427388091', b'"rid":' + b"9" * 5000)),
        ("t is 'result'", raw(current_header(t="result"))),
        ("no t", raw({k: v for k, v in good.items() if k != "t"})),
        ("no v", raw({k: v for k, v in good.items() if k != "v"})),
        ("v is 2", raw(current_header(v=2))),
        ("task null", raw(current_header(task=None))),
        ("task a number", raw(current_header(task=7))),
        ("an unknown top-level field", raw(current_header(trace="abc"))),
        ("an unknown descriptor field", raw(current_header(x={**x, "handle": "abc"}))),
        ("a field twice (t: error, then data)", raw(good).replace(b'{"v":1,', b'{"v":1,"t":"error",', 1)),
        ("both x and xs", raw({**bundle, "x": x})),
        ("neither x nor xs", raw({k: v for k, v in good.items() if k != "x"})),
        ("xs empty", raw(current_header(bundle=True, xs=[]))),
        ("xs of 17", raw(current_header(bundle=True, xs=[x] * 17))),
        ("keys fewer than members", raw({**bundle, "keys": ["a", "b"]})),
        ("keys twice the same", raw({**bundle, "keys": ["a", "a", "b"]})),
        ("a key that is not a name", raw({**bundle, "keys": ["a", "b c", "d"]})),
        ("a path item of three", raw(current_header(path=[["b4", f"ipc://{RUN}/b4-0.sock", "x"]]))),
        ("a path name with a space", raw(current_header(path=[["b 4", f"ipc://{RUN}/b4-0.sock"]]))),
        ("a path address over http", raw(current_header(path=[["b4", "http://example.com/"]]))),
        ("path empty", raw(current_header(path=[]))),
        ("hops not a list", raw(current_header(hops={"b": "b1"}))),
        ("a hop record holding arrays 10,000 deep", raw(good).replace(b'"hops":[{', b'"hops":[{"deep":' + b"[" * 10000
                                                                        + b"]" * 10000 + b",", 1)),
        ("NaN in a hop record", raw(good).replace(b'"dev":', b'"dev":NaN,"x_":', 1)),
        ("not JSON (a pickle)", b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00}\x94."),
    ]
    return cases


def _answer(parse, raw: bytes, dropped: tuple[str, ...] = ()) -> str:
    """'accepted' or 'refused: <message>' (and, for an accepted header whose unknown fields a
    Struct drops, that they would not travel on)."""
    try:
        header, _desc = parse(raw)
    except Exception as exc:
        return "refused: " + " ".join(str(exc).split())[:150]
    if dropped and not isinstance(header, dict):
        import msgspec
        again = msgspec.json.encode(header)
        lost = [k for k in dropped if f'"{k}"'.encode() in raw and f'"{k}"'.encode() not in again]
        if lost:
            return f"accepted; {', '.join(lost)} dropped (not written on)"
    return "accepted"


def differences() -> list[dict]:
    """Each crafted header through today's checks (memos empty, then warm from a valid header)
    and through the typed decode with its checks."""
    typed, _ = struct_path(patterns=False, memo=True)
    good = (current_header(), current_header(bundle=True))
    out = []
    for case, raw in _cases_for_differences():
        forget_memos()
        cold = _answer(today_path, raw)
        for g in good:  # the memos as a running block has them: filled by valid headers
            today_path(json.dumps(g).encode())
        warm = _answer(today_path, raw)
        typed(json.dumps(good[0]).encode())
        row = {"case": case, "today": cold, "struct": _answer(typed, raw, ("trace", "handle"))}
        if warm != cold:
            row["today_memos_warm"] = warm
        # the same answer: both accept (and write on what came), or both refuse (with their own messages)
        row["same"] = (row["today"].split(":")[0] == row["struct"].split(":")[0] and warm == cold)
        out.append(row)
    forget_memos()
    return out


def typed_header(n: int, n_slept: int) -> dict:
    """The typed header against today's path: parse (and the per-hop rewrite) of one tensor's
    header and a bundle's, warm and after a sleep, interleaved; then the differences."""
    import msgspec

    from blockflow.tensormq.wire import dumps
    raws = {"single": json.dumps(current_header(), separators=(",", ":")).encode(),
            "bundle": json.dumps(current_header(bundle=True), separators=(",", ":")).encode()}
    record = _hop_record("b3", 2.0)
    struct_memo, _ = struct_path(patterns=False, memo=True)
    struct_plain, _ = struct_path(patterns=True, memo=False)
    Header, _ = typed_schema(False)
    typed_decode = msgspec.json.Decoder(Header).decode
    dict_decode = msgspec.json.Decoder().decode
    struct_write = msgspec.json.Encoder().encode
    hop_today, _ = _hop_after(today_path, dumps, record)
    _, hop_struct = _hop_after(struct_memo, struct_write, record)
    _, hop_blocks = _hop_after(blocks_path, dumps, record)
    # the rewritten headers must say the same (as JSON values): the typed one is the same message
    for raw in raws.values():
        if not json.loads(hop_today(raw)) == json.loads(hop_struct(raw)) == json.loads(hop_blocks(raw)):
            raise RuntimeError("the typed header is written on differently from today's: not the same message")
    today_name = "dicts: msgspec to dicts + hand-written checks, memos warm"
    typed_name = "struct + memos: typed decode, the rest checked by hand, path and descriptor memos"
    hop_today_name = "dicts: hop (parse, check, add the hop record, write)"
    hop_typed_name = "struct + memos: hop (parse, check, add the hop record, write)"
    variants = {
        today_name: ("parse", today_path, None),
        "dicts, memos emptied before each call": ("parse", today_path, forget_memos),
        "blocks now: DataHeader (tensormq/wire.py) + TensorDesc.parse, memos warm": ("parse", blocks_path, None),
        typed_name: ("parse", struct_memo, None),
        "struct, no memos: patterns in the schema, every descriptor checked": ("parse", struct_plain, None),
        "msgspec to dicts alone (no checks)": ("parse", dict_decode, None),
        "typed decode alone (no checks after it)": ("parse", typed_decode, None),
        hop_today_name: ("hop", hop_today, None),
        hop_typed_name: ("hop", hop_struct, None),
        "blocks now: hop (DataHeader)": ("hop", hop_blocks, None),
    }
    cases = {}
    for name, (what, fn, setup) in variants.items():
        for which, raw in raws.items():
            cases[(name, which)] = (fn, raw, setup) if setup else (fn, raw)
    warm = time_interleaved(cases, n)
    slept = time_interleaved(cases, n_slept, GAP_S)
    rows = []
    for name, (what, _fn, _setup) in variants.items():
        row = {"variant": name, "what": what}
        for which in raws:
            row[f"{which}_us"] = warm[(name, which)]
            row[f"{which}_slept_us"] = slept[(name, which)]
        rows.append(row)
    by = {r["variant"]: r for r in rows}
    today, typed, hop_t, hop_s = by[today_name], by[typed_name], by[hop_today_name], by[hop_typed_name]
    cols = [f"{which}{col}" for which in raws for col in ("_us", "_slept_us")]
    ratios = {c: typed[c] / today[c] for c in cols}
    hop_ratios = {c: hop_s[c] / hop_t[c] for c in cols}
    return {"header_bytes": {k: len(v) for k, v in raws.items()}, "n": n, "n_slept": n_slept,
            "bundle_shapes": [list(s) for s in BUNDLE_SHAPES], "rows": rows,
            "struct_over_today_parse": ratios, "struct_over_today_hop": hop_ratios,
            "differences": differences()}


def update_validation(update: bytes, n: int, compare_schema: str | None = None) -> dict:
    """Median microseconds to validate the update, each way, interleaved (see the module docstring)."""
    import msgspec
    from blockflow.core.schema import BlockDecl
    cases = {"validate_update: BlockDecl (msgspec) + checks": (lambda raw: validate_update(json.loads(raw)), update),
             "msgspec convert alone (BlockDecl, no checks)":
                 (lambda raw: [msgspec.convert(b, BlockDecl) for b in json.loads(raw)["blocks"]], update)}
    try:
        cases["pydantic model (types and bounds only)"] = (pydantic_update(), update)
    except ImportError as exc:
        cases.pop("pydantic model (types and bounds only)", None)
        common.log.info("pydantic skipped: %s", exc)
    if compare_schema:
        import importlib.util
        spec = importlib.util.spec_from_file_location("compared_schema", compare_schema)
        other = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = other  # dataclasses look their module up while the class is made
        # a checkout from before blockflow.core (issue 41, "Layers") imports these from their old places
        import blockflow.core.header
        import blockflow.core.settings
        moved = {"blockflow.settings": blockflow.core.settings, "blockflow.tensormq.header": blockflow.core.header}
        added = [name for name in moved if name not in sys.modules]
        sys.modules.update({name: moved[name] for name in added})
        try:
            spec.loader.exec_module(other)
        finally:
            for name in added:
                del sys.modules[name]
        cases[f"validate_update of {compare_schema}"] = (lambda raw: other.validate_update(json.loads(raw)), update)
    for fn, arg in cases.values():  # the same answer from every full validator
        fn(arg)
    medians = time_interleaved(cases, n)
    base = medians["validate_update: BlockDecl (msgspec) + checks"]
    return {"n": n, "rows": [{"variant": k, "update_us": v, "vs_validate_update": v / base} for k, v in medians.items()]}


def error_text(fn, raw: bytes) -> str:
    try:
        fn(raw)
    except Exception as exc:  # each library's own error type: we keep what a client would read
        return " ".join(str(exc).split())[:160]
    return "(accepted)"


def main(argv: list[str] | None = None) -> int:
    ap = common.parser("validation_cost", __doc__)
    ap.add_argument("--compare-schema", help="another checkout's blockflow/core/schema.py (blockflow/schema.py before the "
                                             "layers): its validate_update is timed "
                                             "in the same rounds (update_validation)")
    ap.add_argument("--update-only", action="store_true", help="time the update validation only")
    args = ap.parse_args(argv)
    common.setup_logging(args.verbose)
    n = args.n or (500 if args.quick else 20000)
    out = common.results_dir(args.out)

    with open(os.path.join(common.ROOT, "configs", "resnet50_shared.json"), "rb") as f:
        update = f.read()
    updates = update_validation(update, max(50, n // 20), args.compare_schema)
    print(json.dumps(updates, indent=1))
    if args.update_only:
        common.write_json(out, "validation_cost_update", {"experiment": "validation_cost", "update_validation": updates})
        return 0
    header = sample_header()
    bad = header.replace(b'"shape":[1,512,28,28]', b'"shape":[1,-512,28,28]')

    rows = []
    makers = {"hand-written": (lambda: handwritten_header, lambda: (lambda raw: validate_update(json.loads(raw))))}
    makers["pydantic"] = (pydantic_header, pydantic_update)
    makers["msgspec"] = (msgspec_header, None)
    makers["json.loads alone (no checks)"] = (lambda: json.loads, lambda: json.loads)
    makers["msgspec decode alone (no checks)"] = (_msgspec_decode, None)
    for lib, (make_h, make_u) in makers.items():
        row = {"library": lib}
        try:
            h = make_h()
            row["header_us"] = time_us(h, header, n)
            row["header_slept_us"] = time_us(h, header, max(50, n // 50), GAP_S)
            row["header_error"] = error_text(h, bad)
            if make_u is not None:
                row["update_us"] = time_us(make_u(), update, max(50, n // 20))
        except ImportError as exc:
            row["skipped"] = f"{exc.name} is not installed (pip install {exc.name})"
        rows.append(row)
        common.log.info("%s", row)
    base = rows[0]["header_us"]
    for row in rows:
        if "header_us" in row:
            row["header_vs_handwritten"] = row["header_us"] / base
    typed = typed_header(n, max(50, n // 50))
    settings = {"n": n, "gap_s": GAP_S, "quick": args.quick, "header_bytes": len(header), "update": "configs/resnet50_shared.json"}
    result = {"experiment": "validation_cost", "env": common.env_info(settings), "settings": settings, "rows": rows,
              "typed_header": typed, "update_validation": updates}
    common.write_json(out, "validation_cost", result)
    for row in rows:
        print(json.dumps(row))
    print(typed_table(typed))
    return 0


def typed_table(t: dict) -> str:
    """The typed-header comparison as Markdown: medians in microseconds, then the differences."""
    lines = [f"typed header ({t['header_bytes']['single']} and {t['header_bytes']['bundle']} bytes; medians of "
             f"{t['n']} calls warm, {t['n_slept']} after a {GAP_S * 1e3:.0f} ms sleep, interleaved)", "",
             "| variant | one tensor µs | after a sleep | bundle of 3 µs | after a sleep |", "|---|---|---|---|---|"]
    for r in t["rows"]:
        lines.append(f"| {r['variant']} | {r['single_us']:.2f} | {r['single_slept_us']:.2f} | {r['bundle_us']:.2f} | "
                     f"{r['bundle_slept_us']:.2f} |")
    p, h = t["struct_over_today_parse"], t["struct_over_today_hop"]
    lines += ["", "struct + memos / today: parse " + ", ".join(f"{k} {v:.2f}x" for k, v in p.items())
              + "; hop " + ", ".join(f"{k} {v:.2f}x" for k, v in h.items()), "",
              "| case | today | struct |", "|---|---|---|"]
    for d in t["differences"]:
        today = d["today"] + (f" (memos warm: {d['today_memos_warm']})" if "today_memos_warm" in d else "")
        lines.append(f"| {d['case']}{'' if d['same'] else ' **differs**'} | {today} | {d['struct']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
