"""The system update: what an optimiser POSTs to /system/update, checked field by field.

``validate_update(body)`` returns a normalised ``Update`` or raises ``UpdateError`` whose
``field`` names the offending part (``blocks[2].device``, ``tasks[0].path[3]``) and whose
message says what would be accepted. Nothing is changed by a refused update.

This module checks the shape of the request only; it reads no file. Whether each ``model``
exists and matches its manifest is the manager's check (manager/models.py), made once at the
same edge and reported under the same field names.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from blockflow import settings

TRANSPORTS = ("tensormq", "zeromq")
PROTOCOLS = ("ipc", "tcp")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_DEVICE_RE = re.compile(r"^(cpu|cuda|cuda:\d{1,2})$")

#: Most files one fused block may chain.
MAX_FUSED = 16
#: Most blocks and tasks one update may declare.
MAX_BLOCKS = settings.MAX_BLOCKS
MAX_TASKS = settings.MAX_TASKS

BLOCK_FIELDS = {"name", "model", "device", "transport", "protocol", "cpus", "threads", "max_inference_s", "batching",
                "replicas", "process", "cuda_graphs", "warmup_shapes", "node"}
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
        unknown = set(obj) - {"max_batch", "max_queue_delay_us", "preferred"}
        if unknown:
            raise PolicyError(f"{where}.{sorted(unknown)[0]}", "unknown field")
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


@dataclass(frozen=True)
class BlockDecl:
    name: str
    model: str | tuple[str, ...]    # a tuple: a fused block, its files run in sequence in one process
    device: str = "cpu"
    transport: str = "tensormq"
    protocol: str = "ipc"
    cpus: tuple[int, ...] | None = None
    threads: int | None = None
    max_inference_s: float = DEFAULT_MAX_INFERENCE_S
    batching: BatchPolicy | None = None   # None: one request at a time
    replicas: int = 1                     # processes of this block; requests spread over them
    process: str | None = None            # a shared process's name: blocks with the same one run in it
    cuda_graphs: bool = True              # on a GPU: a CUDA graph per input shape (blocks/runner.py)
    warmup_shapes: tuple[tuple[int, ...], ...] | None = None  # run before ready; None: the manifest's
    node: str | None = None               # Ray mode: the custom resource of the nodes it may run on

    @property
    def files(self) -> tuple[str, ...]:
        """The model files, in the order they run (a fused block has several)."""
        return self.model if isinstance(self.model, tuple) else (self.model,)

    def as_dict(self) -> dict:
        model = list(self.model) if isinstance(self.model, tuple) else self.model
        d = {"name": self.name, "model": model, "device": self.device, "transport": self.transport,
             "protocol": self.protocol, "max_inference_s": self.max_inference_s}
        if self.cpus is not None:
            d["cpus"] = list(self.cpus)
        if self.threads is not None:
            d["threads"] = self.threads
        if self.batching is not None:
            d["batching"] = self.batching.to_json()
        if self.replicas != 1:
            d["replicas"] = self.replicas
        if self.process is not None:
            d["process"] = self.process
        if not self.cuda_graphs:
            d["cuda_graphs"] = False
        if self.warmup_shapes is not None:
            d["warmup_shapes"] = [list(s) for s in self.warmup_shapes]
        if self.node is not None:
            d["node"] = self.node
        return d

    def replica_names(self) -> list[str]:
        """The process names of this block's replicas: its own name, then ``name.r1``, ..."""
        return [replica_name(self.name, r) for r in range(self.replicas)]


def replica_name(block: str, replica: int) -> str:
    """The process name of replica ``replica`` of ``block`` (REPLICA_SUFFIX_RE reserves the pattern)."""
    return block if replica == 0 else f"{block}.r{replica}"


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
        raise UpdateError(where, f"{value!r:.60} is not a valid name (letters, digits, '_', '.', '-'; "
                                 "up to 63 characters, starting with a letter or digit)")
    return value


def _block_name(value, where: str) -> str:
    """A block's name: a name that does not end like a replica's process name (REPLICA_SUFFIX_RE)."""
    _name(value, where)
    m = REPLICA_SUFFIX_RE.fullmatch(value)
    if m:
        raise UpdateError(where, f"{value!r} is reserved: it is the process name of replica {int(m['replica'])} of "
                                 f"block {m['block']!r} (a block's replicas run as NAME, NAME.r1, NAME.r2, ...); "
                                 f"rename this block, e.g. {m['block'] + '-r' + m['replica']!r}")
    return value


def canonical_device(value: str) -> str:
    """One spelling per device, so that device strings compare: 'cuda' is 'cuda:0' (and what
    torch.cuda.set_device needs: it refuses a device without an index); 'cuda:01' is 'cuda:1'."""
    if value == "cuda":
        return "cuda:0"
    if value.startswith("cuda:") and value[5:].isdigit():
        return f"cuda:{int(value[5:])}"
    return value


def _device(value, where: str, gpus: int) -> str:
    _str(value, where)
    if not _DEVICE_RE.fullmatch(value):
        raise UpdateError(where, f"unknown device {value!r:.40}; use 'cpu', 'cuda' or 'cuda:N'")
    value = canonical_device(value)
    if value.startswith("cuda"):
        index = int(value.split(":")[1])
        if index >= gpus:
            raise UpdateError(where, f"device {value} is not present on this host "
                                     f"({gpus} GPU{'s' if gpus != 1 else ''} visible)")
    return value


def _node(value, where: str, nodes: set[str] | None) -> str | None:
    if value is None:
        return None
    value = _name(value, where)
    if nodes is None:
        raise UpdateError(where, "this server runs every block on its own host; start it with "
                                 "`blockflow serve --ray ADDRESS` to place blocks on the nodes of a Ray cluster")
    if value not in nodes:
        raise UpdateError(where, f"no node of the Ray cluster advertises the resource {value!r}; start one "
                                 f"with `ray start --resources '{{\"{value}\": 1000}}'` (advertised now: "
                                 f"{', '.join(sorted(nodes)) or 'none'})")
    return value


def _model(value, where: str) -> str | tuple[str, ...]:
    """A file, or a list of files run in sequence in one process (a fused block)."""
    if isinstance(value, list):
        if not 1 <= len(value) <= MAX_FUSED:
            raise UpdateError(where, f"a fused block chains 1 to {MAX_FUSED} model files, got {len(value)}")
        files = tuple(_str(v, f"{where}[{j}]") for j, v in enumerate(value))
        return files[0] if len(files) == 1 else files
    if not isinstance(value, str):
        raise UpdateError(where, f"must be a model file or a list of them, got {type(value).__name__}")
    return value


def _replicas(value, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_REPLICAS:
        raise UpdateError(where, f"must be an integer from 1 to {MAX_REPLICAS}, got {value!r:.40}")
    return value


def _bool(value, where: str) -> bool:
    if not isinstance(value, bool):
        raise UpdateError(where, f"must be true or false, got {value!r:.40}")
    return value


def _warmup_shapes(value, where: str) -> tuple[tuple[int, ...], ...] | None:
    if value is None:
        return None
    ok = (isinstance(value, list) and len(value) <= MAX_WARMUP_SHAPES
          and all(isinstance(s, list) and 1 <= len(s) <= 8
                  and all(isinstance(d, int) and not isinstance(d, bool) and 1 <= d <= 1 << 16 for d in s)
                  for s in value))
    if not ok:
        raise UpdateError(where, f"must be a list of at most {MAX_WARMUP_SHAPES} input shapes, each a list of 1 to 8 "
                                 f"sizes from 1 to 65536, e.g. [[1, 3, 224, 224]]")
    return tuple(tuple(s) for s in value)


def _max_inference(value, where: str) -> float:
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or value != value
            or not 0 < value <= MAX_MAX_INFERENCE_S):
        raise UpdateError(where, f"must be a number of seconds above 0 and at most {MAX_MAX_INFERENCE_S:.0f}, "
                                 f"got {value!r:.40}")
    return float(value)


def validate_update(body, gpus: int = 0, cpu_count: int | None = None, nodes: set[str] | None = None) -> Update:
    """Check an update against the schema (no file is read: see manager/models.py). ``nodes``:
    the custom resources a Ray cluster's live nodes advertise (``serve --ray``); None: no
    cluster, and a block may not name a ``node``."""
    if not isinstance(body, dict):
        raise UpdateError("body", "must be a JSON object with 'blocks' and 'tasks'")
    unknown = set(body) - TOP_FIELDS
    if unknown:
        raise UpdateError(sorted(unknown)[0], f"unknown field; an update has {', '.join(sorted(TOP_FIELDS))}")
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
        extra = set(b) - BLOCK_FIELDS
        if extra:
            raise UpdateError(f"{where}.{sorted(extra)[0]}", f"unknown field; a block has {', '.join(sorted(BLOCK_FIELDS))}")
        for key in ("name", "model"):
            if key not in b:
                raise UpdateError(f"{where}.{key}", "is required")
        name = _block_name(b["name"], f"{where}.name")
        if name in blocks:
            raise UpdateError(f"{where}.name", f"duplicate block name {name!r}")
        model = _model(b["model"], f"{where}.model")
        node = _node(b.get("node"), f"{where}.node", nodes)
        # a block on another node: this host's GPUs say nothing of that node's (it fails to start there)
        device = _device(b.get("device", "cpu"), f"{where}.device", gpus if node is None else 100)
        cpus = b.get("cpus")
        if cpus is not None:
            if (not isinstance(cpus, list) or not cpus or len(cpus) > 1024
                    or not all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c < cpu_count for c in cpus)):
                raise UpdateError(f"{where}.cpus", f"must be a non-empty list of CPU numbers from 0 to {cpu_count - 1}")
            cpus = tuple(sorted(set(cpus)))
        threads = b.get("threads")
        if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= 256):
            raise UpdateError(f"{where}.threads", "must be an integer from 1 to 256")
        blocks[name] = BlockDecl(
            name=name, model=model, device=device,
            transport=_str(b.get("transport", transport), f"{where}.transport", TRANSPORTS),
            protocol=_str(b.get("protocol", protocol), f"{where}.protocol", PROTOCOLS),
            cpus=cpus, threads=threads,
            max_inference_s=_max_inference(b.get("max_inference_s", DEFAULT_MAX_INFERENCE_S),
                                           f"{where}.max_inference_s"),
            batching=_batching(b.get("batching"), f"{where}.batching"),
            replicas=_replicas(b.get("replicas", 1), f"{where}.replicas"),
            process=_name(b["process"], f"{where}.process") if b.get("process") is not None else None,
            cuda_graphs=_bool(b.get("cuda_graphs", True), f"{where}.cuda_graphs"),
            warmup_shapes=_warmup_shapes(b.get("warmup_shapes"), f"{where}.warmup_shapes"), node=node)
        decl = blocks[name]
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

    tasks: dict[str, list[str]] = {}
    for i, t in enumerate(tasks_in):
        where = f"tasks[{i}]"
        if not isinstance(t, dict):
            raise UpdateError(where, "must be an object with id and path")
        extra = set(t) - {"id", "path"}
        if extra:
            raise UpdateError(f"{where}.{sorted(extra)[0]}", "unknown field; a task has id and path")
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
