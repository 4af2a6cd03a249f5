"""How the manager starts, watches and stops its children: the launcher seam (issue 30 item 1).

The supervisor (manager.py) never creates or signals a process itself. It asks a ``Launcher``
to start a child -- its entry point (``SERVE_BLOCK``, ``SERVE_HOST``: blocks/spec.py;
``SERVE_DISPATCHER``: dispatcher/spec.py; a ``childproc.Entry``, so the manager never imports
a block's module, nor torch) and its spec -- and gets back a ``ChildHandle``, the little of ``multiprocessing.Process`` the
supervisor uses::

    handle = launcher.start(SERVE_BLOCK, spec, "blockflow-b1")
    handle.pid        # where the manager can see it, for logs and slot clean-up (None: not yet)
    handle.node       # the identity of the machine it runs on (local_node() for a local child)
    handle.exitcode   # None while it runs; else its exit code (<0: killed by that signal)
    handle.is_alive(); handle.join(timeout); handle.terminate(); handle.kill()

Every call returns at once except ``join``; ``exitcode`` is how the supervisor learns of an exit
(its loop polls, it never waits on a child: manager.py's docstring). Exit codes keep their
meaning across launchers (blockflow/core/protocol.py: EXIT_BOOT_ERROR and the others).

``LocalLauncher`` is the default: children forked from the forkserver that has torch imported
(manager/forkserver.py), on this machine. ``RayLauncher`` (ray_launcher.py, ``serve --ray``)
starts a block declared with a ``node`` on a node of a Ray cluster and the rest locally; its
handles also say ``waiting_for`` (the resource a child waits for a node with). ``node`` decides
whether a hop between two blocks stays on one host (by the identity of the machine, never by
comparing addresses).

``HostedProcess`` (children.py) is the third kind of handle: a block inside a shared process,
which lives and dies with its host's handle.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
from typing import Callable, Protocol

from .forkserver import context as forkserver_context

log = logging.getLogger("blockflow.manager")


def local_node() -> str:
    """This machine's identity as children started here report it: its host name."""
    return socket.gethostname()


class ChildHandle(Protocol):
    """One started child, as the supervisor sees it (see the module's docstring)."""

    node: str

    @property
    def pid(self) -> int | None: ...

    @property
    def exitcode(self) -> int | None: ...

    def is_alive(self) -> bool: ...

    def join(self, timeout: float | None = None) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


class LocalChild:
    """A child process of this one, forked from the forkserver."""

    def __init__(self, process, node: str):
        self.process, self.node = process, node

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self.process.join(timeout)

    def terminate(self) -> None:
        self.process.terminate()

    def kill(self) -> None:
        """SIGKILL now (multiprocessing's: a child already reaped or gone is left alone)."""
        self.process.kill()


class LocalLauncher:
    """Children on this machine, forked from the forkserver (the default launcher)."""

    kind = "local"

    def __init__(self):
        self.mp = forkserver_context()  # already running when `blockflow serve` started it early
        self.node = local_node()

    def start(self, target: Callable, spec, name: str, node: str | None = None) -> LocalChild:
        if node is not None:
            raise ValueError(f"{name} is to run on node {node!r}, but this server places nothing on other "
                             "nodes: start it with --ray")
        proc = self.mp.Process(target=target, args=(spec,), name=name, daemon=True)
        proc.start()
        return LocalChild(proc, self.node)

    def close(self) -> None:
        """After every child is gone: nothing this launcher started is left (the forkserver)."""
        stop_forkserver()


def stop_forkserver() -> None:
    """Stop the multiprocessing forkserver (and the resource tracker it started) now, instead of
    letting them notice our exit up to a second later: when ``serve`` returns, nothing it started
    is left. Call it after every child is gone.

    The forkserver gets SIGTERM first: it holds nothing but its listening socket, and a polite
    exit would spend about 2 s tearing down the torch it preloaded. ``_stop()`` (the method
    CPython's own tests use) then closes our end of its pipe and reaps it. Without these
    private names (another Python) both still end on their own when their pipe from us closes."""
    from multiprocessing import forkserver, resource_tracker
    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if pid:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for server in (server, getattr(resource_tracker, "_resource_tracker", None)):
        stop = getattr(server, "_stop", None)
        if stop is None:
            continue
        try:
            stop()
        except (OSError, ChildProcessError) as exc:
            log.debug("stopping %s: %s", type(server).__name__, exc)
