r"""The process table: every child the manager supervises, its state and its launcher handle.

A child is a block process (one per replica), a shared process hosting blocks (blocks/host.py)
or the dispatcher. Its ``status`` is a ``ChildState`` (as Ray Serve's ``ReplicaState``)::

    STARTING --READY--> READY --exit, hang, stuck--> RESTARTING --respawn--> (a new STARTING child)
        |                 |                               \--crash loop, boot error--> FAILED
        |                 \--retired, shut down--> STOPPING --exit--> gone
        \--boot error, early exit, no READY in time--> FAILED

The table only holds and names children; the supervisor (manager.py) moves them between states,
and ``ProcessTable`` answers what it asks of them all (who is starting, who serves a block, ...).
Nothing here starts, signals or messages a process, so it is tested without one
(tests/test_manager_units.py).
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from blockflow.core.protocol import identity
from blockflow.core.schema import BlockDecl

from .controller import Controller
from .launcher import ChildHandle


class ChildState(enum.StrEnum):
    """Where a child is in its life (the module's docstring draws the transitions)."""

    STARTING = "starting"       # spawned; READY not yet seen
    READY = "ready"             # serves: pinged, routed to
    RESTARTING = "restarting"   # died or was killed; the supervisor respawns it next round
    FAILED = "failed"           # will not be respawned (boot error, crash loop, no READY in time)
    STOPPING = "stopping"       # asked to stop; STOP -> SIGTERM -> SIGKILL until it exits


@dataclass(eq=False)
class Child:
    """A running block or the dispatcher, as the manager sees it."""

    name: str
    decl: BlockDecl | None          # None for the dispatcher
    incarnation: int
    process: ChildHandle             # manager/launcher.py: how it was started, where it runs
    status: ChildState = ChildState.STARTING
    endpoint: str | None = None
    ready_info: dict = field(default_factory=dict)
    restarts: int = 0                # respawns of this block name since it was declared
    streak: int = 0                  # respawns in the current crash loop (see RESTART_WINDOW)
    last_exit: str | None = None
    failure: str | None = None
    started: float = field(default_factory=time.time)
    spawned_at: float = field(default_factory=time.monotonic)
    ready_at: float = 0.0            # monotonic; silence is counted from here
    #: wall clock: since when requests are routed to this process (READY for a respawn, the switch
    #: for a process an update started); GET /status counts its KPI records from here (metrics.py)
    serving_since: float | None = None
    stop_asked: float | None = None  # monotonic, when stop_later() asked it to stop
    gone: bool = False               # exited and cleaned up after
    block: str = ""                  # the declared block this process is a replica of
    replica: int = 0                 # which replica (0: the one named like the block)
    host: "Child | None" = None      # the shared process it runs in (blocks/host.py), if any
    hosted_spec: str | None = None   # its BlockSpec as JSON, until the host is asked to start it

    @property
    def ident(self) -> bytes:
        return identity(self.name, self.incarnation)

    @property
    def instance(self) -> str:
        return f"{self.name}#{self.incarnation}"

    def mark_ready(self, info: dict) -> None:
        """READY arrived (``info``: the Ready message): it serves from now on."""
        self.status, self.endpoint, self.ready_info, self.ready_at = ChildState.READY, info["endpoint"], info, \
            time.monotonic()
        self.serving_since = time.time()  # publish() routes to it next; an update's switch() says so again

    def describe(self) -> dict:
        d = {"name": self.name, "pid": self.process.pid, "node": self.process.node, "status": self.status.value,
             "endpoint": self.endpoint,
             "restarts": self.restarts, "incarnation": self.incarnation, "last_exit": self.last_exit,
             "failure": self.failure, "started": self.started, "serving_since": self.serving_since}
        if self.decl is not None:
            d.update(self.decl.as_dict())
            d["block"], d["replica"] = self.block, self.replica
        waiting = getattr(self.process, "waiting_for", None)
        if waiting:  # Ray mode: no live node advertises its resource yet (ray_launcher.py)
            d["waiting_for_node"] = waiting
        return d


class HostedProcess:
    """A block in a shared process (blocks/host.py), seen through the little of
    ``multiprocessing.Process`` the manager uses: its pid is the host's; it has exited when the
    host has (the host's exit code), or when the host said its thread ended (0, or 1 when its
    loop crashed). Killing it kills the host: every block of the group goes down with it."""

    def __init__(self, host: "Child", controller: Controller, ident: bytes):
        self.host, self.controller, self.ident = host, controller, ident

    @property
    def node(self) -> str:
        return self.host.process.node

    @property
    def pid(self) -> int | None:
        return self.host.process.pid

    @property
    def exitcode(self) -> int | None:
        code = self.host.process.exitcode
        if code is not None:
            return code
        crashed = self.controller.gone.get(self.ident)
        return None if crashed is None else int(crashed)

    def host_alive(self) -> bool:
        return self.host.process.exitcode is None

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout if timeout is not None else 3600.0)
        while self.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.02)

    def terminate(self) -> None:
        """No SIGTERM for one block of several: it was asked to stop, and kill() is next."""

    def kill(self) -> None:
        self.host.process.kill()


class ProcessTable:
    """The children of one manager, by role.

    ``blocks``: one Child per block process, by process name: a block's replica 0 has the
    block's name, replica r > 0 ``name.r<r>`` (schema.replica_name); ``declared``: the blocks as
    declared; ``hosts``: shared processes by their ``process`` name (each stops once it hosts
    nothing); ``dispatcher``; ``stopping``: children asked to stop and not yet gone."""

    def __init__(self):
        self.blocks: dict[str, Child] = {}
        self.declared: dict[str, BlockDecl] = {}
        self.hosts: dict[str, Child] = {}
        self.dispatcher: Child | None = None
        self.stopping: list[Child] = []
        self._incarnations: dict[str, int] = {}

    def next_incarnation(self, name: str) -> int:
        """Incarnations of a name only grow: an identity is never reused within a server's life."""
        inc = self._incarnations.get(name, -1) + 1
        self._incarnations[name] = inc
        return inc

    def supervised(self) -> list[Child]:
        """The children pinged and respawned: the current blocks and the dispatcher."""
        return list(self.blocks.values()) + ([self.dispatcher] if self.dispatcher else [])

    def serves(self, c: Child) -> bool:
        """Whether ``c`` is the current process of its name (not one an update is starting)."""
        return c is self.dispatcher or self.blocks.get(c.name) is c

    def replicas(self, block: str) -> list[Child]:
        """The processes of a declared block, replica 0 first."""
        decl = self.declared.get(block)
        return [self.blocks[n] for n in decl.replica_names() if n in self.blocks] if decl else []

    def ready(self) -> bool:
        """The dispatcher and every block serve."""
        return (self.dispatcher is not None and self.dispatcher.status is ChildState.READY
                and all(c.status is ChildState.READY for c in self.blocks.values()))

    def dispatcher_ready(self) -> Child | None:
        d = self.dispatcher
        return d if d is not None and d.status is ChildState.READY else None

    def clear(self) -> None:
        """Shutdown: the table forgets every block (the caller stops them)."""
        self.blocks.clear()
        self.declared.clear()
        self.hosts.clear()
