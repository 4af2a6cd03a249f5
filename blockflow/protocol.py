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

Control messages travel between the controller (ROUTER) and each process (DEALER, identity
``<name>#<incarnation>``) as single JSON frames:

- process -> controller: ``{"t": "ready", "name", "inc", "pid", "endpoint", ...}`` once
  it can serve, then ``{"t": "reply", "id", "ok", "result"|"error"}`` per command;
- controller -> process: ``{"t": "cmd", "id", "cmd", "args"}`` with ``cmd`` one of
  ``ping``, ``store``, ``monitor``, ``update``, ``stop`` and, for the dispatcher,
  ``tasks``, ``fail``, ``outstanding``; an unknown command is answered with an error naming
  the known ones.

The child's side of this contract (READY, boot error, commands by name, the parent watchdog,
the exit code) is written once for blocks and the dispatcher, in ``blockflow/childproc.py``.
"""
import enum


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

    def __str__(self) -> str:
        return self.value

EXIT_NAMES = {EXIT_OK: "stopped", EXIT_CRASH: "crashed", EXIT_BOOT_ERROR: "boot error",
              EXIT_ORPHANED: "orphaned", EXIT_NODE_LOST: "its node was lost"}

#: Name of the return hop at the end of every path: the dispatcher's result socket.
RETURN_HOP = "@dispatcher"
#: DEALER identity of the dispatcher on the control channel.
DISPATCHER = "@dispatcher"


def identity(name: str, incarnation: int) -> bytes:
    return f"{name}#{incarnation}".encode()


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
