"""What the dispatcher process (dispatcher/process.py) is told before it starts: its spec, and
its entry point named by module (torch-free, like blocks/spec.py, for the same reason).
"""
from __future__ import annotations

from blockflow.core import settings
from blockflow.core.childproc import ChildSpec, Entry

#: The entry point the manager starts the dispatcher with (manager/launcher.py).
SERVE_DISPATCHER = Entry("blockflow.dispatcher.process", "serve_dispatcher")


class DispatcherSpec(ChildSpec):
    sock_dir: str
    shm_dir: str | None = None
    address: str = "tcp://127.0.0.1:5580"
    transport: str = "tensormq"
    controller: str | None = None
    parent_pid: int | None = None
    incarnation: int = 0
    request_timeout: float = settings.REQUEST_TIMEOUT  # seconds in the pipeline before the client gets a timeout
    max_pending: int = settings.MAX_PENDING   # requests waiting for a slot before new ones are refused
    max_tensor_bytes: int = settings.MAX_TENSOR_BYTES
    window: int = settings.WINDOW
    token: str | None = None
    tasks: dict = {}                            # initial task table, for standalone use
    run_dir: str | None = None                  # where the request log (@dispatcher.requests.jsonl) goes
    curve: dict | None = None                   # Ray mode: the cluster's CURVE keys (blockflow/core/curve.py)
    bind_host: str = "127.0.0.1"                # where the TCP result socket listens (Ray mode: this node's address)
