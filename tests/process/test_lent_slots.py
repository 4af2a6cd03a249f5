"""The way in and out through slots the dispatcher lends a client on its host (issue 40, item 3;
Note [Lent slots] in dispatcher/lending.py): results are exact, the opt-out sends bytes, a
handle the client was not lent is refused before anything is read, and a client that dies
mid-request leaks neither the dispatcher's slots nor the blocks'."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
import zmq

from blockflow.client import Client
from blockflow.core.protocol import DISPATCHER
from blockflow.standalone import StandalonePipeline

SHM_PREFIX = "bftest-lent"
WINDOW = 8  # settings.WINDOW, the slots of one lease


def _until(cond, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"{what} did not hold within {timeout}s")


def _start(repo: str):
    return StandalonePipeline(repo, {"a": "toy/identity.pt", "d": "toy/double.pt", "s": "toy/sleepy.pt",
                                     "t": "toy/transpose.pt"},
                              {"id": ["a"], "dbl": ["a", "d"], "slow": ["s"], "tr": ["d", "t"]}, shm_prefix=SHM_PREFIX)


def _stop(p) -> None:
    left = p.stop()
    assert left["left"] == {"slots": [], "sockets": []}, left


def _ping(p) -> dict:
    return p.command(DISPATCHER, "ping")


def _settled(p) -> dict:
    """The dispatcher's ping once nothing is in flight anywhere, no client holds a lease, and its
    counts held still between two pings (it counts a reply just after sending it)."""
    last = []

    def quiet():
        ping = _ping(p)
        busy = (ping["outstanding"], ping["pending"], ping["local_clients"], ping["lent_slots"],
                *(p.command(b, "ping")["in_flight"] for b in "adst"))
        counts = [ping[k] for k in ("requests", "ok", "errors", "late", "answered_by_blocks", "client_datagrams")]
        still = last == [counts]
        last[:] = [counts]
        return ping if not any(busy) and still else None
    return _until(quiet, what="the pipeline to settle (nothing in flight, no lease, counts still)")


@pytest.fixture(scope="module")
def shared_pipeline(identity_repo):
    """One pipeline for the tests below (its five processes cost 15-20 s of CPU to start)."""
    p = _start(identity_repo)
    try:
        yield p
    finally:
        _stop(p)


@pytest.fixture
def pipeline(shared_pipeline):
    """The shared pipeline, settled before and after each test: a test that leaves a lease, a
    slot in flight or a request unanswered fails itself, not the one after it."""
    _settled(shared_pipeline)
    yield shared_pipeline
    _settled(shared_pipeline)


@pytest.fixture
def own_pipeline(identity_repo):
    """A pipeline of its own, for a test that breaks something the others need."""
    p = _start(identity_repo)
    try:
        yield p
    finally:
        _stop(p)


def test_a_local_client_writes_and_reads_lent_slots_and_gets_exact_results(pipeline):
    with Client(pipeline.address, timeout=30) as c:
        x0 = torch.randn(2, 256)
        assert torch.equal(c.infer("id", x0), x0)  # before the slots come: bytes
        _until(lambda: c.lent is not None, what="the lent slots")
        assert _ping(pipeline)["lent_slots"] == WINDOW
        for i in range(3 * WINDOW):  # every slot is used and comes back free, whichever block releases it
            x = torch.randn(2, 256, generator=torch.Generator().manual_seed(i))
            assert torch.equal(c.infer("id", x), x)  # the result is the lent slot itself
            assert torch.equal(c.infer("dbl", x), x * 2)  # the result is the last block's slot
        futures = [c.submit("dbl", torch.full((2, 256), float(i))) for i in range(WINDOW + 4)]  # more than slots
        for i, f in enumerate(futures):
            assert torch.equal(f.result(), torch.full((2, 256), 2.0 * i))
        assert c.stats["in_slot"] >= 6 * WINDOW and c.stats["out_slot"] >= 6 * WINDOW, c.stats
        # a result that is a view (not C-contiguous) in its slot is read whole too
        for i in range(3):
            x = torch.randn(2, 256, generator=torch.Generator().manual_seed(100 + i))
            y = c.infer("tr", x)
            assert torch.equal(y, (x * 2).t()) and y.is_contiguous()
        # a tensor larger than the slots and a bundle travel as bytes
        big = torch.randn(64, 256)
        assert torch.equal(c.infer("id", big), big)
        assert c.stats["duplicates"] == 0
    stats = _ping(pipeline)
    assert stats["local_clients"] == 0 and stats["lent_slots"] == 0, stats  # closing gave them back
    assert pipeline.command("d", "ping")["in_flight"] == 0


def test_a_lent_slot_goes_on_as_bytes_where_the_first_hop_takes_bytes(pipeline):
    """A request in a lent slot whose first hop takes no handles (here: the dispatcher told to
    send bytes) is copied out of the slot, which is free again at once; results are exact."""
    with Client(pipeline.address, timeout=30) as c:
        c.infer("id", torch.randn(2, 256))
        _until(lambda: c.lent is not None, what="the lent slots")
        update = {"live": list(pipeline.endpoints.values()), "transport": "zeromq"}
        pipeline.command(DISPATCHER, "update", update)
        try:
            before = c.stats["in_slot"]
            for i in range(WINDOW + 4):  # more than the window: each slot came back free
                x = torch.randn(2, 256, generator=torch.Generator().manual_seed(i))
                assert torch.equal(c.infer("dbl", x), x * 2)
            assert c.stats["in_slot"] - before == WINDOW + 4, c.stats
        finally:
            pipeline.command(DISPATCHER, "update", {**update, "transport": "tensormq"})
    assert _ping(pipeline)["lent_slots"] == 0
    assert pipeline.command("a", "ping")["in_flight"] == 0


def test_the_opt_out_sends_bytes(pipeline):
    with Client(pipeline.address, timeout=30, shared_memory=False) as c:
        for _ in range(5):
            x = torch.randn(1, 256)
            assert torch.equal(c.infer("dbl", x), x * 2)
        assert c.lent is None and c.stats["in_slot"] == 0 and c.stats["out_slot"] == 0
        assert _ping(pipeline)["local_clients"] == 0


class Raw:
    """A hand-written client on a DEALER socket: it sends what it likes."""

    def __init__(self, ctx, address):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.rcvtimeo = 20000
        self.sock.connect(address)
        self.ids = 0

    def call(self, header: dict, *payload) -> tuple[dict, list]:
        self.ids += 1
        self.sock.send_multipart([json.dumps({"v": 1, "id": self.ids, **header}).encode(), *payload])
        frames = self.sock.recv_multipart()
        reply = json.loads(frames[0])
        assert reply["id"] == self.ids
        return reply, frames[1:]

    def lend(self, nbytes: int = 1024) -> list[str]:
        reply, _ = self.call({"op": "lend", "nbytes": nbytes, "pid": os.getpid()})
        assert reply["status"] == "ok", reply
        return reply["slots"]


def _handle(seg, shape=(1, 256), **kw) -> dict:
    stride = [shape[1], 1]
    return {"dtype": "float32", "shape": list(shape), "stride": stride, "loc": "shm", "seg": seg, "off": 0,
            "nbytes": 4 * shape[0] * shape[1], **kw}


def test_handles_the_client_was_not_lent_are_refused(pipeline):
    ctx = zmq.Context()
    try:
        mallory, alice = Raw(ctx, pipeline.address), Raw(ctx, pipeline.address)
        # no lease at all
        reply, _ = mallory.call({"op": "infer", "task": "id", "x": _handle("dispatcher-0-lent.1.1")})
        assert reply["code"] == "bad_request" and "holds no lent slots" in reply["error"], reply
        with Client(pipeline.address, timeout=30, shared_memory=False) as c:  # the blocks' slots are made
            c.infer("dbl", torch.zeros(1, 256))
        mine, hers = mallory.lend(), alice.lend()
        assert not set(mine) & set(hers)
        # alice's slot (another client's data), a block's slot, a path out of the directory, a made-up name
        others = [e for e in os.listdir(pipeline.shm) if e not in mine and e not in hers]
        assert others  # the blocks' and the dispatcher's own slots
        for seg in [hers[0], *others[:3], "../../etc/passwd", "forged"]:
            reply, frames = mallory.call({"op": "infer", "task": "id", "x": _handle(seg), "out": "shm"})
            assert reply["status"] == "error" and reply["code"] == "bad_request", (seg, reply)
            assert "not a slot lent to this client" in reply["error"] and not frames, reply
        # its own slot, but the tensor does not fit, or is not where a lent tensor must be
        reply, _ = mallory.call({"op": "infer", "task": "id", "x": _handle(mine[0], shape=(2, 1024))})
        assert reply["code"] == "bad_request" and "holds" in reply["error"], reply
        reply, _ = mallory.call({"op": "infer", "task": "id", "x": _handle(mine[0], off=64)})
        assert reply["code"] == "bad_request" and "offset 0" in reply["error"], reply
        # a slot still in flight: here its request's result, which is the slot itself (the identity
        # forwards it) and which this client never releases
        reply, _ = mallory.call({"op": "infer", "task": "id", "x": _handle(mine[1]), "out": "shm"})
        assert reply["status"] == "ok" and reply["x"]["seg"] == mine[1], reply
        reply, _ = mallory.call({"op": "infer", "task": "id", "x": _handle(mine[1])})
        assert reply["code"] == "bad_request" and "still in flight" in reply["error"], reply
        # alice's slot was never taken: her own request through it works
        reply, frames = alice.call({"op": "infer", "task": "dbl", "x": _handle(hers[0])})
        assert reply["status"] == "ok" and len(frames) == 1, reply
        # a handle after the lease ended is refused too
        assert mallory.call({"op": "unlend"})[0]["status"] == "ok"
        reply, _ = mallory.call({"op": "infer", "task": "id", "x": _handle(mine[0])})
        assert reply["code"] == "bad_request", reply
        assert alice.call({"op": "unlend"})[0]["status"] == "ok"
    finally:
        ctx.destroy(linger=0)
    with Client(pipeline.address, timeout=30) as c:  # the dispatcher serves on
        x = torch.randn(1, 256)
        assert torch.equal(c.infer("dbl", x), x * 2)


def test_a_result_the_client_does_not_release_is_released_when_its_lease_ends(pipeline):
    ctx = zmq.Context()
    try:
        raw = Raw(ctx, pipeline.address)
        slots = raw.lend()
        reply, frames = raw.call({"op": "infer", "task": "dbl", "x": _handle(slots[0]), "out": "shm"})
        assert reply["status"] == "ok" and reply["x"]["loc"] == "shm" and not frames, reply
        assert pipeline.command("d", "ping")["in_flight"] == 1  # the result's slot waits for the client
        assert raw.call({"op": "unlend"})[0]["status"] == "ok"
        assert pipeline.command("d", "ping")["in_flight"] == 0
    finally:
        ctx.destroy(linger=0)


_DYING = r"""
import os, sys, time, torch
from blockflow.client import Client
c = Client(sys.argv[1], timeout=30)
c.infer("id", torch.zeros(1, 256))
deadline = time.monotonic() + 20
while c.lent is None and time.monotonic() < deadline:
    time.sleep(0.01)
assert c.lent is not None
from blockflow.tensormq.shm import W_GENERATION
gens = {name: int(m.hdr[W_GENERATION]) for name, m in c.lent.mapped.items()}
before = c.stats["in_slot"]  # the first request went in a slot too when the lending came first
f = c.submit("slow", torch.ones(1, 256))
# the dispatcher took the request once it put the slot in flight (a new generation)
while time.monotonic() < deadline and all(int(m.hdr[W_GENERATION]) == gens[n] for n, m in c.lent.mapped.items()):
    time.sleep(0.001)
print("sent", c.stats["in_slot"] - before, flush=True)
os._exit(0)  # dies with its request in flight: never reads the result nor gives the slots back
"""


def test_a_client_that_dies_mid_request_leaks_no_slot(pipeline):
    out = subprocess.run([sys.executable, "-c", _DYING, pipeline.address], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "sent 1", out.stderr[-2000:]
    # the pid check ends the lease; the result of the request in flight is released with it
    _until(lambda: _ping(pipeline)["local_clients"] == 0, what="the dead client's lease to end")
    _until(lambda: pipeline.command("s", "ping")["in_flight"] == 0, what="the result slot to be released")
    assert not [e for e in os.listdir(pipeline.shm) if e.startswith("dispatcher-0-lent")]
    with Client(pipeline.address, timeout=30) as c:
        x = torch.randn(1, 256)
        assert torch.equal(c.infer("dbl", x), x * 2)


# -- Note [Datagrams to a local client] ------------------------------------------------------
def test_a_local_client_sends_and_is_answered_by_datagram_and_loses_nothing(pipeline):
    before = _ping(pipeline)  # settled: the counts below are this test's
    answered0 = pipeline.command("d", "ping")["answered_clients"]
    with Client(pipeline.address, timeout=30) as c:
        c.infer("id", torch.randn(2, 256))
        _until(lambda: c.lent is not None, what="the lent slots")
        assert c.lent.inbox is not None  # the dispatcher told us its inbox
        for i in range(2 * WINDOW):  # one at a time (the caller holds the socket) ...
            x = torch.randn(2, 256, generator=torch.Generator().manual_seed(i))
            assert torch.equal(c.infer("dbl", x), x * 2)
        futures = [c.submit("dbl", torch.full((2, 256), float(i))) for i in range(3 * WINDOW)]  # ... and from the I/O thread
        for i, f in enumerate(futures):
            assert torch.equal(f.result(), torch.full((2, 256), 2.0 * i))
        # requests in a slot went by datagram, and one-frame replies came back by datagram;
        # a datagram refused (a full queue) went by ZeroMQ: each request answered once
        assert c.stats["datagrams_out"] >= 2 * WINDOW and c.stats["datagrams_in"] >= 2 * WINDOW, c.stats
        assert c.stats["duplicates"] == 0 and c.stats["late"] == 0 and c.stats["foreign_datagrams"] == 0, c.stats
        # each reply came from the dispatcher or, for a result in the last block's slots, from
        # that block itself (Note [A direct answer] in blocks/process.py)
        got = c.stats["datagrams_in"]  # the dispatcher's account of an answered result may come after it
        b0, r0 = before["answered_by_blocks"], before["client_datagrams"]["replies"]
        ping = _until(lambda: (p := _ping(pipeline))["client_datagrams"]["replies"] - r0 + p["answered_by_blocks"] - b0
                      >= got and p, what="every reply by datagram accounted for")
        seen = {k: v - before["client_datagrams"][k] for k, v in ping["client_datagrams"].items()}
        by_blocks = ping["answered_by_blocks"] - b0
        assert by_blocks >= 2 * WINDOW and pipeline.command("d", "ping")["answered_clients"] - answered0 == by_blocks, ping
        assert seen["requests"] == c.stats["datagrams_out"], seen
        assert seen["replies"] + by_blocks == c.stats["datagrams_in"], (seen, by_blocks, c.stats)
        assert seen["unknown_key"] == 0
    _until(lambda: pipeline.command("d", "ping")["in_flight"] == 0, what="the last block's slots released")


def test_the_last_block_answers_a_local_client_itself(pipeline):
    """Note [A direct answer] (blocks/process.py): a result in the last block's slots reaches a
    local client from that block by datagram; the dispatcher accounts for it as for a reply it
    sent, and a second answer for the same request (here the dispatcher's, forged with the
    client's key) is taken as late, never as a duplicate or a second result."""
    from blockflow.tensormq.datagram import Sender
    ok0 = _ping(pipeline)["ok"]
    with Client(pipeline.address, timeout=30) as c:
        c.infer("id", torch.randn(2, 256))
        _until(lambda: c.lent is not None, what="the lent slots")
        # the dispatcher counts a reply after sending it: a ping may come between the two
        before = _until(lambda: (p := _ping(pipeline))["ok"] == ok0 + 1 and p, what="the first request counted")
        answered = pipeline.command("d", "ping")["answered_clients"]
        for i in range(5):
            x = torch.randn(2, 256, generator=torch.Generator().manual_seed(i))
            r = c.infer_details("dbl", x)
            assert torch.equal(r.tensor, x * 2)
            assert [h["b"] for h in r.hops] == ["a", "d"] and r.server_ms is not None and r.server_ms > 0
        after = _until(lambda: (p := _ping(pipeline))["answered_by_blocks"] - before["answered_by_blocks"] == 5 and p,
                       what="the dispatcher's account of the 5 answered results")
        assert after["ok"] - before["ok"] == 5 and after["errors"] == before["errors"], after
        assert after["client_datagrams"]["replies"] == before["client_datagrams"]["replies"], after
        assert pipeline.command("d", "ping")["answered_clients"] - answered == 5
        assert c.stats["late"] == 0 and c.stats["duplicates"] == 0, c.stats
        rid = next(reversed(c._answered))
        mallory = Sender()
        try:
            late = {"v": 1, "id": rid, "status": "error", "error": "the dispatcher's own answer", "key": c._key}
            assert mallory.send_to(c._inbox.path, json.dumps(late).encode())
            y = torch.ones(2, 256)
            _until(lambda: torch.equal(c.infer("dbl", y), y * 2) and c.stats["late"] == 1, what="the second answer taken as late")
        finally:
            mallory.close()
        assert c.stats["duplicates"] == 0, c.stats
    _until(lambda: pipeline.command("d", "ping")["in_flight"] == 0, what="the last block's slots released")


def test_datagrams_without_the_key_are_dropped_both_ways(pipeline):
    """A request whose key names no lease is dropped by the dispatcher (nobody to answer) and a
    reply without the client's key is dropped by the client, which still gets its own answer."""
    from blockflow.tensormq.datagram import Sender
    unknown0 = _ping(pipeline)["client_datagrams"]["unknown_key"]
    with Client(pipeline.address, timeout=30) as c:
        c.infer("id", torch.randn(1, 256))
        _until(lambda: c.lent is not None, what="the lent slots")
        inbox = c.lent.inbox
        mallory = Sender()
        try:
            forged = {"v": 1, "id": 7, "op": "infer", "task": "id", "key": "0" * 32,
                      "x": _handle(next(iter(c.lent.mapped)))}
            assert mallory.send_to(inbox, json.dumps(forged).encode())
            _until(lambda: _ping(pipeline)["client_datagrams"]["unknown_key"] == unknown0 + 1,
                   what="the forged request dropped")
            want = c.infer("slow", torch.ones(1, 256))
            f = c.submit("slow", torch.ones(1, 256))  # in flight while the forged reply comes
            rid = max(c._waiting)
            fake = {"v": 1, "id": rid, "status": "ok", "key": "f" * 32}
            assert mallory.send_to(c._inbox.path, json.dumps(fake).encode())
            fake.pop("key")
            assert mallory.send_to(c._inbox.path, json.dumps(fake).encode())
            assert torch.equal(f.result(), want)  # its own answer, not the forged None
            assert c.stats["foreign_datagrams"] == 2, c.stats
        finally:
            mallory.close()
        # and a lease asked for with another program's socket as inbox is refused
        ctx = zmq.Context()
        try:
            raw = Raw(ctx, pipeline.address)
            for dg in ("\0/org/freedesktop/systemd1/notify", "/dev/log"):
                reply, _ = raw.call({"op": "lend", "nbytes": 1024, "pid": os.getpid(), "dg": dg, "key": "a" * 32})
                assert reply["code"] == "bad_request" and "dg" in reply["error"], reply
            reply, _ = raw.call({"op": "lend", "nbytes": 1024, "pid": os.getpid(), "key": c._key,
                                 "dg": f"\0blockflow-client-1-{'0' * 16}"})
            assert reply["code"] == "bad_request" and "no other client" in reply["error"], reply  # c's key
        finally:
            ctx.destroy(linger=0)
        x = torch.randn(1, 256)
        assert torch.equal(c.infer("dbl", x), x * 2)


def test_without_the_dispatchers_inbox_requests_go_by_zeromq(own_pipeline):
    pipeline = own_pipeline  # its inbox is removed: no other test may use this dispatcher after
    with Client(pipeline.address, timeout=30) as c:
        c.infer("id", torch.randn(1, 256))
        _until(lambda: c.lent is not None, what="the lent slots")
        os.unlink(c.lent.inbox)  # as when the dispatcher is stopping: sendto finds no socket
        before = dict(c.stats)
        for i in range(5):
            x = torch.randn(1, 256)
            assert torch.equal(c.infer("dbl", x), x * 2)
        assert c.stats["datagrams_out"] == before["datagrams_out"], c.stats
        assert c.stats["in_slot"] - before["in_slot"] == 5 and c.stats["datagrams_in"] - before["datagrams_in"] == 5



def test_a_last_block_on_zeromq_answers_a_client_with_lent_slots(server_factory, identity_repo):
    """A TensorMQ deployment whose last block sends bytes (``"transport": "zeromq"`` on the block):
    a local client lends slots after its first request, and every later result came as bytes
    from that block, which then took the bytes' buffer for an empty payload and failed every
    request with "The truth value of an array ... is ambiguous". The dispatcher answers them."""
    srv = server_factory(identity_repo)
    srv.call("POST", "/system/update", {
        "blocks": [{"name": "a", "model": "toy/identity.pt"},
                   {"name": "d", "model": "toy/double.pt", "transport": "zeromq"}],
        "tasks": [{"id": "t", "path": ["a", "d"]}, {"id": "u", "path": ["d"]}]}, timeout=60)
    with Client(srv.dispatcher, timeout=30) as c:
        for i in range(6):
            x = torch.full((1000,), float(i))
            for task in ("t", "u"):
                r = c.infer_details(task, x)
                assert torch.equal(r.tensor, 2 * x), (task, i)
        assert c.lent is not None  # the later requests went in lent slots


def test_a_client_whose_requests_are_all_refused_keeps_its_lease(server_factory, identity_repo):
    """Note [A lease's idle clock]: a client that kept sending requests the dispatcher refused
    (its task unavailable for a minute while a node was lost, or unknown) kept filling its lent
    slots, so it held on to its lease, while the dispatcher, counting only the requests it put in
    a slot, ended the lease as unused; the next request went by datagram under a key no lease had
    and was dropped, and the caller waited for its whole deadline. Here the idle limit is 2 s."""
    from blockflow.client import BlockFlowError
    srv = server_factory(identity_repo, env={"BLOCKFLOW_LEASE_IDLE": "2"})
    srv.call("POST", "/system/update", {"blocks": [{"name": "a", "model": "toy/identity.pt"}],
                                        "tasks": [{"id": "id", "path": ["a"]}]}, timeout=60)
    x = torch.arange(256, dtype=torch.float32).reshape(1, 256)
    with Client(srv.dispatcher, timeout=5) as c:
        assert torch.equal(c.infer("id", x), x)
        _until(lambda: c.lent is not None, what="the client's lease")
        lease, refused, end = c.lent, 0, time.monotonic() + 4  # twice the idle limit
        while time.monotonic() < end:
            with pytest.raises(BlockFlowError) as err:
                c.infer("no-such-task", x)
            assert err.value.code == "unknown_task", err.value
            refused += 1
            time.sleep(0.05)
        assert c.lent is lease and c.stats["datagrams_out"] >= refused  # in its slots, by datagram
        for _ in range(3):  # answered, not dropped under a key the dispatcher forgot
            assert torch.equal(c.infer("id", x), x)
        assert c.lent is lease
