"""BlockFlow: serve modular DNNs as one process per block, wired by ZeroMQ, zero-copy with TensorMQ.

Where things are:
- ``blockflow``: the CLI, the REST control plane, the server, the client.
- ``blockflow.core``: the bottom layer every process shares (settings, protocol, update schema,
  child-process plumbing); it imports nothing above it.
- ``blocks``: the block process and the block repository (splitting and exporting models).
- ``manager``: block life-cycle (spawn, health, respawn) and the controller.
- ``dispatcher``: task-to-path translation, the clients' entry point.
- ``tensormq``: the wire format and the transports.
"""
__version__ = "0.1.0"


def __getattr__(name):  # keep `import blockflow` light: torch loads only when the client is used
    if name in ("Client", "BlockFlowError", "Result"):
        from . import client
        return getattr(client, name)
    raise AttributeError(name)


__all__ = ["Client", "BlockFlowError", "Result", "__version__"]
