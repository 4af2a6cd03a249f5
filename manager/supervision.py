"""Keeping the children alive (thesis 3.5): the supervisor's rounds over the process table.

Each round (manager.py, ``Manager.round``) the ``Supervisor`` reaps exits and escalates a stop
(STOP, then SIGTERM, then SIGKILL), pings the ready children and kills one that is silent past
HANG_TIMEOUT, stuck in one inference past its ``max_inference_s`` or, the dispatcher, in one round
of its loop past LOOP_STALL, moves a STARTING child to
READY or FAILED, starts what a shared process hosts once it is ready, and respawns what died.
It moves children between their ``ChildState``s (manager/children.py), never waits on a process,
and tells the processes what changed through the topology publisher (manager/topology.py).
The operation in progress (manager/operation.py) is the Manager's: its new children are handed
in as ``pending``, watched like the others until it switches to them.
"""
from __future__ import annotations

import logging
import queue
import time
from typing import Callable, Iterable

from blockflow.core import settings
from blockflow.core.protocol import EXIT_BOOT_ERROR, EXIT_NODE_LOST, Cmd, Host, describe_exit

from .children import Child, ChildState, HostedProcess, ProcessTable
from .controller import Controller
from .spawner import Spawner
from .state import StateDir
from .topology import TopologyPublisher, log_refusal

log = logging.getLogger("blockflow.manager")

#: Seconds a new block has to load its model and report READY.
READY_TIMEOUT = settings.READY_TIMEOUT
#: Seconds between health pings.
PING_INTERVAL = settings.PING_INTERVAL
#: A process silent for this long is considered hung, killed and respawned.
HANG_TIMEOUT = settings.HANG_TIMEOUT
#: A dispatcher whose main loop has not come round for this long is considered hung (its pings
#: are answered by its control thread: dispatcher/process.py).
LOOP_STALL = settings.LOOP_STALL
#: Respawns allowed per block before it is marked failed.
MAX_RESTARTS = settings.MAX_RESTARTS
#: A process that ran this long before dying starts a fresh restart budget: the limit is meant
#: for crash loops (as systemd's StartLimitBurst within StartLimitIntervalSec), not for a server
#: that lost a block five times over a month.
RESTART_WINDOW = settings.RESTART_WINDOW
#: A child asked to stop gets this long before SIGTERM, and STOP_KILL_S before SIGKILL.
STOP_TERM_S = 1.0
STOP_KILL_S = 5.0


class Supervisor:
    """The supervisor's steps over the children (the module's docstring), called in each round."""

    def __init__(self, table: ProcessTable, controller: Controller, spawner: Spawner, topology: TopologyPublisher,
                 state: StateDir, node: str, events: queue.Queue, changed: Callable[[], None]):
        #: ``node``: this host's (a dead child's slot files elsewhere are its node agent's to remove);
        #: ``events``: the supervisor's queue, where pong replies go; ``changed``: records the state
        self.table, self.controller, self.spawner, self.topology = table, controller, spawner, topology
        self.state, self.node, self.events, self.changed = state, node, events, changed
        self._next_ping = 0.0
        self._last_health = 0.0   # when check_health last ran (monotonic)
        self._grace_from = 0.0    # silence before this moment does not count (see check_health)

    def check_hosts(self, pending: Iterable[Child] = ()) -> None:
        """Shared processes: READY (-> ready, and their waiting blocks are sent to them), an
        exit (-> gone: their blocks see it as their own), nothing left to host (-> stopped)."""
        members = [c for c in [*self.table.blocks.values(), *self.table.stopping,
                               *pending] if c.host is not None and not c.gone]
        for group, host in list(self.table.hosts.items()):
            if host.status is ChildState.STARTING and host.ident in self.controller.ready:
                host.mark_ready(self.controller.ready[host.ident])
                log.info("shared process %s#%d (pid %s) is ready", host.name, host.incarnation, host.process.pid)
            if host.process.exitcode is not None:
                if host.status is not ChildState.STOPPING:
                    log.warning("shared process %s (pid %s) exited: %s", host.instance, host.process.pid,
                                describe_exit(host.process.exitcode))
                    host.status = ChildState.FAILED
                del self.table.hosts[group]
                self.controller.forget(host.ident)
                if host.process.pid:
                    self.state.remove_slots_of(host.process.pid)
                continue
            if not any(c.host is host for c in members) and host.status is not ChildState.STOPPING:
                self.stop_later([host])
                del self.table.hosts[group]
                continue
            if host.status is ChildState.READY:
                for c in members:
                    if c.host is host and c.hosted_spec is not None and c.status is ChildState.STARTING:
                        self.controller.cast(host.ident, Cmd.HOST, Host(c.hosted_spec)).add_done_callback(
                            log_refusal)
                        c.hosted_spec = None

    def stop_later(self, children) -> None:
        """Ask each child to stop; reap_children() escalates to SIGTERM and SIGKILL."""
        now = time.monotonic()
        for c in children:
            if c.gone or c in self.table.stopping:
                continue
            c.status, c.stop_asked = ChildState.STOPPING, now
            if c.process.exitcode is None:
                self.controller.cast(c.ident, Cmd.STOP)
            self.table.stopping.append(c)

    def stop_now(self, children, timeout: float = STOP_KILL_S) -> None:
        """Shutdown only (the supervisor has stopped): ask politely, SIGTERM, SIGKILL, and wait."""
        children = [c for c in children if not c.gone]
        for c in children:
            c.status = ChildState.STOPPING
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
        if c.process.pid is None or c.process.exitcode is None or c.process.node != self.node:
            return  # on another node its agent removes them (ray_launcher.py): a pid names nothing here
        if isinstance(c.process, HostedProcess) and c.process.host_alive():
            return  # the others still use theirs; this one unlinked its own (check_hosts does the rest)
        removed = self.state.remove_slots_of(c.process.pid)
        if removed:
            log.info("removed %d slot files that %s (pid %d) left behind", removed, c.instance, c.process.pid)

    def reap_children(self) -> None:
        for c in self.table.supervised():
            if c.status is ChildState.READY and c.process.exitcode is not None:
                self.on_child_down(c, describe_exit(c.process.exitcode), c.process.exitcode == EXIT_BOOT_ERROR)
        now = time.monotonic()
        for c in list(self.table.stopping):
            if c.process.exitcode is not None:
                self._gone(c)
                self.table.stopping.remove(c)
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
        for c in self.table.supervised():
            if c.status is not ChildState.READY:
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
        its ``max_inference_s``, or a dispatcher whose main loop has not come round for
        ``LOOP_STALL``, is stuck (the control thread still answers, so silence would never tell)."""
        if c.status is not ChildState.READY or not isinstance(result, dict):
            return
        if c.decl is None:  # the dispatcher
            stalled = result.get("beat_age_s")
            if isinstance(stalled, (int, float)) and stalled > LOOP_STALL:
                self.kill_child(c, f"its main loop has not come round for {stalled:.1f}s (BLOCKFLOW_LOOP_STALL "
                                   f"{LOOP_STALL:g} s), killed")
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
            c.status = ChildState.FAILED
            c.failure = f"{how}; not respawned ({'cannot start' if boot_error else f'{MAX_RESTARTS} restarts within {RESTART_WINDOW:.0f}s'})"
            log.error("%s failed: %s", c.instance, c.failure)
        else:
            c.status = ChildState.RESTARTING
            log.warning("%s (pid %s) died: %s; respawning (restart %d of %d)", c.instance, c.process.pid, how,
                        c.streak + 1, MAX_RESTARTS)
        if c.decl is not None:
            # Order matters: first the dispatcher learns that tasks through the block are
            # unavailable (so no new request is sent to a dead socket, where it would wait for
            # its deadline), then it answers the requests the block held. Both go down the same
            # control pipe, so they arrive in this order.
            self.topology.publish()
            self.topology.fail_requests([c.instance], f"block {c.name} failed ({how}) while holding the request")
        self.changed()

    def check_starting(self, pending: Iterable[Child] = ()) -> None:
        """Starting children: READY (-> ready), a boot error, an early exit or no READY in time
        (-> failed: a new block fails its update, a respawn is marked failed)."""
        starting = [c for c in [*self.table.supervised(), *pending] if c.status is ChildState.STARTING]
        changed = False
        now = time.monotonic()
        for c in starting:
            info = self.controller.ready.get(c.ident)
            if info is not None:
                c.mark_ready(info)
                if self.table.serves(c):
                    log.info("%s (pid %s) is ready on %s", c.instance, c.process.pid, c.endpoint)
                    changed = True
                continue
            boot = self.controller.boot_errors.get(c.ident)
            # read once: a Ray child's exit code can appear between two reads (RayChild.exitcode
            # polls Ray), and a respawn on a dying node, alive at one read and gone at the next,
            # was failed as a block that cannot start instead of being placed again
            code = c.process.exitcode
            if c.restarts and code == EXIT_NODE_LOST and self.table.blocks.get(c.name) is c:
                # a respawn that Ray placed on a node that was dying (before its health checks
                # said so) is placed again: not a failure of the block, nor a crash to count
                log.warning("%s was placed on a node that is gone; placing it again", c.instance)
                self.controller.forget(c.ident)
                again = self.spawner.block(c.decl, restarts=c.restarts, streak=c.streak, block=c.block,
                                           replica=c.replica)
                again.last_exit = c.last_exit
                self.table.blocks[c.name] = again
                continue
            if c.restarts and getattr(c.process, "waiting_for", None) and code is None:
                c.spawned_at = now  # a respawn waits for a node with its resource as long as it takes
                continue
            if boot is None and code is None and now - c.spawned_at < READY_TIMEOUT:
                continue
            if boot is not None:
                why = boot.get("error", "boot error")
            elif code is not None:
                why = f"{c.ident.decode()} exited before it was ready"
            else:
                why = f"{c.ident.decode()} did not report READY within {READY_TIMEOUT:.0f}s"
            what = f"block {c.name} ({' + '.join(c.decl.files)} on {c.decl.device})" if c.decl else "the dispatcher"
            c.failure = f"{what} did not start: {why}"
            if code is not None:
                c.failure += f" [{describe_exit(code)}]"
            log.error("%s", c.failure)
            self.stop_later([c])
            c.status = ChildState.FAILED
            changed = changed or self.table.serves(c)
        if changed:
            self.topology.publish()
            self.changed()

    def respawn_children(self, dispatcher_address: str, transport: str) -> None:
        # the new incarnation carries how the last one ended: GET /system and `blockflow status`
        # say why a block restarted after it is ready again, not only while it is down
        for name, c in list(self.table.blocks.items()):
            if c.status is ChildState.RESTARTING:
                self.table.blocks[name] = self.spawner.block(c.decl, restarts=c.restarts + 1, streak=c.streak + 1,
                                                             block=c.block, replica=c.replica)
                self.table.blocks[name].last_exit = c.last_exit
                self.changed()
        if self.table.dispatcher is not None and self.table.dispatcher.status is ChildState.RESTARTING:
            old = self.table.dispatcher
            self.table.dispatcher = self.spawner.dispatcher(dispatcher_address, transport,
                                                            restarts=old.restarts + 1, streak=old.streak + 1)
            self.table.dispatcher.last_exit = old.last_exit
            self.changed()
