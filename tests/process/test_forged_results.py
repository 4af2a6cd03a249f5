"""Results come only from the deployment's own blocks (issue 12, item 1).

A process without the deployment's secrets posts ``result`` messages for requests in flight:
to the TCP result socket (CURVE: its messages never get in) and, as a local user who could
reach it would, to the ipc one with the request ids it would guess (ids are random: none hits).
The client gets the blocks' results, and the flood costs a bounded number of log lines."""
from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch
import zmq

from blockflow.client import Client
from blockflow.core.protocol import DISPATCHER, RETURN_HOP, identity
from blockflow.standalone import StandalonePipeline

SHM_PREFIX = "bftest-forged"


def _forged(rid: int, address: str) -> list:
    header = {"v": 1, "t": "result", "rid": rid, "task": "t", "path": [[RETURN_HOP, address]], "hops": [],
              "x": {"dtype": "float32", "shape": [1, 256], "stride": [256, 1], "loc": "bytes"}}
    return [json.dumps(header).encode(), torch.full((1, 256), 666.0).numpy().tobytes()]


def _flood(endpoints: list[str], stop: threading.Event, sent: list) -> None:
    ctx = zmq.Context()
    socks = []
    for e in endpoints:
        s = ctx.socket(zmq.PUSH)
        s.linger = 0
        s.connect(e)
        socks.append((s, e))
    rid = 0
    try:
        while not stop.is_set():
            rid += 1
            for s, e in socks:
                # the ids a sequential counter would give the first requests, and random ones
                for guess in (rid % 64 + 1, int.from_bytes(os.urandom(8), "big") >> 1):
                    try:
                        s.send_multipart(_forged(guess, e), zmq.NOBLOCK)
                        sent[0] += 1
                    except zmq.Again:
                        pass
            if rid % 200 == 0:
                time.sleep(0.001)
    finally:
        for s, _ in socks:
            s.close()
        ctx.term()


@pytest.mark.parametrize("protocol", ["ipc", "tcp"])
def test_forged_results_never_reach_the_client(identity_repo, protocol, capfd):
    with StandalonePipeline(identity_repo, {"s": "toy/sleepy.pt"}, {"t": ["s"]}, shm_prefix=SHM_PREFIX,
                            protocol=protocol) as p:
        results = p.controller.ready[identity(DISPATCHER, 0)]["results"]
        assert any(r.startswith("ipc://") for r in results) and any(r.startswith("tcp://") for r in results)
        sleepy = torch.jit.load(os.path.join(identity_repo, "toy", "sleepy.pt"))
        stop, sent = threading.Event(), [0]
        attacker = threading.Thread(target=_flood, args=(results, stop, sent))
        with Client(p.address, timeout=30) as c:
            c.infer("t", torch.zeros(1, 256))  # the path is warm before the flood starts
            attacker.start()
            try:
                for i in range(10):
                    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(i))
                    with torch.inference_mode():
                        expected = sleepy(x)
                    y = c.infer("t", x)
                    assert torch.allclose(y, expected), f"request {i} got a forged result"
            finally:
                # the flood goes on until it has sent enough to mean something, however slow the machine
                until = time.monotonic() + 60
                while sent[0] < 300 and attacker.is_alive() and time.monotonic() < until:
                    time.sleep(0.01)
                stop.set()
                attacker.join()
        assert sent[0] >= 300, sent
        stats = p.command(DISPATCHER, "ping")
        assert stats["ok"] == 11 and stats["errors"] == 0, stats
        code = p.stop()
        assert all(c == 0 for c in code["codes"].values()), code
    err = capfd.readouterr().err
    junk = [line for line in err.splitlines() if "[dispatcher]" in line and ("dropped" in line or "suppressed" in line)]
    assert len(junk) <= 30, f"{len(junk)} log lines for {sent[0]} forged messages"
