"""Every ``BLOCKFLOW_*`` environment variable, read once, here.

Other modules import the values from this one and pass them down in the specs they build; no
other module reads the environment for a setting. The README's settings table is generated from
:data:`SETTINGS` (``python -m blockflow.core.settings``), and a test checks that it is current.

A value that cannot be parsed stops the process at import with a message that names the
variable, what it holds and what it should hold.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Setting:
    name: str                    #: the environment variable
    default: object
    parse: Callable[[str], object]
    meaning: str
    shown: str = ""              #: the default as the README shows it


SETTINGS: dict[str, Setting] = {}


def _read(name: str, default, parse, meaning: str, shown: str = ""):
    SETTINGS[name] = Setting(name, default, parse, meaning, shown or str(default))
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return parse(raw)
    except ValueError:
        raise SystemExit(f"blockflow: environment variable {name}={raw!r} is not a valid "
                         f"{getattr(parse, '__name__', 'value')}; unset it or give e.g. {default!r}") from None


def _non_negative(cast, name: str):
    """A parser of numbers ``cast(raw) >= 0``; ``name`` is what an error calls it."""
    def parse(raw: str):
        v = cast(raw)
        if v < 0:
            raise ValueError(raw)
        return v
    parse.__name__ = name
    return parse


_non_negative_int = _non_negative(int, "non-negative integer")
_seconds = _non_negative(float, "number of seconds")


def _flag(raw: str) -> bool:
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


_flag.__name__ = "flag (1 or 0)"


def _one_of(what: str, *choices: str):
    """A parser of one of ``choices`` (any case, spaces around ignored); ``what`` names it in an error."""
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise ValueError(raw)
        return value
    parse.__name__ = f"{what} ({' or '.join(repr(c) for c in choices)})"
    return parse


_hand_over = _one_of("hand-over mode", "event", "sync")

# -- data plane ---------------------------------------------------------------------------------
MAX_TENSOR_BYTES: int = _read("BLOCKFLOW_MAX_TENSOR_BYTES", 1 << 30, _non_negative_int,
                              "largest tensor accepted on any socket, in bytes", "1 GiB")
MAX_HEADER_BYTES: int = _read("BLOCKFLOW_MAX_HEADER_BYTES", 64 * 1024, _non_negative_int,
                              "largest message header, in bytes", "64 KiB")
WINDOW: int = _read("BLOCKFLOW_WINDOW", 8, _non_negative_int,
                    "TensorMQ slots in flight per edge (back-pressure); also `serve --window`")
# Note [A window made at once, up to a budget] in tensormq/shm.py
WINDOW_UPFRONT_BYTES: int = _read("BLOCKFLOW_WINDOW_UPFRONT", 256 << 20, _non_negative_int,
                                  "bytes of slots an edge makes at its first use: its whole window where it "
                                  "fits (at least one slot); the rest one slot at a time, when every slot is in "
                                  "flight", "256 MiB")
SHM_DIR: str = _read("BLOCKFLOW_SHM_DIR", "/dev/shm", str,
                     "tmpfs directory that holds the TensorMQ slots (a private subdirectory per server); "
                     "point it at a larger tmpfs when /dev/shm is small")
# Note [Lent slots] in dispatcher/lending.py
LEASE_IDLE_S: float = _read("BLOCKFLOW_LEASE_IDLE", 60.0, _seconds,
                            "seconds a local client may send no request before the dispatcher ends its lease of "
                            "shared-memory slots (the client asks for new ones after half of it)", "60 s")
SEND_TIMEOUT: float = _read("BLOCKFLOW_SEND_TIMEOUT", 10.0, _seconds,
                            "seconds a block waits for a free slot or a full socket before the request fails",
                            "10 s")
MAX_QUEUE: int = _read("BLOCKFLOW_MAX_QUEUE", 64, _non_negative_int,
                       "tensors a block queues before answering `overloaded`")
MAX_PENDING: int = _read("BLOCKFLOW_MAX_PENDING", 1024, _non_negative_int,
                         "requests the dispatcher holds waiting for a slot")
REQUEST_TIMEOUT: float = _read("BLOCKFLOW_REQUEST_TIMEOUT", 30.0, _seconds,
                               "time a request may spend inside the pipeline", "30 s")
CLIENT_TIMEOUT: float = _read("BLOCKFLOW_CLIENT_TIMEOUT", 30.0, _seconds,
                              "default deadline of one client call", "30 s")


# -- block cache (a shared process with memory_budget_mb: blocks/cache.py) -------------------------
CACHE_POLICY: str = _read("BLOCKFLOW_CACHE_POLICY", "sharing", _one_of("eviction policy", "sharing", "lru"),
                          "which parked-block victim a swap-in evicts first: `sharing` (least recently used among "
                          "blocks of one task, a block several tasks share last) or `lru`")
CACHE_WAIT_S: float = _read("BLOCKFLOW_CACHE_WAIT", 5.0, _seconds,
                            "longest a request waits for room in its shared process's memory budget before it is "
                            "answered `overloaded` (at most half the block's max_inference_s)", "5 s")

# -- supervision ----------------------------------------------------------------------------------
READY_TIMEOUT: float = _read("BLOCKFLOW_READY_TIMEOUT", 60.0, _seconds,
                             "time a new process has to load its model and announce READY", "60 s")
PING_INTERVAL: float = _read("BLOCKFLOW_PING_INTERVAL", 0.25, _seconds,
                             "period of the controller's health pings", "0.25 s")
# 3 s, not less: on a loaded 2-core machine a healthy dispatcher went 1.09 s without answering a
# ping (blocks loading their models beside it) and was killed with a request in flight. A frozen
# model does not need this timeout: the ping's busy_s catches it (max_inference_s).
HANG_TIMEOUT: float = _read("BLOCKFLOW_HANG_TIMEOUT", 3.0, _seconds,
                            "silence after which a process is considered hung and killed", "3 s")
# The dispatcher's control thread answers its pings (dispatcher/process.py), so a main loop stuck
# in one step shows only in the ping's beat_age_s. Idle, the loop goes around every 50 ms; busy,
# copying a 100 MB tensor and making its slots took it seconds on a loaded 2-core machine.
LOOP_STALL: float = _read("BLOCKFLOW_LOOP_STALL", 10.0, _seconds,
                          "time the dispatcher's main loop may go without coming round before it is "
                          "considered hung and killed", "10 s")
# A process on another node cannot tell a lost manager by its pid: it goes by silence. The
# manager pings every PING_INTERVAL and stops pinging an incarnation it gave up for lost (its node
# was declared dead; it has a successor elsewhere), so a partition that heals leaves no duplicate.
CONTROL_LEASE: float = _read("BLOCKFLOW_CONTROL_LEASE", 10.0, _seconds,
                             "a process on another node (Ray mode) that hears nothing from the manager "
                             "for this long stops by itself", "10 s")
# The manager escalates a child's stop to SIGTERM and SIGKILL within seconds (manager/supervision.py);
# nobody does for an orphan (its manager or node agent is gone), so its own stop has a deadline.
STOP_DEADLINE: float = _read("BLOCKFLOW_STOP_DEADLINE", 30.0, _seconds,
                             "a process still running this long after it began to stop writes its threads' "
                             "stacks to its log, removes its sockets and slots, and exits (a shared process as "
                             "a whole, never one member)", "30 s")
MAX_RESTARTS: int = _read("BLOCKFLOW_MAX_RESTARTS", 5, _non_negative_int,
                          "respawns of a crash-looping process before it is marked failed")
RESTART_WINDOW: float = _read("BLOCKFLOW_RESTART_WINDOW", 10.0, _seconds,
                              "a process that ran this long before dying starts a fresh restart budget", "10 s")
DRAIN_TIMEOUT: float = _read("BLOCKFLOW_DRAIN_TIMEOUT", 10.0, _seconds,
                             "time a removed block has to finish its queued requests", "10 s")

# -- limits of an update --------------------------------------------------------------------------
MAX_BLOCKS: int = _read("BLOCKFLOW_MAX_BLOCKS", 64, _non_negative_int, "blocks in one system update")
MAX_TASKS: int = _read("BLOCKFLOW_MAX_TASKS", 256, _non_negative_int, "tasks in one system update")

# -- block processes ------------------------------------------------------------------------------
MALLOC_TRIM: int = _read("BLOCKFLOW_MALLOC_TRIM", 256 << 20, _non_negative_int,
                         "freed heap memory a block process keeps instead of returning it to the kernel "
                         "(glibc M_TRIM_THRESHOLD, bytes): with glibc's default a ResNet50 block page-faults its "
                         "activations back in on every request; 0 keeps glibc's default", "256 MiB")

OUTPUT_IN_SLOT: bool = _read("BLOCKFLOW_OUTPUT_IN_SLOT", True, _flag,
                             "a CPU block's model allocates its output in a TensorMQ slot of the next hop instead of "
                             "copying it there (Note [Outputs made in a slot]; needs the extension that `make install` "
                             "builds); 0 copies", "1")
DATAGRAMS: bool = _read("BLOCKFLOW_DATAGRAMS", True, _flag,
                        "a one-frame message to a process on this host (a TensorMQ header, a local client's request "
                        "in lent slots and its reply) goes by a Unix datagram "
                        "socket beside its ipc:// ZeroMQ socket, and by ZeroMQ whenever the datagram is refused "
                        "(Note [A datagram beside the socket] in tensormq/datagram.py); 0 sends everything by ZeroMQ",
                        "1")
CUDA_HANDOVER: str = _read("BLOCKFLOW_CUDA_HANDOVER", "event", _hand_over,
                           "how a GPU-to-GPU hop is ordered (Note [GPU hand-over order] in blocks/runner.py): "
                           "`event`, the producer records the slot's inter-process CUDA event and sends at once, the "
                           "consumer's stream waits on it; `sync`, the producer synchronises before it sends")
CUDA_STACK_BYTES: int = _read("BLOCKFLOW_CUDA_STACK_BYTES", 256, _non_negative_int,
                              "per-thread stack a GPU block's CUDA context reserves, in bytes (the driver raises it "
                              "for a kernel that needs more); 0 keeps the driver's 1 KiB, which reserves 264 MB per "
                              "process on an H200 (experiments/vram.py)", "256")
EXT_DIR: str = _read("BLOCKFLOW_EXT_DIR", os.path.join(sys.prefix, "lib", "blockflow-ext"), str,
                     "where `blockflow build-ext` compiles that extension (one "
                     "subdirectory per PyTorch version and source)", "`<python prefix>/lib/blockflow-ext`")

# -- observability --------------------------------------------------------------------------------
MONITOR_INTERVAL: float = _read("BLOCKFLOW_MONITOR_INTERVAL", 0.25, _seconds,
                                "period of the per-block resource sampler (psutil, pynvml)", "0.25 s")
KPI_FLUSH_EVERY: int = _read("BLOCKFLOW_KPI_FLUSH_EVERY", 2000, _non_negative_int,
                             "KPI records a block buffers before writing them out")
KPI_FLUSH_INTERVAL: float = _read("BLOCKFLOW_KPI_FLUSH_INTERVAL", 1.0, _seconds,
                                  "longest time a KPI record stays in a block's memory before it is written "
                                  "(what a `kill -9` of a block can lose)", "1 s")


def _ratio(raw: str) -> float:
    v = float(raw)
    if not 0.0 <= v <= 1.0:
        raise ValueError(raw)
    return v


_ratio.__name__ = "ratio between 0 and 1"

OTLP_ENDPOINT: str | None = _read("BLOCKFLOW_OTLP_ENDPOINT", None, str,
                                  "OTLP/HTTP traces endpoint (e.g. `http://127.0.0.1:4318/v1/traces`): set, the "
                                  "dispatcher and every block record OpenTelemetry spans of sampled requests "
                                  "(blockflow/core/tracing.py); unset, nothing is recorded or imported", "none")
TRACE_RATIO: float = _read("BLOCKFLOW_TRACE_RATIO", 0.01, _ratio,
                           "share of requests traced when the client sends no `traceparent` (one that does "
                           "decides for its request)")
TRACE_EXPORT_DELAY: float = _read("BLOCKFLOW_TRACE_EXPORT_DELAY", 1.0, _seconds,
                                  "longest time a finished span waits in a process before it is exported", "1 s")
LOG_LEVEL: str = _read("BLOCKFLOW_LOG", "INFO", str.upper, "log level of every process (DEBUG, INFO, WARNING, ...)")

# -- where the commands find a server -------------------------------------------------------------
URL: str = _read("BLOCKFLOW_URL", "http://127.0.0.1:8080", str,
                 "the REST URL `blockflow update`, `status` and `down` call when no `--url` is given "
                 "(`blockflow serve --port` elsewhere: set it once)", "`http://127.0.0.1:8080`")
DISPATCHER: str = _read("BLOCKFLOW_DISPATCHER", "tcp://127.0.0.1:5580", str,
                        "the dispatcher address `blockflow load` sends to when no `--address` is given "
                        "(`serve --dispatcher-port` elsewhere)", "`tcp://127.0.0.1:5580`")

# -- security -------------------------------------------------------------------------------------
TOKEN: str | None = _read("BLOCKFLOW_TOKEN", None, str,
                          "shared secret: REST calls and client requests must carry it (`serve --token`)", "none")


def markdown_table() -> str:
    """The README's settings table."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for s in SETTINGS.values():
        rows.append(f"| `{s.name}` | {s.shown} | {s.meaning} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.stdout.write(markdown_table() + "\n")
