"""What BlockFlow processes say to each other outside the data path.

Exit codes are a protocol between a block (or the dispatcher) and the manager:

=====================  ====  ========================================================
EXIT_OK                0     asked to stop, stopped cleanly
EXIT_CRASH             1     unexpected error; the manager respawns it (restart limit)
EXIT_BOOT_ERROR        3     cannot start (model missing or corrupt, bad spec, cannot
                             bind): respawning would fail the same way, so it is marked
                             failed instead
EXIT_ORPHANED          4     its manager is gone; it shut itself down
=====================  ====  ========================================================

Control messages travel between the controller (ROUTER, manager/controller.py) and each
process -- the dispatcher, a block, a shared process (``host``, blocks/host.py) and each block
it hosts -- (DEALER, identity ``<name>#<incarnation>``) as single JSON frames. Every one is a
Struct of this module, written with ``encode`` and read with ``decode_control`` (controller
side) or ``decode_command`` (process side); ``t`` says which:

===========  ====================  ==================================================
``t``        from -> to            what
===========  ====================  ==================================================
ready        process -> manager    ``Ready``: it serves (once), the protocol ``v`` it speaks
boot_error   process -> manager    ``BootFailure``: why it cannot start
gone         host -> manager       ``Gone``: a hosted block's thread ended
cmd          manager -> process    ``Command``: ``cmd`` (a ``Cmd``) and its ``args``
reply        process -> manager    ``Reply``: per command, ``result`` or ``error``
===========  ====================  ==================================================

The commands (``Cmd``) and their arguments (``ARGS``):

===============  ===========================  =========================================
``cmd``          answered by                  ``args``
===============  ===========================  =========================================
ping             every process                none
stop             every process                none
store            a block                      none
monitor          a block                      ``Monitor``: ``enabled``
update           a block, the dispatcher      ``Topology``: ``live``, ``devices``,
                                              ``near``, ``transport``
host             a shared process             ``Host``: the ``spec`` of a block to start
tasks            the dispatcher               ``Tasks``: the task table, its ``version``
fail             the dispatcher               ``Fail``: ``blocks`` on failed paths, ``reason``
outstanding      the dispatcher               ``Outstanding``: ``blocks``
===============  ===========================  =========================================

A process answers the commands it has a ``cmd_<name>`` method for (``ChildProcess`` finds
them from ``Cmd``); another command is answered with an error naming the ones it knows.

``PROTOCOL_VERSION`` is the one version of what BlockFlow processes say to each other: the
control messages here (a process says it in READY; the controller refuses one that speaks
another, e.g. a node of a Ray cluster running another BlockFlow) and the data headers
(``v`` of tensormq/wire.py's ``DataHeader``, ``BlockError``, ``ClientRequest`` and ``ClientReply``).

The child's side of this contract (READY, boot error, commands by name, the parent watchdog,
the exit code) is written once for blocks and the dispatcher, in ``blockflow/core/childproc.py``.
"""
import enum
from typing import Any, Literal

import msgspec

from blockflow.core.header import MAX_HEADER_BYTES, WireError, not_utf8

#: The version of every message between BlockFlow processes (see above).
PROTOCOL_VERSION = 1


class ExitCode(enum.IntEnum):
    OK = 0
    CRASH = 1
    BOOT_ERROR = 3
    ORPHANED = 4
    #: never an exit of the process itself: the Ray launcher's word for a child whose node died
    #: or was removed from the cluster (manager/ray_launcher.py), its exit code unknown
    NODE_LOST = 5


EXIT_OK = ExitCode.OK
EXIT_CRASH = ExitCode.CRASH
EXIT_BOOT_ERROR = ExitCode.BOOT_ERROR
EXIT_ORPHANED = ExitCode.ORPHANED
EXIT_NODE_LOST = ExitCode.NODE_LOST


class ErrorCode(str, enum.Enum):
    """The ``code`` of every error reply a client can get; one place, so clients can match on it."""

    BAD_REQUEST = "bad_request"        #: the message could not be parsed
    BAD_INPUT = "bad_input"            #: the tensor does not fit the task (dtype, shape)
    BAD_RESULT = "bad_result"          #: a block produced something that cannot be returned
    UNAUTHORIZED = "unauthorized"      #: a token is required and was missing or wrong
    UNKNOWN_TASK = "unknown_task"      #: no such task is served now
    OVERLOADED = "overloaded"          #: a queue is full; retry later
    TIMEOUT = "timeout"                #: the request's deadline passed inside the pipeline
    BLOCK_FAILED = "block_failed"      #: a block on the path died, hung or was removed
    UNAVAILABLE = "unavailable"        #: the system cannot serve now (e.g. restarting)
    SHUTDOWN = "shutdown"              #: the server is stopping
    DISCONNECTED = "disconnected"      #: the client lost its connection; the request may have run
    NO_SHARED_MEMORY = "no_shared_memory"  #: slot memory could not be reserved (shared memory is full)
    ERROR = "error"                    #: a block could not run the request (its model raised)

    def __str__(self) -> str:
        return self.value

    @classmethod
    def of(cls, code) -> "ErrorCode":
        """The code an error message from a block carries; ERROR for none or one no client knows."""
        try:
            return cls(code)
        except ValueError:
            return cls.ERROR

EXIT_NAMES = {EXIT_OK: "stopped", EXIT_CRASH: "crashed", EXIT_BOOT_ERROR: "boot error",
              EXIT_ORPHANED: "orphaned", EXIT_NODE_LOST: "its node was lost"}

#: Name of the return hop at the end of every path: the dispatcher's result socket.
RETURN_HOP = "@dispatcher"
#: DEALER identity of the dispatcher on the control channel.
DISPATCHER = "@dispatcher"


def identity(name: str, incarnation: int) -> bytes:
    return f"{name}#{incarnation}".encode()


def canonical_device(value: str) -> str:
    """One spelling per device, so that device strings compare (a block's declared ``device``, the
    ``devices`` of a ``Topology``): 'cuda' is 'cuda:0' (and what
    torch.cuda.set_device needs: it refuses a device without an index); 'cuda:01' is 'cuda:1'."""
    if value == "cuda":
        return "cuda:0"
    if value.startswith("cuda:") and value[5:].isdigit():
        return f"cuda:{int(value[5:])}"
    return value


def describe_exit(code: int | None) -> str:
    """Human words for a child's exit code (negative: killed by that signal)."""
    if code is None:
        return "still running"
    if code < 0:
        import signal
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code} ({EXIT_NAMES.get(code, 'error')})"



# -- control messages ----------------------------------------------------------------------------

class Cmd(str, enum.Enum):
    """The commands the controller sends (the table above)."""

    PING = "ping"
    STOP = "stop"
    STORE = "store"
    MONITOR = "monitor"
    UPDATE = "update"
    HOST = "host"
    TASKS = "tasks"
    FAIL = "fail"
    OUTSTANDING = "outstanding"

    def __str__(self) -> str:
        return self.value


class NoArgs(msgspec.Struct):
    """The arguments of a command that takes none."""


class Monitor(msgspec.Struct):
    enabled: bool = True


class Topology(msgspec.Struct, omit_defaults=True):
    """Where tensors may go now: the ``live`` endpoints, each one's device, and (Ray mode) the
    receivers on the sender's node (``near``: TCP endpoint -> endpoint on this node); to the
    dispatcher also how requests reach their first block (``transport``)."""

    live: list[str] = []
    devices: dict[str, str] | None = None
    near: dict[str, str] | None = None
    transport: Literal["tensormq", "zeromq"] | None = None
    #: before an update switches tasks (Note [Ready to serve] in blocks/process.py): the next
    #: hops to connect to and make slots towards now; to the dispatcher each one's task input
    #: (``{"dtype", "shape"}``, None where unknown), to a block None
    prepare: dict[str, dict | None] | None = None
    #: to a block of a shared process with a memory budget: how many tasks' paths go through it
    #: (its block cache evicts a block several tasks share last: blocks/cache.py)
    tasks: int | None = None


class Host(msgspec.Struct):
    spec: str  #: the BlockSpec of a block to start in the shared process, as JSON


class Tasks(msgspec.Struct):
    tasks: dict[str, dict]
    version: int | None = None


class Fail(msgspec.Struct):
    blocks: list[str] = []
    reason: str = "a block failed"


class Outstanding(msgspec.Struct):
    blocks: list[str] = []  #: count the requests through these block instances; empty: all


#: The arguments of each command.
ARGS: dict[Cmd, type[msgspec.Struct]] = {
    Cmd.PING: NoArgs, Cmd.STOP: NoArgs, Cmd.STORE: NoArgs, Cmd.MONITOR: Monitor, Cmd.UPDATE: Topology,
    Cmd.HOST: Host, Cmd.TASKS: Tasks, Cmd.FAIL: Fail, Cmd.OUTSTANDING: Outstanding}
_ARGS_DECODERS = {cmd: msgspec.json.Decoder(t) for cmd, t in ARGS.items()}


class Command(msgspec.Struct, tag="cmd", tag_field="t"):
    """controller -> process. ``cmd`` stays a string here, so that a command this process does
    not know is answered (with the ones it knows) rather than dropped; ``args`` is read with
    the command's own Struct (``command_args``)."""

    id: int
    cmd: str
    args: msgspec.Raw = msgspec.Raw(b"{}")


class Reply(msgspec.Struct, tag="reply", tag_field="t", omit_defaults=True):
    """process -> controller: the answer to command ``id``."""

    id: int | None
    ok: bool
    result: Any = None
    error: str | None = None


class Ready(msgspec.Struct, tag="ready", tag_field="t"):
    """process -> controller, once it serves: where (``endpoint``: a block's data socket, the
    dispatcher's front; Ray mode: ``near``, the same block on its own node; the dispatcher's
    result sockets, ``results``)."""

    name: str
    inc: int
    pid: int
    v: int = PROTOCOL_VERSION
    endpoint: str | None = None
    device: str | None = None
    near: str | None = None
    results: list[str] | None = None


class BootFailure(msgspec.Struct, tag="boot_error", tag_field="t"):
    """process -> controller: why it cannot start (it exits ExitCode.BOOT_ERROR)."""

    name: str
    inc: int
    pid: int
    error: str
    v: int = PROTOCOL_VERSION


class Gone(msgspec.Struct, tag="gone", tag_field="t"):
    """shared process -> controller: the thread of a block it hosted ended (``crashed``: raised)."""

    member: str  #: ``<name>#<incarnation>``
    crashed: bool = False


ControlMessage = Ready | BootFailure | Gone | Reply
_ENCODER = msgspec.json.Encoder()
_CONTROL_DECODER = msgspec.json.Decoder(ControlMessage)
_COMMAND_DECODER = msgspec.json.Decoder(Command)


def encode(msg: msgspec.Struct) -> bytes:
    """One control message as its JSON frame."""
    return _ENCODER.encode(msg)


def command(rid: int, cmd: Cmd | str, args: msgspec.Struct | dict | None = None) -> Command:
    """Command ``cmd`` with its arguments checked against its Struct (a dict is converted:
    ValueError naming the field when it does not fit)."""
    cmd = Cmd(cmd)
    if not isinstance(args, msgspec.Struct):
        try:
            args = msgspec.convert(args or {}, ARGS[cmd])
        except msgspec.ValidationError as exc:
            raise ValueError(f"arguments of {cmd}: {exc}") from None
    return Command(rid, cmd.value, msgspec.Raw(_ENCODER.encode(args)))


def decode_frame(decoder: msgspec.json.Decoder, frame, what: str, limit: int | None = None):
    """``frame`` (bytes, memoryview or zmq.Frame) decoded as ``decoder``'s Struct, or WireError
    naming ``what`` and the field that is wrong (every typed message between processes)."""
    buf = getattr(frame, "buffer", frame)
    if limit is not None and len(buf) > limit:
        raise WireError(f"{what} is {len(buf)} bytes, more than the limit of {limit}")
    try:
        return decoder.decode(buf)
    except msgspec.ValidationError as exc:
        raise WireError(f"{what}: {exc}") from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise WireError(f"{what} is not JSON ({exc}); pickles and other formats are refused") from None
    except UnicodeDecodeError as exc:
        raise WireError(not_utf8(exc)) from None


def decode_control(frame) -> Ready | BootFailure | Gone | Reply:
    """A message a process sent the controller, typed, or WireError naming what is wrong."""
    return decode_frame(_CONTROL_DECODER, frame, "control message")


def decode_command(frame) -> Command:
    """A command the controller sent, or WireError naming what is wrong (a process reads at
    most MAX_HEADER_BYTES from its control socket, as from its data socket)."""
    return decode_frame(_COMMAND_DECODER, frame, "command", MAX_HEADER_BYTES)


def command_args(cmd: Cmd, raw: msgspec.Raw) -> msgspec.Struct:
    """The arguments of ``cmd``, typed (WireError naming the field when they do not fit)."""
    return decode_frame(_ARGS_DECODERS[cmd], raw, f"arguments of {cmd}")
