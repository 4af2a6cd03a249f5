"""The manager: makes the optimiser's decision real and keeps it real (thesis 3.5, 3.6).

Two halves. The *reconciler* (reconcile.py) is pure: ``plan(current, desired)`` says which
blocks to spawn, keep, replace and drain. The *supervisor* is one thread running a loop that
never waits on a process (gunicorn's Arbiter in spirit)::

    while running:
        wait_for_events()     # READY/boot-error notices, pong replies, operations from REST
        reap_children()       # exits, and stopping children: escalate stop -> TERM -> KILL
        check_health()        # pings; silence past HANG_TIMEOUT or an inference past
                              # max_inference_s: kill, answer its requests, respawn
        check_starting()      # READY arrived? boot error? past READY_TIMEOUT?
        respawn_children()    # spawn (no wait) what died
        reconcile()           # advance the operation in progress one step

An operation (an update, a block deletion, DELETE /system) is checked at the edge, in the
REST thread, then queued; the REST thread waits on its future. The supervisor starts the new
blocks and goes on supervising while they load; when every one is READY it switches the
dispatcher's task table and the blocks' connections over, drains the blocks no longer needed
and resolves the future. A block that fails to start fails the whole update and nothing
changes. Only the supervisor thread changes state; the lock lets REST readers see one round's
result whole.

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
from concurrent.futures import Future, InvalidStateError, TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Callable

import msgspec
import zmq
from msgspec.structs import replace

from blockflow import settings
# specs and entry points only: the manager never imports a block or the dispatcher (nor torch)
from blockflow.blocks.spec import SERVE_BLOCK, SERVE_HOST, BlockSpec, HostSpec
from blockflow.dispatcher.spec import SERVE_DISPATCHER, DispatcherSpec
from blockflow.protocol import (DISPATCHER, EXIT_BOOT_ERROR, EXIT_NODE_LOST, Cmd, Fail, Host, Outstanding, Tasks,
                                Topology, describe_exit, identity)
from blockflow.schema import BlockDecl, validate_update
from blockflow.tensormq.curve import ClusterKeys

from .controller import ControlError, Controller
from .launcher import ChildHandle, LocalLauncher
from .models import ModelCatalog
from .reconcile import Desired, Plan, Running, diff_tasks, plan, without_block
from .state import StateDir, process_record, slot_budget

log = logging.getLogger("blockflow.manager")

#: Seconds a new block has to load its model and report READY.
READY_TIMEOUT = settings.READY_TIMEOUT
#: Seconds between health pings.
PING_INTERVAL = settings.PING_INTERVAL
#: A process silent for this long is considered hung, killed and respawned.
HANG_TIMEOUT = settings.HANG_TIMEOUT
#: Respawns allowed per block before it is marked failed.
MAX_RESTARTS = settings.MAX_RESTARTS
#: A process that ran this long before dying starts a fresh restart budget: the limit is meant
#: for crash loops (as systemd's StartLimitBurst within StartLimitIntervalSec), not for a server
#: that lost a block five times over a month.
RESTART_WINDOW = settings.RESTART_WINDOW
#: Seconds an update waits for requests on a retired block's path to finish.
DRAIN_TIMEOUT = settings.DRAIN_TIMEOUT
#: How long the supervisor sleeps when nothing happens (it wakes at once on an event).
TICK = 0.05
#: A child asked to stop gets this long before SIGTERM, and STOP_KILL_S before SIGKILL.
STOP_TERM_S = 1.0
STOP_KILL_S = 5.0
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

@dataclass(eq=False)
class Child:
    """A running block or the dispatcher, as the manager sees it."""

    name: str
    decl: BlockDecl | None          # None for the dispatcher
    incarnation: int
    process: ChildHandle             # manager/launcher.py: how it was started, where it runs
    status: str = "starting"         # starting, ready, restarting, failed, stopping
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

    def describe(self) -> dict:
        d = {"name": self.name, "pid": self.process.pid, "node": self.process.node, "status": self.status,
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


@dataclass(eq=False)
class Operation:
    """One change queued by a REST handler: what it wants (computed when it starts, against the
    state of that moment) and how far the supervisor got with it."""

    kind: str                                   # update, delete_block, delete_all
    desire: Callable[[], Desired]               # raises ValueError (-> 409) or KeyError (-> 404)
    body: dict | None = None                    # the update as posted (kept in state.json)
    transport: str | None = None
    manifests: dict = field(default_factory=dict)
    future: Future = field(default_factory=Future)
    started: float = field(default_factory=time.monotonic)
    # progress, set by the supervisor
    phase: str = "queued"                       # queued, starting, draining
    desired: Desired | None = None
    processes: dict[str, BlockDecl] = field(default_factory=dict)  # the desired blocks, one per replica
    plan: Plan | None = None
    new: dict[str, Child] = field(default_factory=dict)
    retired: list[Child] = field(default_factory=list)
    diff: dict = field(default_factory=dict)
    acks: list[Future] = field(default_factory=list)
    prepared: list[Future] | None = None        # acknowledgements of prepare(), once sent
    prepare_sent: float = 0.0
    switched: float = 0.0
    outstanding: Future | None = None
    drained: bool = False
    stop_sent: bool = False


class Manager:
    def __init__(self, repo: str, state: StateDir, dispatcher_address: str = "tcp://127.0.0.1:5580",
                 token: str | None = None, window: int = settings.WINDOW, ray_address: str | None = None):
        self.repo = os.path.abspath(repo)
        #: Ray mode (issue 30): the cluster to place blocks with a ``node`` on (ray_launcher.py),
        #: the CURVE keys of the deployment (tensormq/curve.py) and the controller's TCP endpoint
        self.ray_address = ray_address
        self.keys: ClusterKeys | None = None
        self.controller_tcp: str | None = None
        self.state = state
        self.dispatcher_address = dispatcher_address
        self.token = token
        self.window = window
        self.catalog = ModelCatalog(self.repo)
        self.lock = threading.RLock()
        #: one Child per block process, by process name: a block's replica 0 has the block's name,
        #: replica r > 0 ``name.r<r>`` (schema.replica_name); ``declared`` keeps the blocks as declared
        self.blocks: dict[str, Child] = {}
        self.declared: dict[str, BlockDecl] = {}
        #: shared processes by their ``process`` name (blocks/host.py); each stops once it hosts nothing
        self.hosts: dict[str, Child] = {}
        self.tasks: dict[str, list[str]] = {}
        self.manifests: dict[str, dict | None] = {}
        self.update_body: dict | None = None
        self.shm_budget: dict | None = None  # what the last update needs of the slot filesystem (state.slot_budget)
        self.transport = "tensormq"
        self.version = 0
        self.dispatcher: Child | None = None
        self.events: queue.Queue = queue.Queue()
        self.ops: collections.deque[Operation] = collections.deque()
        self.op: Operation | None = None
        self.stopping_children: list[Child] = []
        self._incarnations: dict[str, int] = {}
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._next_ping = 0.0
        self._last_health = 0.0   # when check_health last ran (monotonic)
        self._grace_from = 0.0    # silence before this moment does not count (see check_health)
        self.gpus = 0

    # -- life-cycle --------------------------------------------------------------------------
    def start(self) -> None:
        self.state.prepare()
        self.state.clean_leftovers()
        self.state.sweep_orphans()
        self.version = self.state.recorded_version()  # versions only grow across restarts, --fresh too
        if self.ray_address:
            from .ray_launcher import RayLauncher
            self.launcher = RayLauncher(self.ray_address)
            self.keys = ClusterKeys.generate()
        else:
            self.launcher = LocalLauncher()  # manager/launcher.py: the forkserver, running since `blockflow serve` began
        self.gpus = visible_gpus()
        self.ctx = zmq.Context()
        self.controller = Controller(self.ctx, f"ipc://{os.path.join(self.state.sock, 'controller.sock')}",
                                     notify=lambda ident: self.events.put(("notice", ident)))
        if self.keys is not None:
            self.controller_tcp = self.controller.listen_between_nodes(self.launcher.ip, self.keys)
        self.controller.start()
        self.dispatcher = self.spawn_dispatcher()
        try:
            info = self.controller.wait_ready(self.dispatcher.ident, READY_TIMEOUT, alive=self.dispatcher.process.is_alive)
        except (ControlError, TimeoutError) as exc:
            self.stop_now([self.dispatcher])
            raise RuntimeError(f"the dispatcher did not start on {self.dispatcher_address}: {exc} "
                               f"({describe_exit(self.dispatcher.process.exitcode)}); "
                               "is the port in use? try --dispatcher-port") from None
        self.mark_ready(self.dispatcher, info)
        self.dispatcher_address = self.dispatcher.endpoint  # a respawn binds the same port (matters for port 0)
        self._persist()
        self._supervisor = threading.Thread(target=self.supervise, name="supervisor", daemon=True)
        self._supervisor.start()
        log.info("manager ready: repo %s, state %s, dispatcher %s", self.repo, self.state.root,
                 self.dispatcher.endpoint)

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
                _resolve(op.future, error=UpdateFailed("the server is shutting down"))
            children = list(self.blocks.values()) + self.stopping_children
            for op in ops:
                children += list(op.new.values()) + op.retired
            self.blocks.clear()
            self.declared.clear()
            self.tasks.clear()
            self.stop_now(children)
            self.stop_now(list(self.hosts.values()))  # after their blocks: they stop with nothing left to host
            self.hosts.clear()
            if self.dispatcher is not None:
                self.stop_now([self.dispatcher])
                self.dispatcher = None
            self.controller.stop()
            self.ctx.term()
            self._persist()
            self.state.remove_runtime()
        self.launcher.close()
        log.info("manager stopped")

    # -- spawning (never waits: READY arrives as an event) ----------------------------------------
    def _next_incarnation(self, name: str) -> int:
        inc = self._incarnations.get(name, -1) + 1
        self._incarnations[name] = inc
        return inc

    def spawn_block(self, decl: BlockDecl, restarts: int = 0, streak: int = 0, block: str | None = None,
                    replica: int = 0, declared: dict[str, BlockDecl] | None = None) -> Child:
        """Start the process ``decl.name``: replica ``replica`` of ``block`` (default: the block itself).
        A block with a ``process`` goes into that shared process (started here if need be), once
        the process is ready (check_starting)."""
        inc = self._next_incarnation(decl.name)
        # the declaration goes to the block whole (Note [One declaration per block] in blockflow/schema.py)
        spec = BlockSpec(**msgspec.structs.asdict(decl), repo=self.repo, run_dir=self.state.run_dir,
                         sock_dir=self.state.sock, shm_dir=self.state.shm, incarnation=inc,
                         controller=self.controller.endpoint, parent_pid=os.getpid(), window=self.window,
                         verified=self.catalog.verified(decl.files))
        spec = self.cluster_spec(spec, decl.node)
        if decl.node is not None:
            spec = replace(spec, verified=None)  # its node's copy of the files: the block checks it there
        if decl.process is not None:
            host = self.host_for(decl, self.declared if declared is None else declared)
            c = Child(decl.name, decl, inc, None, restarts=restarts, streak=streak, block=block or decl.name,
                      replica=replica, host=host, hosted_spec=spec.to_json())
            c.process = HostedProcess(host, self.controller, c.ident)
            log.info("block %s#%d goes into shared process %s (%s on %s)", decl.name, inc, host.name, decl.model,
                     decl.device)
            return c
        proc = self.launcher.start(SERVE_BLOCK, spec, f"blockflow-{decl.name}", node=decl.node)
        where = f"pid {proc.pid}" if decl.node is None else f"through Ray, on a node with {decl.node!r}"
        log.info("spawned block %s#%d (%s, %s on %s)", decl.name, inc, where, decl.model, decl.device)
        return Child(decl.name, decl, inc, proc, restarts=restarts, streak=streak, block=block or decl.name,
                     replica=replica)

    def host_for(self, decl: BlockDecl, declared: dict[str, BlockDecl]) -> Child:
        """The shared process ``decl.process``: the running one, or a new one whose torch thread
        pool is the largest ``threads`` among the ``declared`` blocks of the group."""
        host = self.hosts.get(decl.process)
        if host is not None and host.process.exitcode is None and host.status in ("starting", "ready"):
            return host
        name = f"@{decl.process}"
        threads = max((d.threads or 0 for d in declared.values() if d.process == decl.process), default=0)
        inc = self._next_incarnation(name)
        spec = self.cluster_spec(HostSpec(name=name, device=decl.device, threads=threads or None, incarnation=inc,
                                          controller=self.controller.endpoint, parent_pid=os.getpid()), decl.node)
        proc = self.launcher.start(SERVE_HOST, spec, f"blockflow-{name}", node=decl.node)
        log.info("spawned shared process %s#%d (pid %s, %s)", name, inc, proc.pid, decl.device)
        restarts = host.restarts + 1 if host is not None else 0
        self.hosts[decl.process] = new = Child(name, None, inc, proc, restarts=restarts)
        return new

    def check_hosts(self) -> None:
        """Shared processes: READY (-> ready, and their waiting blocks are sent to them), an
        exit (-> gone: their blocks see it as their own), nothing left to host (-> stopped)."""
        members = [c for c in [*self.blocks.values(), *self.stopping_children,
                               *(self.op.new.values() if self.op else ())] if c.host is not None and not c.gone]
        for group, host in list(self.hosts.items()):
            if host.status == "starting" and host.ident in self.controller.ready:
                self.mark_ready(host, self.controller.ready[host.ident])
                log.info("shared process %s#%d (pid %s) is ready", host.name, host.incarnation, host.process.pid)
            if host.process.exitcode is not None:
                if host.status != "stopping":
                    log.warning("shared process %s (pid %s) exited: %s", host.instance, host.process.pid,
                                describe_exit(host.process.exitcode))
                    host.status = "failed"
                del self.hosts[group]
                self.controller.forget(host.ident)
                if host.process.pid:
                    self.state.remove_slots_of(host.process.pid)
                continue
            if not any(c.host is host for c in members) and host.status != "stopping":
                self.stop_later([host])
                del self.hosts[group]
                continue
            if host.status == "ready":
                for c in members:
                    if c.host is host and c.hosted_spec is not None and c.status == "starting":
                        self.controller.cast(host.ident, Cmd.HOST, Host(c.hosted_spec)).add_done_callback(
                            _log_refusal)
                        c.hosted_spec = None

    def cluster_spec(self, spec, node: str | None):
        """Ray mode: the spec of a block or shared process gets the cluster's keys and listens
        for other nodes (at this host's address; the node agent puts its node's); one placed on
        another node reaches the controller over CURVE TCP."""
        if self.keys is None:
            return spec
        spec = replace(spec, curve=self.keys.to_json(), bind_host=self.launcher.ip)
        return spec if node is None else replace(spec, controller=self.controller_tcp)

    def spawn_dispatcher(self, restarts: int = 0, streak: int = 0) -> Child:
        inc = self._next_incarnation(DISPATCHER)
        spec = DispatcherSpec(sock_dir=self.state.sock, shm_dir=self.state.shm, address=self.dispatcher_address,
                              run_dir=self.state.run_dir,
                              transport=self.transport, controller=self.controller.endpoint,
                              parent_pid=os.getpid(), incarnation=inc, token=self.token, window=self.window)
        if self.keys is not None:
            spec = replace(spec, curve=self.keys.to_json(), bind_host=self.launcher.ip)
        proc = self.launcher.start(SERVE_DISPATCHER, spec, "blockflow-dispatcher")
        return Child(DISPATCHER, None, inc, proc, restarts=restarts, streak=streak)

    def mark_ready(self, c: Child, info: dict) -> None:
        c.status, c.endpoint, c.ready_info, c.ready_at = "ready", info["endpoint"], info, time.monotonic()
        c.serving_since = time.time()  # publish() routes to it next; an update's switch() says so again

    def stop_later(self, children) -> None:
        """Ask each child to stop; reap_children() escalates to SIGTERM and SIGKILL."""
        now = time.monotonic()
        for c in children:
            if c.gone or c in self.stopping_children:
                continue
            c.status, c.stop_asked = "stopping", now
            if c.process.exitcode is None:
                self.controller.cast(c.ident, Cmd.STOP)
            self.stopping_children.append(c)

    def stop_now(self, children, timeout: float = STOP_KILL_S) -> None:
        """Shutdown only (the supervisor has stopped): ask politely, SIGTERM, SIGKILL, and wait."""
        children = [c for c in children if not c.gone]
        for c in children:
            c.status = "stopping"
            if c.process.is_alive():
                try:
                    self.controller.cast(c.ident, Cmd.STOP)
                except Exception:
                    pass
        deadline = time.monotonic() + timeout
        for c in children:
            c.process.join(max(0.0, min(STOP_TERM_S, deadline - time.monotonic())))
            if c.process.is_alive():
                c.process.terminate()
        for c in children:
            c.process.join(max(0.0, deadline - time.monotonic()))
            if c.process.is_alive():
                log.warning("%s (pid %s) ignored SIGTERM; killing it", c.instance, c.process.pid)
                c.process.kill()
                c.process.join(2)
            self._gone(c)

    def _gone(self, c: Child) -> None:
        if c.gone:
            return
        c.gone = True
        c.last_exit = c.last_exit or describe_exit(c.process.exitcode)
        self.controller.forget(c.ident)
        self._remove_slots(c)

    def _remove_slots(self, c: Child) -> None:
        """A dead producer's slot files are ours to remove (a clean exit left none)."""
        if c.process.pid is None or c.process.exitcode is None or c.process.node != self.launcher.node:
            return  # on another node its agent removes them (ray_launcher.py): a pid names nothing here
        if isinstance(c.process, HostedProcess) and c.process.host_alive():
            return  # the others still use theirs; this one unlinked its own (check_hosts does the rest)
        removed = self.state.remove_slots_of(c.process.pid)
        if removed:
            log.info("removed %d slot files that %s (pid %d) left behind", removed, c.instance, c.process.pid)

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
        return self.submit(Operation("update", lambda: desired, body=body, transport=upd.transport,
                                     manifests=upd.manifests))

    def delete_block(self, name: str) -> dict:
        self.child(name)  # KeyError -> 404 before anything is queued

        def desire() -> Desired:
            if name not in self.declared:
                raise KeyError(name)
            return without_block(self.declared, self.tasks, name)
        return self.submit(Operation("delete_block", desire))

    def delete_all(self) -> dict:
        return self.submit(Operation("delete_all", lambda: Desired()))

    def submit(self, op: Operation) -> dict:
        if self._stopping.is_set():
            raise UpdateFailed("the server is shutting down")
        self.events.put(("op", op))
        # The supervisor resolves every operation: done, failed, or refused at shutdown. One
        # queued just after the supervisor's last round is refused here.
        deadline = time.monotonic() + READY_TIMEOUT + DRAIN_TIMEOUT + 4 * STOP_KILL_S + 60
        while True:
            try:
                return op.future.result(timeout=0.5)
            except FutureTimeout:
                supervised = self._supervisor is not None and self._supervisor.is_alive()
                if time.monotonic() > deadline or (self._stopping.is_set() and not supervised):
                    _resolve(op.future, error=UpdateFailed("the server is shutting down" if self._stopping.is_set()
                                                           else f"{op.kind} did not finish in time"))

    # -- reading (REST) ----------------------------------------------------------------------------
    def task_table(self) -> dict:
        table = {}
        for tid, path in self.tasks.items():
            # per hop, its replicas that serve now (replica 0 stands for a block with none ready)
            choices = [[c for c in self.replicas(n) if c.status == "ready"] or self.replicas(n)[:1] for n in path]
            hops = [cs[0] for cs in choices]
            down = [c for c in hops if c.status != "ready"]
            entry = self.manifests.get(hops[0].decl.files[0])
            table[tid] = {"path": [[c.name, c.endpoint] for c in hops], "blocks": [c.instance for c in hops],
                          "input": _input_spec(entry, hops[0].decl.input_dtype)}
            if any(len(cs) > 1 for cs in choices):  # the dispatcher picks a replica per hop and request
                table[tid]["replicas"] = [[[c.name, c.endpoint, c.instance] for c in cs] for cs in choices]
            if down:
                table[tid]["unavailable"] = ", ".join(f"block {c.block} is {c.status}" for c in down)
        return table

    def replicas(self, block: str) -> list[Child]:
        """The processes of a declared block, replica 0 first."""
        decl = self.declared.get(block)
        return [self.blocks[n] for n in decl.replica_names() if n in self.blocks] if decl else []


    def child(self, name: str) -> Child:
        with self.lock:
            c = self.blocks.get(name)
        if c is None:
            raise KeyError(name)
        return c

    def command(self, name: str, cmd: Cmd, args=None, timeout: float = 5.0):
        c = self.child(name)
        if c.status != "ready":
            raise Conflict(f"block {name} is {c.status}")
        return self.controller.request(c.ident, cmd, args, timeout=timeout)

    def ping(self, name: str) -> dict:
        t0 = time.perf_counter()
        result = self.command(name, Cmd.PING)
        return {"name": name, "rtt_ms": (time.perf_counter() - t0) * 1e3, **result}

    def snapshot(self) -> dict:
        with self.lock:
            return {"version": self.version, "transport": self.transport,
                    "blocks": [{**c.describe(), "next_hops": self.hop_kinds(c)} for c in self.blocks.values()],
                    "tasks": [{"id": t, "path": p} for t, p in self.tasks.items()],
                    "dispatcher": self.dispatcher.describe() if self.dispatcher else None,
                    "state_dir": self.state.root, "run_dir": self.state.run_dir,
                    "shm": self.shm_budget, **self.cluster_info()}

    def cluster_info(self) -> dict:
        """Ray mode: the cluster, this host's node and the deployment's CURVE server key (public:
        what a peer needs besides the client key that only the deployment's processes hold)."""
        if self.keys is None:
            return {}
        return {"cluster": {"ray": self.ray_address, "node": self.launcher.node, "controller": self.controller_tcp,
                            "server_public_key": self.keys.server_public}}

    def ready(self) -> bool:
        with self.lock:
            return (self.dispatcher is not None and self.dispatcher.status == "ready"
                    and all(c.status == "ready" for c in self.blocks.values()))

    # -- the supervisor loop -------------------------------------------------------------------
    def supervise(self) -> None:
        while not self._stopping.is_set():
            try:
                self.wait_for_events(TICK)
                with self.lock:
                    if self._stopping.is_set():
                        return
                    self.reap_children()
                    self.check_health()
                    self.check_hosts()
                    self.check_starting()
                    self.respawn_children()
                    self.reconcile()
            except Exception:
                log.exception("supervisor loop error (continuing)")

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
            self.handle_pong(child, result)
        # "notice" (READY or boot error) and "wake": check_starting() looks at every starting child

    def _all_children(self) -> list[Child]:
        return list(self.blocks.values()) + ([self.dispatcher] if self.dispatcher else [])

    def reap_children(self) -> None:
        for c in self._all_children():
            if c.status == "ready" and c.process.exitcode is not None:
                self.on_child_down(c, describe_exit(c.process.exitcode), c.process.exitcode == EXIT_BOOT_ERROR)
        now = time.monotonic()
        for c in list(self.stopping_children):
            if c.process.exitcode is not None:
                self._gone(c)
                self.stopping_children.remove(c)
            elif now - c.stop_asked > STOP_KILL_S:
                log.warning("%s (pid %s) ignored SIGTERM; killing it", c.instance, c.process.pid)
                c.process.kill()
            elif now - c.stop_asked > STOP_TERM_S:
                c.process.terminate()

    def check_health(self) -> None:
        now = time.monotonic()
        if now < self._next_ping:
            return
        self._next_ping = now + PING_INTERVAL
        # Silence only means a hang if we were pinging all along (the loop may have been
        # starved of CPU): judging then would kill every healthy process.
        if now - self._last_health > HANG_TIMEOUT / 2:
            self._grace_from = now
        self._last_health = now
        for c in self._all_children():
            if c.status != "ready":
                continue
            seen = max(self.controller.last_seen.get(c.ident, c.ready_at), c.ready_at, self._grace_from)
            # No exemption while an update is due: a block answers pings while its inference
            # thread finishes the request before applying it (blocks/process.py, Later), so
            # silence is a hang then too, and killing it fails the due acknowledgement at once
            # (Controller.forget): no update waits on a hung process longer than this.
            if now - seen > HANG_TIMEOUT:
                self.kill_child(c, f"hung ({now - seen:.2f}s without answering), killed")
                continue
            fut = self.controller.cast(c.ident, Cmd.PING)
            fut.add_done_callback(lambda f, c=c: self.events.put(
                ("pong", (c, f.result() if not f.exception() else None))))

    def handle_pong(self, c: Child, result: dict | None) -> None:
        """Liveness: a block whose inference thread has been in one inference for longer than
        its ``max_inference_s`` is stuck (the control thread still answers, so silence would
        never tell)."""
        if c.decl is None or c.status != "ready" or not isinstance(result, dict):
            return
        busy = result.get("busy_s")
        if isinstance(busy, (int, float)) and busy > c.decl.max_inference_s:
            self.kill_child(c, f"stuck in one inference for {busy:.1f}s (max_inference_s "
                               f"{c.decl.max_inference_s:g}), killed")

    def kill_child(self, c: Child, how: str) -> None:
        log.warning("%s (pid %s): %s", c.instance, c.process.pid, how)
        c.process.kill()  # SIGKILL (a block in a shared process: its host, and the group with it)
        c.process.join(1)  # SIGKILL takes milliseconds; the slot files are removed once it is gone
        self.on_child_down(c, how, False)

    def on_child_down(self, c: Child, how: str, boot_error: bool) -> None:
        c.last_exit = how
        if c.process.exitcode == EXIT_NODE_LOST:
            # best effort: its node may still run it (a partition); if this does not reach it, it
            # stops by itself when our pings stop (BLOCKFLOW_CONTROL_LEASE)
            self.controller.cast(c.ident, Cmd.STOP)
        self.controller.forget(c.ident)
        self._remove_slots(c)
        if time.time() - c.started > RESTART_WINDOW:
            c.streak = 0  # it ran for a while: this is not a crash loop
        if boot_error or c.streak >= MAX_RESTARTS:
            c.status = "failed"
            c.failure = f"{how}; not respawned ({'cannot start' if boot_error else f'{MAX_RESTARTS} restarts within {RESTART_WINDOW:.0f}s'})"
            log.error("%s failed: %s", c.instance, c.failure)
        else:
            c.status = "restarting"
            log.warning("%s (pid %s) died: %s; respawning (restart %d of %d)", c.instance, c.process.pid, how,
                        c.streak + 1, MAX_RESTARTS)
        if c.decl is not None:
            # Order matters: first the dispatcher learns that tasks through the block are
            # unavailable (so no new request is sent to a dead socket, where it would wait for
            # its deadline), then it answers the requests the block held. Both go down the same
            # control pipe, so they arrive in this order.
            self.publish()
            self._fail_requests([c.instance], f"block {c.name} failed ({how}) while holding the request")
        self._persist()

    def check_starting(self) -> None:
        """Starting children: READY (-> ready), a boot error, an early exit or no READY in time
        (-> failed: a new block fails its update, a respawn is marked failed)."""
        starting = [c for c in self._all_children() if c.status == "starting"]
        if self.op is not None:
            starting += [c for c in self.op.new.values() if c.status == "starting"]
        changed = False
        now = time.monotonic()
        for c in starting:
            info = self.controller.ready.get(c.ident)
            if info is not None:
                self.mark_ready(c, info)
                if c is self.dispatcher or self.blocks.get(c.name) is c:
                    log.info("%s (pid %s) is ready on %s", c.instance, c.process.pid, c.endpoint)
                    changed = True
                continue
            boot = self.controller.boot_errors.get(c.ident)
            if c.restarts and c.process.exitcode == EXIT_NODE_LOST and self.blocks.get(c.name) is c:
                # a respawn that Ray placed on a node that was dying (before its health checks
                # said so) is placed again: not a failure of the block, nor a crash to count
                log.warning("%s was placed on a node that is gone; placing it again", c.instance)
                self.controller.forget(c.ident)
                again = self.spawn_block(c.decl, restarts=c.restarts, streak=c.streak, block=c.block,
                                         replica=c.replica)
                again.last_exit = c.last_exit
                self.blocks[c.name] = again
                continue
            if c.restarts and getattr(c.process, "waiting_for", None) and c.process.exitcode is None:
                c.spawned_at = now  # a respawn waits for a node with its resource as long as it takes
                continue
            if boot is None and c.process.exitcode is None and now - c.spawned_at < READY_TIMEOUT:
                continue
            if boot is not None:
                why = boot.get("error", "boot error")
            elif c.process.exitcode is not None:
                why = f"{c.ident.decode()} exited before it was ready"
            else:
                why = f"{c.ident.decode()} did not report READY within {READY_TIMEOUT:.0f}s"
            what = f"block {c.name} ({' + '.join(c.decl.files)} on {c.decl.device})" if c.decl else "the dispatcher"
            c.failure = f"{what} did not start: {why}"
            if c.process.exitcode is not None:
                c.failure += f" [{describe_exit(c.process.exitcode)}]"
            log.error("%s", c.failure)
            self.stop_later([c])
            c.status = "failed"
            changed = changed or c is self.dispatcher or self.blocks.get(c.name) is c
        if changed:
            self.publish()
            self._persist()

    def respawn_children(self) -> None:
        # the new incarnation carries how the last one ended: GET /system and `blockflow status`
        # say why a block restarted after it is ready again, not only while it is down
        for name, c in list(self.blocks.items()):
            if c.status == "restarting":
                self.blocks[name] = self.spawn_block(c.decl, restarts=c.restarts + 1, streak=c.streak + 1,
                                                     block=c.block, replica=c.replica)
                self.blocks[name].last_exit = c.last_exit
                self._persist()
        if self.dispatcher is not None and self.dispatcher.status == "restarting":
            old = self.dispatcher
            self.dispatcher = self.spawn_dispatcher(restarts=old.restarts + 1, streak=old.streak + 1)
            self.dispatcher.last_exit = old.last_exit
            self._persist()

    # -- operations, step by step ------------------------------------------------------------------
    def reconcile(self) -> None:
        if self.op is None:
            if not self.ops:
                return
            self.begin(self.ops.popleft())
            if self.op is None:
                return
        op = self.op
        if op.phase == "starting":
            failed = [c for c in op.new.values() if c.status == "failed"]
            if failed:
                self.stop_later(op.new.values())  # roll back: the old blocks were never touched
                if op.prepared is not None:
                    self.publish()  # but for the sockets and slots prepare() opened towards the new ones
                self.finish(op, error=UpdateFailed(failed[0].failure, failed[0].name))
            elif all(c.status == "ready" for c in op.new.values()):
                if op.prepared is None:
                    op.prepared, op.prepare_sent = self.prepare(op), time.monotonic()
                if all(f.done() for f in op.prepared) or time.monotonic() - op.prepare_sent > PREPARE_TIMEOUT:
                    self.switch(op)
        if op.phase == "draining":
            self.drain(op)

    def begin(self, op: Operation) -> None:
        try:
            op.desired = op.desire()
        except KeyError as exc:
            _resolve(op.future, error=exc)
            return
        except ValueError as exc:
            _resolve(op.future, error=Conflict(str(exc)))
            return
        # an update replaces failed blocks; a deletion leaves the other blocks as they are
        current = {n: Running(c.decl, c.status == "failed" and op.kind == "update") for n, c in self.blocks.items()}
        op.processes = one_per_replica(op.desired.blocks)
        op.plan = plan(current, op.processes)
        down = self._nodes_down([op.processes[n] for n in op.plan.starts])
        if down:
            _resolve(op.future, error=UpdateFailed(down[0], down[1]))
            return
        which = replica_of(op.desired.blocks)
        try:
            for n in op.plan.starts:
                op.new[n] = self.spawn_block(op.processes[n], block=which[n][0], replica=which[n][1],
                                             declared=op.desired.blocks)
        except Exception as exc:  # e.g. the forkserver is gone: answer, do not leave the caller waiting
            self.stop_later(op.new.values())
            log.exception("%s: could not spawn its blocks", op.kind)
            _resolve(op.future, error=UpdateFailed(f"could not start a block process: {exc}"))
            return
        op.phase = "starting"
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

    def prepare(self, op: Operation) -> list[Future]:
        """Every new block is READY; before the switch, every new block and every process the
        new tasks make send to a new block (the dispatcher to a new first block) connects to
        its next hops and makes its slots towards them (Note [Ready to serve] in
        blocks/process.py), so that no request pays for it. Returns the acknowledgements;
        each wakes the supervisor. A process that does not answer in PREPARE_TIMEOUT only
        leaves its first request to do it."""
        procs = [op.new.get(n) or self.blocks.get(n) for n in op.processes]
        by_block: dict[str, list[Child]] = {}
        for c in procs:
            if c is not None and c.status == "ready" and c.endpoint:
                by_block.setdefault(c.block, []).append(c)
        d = self.dispatcher
        disp = d if d is not None and d.status == "ready" else None
        results = disp.ready_info.get("results", []) if disp is not None else []
        nexts: dict[Child, dict] = {}
        for path in op.desired.tasks.values():
            hops = [by_block.get(name, []) for name in path]
            if disp is not None:
                for c in hops[0]:
                    entry = op.manifests.get(c.decl.files[0]) if op.transport == "tensormq" else None
                    nexts.setdefault(disp, {})[c.endpoint] = _input_spec(entry)
            for i, senders in enumerate(hops):
                for c in senders:
                    if i + 1 < len(hops):
                        targets = [r.endpoint for r in hops[i + 1]]
                    else:  # the dispatcher reaches the last block the way it is reached itself
                        targets = [results[1] if c.endpoint.startswith("tcp://") and len(results) > 1
                                   else results[0]] if results else []
                    nexts.setdefault(c, {}).update(dict.fromkeys(targets))
        new = {c.endpoint for c in op.new.values()}
        live = [c.endpoint for c in [*self.blocks.values(), *op.new.values()] if c.status == "ready"] + list(results)
        # the blocks being replaced still serve until the switch: their devices stay known
        devices = {c.endpoint: c.decl.device for c in [*self.blocks.values(), *op.new.values()]
                   if c.endpoint and c.decl is not None}
        receivers = self.receivers(draining=list(op.new.values()))
        futures = []
        for c, hops in nexts.items():
            if c not in op.new.values() and not new & set(hops):
                continue  # it sends to no new block: nothing to prepare
            args = Topology(live, devices, self.routes_from(c, receivers), prepare=hops)
            fut = self.controller.cast(c.ident, Cmd.UPDATE, args)
            fut.add_done_callback(_log_refusal)
            fut.add_done_callback(lambda _f: self.events.put(("wake", None)))
            futures.append(fut)
        return futures

    def switch(self, op: Operation) -> None:
        """Every new block is READY: make the desired state the current one."""
        current = self.blocks
        op.retired = [current[n] for n in op.plan.retires]
        self.blocks = {n: op.new[n] if n in op.new else current[n] for n in op.processes}
        self.declared = dict(op.desired.blocks)
        old_tasks, self.tasks = self.tasks, dict(op.desired.tasks)
        if op.kind == "update":
            self.update_body, self.transport = op.body, op.transport
            self.manifests = dict(op.manifests)
        elif self.update_body:  # state.json keeps the update that describes what runs now
            kept = [b for b in self.update_body.get("blocks", []) if b.get("name") in self.declared]
            self.update_body = {**self.update_body, "blocks": kept} if kept else None
        self.version += 1
        op.diff = {**op.plan.as_diff(), "tasks": diff_tasks(old_tasks, self.tasks).as_dict()}
        now = time.time()
        for c in op.new.values():  # ready for a while, sent requests from this publish on
            c.serving_since = now
        op.acks = self.publish(draining=op.retired)
        op.switched = time.monotonic()
        op.phase = "draining"
        self._persist()

    def drain(self, op: Operation) -> None:
        """Let requests already on a retired block's path finish, then stop it (one step per round)."""
        now = time.monotonic()
        if not all(f.done() for f in op.acks) and now - op.switched < ACK_TIMEOUT:
            return
        names = [c.instance for c in op.retired]
        if op.retired and not op.drained:
            disp = self.dispatcher
            if disp is None or disp.status != "ready" or now - op.switched > DRAIN_TIMEOUT:
                op.drained = True
            elif op.outstanding is None:
                op.outstanding = self.controller.cast(disp.ident, Cmd.OUTSTANDING, Outstanding(names))
            elif op.outstanding.done():
                left = op.outstanding.result()["outstanding"] if not op.outstanding.exception() else 0
                op.drained, op.outstanding = not left, None
            if not op.drained:
                return
        if not op.stop_sent:
            self.stop_later(op.retired)
            op.stop_sent = True
        if not all(c.gone for c in op.retired):
            return
        if op.retired:
            self._fail_requests(names, f"blocks {', '.join(names)} were removed by a system update")
            self.publish()  # blocks close their sockets to the retired ones and reclaim slots
        self.finish(op)

    def finish(self, op: Operation, error: Exception | None = None) -> None:
        self.op = None
        self._persist()
        took = time.monotonic() - op.started
        if error is not None:
            log.warning("%s failed after %.2fs: %s", op.kind, took, error)
            _resolve(op.future, error=error)
            return
        if op.kind == "update":
            result = {"version": self.version, "diff": op.diff, "seconds": round(took, 3),
                      "shm": self.shm_budget}
        elif op.kind == "delete_block":
            result = {"removed": op.plan.drain[0], "version": self.version}
        else:
            result = {"removed": list(op.plan.drain), "version": self.version}
        log.info("applied %s version %d in %.2fs: %s", op.kind, self.version, took, op.diff)
        _resolve(op.future, result)

    # -- telling the processes ---------------------------------------------------------------------
    def publish(self, draining: list[Child] = ()) -> list[Future]:
        """Send the task table to the dispatcher and the live hops to every process; never waits.
        Returns the futures of the processes' acknowledgements.

        ``draining``: blocks on their way out whose queued requests must still finish. Their
        endpoints stay live, because a producer reclaims the slots of every hop that is not
        live, which would turn the handles still queued there into stale ones. The drain
        publishes again once they are stopped."""
        live = [c.endpoint for c in [*self.blocks.values(), *draining] if c.status == "ready"]
        if self.dispatcher is not None:
            live += list(self.dispatcher.ready_info.get("results", []))
        devices = {c.endpoint: c.decl.device for c in self.blocks.values() if c.endpoint}
        futures = []
        receivers = self.receivers(draining)
        if self.dispatcher is not None and self.dispatcher.status == "ready":
            futures.append(self.controller.cast(self.dispatcher.ident, Cmd.TASKS,
                                                Tasks(self.task_table(), self.version)))
            futures.append(self.controller.cast(self.dispatcher.ident, Cmd.UPDATE, Topology(
                live, devices, self.routes_from(self.dispatcher, receivers), self.transport)))
        for c in self.blocks.values():
            if c.status == "ready":
                futures.append(self.controller.cast(c.ident, Cmd.UPDATE, Topology(live, devices,
                                                                                  self.routes_from(c, receivers))))
        for f in futures:
            f.add_done_callback(_log_refusal)
        return futures

    def receivers(self, draining=()) -> list[tuple[str, str | None, str | None]]:
        """Ray mode: (the TCP endpoint paths name it by, its endpoint for processes of its own
        node, its node) of every ready process that tensors are sent to: blocks, and the
        dispatcher's result socket."""
        out = [(c.endpoint, c.ready_info.get("near"), c.process.node)
               for c in [*self.blocks.values(), *draining] if c.status == "ready" and c.endpoint]
        d = self.dispatcher
        if d is not None and d.status == "ready" and len(d.ready_info.get("results", [])) == 2:
            ipc, tcp = d.ready_info["results"]
            out.append((tcp, ipc, d.process.node))
        return out

    def routes_from(self, sender: Child, receivers) -> dict | None:
        """Ray mode: ``{TCP endpoint: endpoint on this node}`` (Topology's ``near``), the receivers on
        ``sender``'s node, which it hands handles to (Transport.near); it sends every other hop
        bytes over CURVE TCP. Decided by the nodes' identities (Ray's node ids), never by
        comparing addresses. Nothing without Ray."""
        if self.keys is None:
            return None
        return {addr: near for addr, near, node in receivers if node == sender.process.node and near}

    def hop_kinds(self, c: Child) -> dict[str, str]:
        """How ``c``'s tensors travel to each next hop of the tasks through it (GET /system):
        ``in_process`` to a block of the same shared process (the tensor itself: blocks/handover.py),
        ``handles`` on one node with TensorMQ, ``bytes`` with ZeroMQ, ``tcp`` (bytes over CURVE
        TCP) to another node. The dispatcher is the hop after a path's last block."""
        kinds = {}
        for path in self.tasks.values():
            for i, name in enumerate(path):
                if c.block != name:
                    continue
                nexts = self.replicas(path[i + 1]) if i + 1 < len(path) else [self.dispatcher]
                for n in nexts:
                    if n is None:
                        continue
                    hop = n.name if n.decl is not None else DISPATCHER
                    if c.host is not None and n.host is c.host:
                        kinds[hop] = "in_process"
                    elif n.process.node != c.process.node:
                        kinds[hop] = "tcp"
                    else:
                        kinds[hop] = "handles" if (c.decl.transport == "tensormq") else "bytes"
        return kinds

    def _fail_requests(self, instances: list[str], reason: str) -> None:
        if self.dispatcher is None or self.dispatcher.status != "ready":
            return
        self.controller.cast(self.dispatcher.ident, Cmd.FAIL, Fail(instances, reason)) \
            .add_done_callback(_log_refusal)

    def _persist(self) -> None:
        def rec(c: Child) -> dict:
            return {**process_record(c.process.pid), "name": c.name, "incarnation": c.incarnation,
                    "endpoint": c.endpoint, "status": c.status, "restarts": c.restarts}
        self.state.save({
            "server": process_record(os.getpid()) if not self._stopping.is_set() else None,
            "version": self.version, "update": self.update_body,
            "blocks": {n: rec(c) for n, c in self.blocks.items() if c.process.pid},
            "dispatcher": rec(self.dispatcher) if self.dispatcher and self.dispatcher.process.pid else None,
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


def _resolve(fut: Future, result=None, error: BaseException | None = None) -> None:
    """Answer an operation's caller, unless it gave up waiting already."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except InvalidStateError:
        pass


def _log_refusal(fut: Future) -> None:
    exc = fut.exception()
    if exc is not None:
        log.warning("a process did not take a control message: %s", exc)


def _input_spec(entry: dict | None, dtype: str | None = None) -> dict | None:
    """What a task's first block takes, for the dispatcher's check of a request (its manifest
    entry): dtype and shape, and ``shapes`` where it takes several tensors (``input_shapes``);
    ``dtype``: the block's declared ``input_dtype``, before the manifest's (``dtypes``: one per
    member); ``names``, ``dims`` and ``bounds``: the declared inputs and dynamic dimensions of a
    model split by ``torch.export`` (None in a shape: a dynamic dimension)."""
    if not entry:
        return {"dtype": dtype, "shape": None} if dtype else None
    spec = {"dtype": dtype or entry.get("dtype"), "shape": entry.get("input_shape")}
    if entry.get("input_shapes"):
        spec["shapes"] = entry["input_shapes"]
    if entry.get("input_dtypes") and not dtype:
        spec["dtypes"] = entry["input_dtypes"]
    if entry.get("input_names"):
        spec["names"] = entry["input_names"]
    dims = entry.get("input_dims")
    if dims:  # a dynamic dimension is any size within its bounds, not the size exported with
        def fixed(shape, member_dims):
            return [d if isinstance(named, int) else None for d, named in zip(shape, member_dims)]
        spec["dims"], spec["bounds"] = dims, entry.get("dim_bounds") or {}
        if spec["shape"]:
            spec["shape"] = fixed(spec["shape"], dims[0])
        if spec.get("shapes"):
            spec["shapes"] = [fixed(s, d) for s, d in zip(spec["shapes"], dims)]
    return spec
