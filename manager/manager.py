"""The manager: makes the optimiser's decision real and keeps it real (thesis 3.5, 3.6).

``apply(update)`` diffs the desired state against what runs: spawns missing blocks, keeps
identical ones, replaces changed ones, and only when every new block is READY switches the
dispatcher's task table and the blocks' connections over; then it drains and stops the blocks
no longer needed. A block that fails to start fails the whole update and nothing changes.

The supervisor loop (one screen, gunicorn's Arbiter in spirit)::

    while running:  wait -> reap_children -> check_health -> respawn_failed

Blocks are forked from a forkserver that has torch imported already, so a new block costs a
fork and a model load, not a fresh interpreter (about 2 s of torch import each).
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import zmq

from blockflow.protocol import DISPATCHER, EXIT_BOOT_ERROR, RETURN_HOP, describe_exit, identity
from blockflow.schema import BlockDecl, Update, UpdateError, validate_update
from blockflow.blocks.process import BlockSpec, serve_block
from blockflow.dispatcher.process import DispatcherSpec, serve_dispatcher

from .controller import ControlError, Controller
from .state import StateDir, process_record, slot_budget
from blockflow import settings

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


class UpdateFailed(RuntimeError):
    """A valid update could not be applied (a block did not start); the old state stays."""

    def __init__(self, message: str, block: str | None = None):
        super().__init__(message)
        self.block = block


class Conflict(RuntimeError):
    """The request contradicts the current state (409)."""


@dataclass
class Child:
    """A running block or the dispatcher, as the manager sees it."""

    name: str
    decl: BlockDecl | None          # None for the dispatcher
    incarnation: int
    process: multiprocessing.Process
    status: str = "starting"         # starting, ready, restarting, failed, stopping
    endpoint: str | None = None
    ready_info: dict = field(default_factory=dict)
    restarts: int = 0                # respawns of this block name since it was declared
    streak: int = 0                  # respawns in the current crash loop (see RESTART_WINDOW)
    last_exit: str | None = None
    failure: str | None = None
    started: float = field(default_factory=time.time)

    @property
    def ident(self) -> bytes:
        return identity(self.name, self.incarnation)

    @property
    def instance(self) -> str:
        return f"{self.name}#{self.incarnation}"

    def describe(self) -> dict:
        d = {"name": self.name, "pid": self.process.pid, "status": self.status, "endpoint": self.endpoint,
             "restarts": self.restarts, "incarnation": self.incarnation, "last_exit": self.last_exit,
             "failure": self.failure, "started": self.started}
        if self.decl is not None:
            d.update(self.decl.as_dict())
        return d


class Manager:
    def __init__(self, repo: str, state: StateDir, dispatcher_address: str = "tcp://127.0.0.1:5580",
                 token: str | None = None, window: int = 8):
        self.repo = os.path.abspath(repo)
        self.state = state
        self.dispatcher_address = dispatcher_address
        self.token = token
        self.window = window
        self.lock = threading.RLock()
        self.blocks: dict[str, Child] = {}
        self.tasks: dict[str, list[str]] = {}
        self.update_body: dict | None = None
        self.transport = "tensormq"
        self.version = 0
        self.dispatcher: Child | None = None
        self._incarnations: dict[str, int] = {}
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._last_health = 0.0   # when check_health last ran (monotonic)
        self._grace_from = 0.0    # silence before this moment does not count (see check_health)
        self.gpus = 0

    # -- life-cycle --------------------------------------------------------------------------
    def start(self) -> None:
        self.state.prepare()
        self.state.clean_leftovers()
        self.state.sweep_orphans()
        self.mp = multiprocessing.get_context("forkserver")
        self.mp.set_forkserver_preload(["blockflow.blocks.process", "blockflow.dispatcher.process"])
        try:
            import torch
            self.gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        except Exception:
            self.gpus = 0
        self.ctx = zmq.Context()
        self.controller = Controller(self.ctx, f"ipc://{os.path.join(self.state.sock, 'controller.sock')}")
        self.controller.start()
        self.dispatcher = self.spawn_dispatcher()
        self.dispatcher_address = self.dispatcher.endpoint  # a respawn binds the same port (matters for port 0)
        self._persist()
        self._supervisor = threading.Thread(target=self.supervise, name="supervisor", daemon=True)
        self._supervisor.start()
        log.info("manager ready: repo %s, state %s, dispatcher %s", self.repo, self.state.root,
                 self.dispatcher.endpoint)

    def stop(self) -> None:
        """Shutdown order: stop supervising (so nothing is respawned), stop blocks (they flush
        their KPI logs and answer what they hold), stop the dispatcher (it answers every request
        still open), stop the controller, remove sockets and slots, record the empty state."""
        if self._stopping.is_set() or not hasattr(self, "controller"):
            self._stopping.set()
            return
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=5)
        with self.lock:
            children = list(self.blocks.values())
            self.blocks.clear()
            self.tasks.clear()
            self.stop_children(children)
            if self.dispatcher is not None:
                self.stop_children([self.dispatcher])
                self.dispatcher = None
            self.controller.stop()
            self.ctx.term()
            self._persist()
            self.state.remove_runtime()
        log.info("manager stopped")

    # -- spawning ----------------------------------------------------------------------------
    def _next_incarnation(self, name: str) -> int:
        inc = self._incarnations.get(name, -1) + 1
        self._incarnations[name] = inc
        return inc

    def spawn_block(self, decl: BlockDecl, restarts: int = 0, streak: int = 0) -> Child:
        inc = self._next_incarnation(decl.name)
        spec = BlockSpec(name=decl.name, model=decl.model, repo=self.repo, run_dir=self.state.run_dir,
                         sock_dir=self.state.sock, shm_dir=self.state.shm, device=decl.device,
                         transport=decl.transport, protocol=decl.protocol, threads=decl.threads,
                         cpus=list(decl.cpus) if decl.cpus else None, incarnation=inc,
                         controller=self.controller.endpoint, parent_pid=os.getpid(), window=self.window)
        proc = self.mp.Process(target=serve_block, args=(spec,), name=f"blockflow-{decl.name}", daemon=True)
        proc.start()
        log.info("spawned block %s#%d (pid %d, %s on %s)", decl.name, inc, proc.pid, decl.model, decl.device)
        return Child(decl.name, decl, inc, proc, restarts=restarts, streak=streak)

    def spawn_dispatcher(self, restarts: int = 0, streak: int = 0) -> Child:
        inc = self._next_incarnation(DISPATCHER)
        spec = DispatcherSpec(sock_dir=self.state.sock, shm_dir=self.state.shm, address=self.dispatcher_address,
                              run_dir=self.state.run_dir,
                              transport=self.transport, controller=self.controller.endpoint,
                              parent_pid=os.getpid(), incarnation=inc, token=self.token, window=self.window)
        proc = self.mp.Process(target=serve_dispatcher, args=(spec,), name="blockflow-dispatcher", daemon=True)
        proc.start()
        child = Child(DISPATCHER, None, inc, proc, restarts=restarts, streak=streak)
        try:
            info = self.controller.wait_ready(child.ident, READY_TIMEOUT, alive=proc.is_alive)
        except (ControlError, TimeoutError) as exc:
            self.stop_children([child])
            raise RuntimeError(f"the dispatcher did not start on {self.dispatcher_address}: {exc} "
                               f"({describe_exit(proc.exitcode)}); is the port in use? try --dispatcher-port") from None
        child.status, child.endpoint, child.ready_info = "ready", info["endpoint"], info
        return child

    def wait_ready(self, children: list[Child]) -> None:
        """Wait for every child's READY; raise UpdateFailed naming the first that cannot start."""
        deadline = time.monotonic() + READY_TIMEOUT
        for child in children:
            try:
                info = self.controller.wait_ready(child.ident, max(0.1, deadline - time.monotonic()),
                                                  alive=child.process.is_alive)
            except (ControlError, TimeoutError) as exc:
                child.process.join(0.5)
                raise UpdateFailed(f"block {child.name} ({child.decl.model} on {child.decl.device}) did not start: "
                                   f"{exc} [{describe_exit(child.process.exitcode)}]", child.name) from None
            child.status, child.endpoint, child.ready_info = "ready", info["endpoint"], info

    def stop_children(self, children: list[Child], timeout: float = 5.0) -> None:
        """Ask politely (stop command, then SIGTERM), then SIGKILL what is still there."""
        for c in children:
            c.status = "stopping"
            if c.process.is_alive():
                try:
                    self.controller.cast(c.ident, "stop")
                except Exception:
                    pass
        deadline = time.monotonic() + timeout
        for c in children:
            c.process.join(max(0.0, min(1.0, deadline - time.monotonic())))
            if c.process.is_alive():
                c.process.terminate()
        for c in children:
            c.process.join(max(0.0, deadline - time.monotonic()))
            if c.process.is_alive():
                log.warning("%s (pid %s) ignored SIGTERM; killing it", c.instance, c.process.pid)
                c.process.kill()
                c.process.join(2)
            c.last_exit = describe_exit(c.process.exitcode)
            self.controller.forget(c.ident)
            self._remove_slots(c)

    def _remove_slots(self, c: Child) -> None:
        """A dead producer's slot files are ours to remove (a clean exit left none)."""
        if c.process.pid is None or c.process.is_alive():
            return
        removed = self.state.remove_slots_of(c.process.pid)
        if removed:
            log.info("removed %d slot files that %s (pid %d) left behind", removed, c.instance, c.process.pid)

    # -- system updates ----------------------------------------------------------------------
    def apply(self, body) -> dict:
        started = time.monotonic()
        with self.lock:
            if self._stopping.is_set():
                raise UpdateFailed("the server is shutting down")
            upd: Update = validate_update(body, self.repo, gpus=self.gpus)
            self.shm_budget = slot_budget(upd, self.window, self.state.shm)
            current = self.blocks
            kept = [n for n, d in upd.blocks.items() if n in current and current[n].decl == d
                    and current[n].status != "failed"]
            replaced = [n for n in upd.blocks if n in current and n not in kept]
            spawned = [n for n in upd.blocks if n not in current]
            removed = [n for n in current if n not in upd.blocks]
            new = [self.spawn_block(upd.blocks[n]) for n in spawned + replaced]
            try:
                self.wait_ready(new)
            except UpdateFailed:
                self.stop_children(new)  # roll back: the old blocks were never touched
                raise
            retired = [current[n] for n in removed + replaced]
            blocks = {n: current[n] for n in kept}
            blocks.update({c.name: c for c in new})
            old_tasks = self.tasks
            self.blocks, self.tasks = blocks, dict(upd.tasks)
            self.update_body, self.transport = body, upd.transport
            self.manifests = upd.manifests
            self.version += 1
            self.publish(draining=retired)
            self.retire(retired)
            self._persist()
            diff = {"spawned": spawned, "replaced": replaced, "kept": kept, "removed": removed,
                    "tasks": {"added": sorted(set(upd.tasks) - set(old_tasks)),
                              "removed": sorted(set(old_tasks) - set(upd.tasks)),
                              "changed": sorted(t for t in upd.tasks if t in old_tasks and old_tasks[t] != upd.tasks[t])}}
            took = time.monotonic() - started
            log.info("applied update version %d in %.2fs: %s", self.version, took, diff)
            return {"version": self.version, "diff": diff, "seconds": round(took, 3), "shm": self.shm_budget}

    def task_table(self) -> dict:
        table = {}
        for tid, path in self.tasks.items():
            hops = [self.blocks[n] for n in path]
            down = [c for c in hops if c.status != "ready"]
            first = hops[0].decl
            entry = (getattr(self, "manifests", {}) or {}).get(first.model)
            table[tid] = {"path": [[c.name, c.endpoint] for c in hops], "blocks": [c.instance for c in hops],
                          "input": {"dtype": entry.get("dtype"), "shape": entry.get("input_shape")} if entry else None}
            if down:
                table[tid]["unavailable"] = ", ".join(f"block {c.name} is {c.status}" for c in down)
        return table

    def publish(self, draining: list[Child] = ()) -> None:
        """Send the task table to the dispatcher and the live hops to every process.

        ``draining``: blocks on their way out whose queued requests must still finish. Their
        endpoints stay live, because a producer reclaims the slots of every hop that is not
        live, which would turn the handles still queued there into stale ones. retire()
        publishes again once they are stopped."""
        live = [c.endpoint for c in [*self.blocks.values(), *draining] if c.status == "ready"]
        if self.dispatcher is not None:
            live += list(self.dispatcher.ready_info.get("results", []))
        devices = {c.endpoint: c.decl.device for c in self.blocks.values() if c.endpoint}
        futures = []
        if self.dispatcher is not None and self.dispatcher.status == "ready":
            try:
                self.controller.request(self.dispatcher.ident, "tasks", {"tasks": self.task_table(),
                                                                         "version": self.version}, timeout=5)
            except (ControlError, TimeoutError) as exc:
                log.warning("could not send the task table to the dispatcher: %s", exc)
            futures.append(self.controller.cast(self.dispatcher.ident, "update", {"live": live, "devices": devices}))
        for c in self.blocks.values():
            if c.status == "ready":
                futures.append(self.controller.cast(c.ident, "update", {"live": live, "devices": devices}))
        for f in futures:
            try:
                f.result(5)
            except Exception as exc:
                log.warning("a process did not take the topology update: %s", exc)

    def retire(self, children: list[Child]) -> None:
        """Let requests already on a retired block's path finish, then stop it."""
        if not children:
            return
        names = [c.instance for c in children]
        deadline = time.monotonic() + DRAIN_TIMEOUT
        while self.dispatcher is not None and time.monotonic() < deadline:
            try:
                left = self.controller.request(self.dispatcher.ident, "outstanding", {"blocks": names}, timeout=2)
            except (ControlError, TimeoutError):
                break
            if not left["outstanding"]:
                break
            time.sleep(0.02)
        self.stop_children(children)
        self._fail_requests(names, f"blocks {', '.join(names)} were removed by a system update")
        self.publish()  # blocks close their sockets to the retired ones and reclaim slots

    def _fail_requests(self, instances: list[str], reason: str) -> None:
        if self.dispatcher is None or self.dispatcher.status != "ready":
            return
        try:
            self.controller.request(self.dispatcher.ident, "fail", {"blocks": instances, "reason": reason}, timeout=2)
        except (ControlError, TimeoutError) as exc:
            log.warning("could not tell the dispatcher to fail requests through %s: %s", instances, exc)

    # -- direct operations (REST) ------------------------------------------------------------
    def delete_block(self, name: str) -> dict:
        with self.lock:
            if name not in self.blocks:
                raise KeyError(name)
            users = [t for t, p in self.tasks.items() if name in p]
            if users:
                raise Conflict(f"block {name} is on the path of task(s) {', '.join(users)}; "
                               "post an update that removes those tasks first")
            child = self.blocks.pop(name)
            self.retire([child])
            if self.update_body:  # what a restarted server re-applies (blockflow/server.py) no longer has it
                self.update_body = {**self.update_body, "blocks": [b for b in self.update_body.get("blocks", [])
                                                                   if b.get("name") != name]}
            self.version += 1
            self._persist()
            return {"removed": name, "version": self.version}

    def delete_all(self) -> dict:
        with self.lock:
            children = list(self.blocks.values())
            self.blocks, self.tasks, self.update_body = {}, {}, None
            self.version += 1
            self.publish(draining=children)
            self.retire(children)
            self._persist()
            return {"removed": [c.name for c in children], "version": self.version}

    def child(self, name: str) -> Child:
        with self.lock:
            c = self.blocks.get(name)
        if c is None:
            raise KeyError(name)
        return c

    def command(self, name: str, cmd: str, args: dict | None = None, timeout: float = 5.0):
        c = self.child(name)
        if c.status != "ready":
            raise Conflict(f"block {name} is {c.status}")
        return self.controller.request(c.ident, cmd, args, timeout=timeout)

    def ping(self, name: str) -> dict:
        t0 = time.perf_counter()
        result = self.command(name, "ping")
        return {"name": name, "rtt_ms": (time.perf_counter() - t0) * 1e3, **result}

    def snapshot(self) -> dict:
        with self.lock:
            return {"version": self.version, "transport": self.transport,
                    "blocks": [c.describe() for c in self.blocks.values()],
                    "tasks": [{"id": t, "path": p} for t, p in self.tasks.items()],
                    "dispatcher": self.dispatcher.describe() if self.dispatcher else None,
                    "state_dir": self.state.root, "run_dir": self.state.run_dir,
                    "shm": getattr(self, "shm_budget", None)}

    def ready(self) -> bool:
        with self.lock:
            return (self.dispatcher is not None and self.dispatcher.status == "ready"
                    and all(c.status == "ready" for c in self.blocks.values()))

    # -- supervision -------------------------------------------------------------------------
    def supervise(self) -> None:
        next_ping = 0.0
        while not self._stopping.wait(0.05):
            try:
                with self.lock:
                    if self._stopping.is_set():
                        return
                    self.reap_children()
                    now = time.monotonic()
                    if now >= next_ping:
                        next_ping = now + PING_INTERVAL
                        self.check_health(now)
                    self.respawn_children()
            except Exception:
                log.exception("supervisor loop error (continuing)")

    def _all_children(self) -> list[Child]:
        return list(self.blocks.values()) + ([self.dispatcher] if self.dispatcher else [])

    def reap_children(self) -> None:
        for c in self._all_children():
            if c.status == "ready" and c.process.exitcode is not None:
                self.on_child_down(c, describe_exit(c.process.exitcode), c.process.exitcode == EXIT_BOOT_ERROR)

    def check_health(self, now: float) -> None:
        # Silence only means a hang if we were pinging all along. While an update or a respawn
        # held the lock, nobody was pinged: judging then would kill every healthy process.
        if now - self._last_health > HANG_TIMEOUT / 2:
            self._grace_from = now
        self._last_health = now
        for c in self._all_children():
            if c.status != "ready":
                continue
            seen = max(self.controller.last_seen.get(c.ident, now), self._grace_from)
            if now - seen > HANG_TIMEOUT:
                log.warning("%s (pid %d) did not answer pings for %.2fs; killing it", c.instance, c.process.pid,
                            now - seen)
                try:
                    os.kill(c.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                c.process.join(1)
                self.on_child_down(c, f"hung ({now - seen:.2f}s without answering), killed", False)
                continue
            self.controller.cast(c.ident, "ping")

    def on_child_down(self, c: Child, how: str, boot_error: bool) -> None:
        c.last_exit = how
        self.controller.forget(c.ident)
        self._remove_slots(c)
        if c.decl is not None:
            self._fail_requests([c.instance], f"block {c.name} failed ({how}) while holding the request")
        if time.time() - c.started > RESTART_WINDOW:
            c.streak = 0  # it ran for a while: this is not a crash loop
        if boot_error or c.streak >= MAX_RESTARTS:
            c.status = "failed"
            c.failure = f"{how}; not respawned ({'cannot start' if boot_error else f'{MAX_RESTARTS} restarts within {RESTART_WINDOW:.0f}s'})"
            log.error("%s failed: %s", c.instance, c.failure)
            if c.decl is not None:
                self.publish()  # tasks through it now get an 'unavailable' error at once
        else:
            c.status = "restarting"
            log.warning("%s (pid %s) died: %s; respawning (restart %d of %d)", c.instance, c.process.pid, how,
                        c.streak + 1, MAX_RESTARTS)
        self._persist()

    def respawn_children(self) -> None:
        for name, c in list(self.blocks.items()):
            if self._stopping.is_set():
                return  # shutting down: nothing is respawned, stop() takes them all
            if c.status != "restarting":
                continue
            new = self.spawn_block(c.decl, restarts=c.restarts + 1, streak=c.streak + 1)
            try:
                self.wait_ready([new])
            except UpdateFailed as exc:
                self.stop_children([new])
                new.status, new.failure = "failed", str(exc)
                log.error("respawn of %s failed: %s", name, exc)
            self.blocks[name] = new
            self.publish()
            self._persist()
        if self.dispatcher is not None and self.dispatcher.status == "restarting":
            old = self.dispatcher
            try:
                self.dispatcher = self.spawn_dispatcher(restarts=old.restarts + 1, streak=old.streak + 1)
            except RuntimeError as exc:
                old.status, old.failure = "failed", str(exc)
                log.error("respawn of the dispatcher failed: %s", exc)
                return
            self.publish()
            self._persist()

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
