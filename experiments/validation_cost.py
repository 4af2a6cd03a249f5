"""Issue 11's "measure and decide": hand-written checks against pydantic and msgspec.

    python -m experiments.validation_cost [--quick] [--n N] [--out DIR]

Two jobs are validated the three ways, with the same rules (types, bounds, name patterns):

* the **wire header** every hop parses (``tensormq/wire.py``: ``loads_header``, ``check_path``,
  ``TensorDesc.parse``): a data header of the 5-block ResNet50 path, a shared-memory descriptor and
  the hops' KPI records, as a block receives it at its third hop;
* the **system update** the REST API takes (``blockflow/schema.py``: ``validate_update``), here
  ``configs/resnet50_shared.json`` (7 blocks, 2 tasks).

The figure is the median time of one parse-and-validate, in microseconds, back to back
(``header_us``, caches warm) and after a 2 ms sleep before each call (``header_slept_us``: what
a block of a synchronous pipeline sees; on this VM its caches are cold then). The hand-written
checks parse with msgspec's schema-less JSON decoder (Note [Header JSON] in tensormq/wire.py);
the two "alone" rows are the bare codecs, json and msgspec, without checks. A library that is not
installed is reported as skipped (``pip install pydantic msgspec``; both are in the ``bench`` extra).
Field-named errors matter as much as speed: each library's message for a bad ``x.shape`` is kept
beside its time, so the table shows what a client would read.
"""


import json
import os
import statistics
import time

from blockflow.schema import validate_update
from blockflow.tensormq.wire import TensorDesc, WireError, check_path, loads_header

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

    class Block(BaseModel, extra="forbid"):
        name: Name
        model: str | Annotated[list[str], Field(min_length=1, max_length=16)]
        device: str = "cpu"
        transport: Literal["zeromq", "tensormq"] | None = None
        protocol: Literal["ipc", "tcp"] | None = None
        cpus: list[Annotated[int, Field(ge=0)]] | None = None
        threads: Annotated[int, Field(ge=1, le=256)] | None = None
        max_inference_s: Annotated[float, Field(gt=0)] = 60.0
        batching: dict | None = None

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


def error_text(fn, raw: bytes) -> str:
    try:
        fn(raw)
    except Exception as exc:  # each library's own error type: we keep what a client would read
        return " ".join(str(exc).split())[:160]
    return "(accepted)"


def main(argv: list[str] | None = None) -> int:
    ap = common.parser("validation_cost", __doc__)
    args = ap.parse_args(argv)
    common.setup_logging(args.verbose)
    n = args.n or (500 if args.quick else 20000)
    out = common.results_dir(args.out)

    header = sample_header()
    bad = header.replace(b'"shape":[1,512,28,28]', b'"shape":[1,-512,28,28]')
    with open(os.path.join(common.ROOT, "configs", "resnet50_shared.json"), "rb") as f:
        update = f.read()

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
    settings = {"n": n, "gap_s": GAP_S, "quick": args.quick, "header_bytes": len(header), "update": "configs/resnet50_shared.json"}
    result = {"experiment": "validation_cost", "env": common.env_info(settings), "settings": settings, "rows": rows}
    common.write_json(out, "validation_cost", result)
    for row in rows:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
