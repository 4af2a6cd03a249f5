"""The manager's fast tier (issue 41 item 3): the process table and the update operation driven
by fake children, no processes, the whole file in seconds.

The fake is at the launcher seam (manager/launcher.py), as Ray Serve tests its controller with
fake replicas: ``FakeLauncher.start`` returns a ``FakeChild``, a thread that speaks the control
protocol to the manager's real controller (READY or a boot error, an answer to every command,
STOP) and runs no model. A test decides what a child does (boot error, exit, stay silent, die,
hang, hold requests) and watches the real supervisor carry an update through its phases
(manager/operation.py): apply, drain, rollback, a child dying mid-update, a node down.
"""
from __future__ import annotations

import os
import threading
import time

import pytest
import zmq

from blockflow.core import protocol
from blockflow.manager import manager as mgr, supervision
from blockflow.manager.children import ChildState, ProcessTable
from blockflow.manager.manager import Manager, UpdateFailed
from blockflow.manager.operation import Kind, Operation, Phase
from blockflow.manager.reconcile import Desired
from blockflow.manager.state import StateDir
from blockflow.core.protocol import DISPATCHER, EXIT_BOOT_ERROR, EXIT_NODE_LOST, BootFailure, Cmd, Ready
from blockflow.core.schema import BlockDecl

from conftest import wait_for

TIMEOUT = 10.0  # every wait below is a bounded poll; on a loaded 2-core box a round can take long


class FakeChild:
    """A launched child as the manager sees it (launcher.ChildHandle), run by a thread.

    ``behaviour``: ``ok`` (READY at once), ``later`` (READY once ``boot()`` is called),
    ``boot_error`` (BootFailure, exit EXIT_BOOT_ERROR), ``exit`` (exit 1 before READY)."""

    def __init__(self, launcher: "FakeLauncher", spec, node: str, behaviour: str):
        self.launcher, self.spec, self.behaviour = launcher, spec, behaviour
        self.name = getattr(spec, "name", DISPATCHER)
        self.node = node
        self.pid = None                # no process: nothing for the manager to signal or clean
        self.exitcode: int | None = None
        self.commands: list[Cmd] = []  # every command received, in order
        self.outstanding = 0           # as a dispatcher: requests it holds on the blocks asked about
        self.waiting_for: str | None = None
        self._booted = threading.Event()
        self._hung = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"fake-{self.name}", daemon=True)

    # -- what the manager calls (launcher.ChildHandle) -------------------------------------------
    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        if self._thread.ident is not None:
            self._thread.join(timeout)

    def terminate(self) -> None:
        self.exit(-15)

    def kill(self) -> None:
        self.exit(-9)

    # -- what a test does to it --------------------------------------------------------------------
    def boot(self) -> None:
        self._booted.set()

    def hang(self) -> None:
        """Stop answering (a process stuck with its control thread too)."""
        self._hung.set()

    def exit(self, code: int) -> None:
        if self.exitcode is None:
            self.exitcode = code
        self._done.set()

    @property
    def ident(self) -> bytes:
        return protocol.identity(self.name, self.spec.incarnation)

    # -- the thread --------------------------------------------------------------------------------
    def start(self) -> None:
        if self.behaviour != "later":
            self._booted.set()
        self._thread.start()

    def _run(self) -> None:
        sock = self.launcher.ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.identity = self.ident
        sock.connect(self.launcher.controller)
        try:
            while not self._booted.wait(0.01):
                if self._done.is_set():
                    return
            inc = self.spec.incarnation
            if self.behaviour == "boot_error":
                sock.send(protocol.encode(BootFailure(self.name, inc, os.getpid(), "fake: cannot load the model")))
                # a real child's exit takes longer than the message: it exits once the controller has it
                deadline = time.monotonic() + TIMEOUT
                while self.ident not in self.launcher.manager.controller.boot_errors and time.monotonic() < deadline:
                    time.sleep(0.005)
                self.exit(EXIT_BOOT_ERROR)
                return
            if self.behaviour == "exit":
                self.exit(1)
                return
            if self.name == DISPATCHER:
                ready = Ready(self.name, inc, os.getpid(), endpoint=self.spec.address,
                              results=[f"ipc://fake/results#{inc}"])
            else:
                ready = Ready(self.name, inc, os.getpid(), endpoint=f"ipc://fake/{self.name}#{inc}",
                              device=self.spec.device)
            sock.send(protocol.encode(ready))
            while not self._done.is_set():
                if not sock.poll(10):
                    continue
                msg = protocol.decode_command(sock.recv())
                cmd = Cmd(msg.cmd)
                self.commands.append(cmd)
                if self._hung.is_set():
                    continue
                result = {Cmd.PING: {"pid": 0}, Cmd.OUTSTANDING: {"outstanding": self.outstanding},
                          Cmd.STOP: {"stopping": True}, Cmd.FAIL: {"failed": 0}}.get(cmd, {})
                sock.send(protocol.encode(protocol.Reply(msg.id, True, result=result)))
                if cmd is Cmd.STOP:
                    self.exit(0)
        finally:
            sock.close()


class FakeLauncher:
    """The launcher seam with fake children: ``behaviour`` by process name (default ``ok``);
    ``nodes``: the node resources live now (Ray mode: a block declared with a ``node``)."""

    kind = "fake"

    def __init__(self, nodes: set[str] = frozenset()):
        self.ctx = zmq.Context()
        self.node = "here"
        self.ip = "127.0.0.1"
        self.live = set(nodes)
        self.behaviour: dict[str, str] = {}
        self.started: list[FakeChild] = []
        self.controller: str | None = None  # the manager's ipc endpoint: children on "nodes" use it too
        self.manager: Manager | None = None  # whose controller a child's boot error goes to

    def start(self, target, spec, name: str, node: str | None = None) -> FakeChild:
        if spec.controller.startswith("ipc://"):
            self.controller = spec.controller
        child = FakeChild(self, spec, node or self.node, self.behaviour.get(getattr(spec, "name", DISPATCHER), "ok"))
        self.started.append(child)
        if node is not None and node not in self.live:
            child.waiting_for = node  # as RayLauncher: it waits for a node with its resource
        else:
            child.start()
        return child

    def live_resources(self) -> set[str]:
        return set(self.live)

    def resources(self) -> set[str]:
        return set(self.live)

    def lose_node(self, node: str) -> None:
        self.live.discard(node)
        for c in self.started:
            if c.node == node:
                c.exit(EXIT_NODE_LOST)

    def join_node(self, node: str) -> None:
        self.live.add(node)
        for c in self.started:
            if c.waiting_for == node and c.exitcode is None:
                c.waiting_for = None
                c.start()

    def close(self) -> None:
        for c in self.started:
            c.exit(c.exitcode if c.exitcode is not None else 0)
        for c in self.started:
            c.join(5)
        self.ctx.term()

    def current(self, name: str) -> FakeChild:
        return [c for c in self.started if c.name == name][-1]


@pytest.fixture
def manager(short_tmp, leak_check, monkeypatch):
    """A started Manager on a FakeLauncher (its supervisor thread runs); stopped afterwards."""
    monkeypatch.setattr(mgr, "DRAIN_TIMEOUT", 30.0)  # a drain ends when the test says, not by the clock
    made = []

    def make(ray: bool = False, nodes: set[str] = frozenset()) -> Manager:
        m = Manager(short_tmp, StateDir(os.path.join(short_tmp, "state")), "tcp://127.0.0.1:0",
                    ray_address="fake://cluster" if ray else None, launcher=FakeLauncher(nodes))
        m.launcher.manager = m
        made.append(m)
        m.start()
        return m
    yield make
    for m in made:
        m.stop()


def block(name: str, **kw) -> BlockDecl:
    return BlockDecl(name=name, model=f"fake/{name}.pt", **kw)


def update(m: Manager, blocks: list[BlockDecl], tasks: dict[str, list[str]]) -> Operation:
    desired = Desired({b.name: b for b in blocks}, tasks)
    op = Operation(Kind.UPDATE, lambda: desired, transport="tensormq")
    m.enqueue(op)
    return op


def result(op: Operation):
    return op.future.result(TIMEOUT)


def incarnations(m: Manager) -> dict[str, int]:
    with m.lock:
        return {n: c.incarnation for n, c in m.table.blocks.items()}


def tasks_sent(launcher: FakeLauncher) -> int:
    return launcher.current(DISPATCHER).commands.count(Cmd.TASKS)


# -- the pure parts ----------------------------------------------------------------------------------

def test_incarnations_only_grow_and_the_table_says_who_serves():
    table = ProcessTable()
    assert [table.next_incarnation("b1") for _ in range(3)] == [0, 1, 2]
    assert table.next_incarnation("b2") == 0
    assert not table.ready()  # no dispatcher yet


def test_operation_phases_wait_for_acknowledgements_or_their_timeout():
    from concurrent.futures import Future
    op = Operation(Kind.DELETE_ALL, lambda: Desired())
    assert op.phase is Phase.QUEUED
    op.acks = [Future()]
    op.enter(Phase.PREPARING, now=100.0)
    assert not op.acknowledged(timeout=5.0, now=104.0)
    assert op.acknowledged(timeout=5.0, now=105.5)
    op.acks[0].set_result({})
    assert op.acknowledged(timeout=5.0, now=100.0)


# -- apply -------------------------------------------------------------------------------------------

def test_an_update_starts_its_blocks_switches_then_replaces_only_what_changed(manager):
    m = manager()
    launcher = m.launcher
    op = update(m, [block("b1"), block("b2")], {"t": ["b1", "b2"]})
    assert result(op)["diff"]["spawned"] == ["b1", "b2"]
    assert op.phase is Phase.DONE and m.version == 1
    assert m.ready() and tasks_sent(launcher) >= 1
    assert m.task_table()["t"]["path"] == [["b1", "ipc://fake/b1#0"], ["b2", "ipc://fake/b2#0"]]

    old_b2 = launcher.current("b2")
    op = update(m, [block("b1"), block("b2", threads=2), block("b3")], {"t": ["b1", "b2", "b3"]})
    diff = result(op)["diff"]
    assert (diff["kept"], diff["replaced"], diff["spawned"]) == (["b1"], ["b2"], ["b3"])
    assert incarnations(m) == {"b1": 0, "b2": 1, "b3": 0}
    assert old_b2.exitcode == 0 and Cmd.STOP in old_b2.commands  # drained, asked to stop, gone
    assert m.version == 2 and [s["status"] for s in m.snapshot()["blocks"]] == ["ready"] * 3


def test_deleting_everything_stops_every_block(manager):
    m = manager()
    result(update(m, [block("b1"), block("b2")], {"t": ["b1", "b2"]}))
    children = [m.launcher.current("b1"), m.launcher.current("b2")]
    op = Operation(Kind.DELETE_ALL, lambda: Desired())
    m.enqueue(op)
    assert result(op) == {"removed": ["b1", "b2"], "version": 2}
    assert [c.exitcode for c in children] == [0, 0] and m.snapshot()["blocks"] == []


# -- drain -------------------------------------------------------------------------------------------

def test_a_retired_block_is_stopped_only_once_the_dispatcher_holds_nothing_on_it(manager):
    m = manager()
    result(update(m, [block("b1"), block("b2")], {"t": ["b1", "b2"]}))
    disp, old_b2 = m.launcher.current(DISPATCHER), m.launcher.current("b2")
    disp.outstanding = 2  # two requests still on their way through b2
    op = update(m, [block("b1"), block("b2x")], {"t": ["b1", "b2x"]})
    wait_for(lambda: op.phase is Phase.DRAINING and disp.commands.count(Cmd.OUTSTANDING) >= 2, TIMEOUT,
             "the update to ask the dispatcher twice what it holds on b2")
    assert Cmd.STOP not in old_b2.commands and old_b2.exitcode is None
    assert m.task_table()["t"]["path"][1][0] == "b2x"  # switched: new requests go the new way
    disp.outstanding = 0
    assert result(op)["diff"]["removed"] == ["b2"]
    assert old_b2.exitcode == 0
    # the requests b2 might still hold are answered once it is gone, not before (FAIL is cast, not
    # awaited, before the update is answered)
    wait_for(lambda: Cmd.FAIL in disp.commands, TIMEOUT, "the dispatcher to be told to fail what b2 held")
    assert disp.commands.index(Cmd.FAIL) > disp.commands.index(Cmd.OUTSTANDING)


# -- rollback ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("behaviour, words", [("boot_error", "fake: cannot load the model"),
                                              ("exit", "exited before it was ready")])
def test_a_block_that_cannot_start_rolls_the_update_back(manager, behaviour, words):
    m = manager()
    result(update(m, [block("b1")], {"t": ["b1"]}))
    before, b1 = incarnations(m), m.launcher.current("b1")
    m.launcher.behaviour["b2"] = behaviour
    op = update(m, [block("b1", threads=2), block("b2"), block("b3")], {"t": ["b1", "b2", "b3"]})
    with pytest.raises(UpdateFailed, match=words) as err:
        result(op)
    assert err.value.block == "b2" and op.phase is Phase.FAILED
    assert incarnations(m) == before and m.version == 1 and b1.exitcode is None  # nothing changed
    wait_for(lambda: all(c.exitcode is not None for c in m.launcher.started if c.name in ("b1", "b3")
                         and c is not b1), TIMEOUT, "the update's new blocks to be stopped")
    assert m.task_table()["t"]["blocks"] == ["b1#0"]


# -- a child dying mid-update ------------------------------------------------------------------------

def test_a_kept_block_that_dies_while_an_update_starts_is_respawned_and_the_update_goes_on(manager):
    m = manager()
    result(update(m, [block("b1"), block("b2")], {"t": ["b1", "b2"]}))
    m.launcher.behaviour["b3"] = "later"
    op = update(m, [block("b1"), block("b2"), block("b3")], {"t": ["b1", "b2", "b3"]})
    wait_for(lambda: op.phase is Phase.STARTING and any(c.name == "b3" for c in m.launcher.started), TIMEOUT,
             "the update to start b3")
    m.launcher.current("b1").exit(-9)  # killed by someone else while b3 loads
    wait_for(lambda: incarnations(m)["b1"] == 1, TIMEOUT, "b1 to be respawned")
    m.launcher.current("b3").boot()
    assert result(op)["diff"]["kept"] == ["b1", "b2"]
    b1 = m.child("b1")
    assert b1.restarts == 1 and "killed by SIGKILL" in b1.last_exit
    wait_for(lambda: m.task_table()["t"]["blocks"] == ["b1#1", "b2#0", "b3#0"], TIMEOUT,
             "the task table to route through the respawned b1")


def test_a_new_block_that_dies_after_the_switch_is_respawned_like_any_other(manager):
    m = manager()
    op = update(m, [block("b1")], {"t": ["b1"]})
    result(op)
    m.launcher.current("b1").exit(1)
    wait_for(lambda: m.child("b1").incarnation == 1 and m.child("b1").status is ChildState.READY, TIMEOUT,
             "b1 to be respawned and ready")
    assert m.child("b1").last_exit == "exit code 1 (crashed)"


def test_a_hung_block_is_killed_and_respawned(manager, monkeypatch):
    monkeypatch.setattr(supervision, "HANG_TIMEOUT", 0.5)
    monkeypatch.setattr(supervision, "PING_INTERVAL", 0.05)
    m = manager()
    result(update(m, [block("b1")], {"t": ["b1"]}))
    hung = m.launcher.current("b1")
    hung.hang()
    wait_for(lambda: m.child("b1").incarnation == 1, TIMEOUT, "the hung b1 to be replaced")
    assert hung.exitcode == -9 and "hung" in m.child("b1").last_exit


def test_a_crash_loop_marks_the_block_failed_and_the_next_update_replaces_it(manager, monkeypatch):
    monkeypatch.setattr(supervision, "MAX_RESTARTS", 1)
    m = manager()
    result(update(m, [block("b1")], {"t": ["b1"]}))
    m.launcher.behaviour["b1"] = "exit"  # every respawn dies before READY: a crash loop
    m.launcher.current("b1").exit(1)
    wait_for(lambda: m.child("b1").status is ChildState.FAILED, TIMEOUT, "b1 to be marked failed")
    assert "unavailable" in m.task_table()["t"]
    m.launcher.behaviour["b1"] = "ok"
    assert result(update(m, [block("b1")], {"t": ["b1"]}))["diff"]["replaced"] == ["b1"]
    assert m.child("b1").status is ChildState.READY


# -- a node down (Ray mode, its launcher faked) ------------------------------------------------------

def test_an_update_that_would_start_a_block_on_a_node_that_is_down_is_refused_before_anything_starts(manager):
    m = manager(ray=True, nodes={"edge"})
    result(update(m, [block("b1", node="edge")], {"t": ["b1"]}))
    m.launcher.lose_node("edge")
    started = len(m.launcher.started)
    op = update(m, [block("b1", node="edge"), block("b2", node="edge")], {"t": ["b1", "b2"]})
    with pytest.raises(UpdateFailed, match="no live node of the Ray cluster advertises it now") as err:
        result(op)
    assert err.value.block == "b2"
    assert all(c.name != "b2" for c in m.launcher.started[started:])  # nothing of it started


def test_a_block_whose_node_is_lost_waits_for_the_node_and_serves_again(manager):
    m = manager(ray=True, nodes={"edge"})
    result(update(m, [block("b1", node="edge"), block("b2")], {"t": ["b1", "b2"]}))
    m.launcher.lose_node("edge")
    wait_for(lambda: m.child("b1").incarnation == 1 and m.child("b1").process.waiting_for == "edge", TIMEOUT,
             "b1 to be respawned, waiting for a node with 'edge'")
    assert m.child("b1").status is ChildState.STARTING and "unavailable" in m.task_table()["t"]
    m.launcher.join_node("edge")
    wait_for(lambda: m.child("b1").status is ChildState.READY, TIMEOUT, "b1 to be ready on the node again")
    assert "unavailable" not in m.task_table()["t"]
