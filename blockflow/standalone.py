"""Blocks and a dispatcher as separate processes without the REST server.

For benchmarks and tests that want the data plane alone: each block and the dispatcher is a
real process started from the command line (``python -m blockflow.blocks.process --spec ...``), wired
by real ZeroMQ sockets, registering with a real controller that lives in this process.

``nodes`` (block name -> a node's name) lays the blocks out as if on several machines, all on
this one: each block also listens on CURVE TCP, and every hop between blocks of different
nodes (the dispatcher is on a node of its own, ``serve``) travels as bytes over CURVE TCP with
the deployment's keys, exactly as in Ray mode (manager/ray_launcher.py) -- Ray only places
processes, it carries none of their traffic. What a hop between nodes costs in software
(encryption, TCP, bytes) is measured so on one machine (experiments/hop_overhead.py); the
network between two real machines is not.

What the processes are told about each other is what the manager tells them: the task table and
the topology come from the manager's own ``TopologyPublisher`` (manager/topology.py), over a
process table (manager/children.py) that holds the processes started here.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import zmq

from blockflow.core import settings
from blockflow.core.curve import ClusterKeys
from blockflow.core.protocol import DISPATCHER, Cmd, identity
from blockflow.core.schema import BlockDecl
from blockflow.manager.children import Child, ProcessTable
from blockflow.manager.controller import Controller
from blockflow.manager.launcher import LocalChild
from blockflow.manager.topology import Deployment, TopologyPublisher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class StartedChild(LocalChild):
    """A child started here with ``subprocess`` (``LocalChild``'s handle over a ``Popen``), as the
    manager's process table holds one: ``node`` is the node it stands for (``nodes``)."""

    @property
    def exitcode(self) -> int | None:
        return self.process.poll()

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


class StandalonePipeline:
    """``blocks``: name -> model path in ``repo``; ``tasks``: task id -> list of block names;
    every block runs on ``device`` (``cpu``, ``cuda``, ``cuda:N``)."""

    def __init__(self, repo: str, blocks: dict[str, str], tasks: dict[str, list[str]], transport: str = "tensormq",
                 threads: int | None = 1, window: int = settings.WINDOW, workdir: str | None = None,
                 env: dict | None = None, device: str = "cpu", shm_prefix: str = "blockflow-sa",
                 protocol: str = "ipc", nodes: dict[str, str] | None = None):
        self.workdir = workdir or tempfile.mkdtemp(prefix="bfs-")
        self.ctx = zmq.Context()
        self.sock = os.path.join(self.workdir, "sock")
        # benchmarks pass another prefix: other runs' leak checks and sweeps look for blockflow-*
        self.shm = f"/dev/shm/{shm_prefix}-{os.getpid()}-{os.path.basename(self.workdir)}"
        self.run = os.path.join(self.workdir, "run")
        for d in (self.sock, self.shm, self.run):
            os.makedirs(d, mode=0o700, exist_ok=True)
        self.controller = Controller(self.ctx, f"ipc://{self.sock}/ctl.sock")
        self.controller.start()
        self.procs: dict[str, subprocess.Popen] = {}
        env = dict(os.environ, **(env or {}))
        keys = ClusterKeys.generate().to_json() if nodes else None
        cluster = {"curve": keys, "bind_host": "127.0.0.1"} if nodes else {}
        # the manager's view of what runs: a process table and a deployment, published by its own
        # publisher (the dispatcher is on a node of its own, "serve")
        self.table = ProcessTable()
        publisher = TopologyPublisher(self.table, Deployment(tasks=dict(tasks), transport=transport), self.controller,
                                      wake=lambda: None, cluster=bool(nodes))
        try:
            for name, model in blocks.items():
                spec = dict(name=name, model=model, repo=repo, run_dir=self.run, sock_dir=self.sock,
                            shm_dir=self.shm, transport=transport, controller=self.controller.endpoint,
                            parent_pid=os.getpid(), threads=threads, window=window, device=device,
                            protocol=protocol, **cluster)
                self.procs[name] = self._start("blockflow.blocks.process", spec, env)
                decl = BlockDecl(name=name, model=model, device=device, transport=transport, protocol=protocol)
                self.table.declared[name] = decl
                node = nodes[name] if nodes else "serve"
                self.table.blocks[name] = Child(name, decl, 0, StartedChild(self.procs[name], node), block=name)
            for name, c in self.table.blocks.items():
                c.mark_ready(self.controller.wait_ready(c.ident, 120))
            self.endpoints = {n: c.endpoint for n, c in self.table.blocks.items()}
            dspec = dict(sock_dir=self.sock, shm_dir=self.shm, address="tcp://127.0.0.1:0", transport=transport,
                         controller=self.controller.endpoint, parent_pid=os.getpid(),
                         tasks=publisher.task_table(), window=window, **cluster)
            self.procs[DISPATCHER] = self._start("blockflow.dispatcher.process", dspec, env)
            self.table.dispatcher = Child(DISPATCHER, None, 0, StartedChild(self.procs[DISPATCHER], "serve"))
            self.table.dispatcher.mark_ready(self.controller.wait_ready(self.table.dispatcher.ident, 120))
            self.address = self.table.dispatcher.endpoint
            # the task table and every process's live hops, their devices and (nodes) the hops on its node
            for fut in publisher.publish():
                fut.result(15)
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def _start(module: str, spec: dict, env: dict) -> subprocess.Popen:
        """A child with its spec on standard input (it may hold keys: not on a command line)."""
        proc = subprocess.Popen([sys.executable, "-m", module, "--spec", "-"], cwd=ROOT, env=env, stdin=subprocess.PIPE)
        proc.stdin.write(json.dumps(spec).encode())
        proc.stdin.close()
        return proc

    def command(self, name: str, cmd: str, args=None, timeout: float = 5.0):
        return self.controller.request(identity(name, 0), cmd, args, timeout=timeout)

    def stop(self) -> dict:
        """Stop every process; return exit codes and what was left behind (should be nothing)."""
        if getattr(self, "_result", None) is not None:
            return self._result
        for name, p in self.procs.items():
            if p.poll() is None:
                try:
                    self.controller.cast(identity(name, 0), Cmd.STOP)
                except Exception:
                    pass
        codes = {}
        for name, p in self.procs.items():
            try:
                codes[name] = p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                codes[name] = p.wait()
        self.controller.stop()
        self.ctx.term()
        left = {"slots": os.listdir(self.shm) if os.path.isdir(self.shm) else [],
                "sockets": [f for f in os.listdir(self.sock) if f != "ctl.sock"] if os.path.isdir(self.sock) else []}
        shutil.rmtree(self.shm, ignore_errors=True)
        shutil.rmtree(self.workdir, ignore_errors=True)
        self._result = {"codes": codes, "left": left}
        return self._result

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
