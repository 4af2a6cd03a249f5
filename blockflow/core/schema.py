"""The system update: what an optimiser POSTs to /system/update, checked field by field.

``validate_update(body)`` returns a normalised ``Update`` or raises ``UpdateError`` whose
``field`` names the offending part (``blocks[2].device``, ``tasks[0].path[3]``) and whose
message says what would be accepted. Nothing is changed by a refused update.

This module checks the shape of the request only; it reads no file. Whether each ``model``
exists and matches its manifest is the manager's check (manager/models.py), made once at the
same edge and reported under the same field names.
"""
from __future__ import annotations

import difflib
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from blockflow.core import settings
from blockflow.core.header import TENSOR_DTYPES
from blockflow.core.protocol import canonical_device

TRANSPORTS = ("tensormq", "zeromq")
PROTOCOLS = ("ipc", "tcp")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")

#: Most files one fused block may chain.
MAX_FUSED = 16
#: Most blocks and tasks one update may declare.
MAX_BLOCKS = settings.MAX_BLOCKS
MAX_TASKS = settings.MAX_TASKS

#: Input shapes one block may declare for its warm-up (each may capture a CUDA graph).
MAX_WARMUP_SHAPES = 16
#: Processes one block may run as (``replicas``).
MAX_REPLICAS = 16
#: Replica r > 0 of block ``b`` runs as the process ``b.r<r>`` (replica 0 keeps the block's name), so
#: no block may be named so, whatever its stem's replica count (_block_name refuses it): a block
#: ``b2.r1`` beside a one-replica ``b2`` would collide with b2's second replica the day it gets one.
REPLICA_SUFFIX_RE = re.compile(r"^(?P<block>.+)\.r(?P<replica>\d+)$")
#: Seconds one inference may take before the block is considered stuck, killed and respawned.
DEFAULT_MAX_INFERENCE_S = 60.0
#: The largest ``max_inference_s`` accepted (a day): larger values are almost surely a unit mistake.
MAX_MAX_INFERENCE_S = 86400.0
TOP_FIELDS = {"transport", "protocol", "blocks", "tasks"}


class UpdateError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


# A block's `batching` object (blocks/batching.py runs it; DelayController there decides "auto").
class PolicyError(ValueError):
    """An invalid ``batching`` object; ``field`` names the offending part."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


#: The fields a ``batching`` object may have (BatchPolicy.parse).
BATCHING_FIELDS = ("max_batch", "max_queue_delay_us", "preferred")


@dataclass(frozen=True)
class BatchPolicy:
    max_batch: int
    max_queue_delay_us: int | None      #: None means "auto"
    preferred: tuple[int, ...] = ()

    @property
    def auto(self) -> bool:
        return self.max_queue_delay_us is None

    @staticmethod
    def parse(obj, where: str = "batching") -> "BatchPolicy":
        if not isinstance(obj, dict):
            raise PolicyError(where, "must be an object {max_batch, max_queue_delay_us, preferred}")
        unknown = set(obj) - set(BATCHING_FIELDS)
        if unknown:
            field = sorted(unknown)[0]
            raise PolicyError(f"{where}.{field}", unknown_field(field, BATCHING_FIELDS, "batching"))
        mb = obj.get("max_batch")
        if isinstance(mb, bool) or not isinstance(mb, int) or not 1 <= mb <= 1024:
            raise PolicyError(f"{where}.max_batch", "must be an integer from 1 to 1024")
        delay = obj.get("max_queue_delay_us", 0)
        if delay == "auto":
            delay = None
        elif isinstance(delay, bool) or not isinstance(delay, int) or not 0 <= delay <= 10_000_000:
            raise PolicyError(f"{where}.max_queue_delay_us", "must be 'auto' or microseconds from 0 to 10000000")
        pref = obj.get("preferred", [])
        if not isinstance(pref, list) or any(isinstance(p, bool) or not isinstance(p, int) or not 1 <= p <= mb
                                             for p in pref):
            raise PolicyError(f"{where}.preferred", f"must be a list of batch sizes from 1 to max_batch ({mb})")
        return BatchPolicy(mb, delay, tuple(sorted(set(pref))))

    def to_json(self) -> dict:
        return {"max_batch": self.max_batch,
                "max_queue_delay_us": "auto" if self.auto else self.max_queue_delay_us,
                "preferred": list(self.preferred)}


def _batching(obj, where: str) -> BatchPolicy | None:
    if obj is None:
        return None
    try:
        return BatchPolicy.parse(obj, where)
    except PolicyError as exc:
        raise UpdateError(exc.field, str(exc).split(": ", 1)[-1]) from None


# Note [One declaration per block]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``BlockDecl`` is the only place a block option is declared: its name, type, default, bounds
# (``msgspec.Meta``) and the words of its 400 (``_option``). The REST validation converts a
# block object into it (``validate_update``: msgspec checks types and bounds in C, and the
# error is said in the field's own words), the manager hands it to the block process whole
# (``BlockSpec`` in blocks/spec.py is a BlockDecl with the process's own fields added), and the
# block process reads the option from its spec. What msgspec cannot say from the value alone
# (a device this host has, a node the cluster has, the CPUs there are, a name reserved for a
# replica, a shared process's rules) is checked after the conversion, by name, below it.
# Adding an option: a field here, and the code that acts on it (CONTRIBUTING.md).


def _option(type_, error: str, parse=None, **bounds):
    """A declared field's type with its bounds (msgspec.Meta) and the words of a refused value:
    ``error`` may name ``{value}`` (the value sent) and ``{cpu_max}``. ``parse(value, where)``:
    a field msgspec does not convert, parsed by its own parser (its own field-named errors)."""
    return Annotated[type_, Meta(extra={"error": error, "parse": parse}, **bounds)]


_NAME_PATTERN = NAME_RE.pattern[:-1] + r"\Z"  # '$' would also match before a final newline
_NAME_ERROR = ("{value!r:.60} is not a valid name (letters, digits, '_', '.', '-'; up to 63 characters, "
               "starting with a letter or digit)")
_Name = _option(str, _NAME_ERROR, pattern=_NAME_PATTERN)
_Transport = _option(Literal[TRANSPORTS], "{value!r:.60} is not one of " + ", ".join(TRANSPORTS))
_Protocol = _option(Literal[PROTOCOLS], "{value!r:.60} is not one of " + ", ".join(PROTOCOLS))
_WARMUP_ERROR = (f"must be a list of at most {MAX_WARMUP_SHAPES} input shapes, each a list of 1 to 8 sizes from 1 "
                 f"to 65536, e.g. [[1, 3, 224, 224]]")


class BlockDecl(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One block of an update, as declared (Note [One declaration per block])."""

    name: _Name
    #: a tuple: a fused block, its files run in sequence in one process
    model: _option(str | Annotated[tuple[str, ...], Meta(min_length=1, max_length=MAX_FUSED)],
                   f"must be a model file or a list of 1 to {MAX_FUSED} of them, got {{value!r:.60}}")
    device: _option(str, "unknown device {value!r:.40}; use 'cpu', 'cuda' or 'cuda:N'",
                    pattern=r"^(cpu|cuda|cuda:\d{1,2})\Z") = "cpu"
    transport: _Transport = "tensormq"    # in an update: the update's, where the block names none
    protocol: _Protocol = "ipc"           # likewise
    cpus: _option(Annotated[tuple[Annotated[int, Meta(ge=0)], ...], Meta(min_length=1, max_length=1024)],
                  "must be a non-empty list of CPU numbers from 0 to {cpu_max}") | None = None
    threads: _option(int, "must be an integer from 1 to 256", ge=1, le=256) | None = None
    max_inference_s: _option(float, f"must be a number of seconds above 0 and at most {MAX_MAX_INFERENCE_S:.0f}, "
                                    "got {value!r:.40}", gt=0, le=MAX_MAX_INFERENCE_S) = DEFAULT_MAX_INFERENCE_S
    batching: _option(BatchPolicy, "", parse=_batching) | None = None  # None: one request at a time
    #: processes of this block; requests spread over them
    replicas: _option(int, f"must be an integer from 1 to {MAX_REPLICAS}, got {{value!r:.40}}",
                      ge=1, le=MAX_REPLICAS) = 1
    process: _Name | None = None          # a shared process's name: blocks with the same one run in it
    #: on a GPU: a CUDA graph per input shape (blocks/runner.py)
    cuda_graphs: _option(bool, "must be true or false, got {value!r:.40}") = True
    #: run before ready; None: the manifest's
    warmup_shapes: _option(Annotated[tuple[Annotated[tuple[Annotated[int, Meta(ge=1, le=1 << 16)], ...],
                                                     Meta(min_length=1, max_length=8)], ...],
                                     Meta(max_length=MAX_WARMUP_SHAPES)], _WARMUP_ERROR) | None = None
    node: _Name | None = None             # Ray mode: the custom resource of the nodes it may run on
    #: the dtype of the tensors the block takes (e.g. int64 token ids): its warm-up (and CUDA
    #: graphs) run on such inputs, and a task it starts refuses others; None: the manifest's
    #: a shared process's budget for its blocks' weights (blocks/cache.py): the blocks of a group
    #: that state it state the same; a group may then declare more blocks than fit at once
    memory_budget_mb: _option(float, "must be a number of megabytes above 0, got {value!r:.40}", gt=0,
                              le=1 << 24) | None = None
    #: in a group with a memory budget: kept resident, never parked to make room
    pinned: _option(bool, "must be true or false, got {value!r:.40}") = False
    input_dtype: _option(Literal[TENSOR_DTYPES],
                         "{value!r:.40} is not a dtype a tensor travels as; use one of " + ", ".join(TENSOR_DTYPES)
                         ) | None = None

    @property
    def files(self) -> tuple[str, ...]:
        """The model files, in the order they run (a fused block has several)."""
        return self.model if isinstance(self.model, tuple) else (self.model,)

    def as_dict(self) -> dict:
        """The declaration as JSON values (what validate_update takes back), unset options left out."""
        return msgspec.json.decode(msgspec.json.encode({k: v.to_json() if hasattr(v, "to_json") else v
                                                        for k, v in msgspec.structs.asdict(self).items()
                                                        if v is not None}))

    def replica_names(self) -> list[str]:
        """The process names of this block's replicas: its own name, then ``name.r1``, ..."""
        return [replica_name(self.name, r) for r in range(self.replicas)]


#: The fields a block object may have (the declaration's).
BLOCK_FIELDS = frozenset(BlockDecl.__struct_fields__)


def _field_words(annotation) -> dict:
    """The ``extra`` of a field's outermost ``Meta`` (its error words and parser), looking
    through ``| None``."""
    for arg in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(arg) is Annotated:
            metas = [m for m in arg.__metadata__ if isinstance(m, Meta) and m.extra]
            if metas:
                return metas[-1].extra
    return {}


#: field -> {"error": words of a refused value, "parse": its own parser, if any}
_WORDS = {name: _field_words(t) for name, t in typing.get_type_hints(BlockDecl, include_extras=True).items()}
#: fields msgspec does not convert: their parser does, with its own field-named errors
_PARSED = {name: w["parse"] for name, w in _WORDS.items() if w.get("parse")}


def replica_name(block: str, replica: int) -> str:
    """The process name of replica ``replica`` of ``block`` (REPLICA_SUFFIX_RE reserves the pattern)."""
    return block if replica == 0 else f"{block}.r{replica}"


def block_and_replica(process: str) -> tuple[str, int]:
    """The declared block and replica of a block process's name (replica_name's inverse)."""
    m = REPLICA_SUFFIX_RE.fullmatch(process)
    return (m["block"], int(m["replica"])) if m else (process, 0)


@dataclass
class Update:
    transport: str
    protocol: str
    blocks: dict[str, BlockDecl]
    tasks: dict[str, list[str]]
    manifests: dict[str, dict | None] = field(default_factory=dict)  # model path -> manifest entry


def _str(value, where: str, choices=None) -> str:
    if not isinstance(value, str):
        raise UpdateError(where, f"must be a string, got {type(value).__name__}")
    if choices and value not in choices:
        raise UpdateError(where, f"{value!r:.60} is not one of {', '.join(choices)}")
    return value


def _name(value, where: str) -> str:
    _str(value, where)
    if not NAME_RE.fullmatch(value):
        raise UpdateError(where, _NAME_ERROR.format(value=value))
    return value


def _block_name(value, where: str) -> str:
    """A block's name (a valid name: BlockDecl) must not end like a replica's process name (REPLICA_SUFFIX_RE)."""
    m = REPLICA_SUFFIX_RE.fullmatch(value)
    if m:
        raise UpdateError(where, f"{value!r} is reserved: it is the process name of replica {int(m['replica'])} of "
                                 f"block {m['block']!r} (a block's replicas run as NAME, NAME.r1, NAME.r2, ...); "
                                 f"rename this block, e.g. {m['block'] + '-r' + m['replica']!r}")
    return value


def _device(value: str, where: str, gpus: int) -> str:
    """A declared device (its spelling checked by BlockDecl), canonical and present on this host."""
    value = canonical_device(value)
    if value.startswith("cuda"):
        index = int(value.split(":")[1])
        if index >= gpus:
            raise UpdateError(where, f"device {value} is not present on this host "
                                     f"({gpus} GPU{'s' if gpus != 1 else ''} visible)")
    return value


def _node(value: str | None, where: str, nodes: set[str] | None) -> str | None:
    """A declared node (a valid name: BlockDecl) that the Ray cluster has."""
    if value is None:
        return None
    if nodes is None:
        raise UpdateError(where, "this server runs every block on its own host; start it with "
                                 "`blockflow serve --ray ADDRESS` to place blocks on the nodes of a Ray cluster")
    if value not in nodes:
        raise UpdateError(where, f"no node of the Ray cluster advertises the resource {value!r}; start one "
                                 f"with `ray start --resources '{{\"{value}\": 1000}}'` (advertised now: "
                                 f"{', '.join(sorted(nodes)) or 'none'})")
    return value


def unknown_field(field: str, known, what: str) -> str:
    """The words for a field no schema declares: the nearest declared name when there is one (a
    typo such as ``replica``), then every name ``what`` has."""
    near = difflib.get_close_matches(field, list(known), n=1, cutoff=0.6)
    hint = f"did you mean {near[0]}? " if near else ""
    return f"unknown field; {hint}{what} has {', '.join(sorted(known))}"


#: msgspec's words for where a value failed (``- at `$.cpus[0]` ``) and for unknown and missing fields
_AT_RE = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_FIELD_RE = re.compile(r"(?P<what>unknown|missing required) field `(?P<field>[^`]+)`")


def _refusal(exc: msgspec.ValidationError, raw: dict, where: str, cpu_count: int) -> UpdateError:
    """msgspec's refusal of a block object, said with the field's declared words."""
    text = str(exc)
    named = _FIELD_RE.search(text)
    if named and named["what"] == "unknown":
        return UpdateError(f"{where}.{named['field']}", unknown_field(named["field"], BLOCK_FIELDS, "a block"))
    if named:
        return UpdateError(f"{where}.{named['field']}", "is required")
    at = _AT_RE.search(text)
    path = at["path"] if at else ""
    field = re.match(r"[A-Za-z_]*", path)[0]
    words = _WORDS.get(field, {}).get("error")
    if not words:  # not a declared field's value (cannot happen with forbid_unknown_fields): msgspec's words
        return UpdateError(f"{where}.{path}" if path else where, text)
    # a value inside a list is named by its index (model[1]) where the words speak of the list itself
    return UpdateError(f"{where}.{path if field == 'model' else field}",
                       words.format(value=raw.get(field), cpu_max=cpu_count - 1))


def _block(raw: dict, where: str, defaults: dict, gpus: int, cpu_count: int, nodes: set[str] | None) -> BlockDecl:
    """One block object converted into its declaration, then what the declaration cannot say
    alone (Note [One declaration per block])."""
    parsed = {name: parse(raw[name], f"{where}.{name}") for name, parse in _PARSED.items() if raw.get(name) is not None}
    try:
        decl = msgspec.convert({**raw, **dict.fromkeys(parsed)}, BlockDecl, strict=True)
    except msgspec.ValidationError as exc:
        raise _refusal(exc, raw, where, cpu_count) from None
    changes = {**parsed, **{k: v for k, v in defaults.items() if k not in raw}}
    _block_name(decl.name, f"{where}.name")
    if isinstance(decl.model, tuple) and len(decl.model) == 1:
        changes["model"] = decl.model[0]
    node = _node(decl.node, f"{where}.node", nodes)
    # a block on another node: this host's GPUs say nothing of that node's (it fails to start there)
    changes["device"] = _device(decl.device, f"{where}.device", gpus if node is None else 100)
    if decl.cpus is not None:
        if max(decl.cpus) >= cpu_count:
            raise UpdateError(f"{where}.cpus", _WORDS["cpus"]["error"].format(cpu_max=cpu_count - 1))
        changes["cpus"] = tuple(sorted(set(decl.cpus)))
    return msgspec.structs.replace(decl, **changes)


def validate_update(body, gpus: int = 0, cpu_count: int | None = None, nodes: set[str] | None = None) -> Update:
    """Check an update against the schema (no file is read: see manager/models.py). ``nodes``:
    the custom resources a Ray cluster's live nodes advertise (``serve --ray``); None: no
    cluster, and a block may not name a ``node``."""
    if not isinstance(body, dict):
        raise UpdateError("body", "must be a JSON object with 'blocks' and 'tasks'")
    unknown = set(body) - TOP_FIELDS
    if unknown:
        field = sorted(unknown)[0]
        raise UpdateError(field, unknown_field(field, TOP_FIELDS, "an update"))
    transport = _str(body.get("transport", "tensormq"), "transport", TRANSPORTS)
    protocol = _str(body.get("protocol", "ipc"), "protocol", PROTOCOLS)
    blocks_in, tasks_in = body.get("blocks"), body.get("tasks", [])
    if not isinstance(blocks_in, list):
        raise UpdateError("blocks", "must be a list of block objects")
    if not isinstance(tasks_in, list):
        raise UpdateError("tasks", "must be a list of task objects")
    if len(blocks_in) > MAX_BLOCKS:
        raise UpdateError("blocks", f"{len(blocks_in)} blocks is more than the limit of {MAX_BLOCKS}")
    if len(tasks_in) > MAX_TASKS:
        raise UpdateError("tasks", f"{len(tasks_in)} tasks is more than the limit of {MAX_TASKS}")
    cpu_count = cpu_count or os.cpu_count() or 1

    blocks: dict[str, BlockDecl] = {}
    for i, b in enumerate(blocks_in):
        where = f"blocks[{i}]"
        if not isinstance(b, dict):
            raise UpdateError(where, "must be an object with name and model")
        decl = _block(b, where, {"transport": transport, "protocol": protocol}, gpus, cpu_count, nodes)
        name = decl.name
        if name in blocks:
            raise UpdateError(f"{where}.name", f"duplicate block name {name!r}")
        blocks[name] = decl
        if decl.process is not None:
            if decl.replicas != 1:
                raise UpdateError(f"{where}.replicas", "a block in a shared process runs once; give it its own "
                                                       "process (no 'process' field) to run replicas")
            if decl.cpus is not None:
                raise UpdateError(f"{where}.cpus", "CPU affinity is per process: pin a shared process's blocks "
                                                   "with 'cpus' only when each has a process of its own")
            first = next(d for d in blocks.values() if d.process == decl.process)
            if first.node != decl.node:
                raise UpdateError(f"{where}.node", f"shared process {decl.process!r} runs on node {first.node!r} "
                                                   f"(block {first.name!r}); a process is on one node")
            if first.device != decl.device:
                raise UpdateError(f"{where}.device", f"shared process {decl.process!r} runs on {first.device} "
                                                     f"(block {first.name!r}); a process has one device")
            budget = next((d for d in blocks.values() if d.process == decl.process and d.memory_budget_mb), None)
            if budget is not None and decl.memory_budget_mb not in (None, budget.memory_budget_mb):
                raise UpdateError(f"{where}.memory_budget_mb",
                                  f"shared process {decl.process!r} has memory_budget_mb {budget.memory_budget_mb:g} "
                                  f"(block {budget.name!r}); a process has one budget: state the same or none")
    for process in {d.process for d in blocks.values() if d.process is not None}:
        members = [d for d in blocks.values() if d.process == process]
        budget = next((d.memory_budget_mb for d in members if d.memory_budget_mb), None)
        for d in members:  # every member carries its group's budget: a new budget is a new group
            if budget is not None and d.memory_budget_mb is None:
                blocks[d.name] = msgspec.structs.replace(d, memory_budget_mb=budget)
    for i, decl in enumerate(blocks.values()):
        if decl.memory_budget_mb is not None and decl.process is None:
            raise UpdateError(f"blocks[{i}].memory_budget_mb", "a memory budget is a shared process's: give the block "
                                                             "a 'process' (the group whose blocks share the budget)")
        if decl.pinned and decl.memory_budget_mb is None:
            raise UpdateError(f"blocks[{i}].pinned", "pinned keeps a block resident within its shared process's "
                                                     "memory_budget_mb, and this block's process has none")

    tasks: dict[str, list[str]] = {}
    for i, t in enumerate(tasks_in):
        where = f"tasks[{i}]"
        if not isinstance(t, dict):
            raise UpdateError(where, "must be an object with id and path")
        extra = set(t) - {"id", "path"}
        if extra:
            field = sorted(extra)[0]
            raise UpdateError(f"{where}.{field}", unknown_field(field, ("id", "path"), "a task"))
        if "id" not in t:
            raise UpdateError(f"{where}.id", "is required")
        tid = _name(t["id"], f"{where}.id")
        if tid in tasks:
            raise UpdateError(f"{where}.id", f"duplicate task id {tid!r}")
        path = t.get("path")
        if not isinstance(path, list) or not path:
            raise UpdateError(f"{where}.path", "must be a non-empty list of block names")
        if len(path) > 32:
            raise UpdateError(f"{where}.path", "is longer than 32 blocks")
        seen = set()
        for j, hop in enumerate(path):
            if not isinstance(hop, str):
                raise UpdateError(f"{where}.path[{j}]", f"must be a block name, got {type(hop).__name__}")
            if hop not in blocks:
                raise UpdateError(f"{where}.path[{j}]", f"names block {hop!r:.60}, which the update does not declare")
            if hop in seen:
                raise UpdateError(f"{where}.path[{j}]", f"block {hop!r} appears twice; paths may not loop")
            seen.add(hop)
        tasks[tid] = list(path)
    return Update(transport, protocol, blocks, tasks)
