"""What a block process (blocks/process.py) and a shared block process (blocks/host.py) are
told before they start: their specs, and their entry points named by module.

The manager builds a spec for every child it starts; nothing here touches a process, and
nothing here imports torch, so the control plane (``blockflow serve``) never loads it: the
forkserver preloads the block modules for the children (manager/forkserver.py), and a child
imports its entry point's module when it starts (``childproc.Entry``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from blockflow import settings
from blockflow.childproc import ChildSpec, Entry

#: The entry points the manager starts blocks with (manager/launcher.py).
SERVE_BLOCK = Entry("blockflow.blocks.process", "serve_block")
SERVE_HOST = Entry("blockflow.blocks.host", "serve_host")


@dataclass
class BlockSpec(ChildSpec):
    """Everything a block needs, decided before it is spawned (nothing here touches the process)."""

    name: str
    model: str                      # path relative to repo, e.g. "resnet50/block1.pt"
    repo: str
    run_dir: str                    # KPI logs
    sock_dir: str                   # ipc socket files
    shm_dir: str | None = None      # TensorMQ slots (0700 directory)
    device: str = "cpu"
    transport: str = "tensormq"
    protocol: str = "ipc"
    threads: int | None = None
    cpus: list[int] | None = None
    incarnation: int = 0
    controller: str | None = None   # control endpoint; None: standalone (tests, benchmarks)
    parent_pid: int | None = None   # exit when this process is gone
    window: int = settings.WINDOW
    max_inference_s: float = 60.0   # past it in one inference the manager kills and respawns it
    verified: dict | None = None    # {file: {"sha256", "signature"}} the manager already checked
    max_queue: int = settings.MAX_QUEUE   # tensors queued before new ones get an `overloaded` error
    send_timeout: float = settings.SEND_TIMEOUT
    monitor: bool = True
    monitor_interval: float = settings.MONITOR_INTERVAL
    warmup: bool = True
    warmup_shapes: list | None = None  # input shapes run (graphs captured) before ready; None: the manifest's
    cuda_graphs: bool = True        # on a GPU, replay a CUDA graph per input shape (blocks/runner.py)
    batching: dict | None = None    # BatchPolicy.to_json(); None: one request at a time
    malloc_trim: int = settings.MALLOC_TRIM  # blocks/heap.py: freed heap bytes kept between requests
    hosted: bool = False            # one of several blocks in a shared process (blocks/host.py)
    #: Ray mode (issue 30): the cluster's CURVE keys (tensormq/curve.py) and the address of this
    #: block's node; the block then also listens on TCP there, for producers on other nodes
    curve: dict | None = None
    bind_host: str | None = None
    extra: dict = field(default_factory=dict)

    def endpoint_hint(self) -> str:
        if self.protocol == "ipc":
            return f"ipc://{os.path.join(self.sock_dir, f'{self.name}-{self.incarnation}.sock')}"
        return "tcp://127.0.0.1"


@dataclass
class HostSpec(ChildSpec):
    """A shared process before it starts: its name (``@<group>``) and what is process-wide."""

    name: str
    device: str = "cpu"
    threads: int | None = None       # torch's intra-op pool, shared by every member
    incarnation: int = 0
    controller: str | None = None
    parent_pid: int | None = None
    malloc_trim: int = settings.MALLOC_TRIM
    curve: dict | None = None        # Ray mode (issue 30): the cluster's CURVE keys, for the control channel
    bind_host: str | None = None     # Ray mode: this node's address, where members listen for other nodes
