"""What a block process (blocks/process.py) and a shared block process (blocks/host.py) are
told before they start: their specs, and their entry points named by module.

The manager builds a spec for every child it starts; nothing here touches a process, and
nothing here imports torch, so the control plane (``blockflow serve``) never loads it: the
forkserver preloads the block modules for the children (manager/forkserver.py), and a child
imports its entry point's module when it starts (``childproc.Entry``).
"""
from __future__ import annotations

import os

from blockflow.core import settings
from blockflow.core.childproc import ChildSpec, Entry
from blockflow.core.schema import BlockDecl

#: The entry points the manager starts blocks with (manager/launcher.py).
SERVE_BLOCK = Entry("blockflow.blocks.process", "serve_block")
SERVE_HOST = Entry("blockflow.blocks.host", "serve_host")


class BlockSpec(BlockDecl, ChildSpec, kw_only=True, frozen=False, forbid_unknown_fields=False):
    """Everything a block needs, decided before it is spawned (nothing here touches the process):
    its declaration as the update made it (every option of ``BlockDecl``, blockflow/core/schema.py:
    Note [One declaration per block]), and what the manager adds for this process."""

    repo: str
    run_dir: str                    # KPI logs
    sock_dir: str                   # ipc socket files
    shm_dir: str | None = None      # TensorMQ slots (0700 directory)
    incarnation: int = 0
    controller: str | None = None   # control endpoint; None: standalone (tests, benchmarks)
    parent_pid: int | None = None   # exit when this process is gone
    window: int = settings.WINDOW
    verified: dict | None = None    # {file: {"sha256", "signature"}} the manager already checked
    max_queue: int = settings.MAX_QUEUE   # tensors queued before new ones get an `overloaded` error
    send_timeout: float = settings.SEND_TIMEOUT
    monitor: bool = True
    monitor_interval: float = settings.MONITOR_INTERVAL
    warmup: bool = True
    malloc_trim: int = settings.MALLOC_TRIM  # blocks/heap.py: freed heap bytes kept between requests
    #: Ray mode (issue 30): the cluster's CURVE keys (blockflow/core/curve.py) and the address of this
    #: block's node; the block then also listens on TCP there, for producers on other nodes
    curve: dict | None = None
    bind_host: str | None = None
    extra: dict = {}

    @property
    def hosted(self) -> bool:
        """One of several blocks in a shared process (blocks/host.py)."""
        return self.process is not None

    def endpoint_hint(self) -> str:
        if self.protocol == "ipc":
            return f"ipc://{os.path.join(self.sock_dir, f'{self.name}-{self.incarnation}.sock')}"
        return "tcp://127.0.0.1"


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
