"""TensorMQ: tensors between BlockFlow processes as handles, not bytes.

- ``wire``: the header/descriptor format and its validation (no pickle anywhere).
- ``bundle``: several tensors in one message (a tuple or a dict crossing a cut together).
- ``shm``: shared-memory slot pools for CPU tensors (Note [TensorMQ slot ownership]).
- ``cuda_ipc``: CUDA IPC slot pools for GPU tensors (Note [CUDA IPC slots]).
- ``transport``: the two transports, ``zeromq`` (bytes) and ``tensormq`` (handles).

The names below are imported on first use: the control plane imports modules of this package
that need no torch (``sizing``: a slot file's size and name), and importing the package must not
load torch for them (tests/process/test_layout.py, test_the_control_plane_imports_no_torch).
"""
__all__ = ["MODES", "Transport", "TensorDesc", "WireError"]


def __getattr__(name: str):
    if name in ("MODES", "Transport"):
        from . import transport
        return getattr(transport, name)
    if name in ("TensorDesc", "WireError"):
        from . import wire
        return getattr(wire, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
