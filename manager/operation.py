"""One change to the system (an update, a block deletion, DELETE /system) on its way through
the supervisor: what it wants and which phase it is in (thesis 3.6).

A REST handler checks the change at the edge and queues an ``Operation``; the supervisor
(manager.py, ``Manager.reconcile``) moves it through its phases, one step per round, never
waiting on a process::

    QUEUED --begin: plan, spawn the new blocks--> STARTING
    STARTING --every new block READY: prepare()--> PREPARING
    PREPARING --acknowledged, or PREPARE_TIMEOUT: switch(), publish--> SWITCHED
    SWITCHED --acknowledged, or ACK_TIMEOUT--> DRAINING
    DRAINING --the dispatcher holds nothing on a retired block, or DRAIN_TIMEOUT: stop them--> STOPPING
    STOPPING --every retired block gone--> DONE
    STARTING, PREPARING --a new block failed: stop the new ones (the old never changed)--> FAILED

Nothing here starts or messages a process: the phase, the blocks the operation started and
retired, and the acknowledgements it waits on are data the supervisor reads and writes
(tests/test_manager_units.py drives them with fake children).
"""
from __future__ import annotations

import enum
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Callable

from blockflow.core.schema import BlockDecl

from .children import Child, ChildState
from .reconcile import Desired, Plan


class Phase(enum.StrEnum):
    """How far an operation got (the module's docstring draws the transitions)."""

    QUEUED = "queued"           # waiting for the one before it
    STARTING = "starting"       # its new blocks load; nothing else changed yet
    PREPARING = "preparing"     # every new block is READY; its senders open sockets and slots to them
    SWITCHED = "switched"       # the desired state is the current one; processes take the new topology
    DRAINING = "draining"       # requests on the retired blocks' paths finish
    STOPPING = "stopping"       # the retired blocks were asked to stop
    DONE = "done"
    FAILED = "failed"


class Kind(enum.StrEnum):
    UPDATE = "update"
    DELETE_BLOCK = "delete_block"
    DELETE_ALL = "delete_all"


@dataclass(eq=False)
class Operation:
    """One change queued by a REST handler: what it wants (computed when it begins, against
    the state of that moment) and how far the supervisor got with it."""

    kind: Kind
    desire: Callable[[], Desired]               # raises ValueError (-> 409) or KeyError (-> 404)
    body: dict | None = None                    # the update as posted (kept in state.json)
    transport: str | None = None
    manifests: dict = field(default_factory=dict)
    future: Future = field(default_factory=Future)
    started: float = field(default_factory=time.monotonic)
    # progress, set by the supervisor
    phase: Phase = Phase.QUEUED
    since: float = 0.0                          # monotonic: when ``phase`` began
    desired: Desired | None = None
    processes: dict[str, BlockDecl] = field(default_factory=dict)  # the desired blocks, one per replica
    plan: Plan | None = None
    new: dict[str, Child] = field(default_factory=dict)
    retired: list[Child] = field(default_factory=list)
    diff: dict = field(default_factory=dict)
    #: what the current phase waits on: the acknowledgements of prepare() (PREPARING) or of the
    #: switch's topology (SWITCHED)
    acks: list[Future] = field(default_factory=list)
    switched: float = 0.0                       # monotonic: when the switch happened (DRAIN_TIMEOUT counts from it)
    outstanding: Future | None = None           # DRAINING: the dispatcher's count, asked and not yet answered

    def enter(self, phase: Phase, now: float | None = None) -> None:
        self.phase, self.since = phase, time.monotonic() if now is None else now

    def acknowledged(self, timeout: float, now: float) -> bool:
        """Every process answered what this phase sent, or ``timeout`` passed since it began."""
        return all(f.done() for f in self.acks) or now - self.since > timeout

    def failed_block(self) -> Child | None:
        """A new block that did not start (it fails the whole operation)."""
        return next((c for c in self.new.values() if c.status is ChildState.FAILED), None)

    def new_ready(self) -> bool:
        return all(c.status is ChildState.READY for c in self.new.values())

    def result(self, version: int, shm: dict | None) -> dict:
        """What the caller is answered once the operation is DONE."""
        if self.kind is Kind.UPDATE:
            return {"version": version, "diff": self.diff, "seconds": round(time.monotonic() - self.started, 3),
                    "shm": shm}
        if self.kind is Kind.DELETE_BLOCK:
            return {"removed": self.plan.drain[0], "version": version}
        return {"removed": list(self.plan.drain), "version": version}

    def resolve(self, result=None, error: BaseException | None = None) -> None:
        """Answer the caller, unless it gave up waiting already."""
        resolve(self.future, result, error)


def resolve(fut: Future, result=None, error: BaseException | None = None) -> None:
    """Set ``fut`` unless it is set already (a caller that gave up, a second answer at shutdown)."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except InvalidStateError:
        pass
