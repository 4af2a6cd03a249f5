"""What the processes are told about each other (thesis 3.5): the dispatcher's task table, and
each process's live hops.

``TopologyPublisher.publish`` sends the dispatcher the task table (``Cmd.TASKS``: per task, the
replicas of each hop that serve now) and every ready process the topology (``Cmd.UPDATE``: the
live endpoints, their devices and, in Ray mode, which of them are on its own node); ``prepare``
tells the processes an update makes send to a new block to open their sockets and slots towards
it before the switch (Note [Ready to serve] in blocks/process.py). It never waits: it returns
the acknowledgements' futures, which the operation in progress waits on (manager/operation.py).
It reads the process table (manager/children.py) and the ``Deployment``, and changes neither.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from blockflow.core.protocol import DISPATCHER, Cmd, Fail, Tasks, Topology

from .children import Child, ChildState, ProcessTable
from .controller import Controller
from .operation import Operation

log = logging.getLogger("blockflow.manager")


@dataclass
class Deployment:
    """What runs now besides the processes: the tasks, the update that declared it (kept in
    state.json), its transport and the manifests of its model files, and its version."""

    version: int = 0
    tasks: dict[str, list[str]] = field(default_factory=dict)
    transport: str = "tensormq"
    manifests: dict[str, dict | None] = field(default_factory=dict)
    update_body: dict | None = None


class TopologyPublisher:
    """Tells the dispatcher and the blocks what the process table and the deployment say now."""

    def __init__(self, table: ProcessTable, deployed: Deployment, controller: Controller, wake: Callable[[], None],
                 cluster: bool = False):
        #: ``wake``: wakes the supervisor (an acknowledgement of prepare() arrived); ``cluster``: Ray
        #: mode, where a process hands tensors only to the hops on its own node
        self.table, self.deployed, self.controller, self.wake, self.cluster = table, deployed, controller, wake, cluster

    def task_table(self) -> dict:
        table = {}
        for tid, path in self.deployed.tasks.items():
            # per hop, its replicas that serve now (replica 0 stands for a block with none ready)
            choices = [[c for c in self.table.replicas(n) if c.status is ChildState.READY] or self.table.replicas(n)[:1]
                       for n in path]
            hops = [cs[0] for cs in choices]
            down = [c for c in hops if c.status is not ChildState.READY]
            entry = self.deployed.manifests.get(hops[0].decl.files[0])
            table[tid] = {"path": [[c.name, c.endpoint] for c in hops], "blocks": [c.instance for c in hops],
                          "input": input_spec(entry, hops[0].decl.input_dtype)}
            if any(len(cs) > 1 for cs in choices):  # the dispatcher picks a replica per hop and request
                table[tid]["replicas"] = [[[c.name, c.endpoint, c.instance] for c in cs] for cs in choices]
            if down:
                table[tid]["unavailable"] = ", ".join(f"block {c.block} is {c.status}" for c in down)
        return table

    def publish(self, draining: list[Child] = ()) -> list[Future]:
        """Send the task table to the dispatcher and the live hops to every process; never waits.
        Returns the futures of the processes' acknowledgements.

        ``draining``: blocks on their way out whose queued requests must still finish. Their
        endpoints stay live, because a producer reclaims the slots of every hop that is not
        live, which would turn the handles still queued there into stale ones. The drain
        publishes again once they are stopped."""
        live = [c.endpoint for c in [*self.table.blocks.values(), *draining] if c.status is ChildState.READY]
        if self.table.dispatcher is not None:
            live += list(self.table.dispatcher.ready_info.get("results", []))
        devices = {c.endpoint: c.decl.device for c in self.table.blocks.values() if c.endpoint}
        futures = []
        receivers = self.receivers(draining)
        disp = self.table.dispatcher_ready()
        if disp is not None:
            futures.append(self.controller.cast(disp.ident, Cmd.TASKS, Tasks(self.task_table(), self.deployed.version)))
            futures.append(self.controller.cast(disp.ident, Cmd.UPDATE, Topology(
                live, devices, self.routes_from(disp, receivers), self.deployed.transport)))
        for c in self.table.blocks.values():
            if c.status is ChildState.READY:
                futures.append(self.controller.cast(c.ident, Cmd.UPDATE, Topology(
                    live, devices, self.routes_from(c, receivers), tasks=self.tasks_through(c))))
        for f in futures:
            f.add_done_callback(log_refusal)
        return futures

    def tasks_through(self, c: Child) -> int | None:
        """How many deployed tasks' paths go through ``c``'s block: the sharing weight of its
        shared process's block cache (blocks/cache.py); None for a block without a budget."""
        if c.decl is None or c.decl.memory_budget_mb is None:
            return None
        return sum(1 for path in self.deployed.tasks.values() if c.block in path)

    def receivers(self, draining=()) -> list[tuple[str, str | None, str | None]]:
        """Ray mode: (the TCP endpoint paths name it by, its endpoint for processes of its own
        node, its node) of every ready process that tensors are sent to: blocks, and the
        dispatcher's result socket."""
        out = [(c.endpoint, c.ready_info.get("near"), c.process.node)
               for c in [*self.table.blocks.values(), *draining] if c.status is ChildState.READY and c.endpoint]
        d = self.table.dispatcher_ready()
        if d is not None and len(d.ready_info.get("results", [])) == 2:
            ipc, tcp = d.ready_info["results"]
            out.append((tcp, ipc, d.process.node))
        return out

    def routes_from(self, sender: Child, receivers) -> dict | None:
        """Ray mode: ``{TCP endpoint: endpoint on this node}`` (Topology's ``near``), the receivers on
        ``sender``'s node, which it hands handles to (Transport.near); it sends every other hop
        bytes over CURVE TCP. Decided by the nodes' identities (Ray's node ids), never by
        comparing addresses. Nothing without Ray."""
        if not self.cluster:
            return None
        return {addr: near for addr, near, node in receivers if node == sender.process.node and near}

    def hop_kinds(self, c: Child) -> dict[str, str]:
        """How ``c``'s tensors travel to each next hop of the tasks through it (GET /system):
        ``in_process`` to a block of the same shared process (the tensor itself: blocks/handover.py),
        ``handles`` on one node with TensorMQ, ``bytes`` with ZeroMQ, ``tcp`` (bytes over CURVE
        TCP) to another node. The dispatcher is the hop after a path's last block."""
        kinds = {}
        for path in self.deployed.tasks.values():
            for i, name in enumerate(path):
                if c.block != name:
                    continue
                nexts = self.table.replicas(path[i + 1]) if i + 1 < len(path) else [self.table.dispatcher]
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

    def fail_requests(self, instances: list[str], reason: str) -> None:
        d = self.table.dispatcher_ready()
        if d is None:
            return
        self.controller.cast(d.ident, Cmd.FAIL, Fail(instances, reason)) \
            .add_done_callback(log_refusal)

    def prepare(self, op: Operation) -> list[Future]:
        """Every new block is READY; before the switch, every new block and every process the
        new tasks make send to a new block (the dispatcher to a new first block) connects to
        its next hops and makes its slots towards them (Note [Ready to serve] in
        blocks/process.py), so that no request pays for it. Returns the acknowledgements;
        each wakes the supervisor. A process that does not answer in PREPARE_TIMEOUT only
        leaves its first request to do it."""
        procs = [op.new.get(n) or self.table.blocks.get(n) for n in op.processes]
        by_block: dict[str, list[Child]] = {}
        for c in procs:
            if c is not None and c.status is ChildState.READY and c.endpoint:
                by_block.setdefault(c.block, []).append(c)
        disp = self.table.dispatcher_ready()
        results = disp.ready_info.get("results", []) if disp is not None else []
        nexts: dict[Child, dict] = {}
        for path in op.desired.tasks.values():
            hops = [by_block.get(name, []) for name in path]
            if disp is not None:
                for c in hops[0]:
                    entry = op.manifests.get(c.decl.files[0]) if op.transport == "tensormq" else None
                    nexts.setdefault(disp, {})[c.endpoint] = input_spec(entry)
            for i, senders in enumerate(hops):
                for c in senders:
                    if i + 1 < len(hops):
                        targets = [r.endpoint for r in hops[i + 1]]
                    else:  # the dispatcher reaches the last block the way it is reached itself
                        targets = [results[1] if c.endpoint.startswith("tcp://") and len(results) > 1
                                   else results[0]] if results else []
                    nexts.setdefault(c, {}).update(dict.fromkeys(targets))
        new = {c.endpoint for c in op.new.values()}
        live = [c.endpoint for c in [*self.table.blocks.values(), *op.new.values()]
                if c.status is ChildState.READY] + list(results)
        # the blocks being replaced still serve until the switch: their devices stay known
        devices = {c.endpoint: c.decl.device for c in [*self.table.blocks.values(), *op.new.values()]
                   if c.endpoint and c.decl is not None}
        receivers = self.receivers(draining=list(op.new.values()))
        futures = []
        for c, hops in nexts.items():
            if c not in op.new.values() and not new & set(hops):
                continue  # it sends to no new block: nothing to prepare
            args = Topology(live, devices, self.routes_from(c, receivers), prepare=hops)
            fut = self.controller.cast(c.ident, Cmd.UPDATE, args)
            fut.add_done_callback(log_refusal)
            fut.add_done_callback(lambda _f: self.wake())
            futures.append(fut)
        return futures


def log_refusal(fut: Future) -> None:
    exc = fut.exception()
    if exc is not None:
        log.warning("a process did not take a control message: %s", exc)


def input_spec(entry: dict | None, dtype: str | None = None) -> dict | None:
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
