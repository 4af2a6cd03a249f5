"""TensorMQ: tensors between BlockFlow processes as handles, not bytes.

- ``wire``: the header/descriptor format and its validation (no pickle anywhere).
- ``shm``: shared-memory slot pools for CPU tensors (Note [TensorMQ slot ownership]).
- ``cuda_ipc``: CUDA IPC slot pools for GPU tensors (Note [CUDA IPC slots]).
- ``transport``: the two transports, ``zeromq`` (bytes) and ``tensormq`` (handles).
"""
from .transport import MODES, Transport
from .wire import TensorDesc, WireError

__all__ = ["MODES", "Transport", "TensorDesc", "WireError"]
