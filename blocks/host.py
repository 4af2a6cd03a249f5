"""A shared block process: several blocks in one process (issue 28, the block field ``process``).

Blocks declared with the same ``process`` name (and device) run in one process, so they share
one interpreter, one torch and, on a GPU, one CUDA context, instead of paying for each. Inside,
every hosted block is the same ``Block`` a block process runs (blocks/process.py), with its own
inference, control and monitor threads, its own data socket, mailbox, TensorMQ pools, queue
and KPI log, and its own DEALER to the controller under its own identity: the manager pings,
updates, replaces and retires each one as it does a block process. One member hands its output
to the next one in the process by reference, not through their sockets (blocks/handover.py). Only what is process-wide
is the host's: signals, the parent watch, glibc's heap settings and torch's thread pool.

    manager ──host {spec}──> [DEALER] host main thread ──starts──> member thread: Block.run()
                                                                    (init, READY, loop, shutdown)
    controller <──────────── each member's own DEALER (ping, update, store, stop) ──────────>

The host's main thread owns its DEALER: it answers ``host`` (start a member: model load and
READY happen on the member's thread, so the host keeps answering), ``ping`` and ``stop``, and
tells the controller when a member's thread has ended (``gone``, with ``crashed`` when its loop
raised) so the manager can tell a retired member from one that is still running.

The trade-off (README, "Shared processes"): a crash of the process, or a member hung so badly
that the manager kills it, takes every block of the group down; their held requests are
answered at once and the group comes back as a new process, each member in it.
"""
from __future__ import annotations

import logging
import os
import threading
import time

import setproctitle
import torch
import zmq

from blockflow.core import protocol
from blockflow.core.childproc import ChildProcess, exit_with, serve, spec_from_argv
from blockflow.core.protocol import Gone, Host, NoArgs, canonical_device

from .heap import keep_freed_memory, one_heap
from .process import Block
from .spec import BlockSpec, HostSpec

log = logging.getLogger("blockflow.host")

#: Seconds the host's shutdown waits for its members to stop (each answers what it holds first).
MEMBER_STOP_S = 10.0


class _Member:
    """One hosted block and the thread its life runs on."""

    def __init__(self, block: Block):
        self.block = block
        self.crashed = False
        self.thread = threading.Thread(target=self.live, name=f"{block.name}-life", daemon=True)

    def live(self) -> None:
        """Block.run() on this thread, as serve() runs it in a process of its own."""
        from blockflow.core.childproc import BootError
        b = self.block
        setproctitle.setthreadtitle(f"bf:{b.name}")  # top -H: its threads, started from here, inherit it
        try:
            b.init_process()
        except BootError as exc:
            log.error("%s", exc)
            b.report_boot_error(str(exc))
            self.crashed = True
            return
        except Exception:
            log.exception("%s crashed while starting", b.label)
            b.report_boot_error(f"{b.label} crashed while starting (see the server's log)")
            self.crashed = True
            return
        try:
            b.run()
        except Exception:
            log.exception("%s crashed", b.label)
            self.crashed = True


class BlockHost(ChildProcess):
    def __init__(self, spec: HostSpec):
        super().__init__(spec, spec.name, f"shared process {spec.name}", spec.name)
        self.members: dict[str, _Member] = {}
        #: the block cache, once a member brings a memory budget (blocks/cache.py); None: every
        #: member's weights stay on the device
        self.cache = None
        #: whether serve() replaced the command line (forked from the forkserver): then it follows the members
        self.titled = False

    def title(self) -> str:
        """``blockflow group grp: b3, b4, h``: the group and the blocks it hosts now."""
        members = ", ".join(sorted({m.block.name for m in self.members.values()}))
        return f"blockflow group {self.name.removeprefix('@')}" + (f": {members}" if members else "")

    def set_title(self, command_line: bool) -> None:
        self.titled = command_line
        super().set_title(command_line)

    def init_process(self) -> None:
        if self.spec.threads:
            torch.set_num_threads(self.spec.threads)
        keep_freed_memory(self.spec.malloc_trim)
        one_heap()  # before the members' threads: see blocks/heap.py
        self.ctx = zmq.Context()
        self.transport = None
        self.open_control()

    def ready_info(self) -> dict:
        return {"endpoint": None, "device": self.spec.device}

    def cmd_host(self, args: Host) -> dict:
        spec = BlockSpec.from_json(args.spec)
        if not spec.hosted:
            raise ValueError(f"block {spec.name}: its spec is not marked hosted")
        key = f"{spec.name}#{spec.incarnation}"
        if key in self.members:
            raise ValueError(f"block {key} is hosted here already")
        if spec.curve is not None and self.spec.bind_host:  # the manager cannot know the node's address
            spec.bind_host = self.spec.bind_host
        if spec.threads and spec.threads > torch.get_num_threads():  # a later, bigger member: one pool
            torch.set_num_threads(spec.threads)
        block = Block(spec)
        if spec.memory_budget_mb is not None:
            block.cache = self.block_cache(spec.memory_budget_mb,
                                           os.path.join(spec.sock_dir, f"swap-{canonical_device(spec.device).replace(':', '')}.lock"))
        member = self.members[key] = _Member(block)
        member.thread.start()
        self.set_title(self.titled)
        return {"hosting": key, "pid": os.getpid()}

    def block_cache(self, budget_mb: float, device_lock: str):
        """The process's block cache, made by its first member with a budget; a later member
        brings its update's budget (the manager gives every member of a group the same one)."""
        from blockflow.core import settings
        from .cache import POLICIES, BlockCache
        budget = int(budget_mb * 2**20)
        if self.cache is None:
            self.cache = BlockCache(budget, POLICIES[settings.CACHE_POLICY](), device_lock)
            log.info("%s: memory budget %.1f MB (%s eviction)", self.label, budget_mb, settings.CACHE_POLICY)
        elif self.cache.budget != budget:
            log.info("%s: memory budget %.1f -> %.1f MB", self.label, self.cache.budget / 2**20, budget_mb)
            self.cache.budget = budget
        return self.cache

    def last_heard(self) -> float:
        """The manager pings the members, not the process that hosts them: hearing from it is
        what any member heard last."""
        return max([self._heard, *(m.block.last_heard() for m in list(self.members.values()))])

    def cmd_ping(self, args: NoArgs) -> dict:
        return {**super().cmd_ping(args), "members": sorted(self.members)}

    def loop(self) -> None:
        while not self.stopping.is_set():
            if self.ctrl is not None and self.ctrl.poll(100):
                self.receive_control()
            elif self.ctrl is None:
                self.stopping.wait(0.1)
            self.report_gone()
            self.watch_parent()

    def report_gone(self) -> None:
        """Tell the controller about members whose thread ended (main thread: it owns ``ctrl``)."""
        for key, m in list(self.members.items()):
            if m.thread.is_alive():
                continue
            del self.members[key]
            log.info("%s: %s has stopped%s", self.label, key, " (crashed)" if m.crashed else "")
            if self.ctrl is not None:
                self.ctrl.send(protocol.encode(Gone(key, m.crashed)))
            self.set_title(self.titled)

    def answer_held(self) -> None:
        """Stop every member: each answers what it holds and closes its own sockets."""
        for m in self.members.values():
            m.block.request_stop()  # its inference thread sees it within BEAT_INTERVAL
        deadline = time.monotonic() + MEMBER_STOP_S
        for key, m in self.members.items():
            m.thread.join(max(0.0, deadline - time.monotonic()))
            if m.thread.is_alive():
                log.warning("%s: %s did not stop within %.0fs", self.label, key, MEMBER_STOP_S)

    def abandoned_files(self) -> list[str]:
        """What each member would leave (its sockets, and the slots of this process's pid, which
        its members' pools share: listed once)."""
        return sorted({f for m in list(self.members.values()) for f in m.block.abandoned_files()})

    def shutdown(self) -> None:
        self.stopping.set()
        self.answer_held()
        if self.ctrl is not None:
            self.ctrl.close(linger=0)
        self.ctx.term()
        log.info("%s stopped (exit %d)", self.label, self.exit_code)


def serve_host(spec: HostSpec) -> None:
    """Entry point of a shared process the manager forks from the forkserver: ends it with its exit code."""
    exit_with(serve(BlockHost, spec, forked=True))


def main(argv: list[str] | None = None) -> int:
    return serve(BlockHost, spec_from_argv(HostSpec, argv, "blockflow host", (
        "Run one shared process: blocks of one group, sent by the manager's 'host' command, each on its "
        "own threads. The manager starts it itself (the Ray launcher through this command line).")))


if __name__ == "__main__":
    exit_with(main())
