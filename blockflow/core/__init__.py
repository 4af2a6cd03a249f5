"""The bottom layer: what every BlockFlow process shares, and nothing that builds on it.

- ``settings``: every ``BLOCKFLOW_*`` environment variable, read once;
- ``header``: the header-frame JSON codec every process speaks (without torch), the tensor dtypes;
- ``protocol``: the typed control messages between processes, exit and error codes, the protocol
  version;
- ``schema``: the system update (one declaration per block) the REST API, the manager and the
  block processes read;
- ``curve``: the deployment's CURVE keys (control channel and data hops between nodes);
- ``childproc``: the life of a child process (READY, boot error, commands, the parent watchdog);
- ``tracing``: OpenTelemetry spans of requests; ``ratelog``: bounded logging of hostile input.

It imports nothing of BlockFlow above it (tensormq, blocks, dispatcher, manager, the CLI, REST,
server and client): tests/process/test_layout.py checks that, and the layer order it states
(CONTRIBUTING.md, "Layers").
"""
