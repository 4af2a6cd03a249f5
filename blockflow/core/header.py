"""TensorMQ header frames: the JSON codec every BlockFlow process speaks, without torch.

A header frame is one JSON object (tensormq/wire.py describes its fields). This module only
writes and parses such frames; what a tensor descriptor in a header means, and the checks
that need torch's dtypes, live in tensormq/wire.py, which re-exports everything here.

The split keeps the control plane free of torch: the manager, the controller and every
child's control channel exchange headers but never a tensor, so ``blockflow serve`` imports
this module and not wire.py (about 2.8 s of CPU and 600 MB less per server on the 2-core VM).
"""
from __future__ import annotations

import msgspec

from blockflow.core import settings

#: The dtypes a tensor can travel as, by name (tensormq/wire.py maps them to torch's; a block's
#: ``input_dtype`` names one: blockflow/core/schema.py).
TENSOR_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")

#: Largest header frame accepted (bytes). Paths and timings are small; anything bigger is hostile.
MAX_HEADER_BYTES = settings.MAX_HEADER_BYTES


class WireError(ValueError):
    """A frame that does not follow the wire format. The message names the field."""


# Note [Header JSON]
# ~~~~~~~~~~~~~~~~~
# Every hop parses one header and writes one. msgspec's JSON codec (C, no schema: it builds
# the same dicts, lists and ints json.loads does) instead of the json module: on this 2-core
# VM a block's caches are cold when a request wakes it, and there a header costs 33 us to
# parse and 27 us to write with msgspec against 102 us and 90 us with json (warm: 2.7/1.8
# against 11/12 us; python -m experiments.validation_cost, header_slept_us column, has the
# parse side with and without our checks). The checks stay ours (wire.check_path,
# TensorDesc.parse: field-named errors). What the codec refuses that json accepted: NaN and
# Infinity literals and lone surrogates, which no header of ours holds; integers longer than
# Python's digit limit are refused by both.
_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder()


def not_utf8(exc: UnicodeDecodeError) -> str:
    """The error for a header whose strings are not UTF-8. msgspec 0.22 raises UnicodeDecodeError,
    not DecodeError, for invalid UTF-8 inside a JSON string (found by experiments/fuzz.py): a
    ValueError that a handler of other ValueErrors would take for something else."""
    return f"header is not UTF-8 JSON (byte {exc.object[exc.start:exc.start + 1]!r} in a string)"


def dumps(obj: dict) -> bytes:
    """Compact JSON; a float NaN or infinity becomes null (JSON has neither)."""
    return _ENCODER.encode(obj)


def loads_header(frame, limit: int = MAX_HEADER_BYTES) -> dict:
    """Parse a header frame (bytes, memoryview or zmq.Frame) into a dict, or raise WireError."""
    buf = getattr(frame, "buffer", frame)  # a zmq.Frame's memory, not a copy of it
    if len(buf) > limit:
        raise WireError(f"header is {len(buf)} bytes, more than the limit of {limit}")
    try:
        obj = _DECODER.decode(buf)
    except (msgspec.DecodeError, RecursionError) as exc:
        # DecodeError covers malformed JSON (msgspec 0.22 reads integers of any size below
        # Python's digit limit: whoever uses one bounds it, as admit() does rid); RecursionError
        # covers arrays nested thousands deep
        raise WireError(f"header is not JSON ({exc}); pickles and other formats are refused") from None
    except UnicodeDecodeError as exc:
        raise WireError(not_utf8(exc)) from None
    if not isinstance(obj, dict):
        raise WireError("header must be a JSON object")
    return obj
