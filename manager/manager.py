"""The manager: makes the optimiser's decision real and keeps it real (thesis 3.5, 3.6).

Two halves. The *reconciler* (reconcile.py) is pure: ``plan(current, desired)`` says which
blocks to spawn, keep, replace and drain. The *supervisor* is one thread running a loop that
never waits on a process (gunicorn's Arbiter in spirit)::

    while running:
        wait_for_events()     # READY/boot-error notices, pong replies, operations from REST
        reap_children()       # exits, and stopping children: escalate stop -> TERM -> KILL
        check_health()        # pings; silence past HANG_TIMEOUT or an inference past
                              # max_inference_s: kill, answer its requests, respawn
        check_hosts()         # shared processes: READY, exits, nothing left to host
        check_starting()      # READY arrived? boot error? past READY_TIMEOUT?
        respawn_children()    # spawn (no wait) what died
        reconcile()           # advance the operation in progress

An operation (an update, a block deletion, DELETE /system) is checked at the edge, in the
REST thread, then queued; the REST thread waits on its future. The supervisor starts the new
blocks and goes on supervising while they load; when every one is READY it switches the
dispatcher's task table and the blocks' connections over, drains the blocks no longer needed
and resolves the future. A block that fails to start fails the whole update and nothing
changes. Only the supervisor thread changes state; the lock lets REST readers see one round's
result whole.

The manager coordinates five parts, each its own class: the process table (children.py: every
child, its ``ChildState``, its launcher handle), the spawner (spawner.py: a child's spec, handed to
the launcher), the supervisor's rounds over the children (supervision.py: the steps above but the
first and the last), the operation in progress (operation.py: its ``Phase``; ``reconcile`` here
moves it on) and the topology publisher (topology.py: what the dispatcher and the blocks are
told). tests/test_manager_units.py drives them, through this class, with fake children at the
launcher seam.

Blocks are forked from a forkserver that has torch imported already, so a new block costs a
fork and a model load, not a fresh interpreter (about 2 s of torch import each). The
forkserver is stopped last at shutdown, so nothing the server started outlives it.
"""
from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout

import zmq
from msgspec.structs import replace

from blockflow.core import settings
from blockflow.core.protocol import Cmd, Outstanding, describe_exit
from blockflow.core.schema import BlockDecl, validate_update
from blockflow.core.curve import ClusterKeys

from .controller import ControlError, Controller
from .children import Child, ChildState, ProcessTable
from .launcher import LocalLauncher
from .models import ModelCatalog
from .operation import Kind, Operation, Phase
from .spawner import Spawner
from .supervision import HANG_TIMEOUT, READY_TIMEOUT, STOP_KILL_S, Supervisor
from .topology import Deployment, TopologyPublisher
from .reconcile import Desired, Running, diff_tasks, plan, without_block
from .state import StateDir, process_record, slot_budget

log = logging.getLogger("blockflow.manager")

#: Seconds an update waits for requests on a retired block's path to finish.
DRAIN_TIMEOUT = settings.DRAIN_TIMEOUT
#: How long the supervisor sleeps when nothing happens (it wakes at once on an event).
TICK = 0.05
#: Seconds the switch waits for processes to take a topology update before draining anyway. A
#: hung process is killed within HANG_TIMEOUT, which fails its acknowledgement at once; this is
#: the bound for one that answers pings but not the update (its inference thread is busy).
ACK_TIMEOUT = HANG_TIMEOUT
#: Seconds an update waits for its processes to open their sockets and slots towards the new
#: blocks before it switches tasks to them anyway (Note [Ready to serve] in blocks/process.py).
PREPARE_TIMEOUT = 10.0


class UpdateFailed(RuntimeError):
    """A valid update could not be applied (a block did not start); the old state stays."""

    def __init__(self, message: str, block: str | None = None):
        super().__init__(message)
        self.block = block


class Conflict(RuntimeError):
    """The request contradicts the current state (409)."""



def visible_gpus(env: str | None = None, physical: int | None = None) -> int:
    """How many GPUs a block started now would see, without importing torch (the control
    plane never loads it): the devices NVML counts, narrowed by ``CUDA_VISIBLE_DEVICES`` as
    the CUDA runtime narrows them. That list is read up to its first entry CUDA would stop at
    (blank, negative, out of range, a repeat or junk); ``GPU-``/``MIG-`` UUIDs count as given.
    No NVML (no driver, a CPU host): 0."""
    if physical is None:
        physical = 0
        try:
            import pynvml
            pynvml.nvmlInit()
            try:
                physical = pynvml.nvmlDeviceGetCount()
            finally:
                pynvml.nvmlShutdown()
        except Exception:  # NVMLError_LibraryNotFound/DriverNotLoaded/...: no GPU to use
            return 0
    if env is None:
        env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return physical
    seen: set[str] = set()
    for entry in (e.strip() for e in env.split(",")):
        if entry.isdigit():
            ok = int(entry) < physical
        else:
            ok = entry.startswith(("GPU-", "MIG-")) and len(entry) > 4
        if not ok or entry in seen:
            break
        seen.add(entry)
    return min(len(seen), physical)


class Manager:
    def __init__(self, repo: str, state: StateDir, dispatcher_address: str = "tcp://127.0.0.1:5580",
                 token: str | None = None, window: int = settings.WINDOW, ray_address: str | None = None,
                 launcher=None):
        self.repo = os.path.abspath(repo)
        #: how children are started (manager/launcher.py); None: chosen by start(), the forkserver
        #: or Ray's (tests/test_manager_units.py passes one whose children are threads)
        self.launcher = launcher
        #: Ray mode (issue 30): the cluster to place blocks with a ``node`` on (ray_launcher.py),
        #: the CURVE keys of the deployment (blockflow/core/curve.py) and the controller's TCP endpoint
        self.ray_address = ray_address
        self.keys: ClusterKeys | None = None
        self.controller_tcp: str | None = None
        self.state = state
        self.dispatcher_address = dispatcher_address
        self.token = token
        self.window = window
        self.catalog = ModelCatalog(self.repo)
        self.lock = threading.RLock()
        self.table = ProcessTable()  # manager/children.py: every child, its state and launcher handle
        self.deployed = Deployment()  # manager/topology.py: the tasks, version, transport of what runs
        self.shm_budget: dict | None = None  # what the last update needs of the slot filesystem (state.slot_budget)
        self.events: queue.Queue = queue.Queue()
        self.ops: collections.deque[Operation] = collections.deque()
        self.op: Operation | None = None
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        self.gpus = 0

    # -- life-cycle --------------------------------------------------------------------------
    def start(self) -> None:
        self.state.prepare()
        self.state.clean_leftovers()
        self.state.sweep_orphans()
        self.deployed.version = self.state.recorded_version()  # versions only grow across restarts, --fresh too
        if self.launcher is None and self.ray_address:
            from .ray_launcher import RayLauncher
            self.launcher = RayLauncher(self.ray_address)
        elif self.launcher is None:
            self.launcher = LocalLauncher()  # manager/launcher.py: the forkserver, running since `blockflow serve` began
        if self.ray_address:
            self.keys = ClusterKeys.generate()
        self.gpus = visible_gpus()
        self.ctx = zmq.Context()
        self.controller = Controller(self.ctx, f"ipc://{os.path.join(self.state.sock, 'controller.sock')}",
                                     notify=lambda ident: self.events.put(("notice", ident)))
        if self.keys is not None:
            self.controller_tcp = self.controller.listen_between_nodes(self.launcher.ip, self.keys)
        self.controller.start()
        self.spawner = Spawner(self.table, self.launcher, self.controller, self.state, self.repo, self.catalog,
                               self.window, self.token, self.keys, self.controller_tcp)
        self.topology = TopologyPublisher(self.table, self.deployed, self.controller,
                                          wake=lambda: self.events.put(("wake", None)), cluster=self.keys is not None)
        self.supervisor = Supervisor(self.table, self.controller, self.spawner, self.topology, self.state,
                                     self.launcher.node, self.events, changed=self._persist)
        self.table.dispatcher = d = self.spawner.dispatcher(self.dispatcher_address, self.deployed.transport)
        try:
            info = self.controller.wait_ready(d.ident, READY_TIMEOUT, alive=d.process.is_alive)
        except (ControlError, TimeoutError) as exc:
            self.supervisor.stop_now([d])
            raise RuntimeError(f"the dispatcher did not start on {self.dispatcher_address}: {exc} "
                               f"({describe_exit(d.process.exitcode)}); "
                               "is the port in use? try --dispatcher-port") from None
        d.mark_ready(info)
        self.dispatcher_address = d.endpoint  # a respawn binds the same port (matters for port 0)
        self._persist()
        self._supervisor = threading.Thread(target=self.supervise, name="supervisor", daemon=True)
        self._supervisor.start()
        log.info("manager ready: repo %s, state %s, dispatcher %s", self.repo, self.state.root,
                 d.endpoint)

    def stop(self) -> None:
        """Shutdown order: stop supervising (so nothing is respawned and no operation advances),
        answer queued operations, stop blocks (they flush their KPI logs and answer what they
        hold), stop the dispatcher (it answers every request still open), stop the controller,
        remove sockets and slots, record the empty state, and last stop the forkserver (every
        block was its child, so it goes after them)."""
        if self._stopping.is_set() or not hasattr(self, "controller"):
            self._stopping.set()
            return
        self._stopping.set()
        self.events.put(("wake", None))
        if self._supervisor is not None:
            self._supervisor.join(timeout=5)
        with self.lock:
            ops = ([self.op] if self.op else []) + list(self.ops)
            self.op, self.ops = None, collections.deque()
            while True:  # operations queued after the supervisor's last round
                try:
                    kind, item = self.events.get_nowait()
                except queue.Empty:
                    break
                if kind == "op":
                    ops.append(item)
            for op in ops:
                op.resolve(error=UpdateFailed("the server is shutting down"))
            children = list(self.table.blocks.values()) + self.table.stopping
            for op in ops:
                children += list(op.new.values()) + op.retired
            hosts = list(self.table.hosts.values())
            self.table.clear()
            self.deployed.tasks.clear()
            self.supervisor.stop_now(children)
            self.supervisor.stop_now(hosts)  # after their blocks: they stop with nothing left to host
            if self.table.dispatcher is not None:
                self.supervisor.stop_now([self.table.dispatcher])
                self.table.dispatcher = None
            self.controller.stop()
            self.ctx.term()
            self._persist()
            self.state.remove_runtime()
        self.launcher.close()
        log.info("manager stopped")

    # -- operations, queued by REST threads --------------------------------------------------------
    def apply(self, body) -> dict:
        """Check ``body`` here, at the edge (UpdateError -> 400), then let the supervisor apply it."""
        if self._stopping.is_set():
            raise UpdateFailed("the server is shutting down")
        upd = validate_update(body, gpus=self.gpus,
                              nodes=self.launcher.resources() if self.ray_address else None)
        self.catalog.check_update(upd)
        self.shm_budget = slot_budget(upd, self.window, self.state.shm)
        desired = Desired(dict(upd.blocks), dict(upd.tasks))
        return self.submit(Operation(Kind.UPDATE, lambda: desired, body=body, transport=upd.transport,
                                     manifests=upd.manifests))

    def delete_block(self, name: str) -> dict:
        self.child(name)  # KeyError -> 404 before anything is queued

        def desire() -> Desired:
            if name not in self.table.declared:
                raise KeyError(name)
            return without_block(self.table.declared, self.deployed.tasks, name)
        return self.submit(Operation(Kind.DELETE_BLOCK, desire))

    def delete_all(self) -> dict:
        return self.submit(Operation(Kind.DELETE_ALL, lambda: Desired()))

    def enqueue(self, op: Operation) -> Future:
        """Queue ``op`` for the supervisor; its future is answered once it is done or failed."""
        if self._stopping.is_set():
            raise UpdateFailed("the server is shutting down")
        self.events.put(("op", op))
        return op.future

    def submit(self, op: Operation) -> dict:
        self.enqueue(op)
        # The supervisor resolves every operation: done, failed, or refused at shutdown. One
        # queued just after the supervisor's last round is refused here.
        deadline = time.monotonic() + READY_TIMEOUT + DRAIN_TIMEOUT + 4 * STOP_KILL_S + 60
        while True:
            try:
                return op.future.result(timeout=0.5)
            except FutureTimeout:
                supervised = self._supervisor is not None and self._supervisor.is_alive()
                if time.monotonic() > deadline or (self._stopping.is_set() and not supervised):
                    op.resolve(error=UpdateFailed("the server is shutting down" if self._stopping.is_set()
                                                           else f"{op.kind} did not finish in time"))

    # -- reading (REST) ----------------------------------------------------------------------------
    def child(self, name: str) -> Child:
        with self.lock:
            c = self.table.blocks.get(name)
        if c is None:
            raise KeyError(name)
        return c

    def command(self, name: str, cmd: Cmd, args=None, timeout: float = 5.0):
        c = self.child(name)
        if c.status is not ChildState.READY:
            raise Conflict(f"block {name} is {c.status}")
        return self.controller.request(c.ident, cmd, args, timeout=timeout)

    def ping(self, name: str) -> dict:
        t0 = time.perf_counter()
        result = self.command(name, Cmd.PING)
        return {"name": name, "rtt_ms": (time.perf_counter() - t0) * 1e3, **result}

    def snapshot(self) -> dict:
        with self.lock:
            return {"version": self.deployed.version, "transport": self.deployed.transport,
                    "blocks": [{**c.describe(), "next_hops": self.topology.hop_kinds(c)}
                               for c in self.table.blocks.values()],
                    "tasks": [{"id": t, "path": p} for t, p in self.deployed.tasks.items()],
                    "dispatcher": self.table.dispatcher.describe() if self.table.dispatcher else None,
                    "state_dir": self.state.root, "run_dir": self.state.run_dir,
                    "shm": self.shm_budget, **self.cluster_info()}

    def cluster_info(self) -> dict:
        """Ray mode: the cluster, this host's node and the deployment's CURVE server key (public:
        what a peer needs besides the client key that only the deployment's processes hold)."""
        if self.keys is None:
            return {}
        return {"cluster": {"ray": self.ray_address, "node": self.launcher.node, "controller": self.controller_tcp,
                            "server_public_key": self.keys.server_public}}

    @property
    def version(self) -> int:
        return self.deployed.version

    def task_table(self) -> dict:
        return self.topology.task_table()

    @property
    def dispatcher(self) -> Child | None:
        return self.table.dispatcher

    def ready(self) -> bool:
        with self.lock:
            return self.table.ready()

    # -- the supervisor loop -------------------------------------------------------------------
    def supervise(self) -> None:
        while not self._stopping.is_set():
            try:
                self.round()
            except Exception:
                log.exception("supervisor loop error (continuing)")

    def round(self, wait: float = TICK) -> None:
        """One round of the supervisor (the module's docstring): the supervisor thread runs them
        back to back; tests/test_manager_units.py runs them one by one, without that thread."""
        self.wait_for_events(wait)
        with self.lock:
            if self._stopping.is_set():
                return
            pending = list(self.op.new.values()) if self.op is not None else []
            self.supervisor.reap_children()
            self.supervisor.check_health()
            self.supervisor.check_hosts(pending)
            self.supervisor.check_starting(pending)
            self.supervisor.respawn_children(self.dispatcher_address, self.deployed.transport)
            self.reconcile()

    def wait_for_events(self, timeout: float) -> None:
        try:
            event = self.events.get(timeout=timeout)
        except queue.Empty:
            return
        with self.lock:
            while event is not None:
                self.handle_event(*event)
                try:
                    event = self.events.get_nowait()
                except queue.Empty:
                    event = None

    def handle_event(self, kind: str, item) -> None:
        if kind == "op":
            self.ops.append(item)
        elif kind == "pong":
            child, result = item
            self.supervisor.handle_pong(child, result)
        # "notice" (READY or boot error) and "wake": check_starting() looks at every starting child

    # -- operations, step by step ------------------------------------------------------------------
    def reconcile(self) -> None:
        """Advance the operation in progress (the next queued one if none) as far as it can go
        this round: each phase below falls through to the next once it is complete."""
        if self.op is None:
            if not self.ops:
                return
            self.begin(self.ops.popleft())
            if self.op is None:
                return
        op, now = self.op, time.monotonic()
        if op.phase in (Phase.STARTING, Phase.PREPARING):
            failed = op.failed_block()
            if failed is not None:
                self.supervisor.stop_later(op.new.values())  # roll back: the old blocks were never touched
                if op.phase is Phase.PREPARING:
                    self.topology.publish()  # but for the sockets and slots prepare() opened towards the new ones
                op.enter(Phase.FAILED, now)
                self.finish(op, error=UpdateFailed(failed.failure, failed.name))
                return
        if op.phase is Phase.STARTING and op.new_ready():
            op.acks = self.topology.prepare(op)
            op.enter(Phase.PREPARING, now)
        if op.phase is Phase.PREPARING and op.acknowledged(PREPARE_TIMEOUT, now):
            self.switch(op)
            op.enter(Phase.SWITCHED, now)
        if op.phase is Phase.SWITCHED and op.acknowledged(ACK_TIMEOUT, now):
            op.enter(Phase.DRAINING, now)
        if op.phase is Phase.DRAINING and self.drained(op, now):
            self.supervisor.stop_later(op.retired)
            op.enter(Phase.STOPPING, now)
        if op.phase is Phase.STOPPING and all(c.gone for c in op.retired):
            if op.retired:
                names = [c.instance for c in op.retired]
                self.topology.fail_requests(names, f"blocks {', '.join(names)} were removed by a system update")
                self.topology.publish()  # blocks close their sockets to the retired ones and reclaim slots
            op.enter(Phase.DONE, now)
            self.finish(op)

    def begin(self, op: Operation) -> None:
        try:
            op.desired = op.desire()
        except KeyError as exc:
            op.resolve(error=exc)
            return
        except ValueError as exc:
            op.resolve(error=Conflict(str(exc)))
            return
        # an update replaces failed blocks; a deletion leaves the other blocks as they are
        current = {n: Running(c.decl, c.status is ChildState.FAILED and op.kind is Kind.UPDATE)
                   for n, c in self.table.blocks.items()}
        op.processes = one_per_replica(op.desired.blocks)
        op.plan = plan(current, op.processes)
        down = self._nodes_down([op.processes[n] for n in op.plan.starts])
        if down:
            op.resolve(error=UpdateFailed(down[0], down[1]))
            return
        which = replica_of(op.desired.blocks)
        try:
            for n in op.plan.starts:
                op.new[n] = self.spawner.block(op.processes[n], block=which[n][0], replica=which[n][1],
                                             declared=op.desired.blocks)
        except Exception as exc:  # e.g. the forkserver is gone: answer, do not leave the caller waiting
            self.supervisor.stop_later(op.new.values())
            log.exception("%s: could not spawn its blocks", op.kind)
            op.resolve(error=UpdateFailed(f"could not start a block process: {exc}"))
            return
        op.enter(Phase.STARTING)
        self.op = op

    def _nodes_down(self, starting: list[BlockDecl]) -> tuple[str, str] | None:
        """(message, block) where a block the operation would start names a node resource that
        no live node advertises now, before anything starts: such a block would only wait out
        READY_TIMEOUT and roll the update back. Blocks it keeps on that node wait for it."""
        if not self.ray_address or not any(d.node for d in starting):
            return None
        live = self.launcher.live_resources()
        for d in starting:
            if d.node and d.node not in live:
                return (f"block {d.name!r} would start on a node with {d.node!r}, and no live node of the "
                        f"Ray cluster advertises it now (one did: it is down or has left); POST the update "
                        f"again once a node with {d.node!r} has joined, or place the block on another node",
                        d.name)
        return None

    def switch(self, op: Operation) -> None:
        """Every new block is READY: make the desired state the current one."""
        current = self.table.blocks
        op.retired = [current[n] for n in op.plan.retires]
        self.table.blocks = {n: op.new[n] if n in op.new else current[n] for n in op.processes}
        self.table.declared = dict(op.desired.blocks)
        old_tasks, self.deployed.tasks = self.deployed.tasks, dict(op.desired.tasks)
        if op.kind is Kind.UPDATE:
            self.deployed.update_body, self.deployed.transport = op.body, op.transport
            self.deployed.manifests = dict(op.manifests)
        elif self.deployed.update_body:  # state.json keeps the update that describes what runs now
            kept = [b for b in self.deployed.update_body.get("blocks", []) if b.get("name") in self.table.declared]
            self.deployed.update_body = {**self.deployed.update_body, "blocks": kept} if kept else None
        self.deployed.version += 1
        op.diff = {**op.plan.as_diff(), "tasks": diff_tasks(old_tasks, self.deployed.tasks).as_dict()}
        now = time.time()
        for c in op.new.values():  # ready for a while, sent requests from this publish on
            c.serving_since = now
        op.acks = self.topology.publish(draining=op.retired)
        op.switched = time.monotonic()
        self._persist()

    def drained(self, op: Operation, now: float) -> bool:
        """Whether the requests already on a retired block's path have finished: the dispatcher
        holds none (asked once per answer), it cannot say (not ready), or DRAIN_TIMEOUT passed."""
        disp = self.table.dispatcher_ready()
        if not op.retired or disp is None or now - op.switched > DRAIN_TIMEOUT:
            return True
        if op.outstanding is None:
            op.outstanding = self.controller.cast(disp.ident, Cmd.OUTSTANDING,
                                                  Outstanding([c.instance for c in op.retired]))
            return False
        if not op.outstanding.done():
            return False
        left = op.outstanding.result()["outstanding"] if not op.outstanding.exception() else 0
        op.outstanding = None
        return not left

    def finish(self, op: Operation, error: Exception | None = None) -> None:
        self.op = None
        self._persist()
        took = time.monotonic() - op.started
        if error is not None:
            log.warning("%s failed after %.2fs: %s", op.kind, took, error)
            op.resolve(error=error)
            return
        log.info("applied %s version %d in %.2fs: %s", op.kind, self.deployed.version, took, op.diff)
        op.resolve(op.result(self.deployed.version, self.shm_budget))

    def _persist(self) -> None:
        def rec(c: Child) -> dict:
            return {**process_record(c.process.pid), "name": c.name, "incarnation": c.incarnation,
                    "endpoint": c.endpoint, "status": c.status, "restarts": c.restarts}
        self.state.save({
            "server": process_record(os.getpid()) if not self._stopping.is_set() else None,
            "version": self.deployed.version, "update": self.deployed.update_body,
            "blocks": {n: rec(c) for n, c in self.table.blocks.items() if c.process.pid},
            "dispatcher": rec(d) if (d := self.table.dispatcher) and d.process.pid else None,
            "shm_dir": self.state.shm, "run_dir": self.state.run_dir,
        })


def one_per_replica(blocks: dict[str, BlockDecl]) -> dict[str, BlockDecl]:
    """The processes that run ``blocks``: one per replica, named by ``replica_name``, each
    declared with ``replicas`` 1, so that an update changing a block's replicas alone keeps
    the replicas it already has (the reconciler compares declarations) and starts or drains
    only the difference."""
    return {n: replace(decl, name=n, replicas=1) for decl in blocks.values() for n in decl.replica_names()}


def replica_of(blocks: dict[str, BlockDecl]) -> dict[str, tuple[str, int]]:
    """Process name -> (block, replica), for the processes ``one_per_replica`` names."""
    return {n: (decl.name, r) for decl in blocks.values() for r, n in enumerate(decl.replica_names())}


