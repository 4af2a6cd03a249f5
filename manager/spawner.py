"""How a child of this server is started: its spec, and the launcher that starts it.

``Spawner`` turns a block declaration into a ``BlockSpec`` (the declaration whole, plus where this
server keeps its sockets, slots and KPI logs, and its controller), asks the launcher
(manager/launcher.py) to start it, and returns the new ``Child`` for the process table
(manager/children.py), STARTING. A block declared with a ``process`` goes into that shared
process, started here if need be. It never waits: READY arrives at the controller, and the
supervisor (supervision.py) moves the child on.
"""
from __future__ import annotations

import logging
import os

import msgspec
from msgspec.structs import replace

# specs and entry points only: the manager never imports a block or the dispatcher (nor torch)
from blockflow.blocks.spec import SERVE_BLOCK, SERVE_HOST, BlockSpec, HostSpec
from blockflow.dispatcher.spec import SERVE_DISPATCHER, DispatcherSpec
from blockflow.core.protocol import DISPATCHER
from blockflow.core.schema import BlockDecl
from blockflow.core.curve import ClusterKeys

from .children import Child, ChildState, HostedProcess, ProcessTable
from .controller import Controller
from .models import ModelCatalog
from .state import StateDir

log = logging.getLogger("blockflow.manager")


class Spawner:
    """Starts this server's children (the module's docstring). The caller puts a block or the
    dispatcher in the table; a shared process started for a block goes into ``table.hosts`` here."""

    def __init__(self, table: ProcessTable, launcher, controller: Controller, dirs: StateDir, repo: str,
                 catalog: ModelCatalog, window: int, token: str | None = None, keys: ClusterKeys | None = None,
                 controller_tcp: str | None = None):
        #: ``keys``, ``controller_tcp``: Ray mode, the deployment's CURVE keys and the controller's
        #: endpoint for processes on other nodes
        self.table, self.launcher, self.controller, self.dirs = table, launcher, controller, dirs
        self.repo, self.catalog, self.window, self.token = repo, catalog, window, token
        self.keys, self.controller_tcp = keys, controller_tcp

    def block(self, decl: BlockDecl, restarts: int = 0, streak: int = 0, block: str | None = None,
                    replica: int = 0, declared: dict[str, BlockDecl] | None = None) -> Child:
        """Start the process ``decl.name``: replica ``replica`` of ``block`` (default: the block itself).
        A block with a ``process`` goes into that shared process (started here if need be), once
        the process is ready (Supervisor.check_hosts)."""
        inc = self.table.next_incarnation(decl.name)
        # the declaration goes to the block whole (Note [One declaration per block] in blockflow/core/schema.py)
        spec = BlockSpec(**msgspec.structs.asdict(decl), repo=self.repo, run_dir=self.dirs.run_dir,
                         sock_dir=self.dirs.sock, shm_dir=self.dirs.shm, incarnation=inc,
                         controller=self.controller.endpoint, parent_pid=os.getpid(), window=self.window,
                         verified=self.catalog.verified(decl.files))
        spec = self.cluster_spec(spec, decl.node)
        if decl.node is not None:
            spec = replace(spec, verified=None)  # its node's copy of the files: the block checks it there
        if decl.process is not None:
            host = self.host_for(decl, self.table.declared if declared is None else declared)
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
        host = self.table.hosts.get(decl.process)
        if (host is not None and host.process.exitcode is None
                and host.status in (ChildState.STARTING, ChildState.READY)):
            return host
        name = f"@{decl.process}"
        threads = max((d.threads or 0 for d in declared.values() if d.process == decl.process), default=0)
        inc = self.table.next_incarnation(name)
        spec = self.cluster_spec(HostSpec(name=name, device=decl.device, threads=threads or None, incarnation=inc,
                                          controller=self.controller.endpoint, parent_pid=os.getpid()), decl.node)
        proc = self.launcher.start(SERVE_HOST, spec, f"blockflow-{name}", node=decl.node)
        log.info("spawned shared process %s#%d (pid %s, %s)", name, inc, proc.pid, decl.device)
        restarts = host.restarts + 1 if host is not None else 0
        self.table.hosts[decl.process] = new = Child(name, None, inc, proc, restarts=restarts)
        return new

    def cluster_spec(self, spec, node: str | None):
        """Ray mode: the spec of a block or shared process gets the cluster's keys and listens
        for other nodes (at this host's address; the node agent puts its node's); one placed on
        another node reaches the controller over CURVE TCP."""
        if self.keys is None:
            return spec
        spec = replace(spec, curve=self.keys.to_json(), bind_host=self.launcher.ip)
        return spec if node is None else replace(spec, controller=self.controller_tcp)

    def dispatcher(self, address: str, transport: str, restarts: int = 0, streak: int = 0) -> Child:
        inc = self.table.next_incarnation(DISPATCHER)
        spec = DispatcherSpec(sock_dir=self.dirs.sock, shm_dir=self.dirs.shm, address=address,
                              run_dir=self.dirs.run_dir,
                              transport=transport, controller=self.controller.endpoint,
                              parent_pid=os.getpid(), incarnation=inc, token=self.token, window=self.window)
        spec = self.cluster_spec(spec, None)
        proc = self.launcher.start(SERVE_DISPATCHER, spec, "blockflow-dispatcher")
        return Child(DISPATCHER, None, inc, proc, restarts=restarts, streak=streak)
