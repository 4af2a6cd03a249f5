"""Children on the nodes of a Ray cluster: ``blockflow serve --ray ADDRESS`` (issue 30).

The supervisor sees the same two calls and handle as with the local launcher (launcher.py). A
block declared with ``"node": "edge-a"`` is started on a node that advertises the Ray custom
resource ``edge-a`` (``ray start --resources '{"edge-a": 1000}'``); everything else (the
dispatcher, blocks without ``node``, their shared processes) is forked here by the local
launcher, as without Ray. Ray only places processes and reports the death of nodes: BlockFlow
is not a Ray application, and its data and control traffic never go through Ray.

One ``NodeAgent`` actor per remote child, placed by the resource::

    manager ──ray──> NodeAgent (a Ray worker on edge-a) ──Popen──> python -m blockflow.blocks.process --spec -
        start(): make the state directories, start the child (spec on its stdin: it holds keys)
        wait():  the child's exit code, once it exits (a Ray object the handle polls)

The child is an ordinary block process of that node: it watches its parent (the agent) as a
local block watches the manager, and exits when the agent is gone, so a node that Ray gave up
for dead and that comes back leaves no block running twice (Ray also stops the raylet of a node
it declared dead, and every worker with it). When the node dies, ``wait()`` fails: the handle
reports ``EXIT_NODE_LOST`` and the supervisor answers the block's requests and respawns it; the
new agent waits, unplaced, until a node with the resource joins (``waiting_for``).

Node identity is Ray's node id: the supervisor compares it to decide whether a hop stays on one
host (handles) or crosses nodes (bytes over CURVE TCP), never addresses -- every node of a test
cluster is 127.0.0.1.

The spec a remote child gets holds the deployment's CURVE keys (blockflow/core/curve.py); it travels
as an argument of the agent's ``start`` over Ray's own channels, which are plain gRPC unless the
cluster runs with Ray's TLS (``RAY_USE_TLS=1`` and its certificates): on a network you do not
trust, turn that on, or the keys can be read on the wire.

Who owns what on a remote node: the agent owns its child and, once the child is gone, the slot
files it left in the node's shared-memory directory (a pid means nothing on another machine, so
the manager never removes them there).
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading

from blockflow.core.protocol import EXIT_BOOT_ERROR, EXIT_NODE_LOST

from .launcher import LocalLauncher
from .state import remove_slots_of

log = logging.getLogger("blockflow.manager")

#: The share of a node's custom resource one block takes: nodes advertise e.g. 1000 units, so
#: a node holds as many blocks as the optimiser puts there (Ray does not second-guess it).
RESOURCE_SHARE = 0.001
#: Resources Ray itself gives every node: no block is placed by them.
RAY_OWN_RESOURCES = {"CPU", "GPU", "memory", "object_store_memory"}
INSTALL_HINT = "pip install -e '.[cluster]' (Ray 2.60 or later)"


def import_ray():
    try:
        import ray
    except ImportError:
        raise RuntimeError(f"--ray needs Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


class NodeAgent:
    """A Ray actor on one node that starts one child there and reports its exit (see above)."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.shm_dir: str | None = None
        self.started = threading.Event()

    def start(self, module: str, spec_json: str) -> dict:
        import ray
        try:
            spec = json.loads(spec_json)
            ip = ray.util.get_node_ip_address()
            spec["parent_pid"] = os.getpid()  # the child exits when this agent is gone
            if spec.get("bind_host"):
                spec["bind_host"] = ip  # listen where this node is reached, as Ray knows it
            for key in ("sock_dir", "shm_dir", "run_dir"):
                if spec.get(key):
                    os.makedirs(spec[key], mode=0o700, exist_ok=True)
            self.shm_dir = spec.get("shm_dir")
            self.proc = subprocess.Popen([sys.executable, "-m", module, "--spec", "-"], stdin=subprocess.PIPE)
            self.proc.stdin.write(json.dumps(spec).encode())
            self.proc.stdin.close()
            return {"pid": self.proc.pid, "node": ray.get_runtime_context().get_node_id(), "ip": ip}
        finally:
            self.started.set()

    def wait(self) -> int:
        self.started.wait()
        if self.proc is None:
            return int(EXIT_BOOT_ERROR)
        code = self.proc.wait()
        if code != 0 and self.shm_dir:
            removed = remove_slots_of(self.shm_dir, self.proc.pid)
            if removed:
                log.info("removed %d slot files that pid %d left behind", removed, self.proc.pid)
        return code

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)


class RayChild:
    """The handle of a child that a ``NodeAgent`` runs (launcher.ChildHandle)."""

    def __init__(self, ray, agent, resource: str, module: str, spec_json: str):
        self.ray, self.agent, self.resource = ray, agent, resource
        self._started = agent.start.remote(module, spec_json)
        self._done = agent.wait.remote()
        self._info: dict | None = None
        self._exit: int | None = None

    def _placed(self) -> dict | None:
        if self._info is None:
            ready, _ = self.ray.wait([self._started], timeout=0)
            if ready:
                try:
                    self._info = self.ray.get(self._started)
                except Exception as exc:  # the node died before it started the child
                    self._info = {"pid": None, "node": None, "error": str(exc)}
        return self._info

    @property
    def waiting_for(self) -> str | None:
        """The resource this child waits for a node with, while it is not placed."""
        return self.resource if self._placed() is None and self._exit is None else None

    @property
    def node(self) -> str | None:
        info = self._placed()
        return info["node"] if info else None

    @property
    def pid(self) -> int | None:
        info = self._placed()
        return info["pid"] if info else None

    @property
    def exitcode(self) -> int | None:
        if self._exit is None:
            ready, _ = self.ray.wait([self._done], timeout=0)
            if ready:
                self._finish()
        return self._exit

    def _finish(self) -> None:
        try:
            self._exit = int(self.ray.get(self._done))
        except Exception as exc:  # ActorDiedError, ActorUnavailableError, ...: its node is gone
            log.warning("the node running %s (resource %s) is gone: %s", self.agent, self.resource,
                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            self._exit = int(EXIT_NODE_LOST)
        self.ray.kill(self.agent, no_restart=True)

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        if self._exit is None:
            ready, _ = self.ray.wait([self._done], timeout=timeout)
            if ready:
                self._finish()

    def _signal(self, signum: int) -> None:
        if self._exit is not None:
            return
        if self._placed() is None:  # nothing started yet: the agent itself goes
            self.ray.kill(self.agent, no_restart=True)
            return
        self.agent.signal.remote(signum)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)


class RayLauncher:
    """Blocks with a ``node`` on the Ray cluster's nodes; the rest here, by the local launcher."""

    kind = "ray"

    def __init__(self, address: str):
        ray = import_ray()
        # ray.init() makes SIGTERM end the driver at once (sys.exit(15)); the server's own handler
        # (CherryPy's: stop everything in order, exit 0) stays in charge
        main = threading.current_thread() is threading.main_thread()
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)} if main else {}
        try:
            ray.init(address=address, namespace="blockflow", log_to_driver=False,
                     logging_level=logging.WARNING)
        except ConnectionError as exc:
            raise RuntimeError(f"cannot join the Ray cluster at {address!r}: {exc}; start one with "
                               "`ray start --head` or pass its address (--ray ADDRESS)") from None
        finally:
            for sig, handler in handlers.items():
                if handler is not None:
                    signal.signal(sig, handler)
        self.ray = ray
        self.agent_class = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=4)(NodeAgent)
        self.local = LocalLauncher()
        self.node = self.local.node = ray.get_runtime_context().get_node_id()
        self.ip = ray.util.get_node_ip_address()
        self.children: list[RayChild] = []
        self.seen: set[str] = set()  # custom resources any node advertised since we joined

    def live_resources(self) -> set[str]:
        """The custom resources that the cluster's live nodes advertise now."""
        live = {r for n in self.ray.nodes() if n.get("Alive") for r in n.get("Resources", {})
                if r not in RAY_OWN_RESOURCES and not r.startswith(("node:", "accelerator_type:"))}
        self.seen |= live
        return live

    def resources(self) -> set[str]:
        """The custom resources the cluster's nodes advertise, or did since we joined: an
        update may name a node that is down for now, for the blocks it keeps there (they wait
        for the node); a block it would start there is refused (Manager.begin)."""
        self.live_resources()
        return set(self.seen)

    def start(self, target, spec, name: str, node: str | None = None):
        if node is None:
            return self.local.start(target, spec, name)
        agent = self.agent_class.options(resources={node: RESOURCE_SHARE}, name=None).remote()
        # on the node the child runs as ``python -m <its entry's module>``, whose ``main`` reads ``--spec -``
        child = RayChild(self.ray, agent, node, target.module, spec.to_json())
        self.children = [c for c in self.children if c._exit is None] + [child]
        return child

    def close(self) -> None:
        """After every child is gone: no agent is left, nor the forkserver; leave the cluster."""
        for c in self.children:
            if c._exit is None:
                try:
                    self.ray.kill(c.agent, no_restart=True)
                except Exception as exc:
                    log.debug("killing agent %s: %s", c.agent, exc)
        self.children.clear()
        self.local.close()
        self.ray.shutdown()
