"""Unit tests of the wire format and the shared-memory slots (one test races two processes)."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile

import time

import pytest
import torch
import zmq

from blockflow.tensormq.shm import FREE, IN_FLIGHT, SlotMapper, SlotPool
from blockflow.tensormq.transport import Transport, decode_bytes, encode_bytes
from blockflow.tensormq import wire
from blockflow.tensormq.wire import TensorDesc, WireError, check_path, loads_header


def test_bytes_roundtrip_is_zero_copy_on_receive():
    x = torch.randn(2, 3, 4)
    desc, payload = encode_bytes(x)
    y = decode_bytes(TensorDesc.parse(desc.to_json()), memoryview(payload))
    assert torch.equal(x, y)
    assert y.data_ptr() == payload.ctypes.data  # a view of the received buffer, no copy


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool])
def test_dtypes_roundtrip(dtype):
    x = (torch.randn(3, 5) * 10).to(dtype)
    desc, payload = encode_bytes(x)
    assert torch.equal(decode_bytes(TensorDesc.parse(desc.to_json()), memoryview(payload)), x)


@pytest.mark.parametrize("make", [
    lambda: torch.randn(2, 128, 8)[:, 0],          # contiguous, but dimension 0's stride is 1024, not 8
    lambda: torch.randn(1, 16, 4)[:, 3],           # size 1 with a stride of its own
    lambda: torch.randn(4, 6).t(),                 # not contiguous: copied first
    lambda: torch.tensor(2.5),                     # no dimensions
    lambda: torch.randn(3, 2, requires_grad=True),
])
def test_any_tensor_travels_as_bytes_with_the_strides_a_receiver_takes(make):
    # Found while making encode_bytes cheaper: a contiguous tensor whose dimension of size 1
    # had another stride (a model returning x[:, 0]) was described with that stride, and every
    # receiver refused it ("x.stride must be C-contiguous when bytes travel").
    x = make()
    desc, payload = encode_bytes(x)
    assert desc.to_json()["stride"] == list(wire.contiguous_stride(x.shape))
    assert torch.equal(decode_bytes(TensorDesc.parse(desc.to_json()), memoryview(payload)), x.detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
@pytest.mark.parametrize("make", [
    lambda dt: (torch.randn(2, 3, 4) * 9).to(dt),            # contiguous: one memmove into the slot
    lambda dt: (torch.randn(1, 16, 4) * 9).to(dt)[:, 3],     # contiguous, a size-1 dimension's own stride
    lambda dt: (torch.randn(4, 6) * 9).to(dt).t(),           # not contiguous: torch copies it
    lambda dt: torch.zeros(0, 5, dtype=dt),
])
def test_what_a_slot_is_given_is_what_its_reader_opens(shm_dir, make, dtype):
    x = make(dtype)
    pool, mapper = SlotPool(shm_dir, "prod", window=2), SlotMapper(shm_dir)
    try:
        pool.put("e", torch.full((64,), 7.0).to(dtype), timeout=1)  # the slot held other bytes before
        y, lease = mapper.open(TensorDesc.parse(pool.put("e", x, timeout=1).to_json()))
        assert y.dtype == x.dtype and y.shape == x.shape and torch.equal(y, x)
        lease.release()
    finally:
        mapper.close()
        pool.close()


@pytest.mark.parametrize("bad, word", [
    ({"dtype": "object", "shape": [1], "stride": [1], "loc": "bytes"}, "dtype"),
    ({"dtype": "float32", "shape": [-1], "stride": [1], "loc": "bytes"}, "shape"),
    ({"dtype": "float32", "shape": [1, 2], "stride": [1], "loc": "bytes"}, "stride"),
    ({"dtype": "float32", "shape": [1 << 30, 100], "stride": [100, 1], "loc": "bytes"}, "limit"),
    ({"dtype": "float32", "shape": [1], "stride": [1], "loc": "gpu-magic"}, "loc"),
    ({"dtype": "float32", "shape": "big", "stride": [1], "loc": "bytes"}, "shape"),
    ("not a dict", "object"),
])
def test_descriptor_validation_names_the_field(bad, word):
    with pytest.raises(WireError, match=word):
        TensorDesc.parse(bad)


def test_a_remembered_descriptor_is_built_from_its_checked_values():
    """Note [Descriptor memo]: once a descriptor is accepted, an equal one is not checked again,
    but what it builds comes from the checked integers, and any other change is checked anew."""
    wire._ACCEPTED_DESCS.clear()  # the memo is per process: what earlier tests parsed is in it
    good = {"dtype": "float32", "shape": [7, 3], "stride": [3, 1], "loc": "shm", "seg": "p.1.1"}
    first = TensorDesc.parse(dict(good))
    assert first.shape == (7, 3) and first.numel == 21 and first.span_bytes() == 84
    forged = {**good, "shape": [7.0, 3]}  # equal in Python to the accepted [7, 3]
    desc = TensorDesc.parse(forged)
    assert desc.shape == (7, 3) and all(type(d) is int for d in desc.shape)  # the memo's own ints
    assert desc.fields is forged and desc.loc == "shm"
    for bad, word in (({**good, "shape": [7, -3]}, "shape"), ({**good, "shape": [7.0, 5], "stride": [5, 1]}, "shape"),
                      ({**good, "stride": [3, "1"]}, "stride"),
                      ({**good, "loc": "elsewhere"}, "loc"), ({**good, "shape": [[2], 3]}, "shape")):
        with pytest.raises(WireError, match=word):
            TensorDesc.parse(bad)
    with pytest.raises(WireError, match="limit"):  # a remembered descriptor still meets each limit
        TensorDesc.parse(dict(good), max_bytes=8)


def test_payload_size_must_match_shape():
    desc = TensorDesc.parse({"dtype": "float32", "shape": [4], "stride": [1], "loc": "bytes"})
    with pytest.raises(WireError, match="needs 16"):
        decode_bytes(desc, memoryview(bytes(12)))


def test_pickle_header_is_refused(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    with pytest.raises(WireError, match="not JSON"):
        loads_header(pickle.dumps(Evil()))
    assert not marker.exists()


def test_paths_are_checked():
    assert check_path([["b1", "ipc:///tmp/x.sock"], ["@dispatcher", "tcp://127.0.0.1:5"]])
    for bad in ([], [["b1"]], [["b 1", "ipc:///x"]], [["b1", "http://evil"]], "b1"):
        with pytest.raises(WireError):
            check_path(bad)


def test_slot_lifecycle_and_release(shm_dir):
    pool = SlotPool(shm_dir, "prod", window=2)
    mapper = SlotMapper(shm_dir)
    try:
        x = torch.arange(12, dtype=torch.float32).view(3, 4)
        desc = pool.put("edge", x, timeout=1)
        y, lease = mapper.open(TensorDesc.parse(desc.to_json()))
        assert torch.equal(x, y)
        assert pool.in_flight("edge") == 1
        lease.release()
        assert pool.in_flight("edge") == 0
        # the same slot is reused; the old handle is now stale and refused
        pool.put("edge", x + 1, timeout=1)
        with pytest.raises(WireError, match="stale"):
            mapper.open(TensorDesc.parse(desc.to_json()))
    finally:
        mapper.close()
        pool.close()
    assert os.listdir(shm_dir) == []  # the producer unlinked every slot it created


def test_an_edge_commits_its_whole_window_on_first_use(shm_dir):
    """Shared memory is committed when an edge starts serving and stays flat afterwards,
    whatever bursts come (one slot at a time, it crept up over a soak)."""
    pool = SlotPool(shm_dir, "prod", window=3)
    mapper = SlotMapper(shm_dir)
    try:
        x = torch.ones(1000)
        first = pool.put("e", x, timeout=1)
        names = sorted(os.listdir(shm_dir))
        assert len(names) == 3 and pool.in_flight("e") == 1
        held = [first] + [pool.put("e", x, timeout=1) for _ in range(2)]  # a burst fills the window
        for d in held:
            mapper.open(TensorDesc.parse(d.to_json()))[1].release()
        for _ in range(20):
            d = pool.put("e", x, timeout=1)
            mapper.open(TensorDesc.parse(d.to_json()))[1].release()
        assert sorted(os.listdir(shm_dir)) == names
    finally:
        mapper.close()
        pool.close()


def test_window_full_is_back_pressure_with_deadline(shm_dir):
    pool = SlotPool(shm_dir, "prod", window=2)
    try:
        x = torch.zeros(10)
        pool.put("e", x, timeout=1)
        pool.put("e", x, timeout=1)
        with pytest.raises(TimeoutError, match="2 slots"):
            pool.put("e", x, timeout=0.05)
        # another edge has its own window
        pool.put("other", x, timeout=0.05)
    finally:
        pool.close()


def test_wait_for_a_removed_hop_ends_at_once(shm_dir):
    """A full window towards a consumer that a topology update removed never frees up: the
    producer must stop waiting as soon as it hears, not after its send timeout."""
    import threading
    from blockflow.tensormq.shm import HopGone
    ctx = zmq.Context()
    t = Transport(ctx, "prod", "tensormq", shm_dir, window=1, send_timeout=30)
    try:
        dead = "ipc:///nonexistent/dead.sock"
        t.encode(torch.zeros(4), dead)                      # the only slot: never released
        threading.Timer(0.2, t.mark_live, args=(["ipc:///nonexistent/other.sock"],)).start()
        t0 = time.monotonic()
        with pytest.raises(HopGone, match="removed"):
            t.encode(torch.zeros(4), dead)
        assert time.monotonic() - t0 < 5
        assert t.abandoned(dead) and not t.abandoned("ipc:///nonexistent/other.sock")
        assert t.set_topology(["ipc:///nonexistent/other.sock"]) == [dead]
        assert t.in_flight() == 0                         # reclaimed
    finally:
        t.close()
        ctx.term()


def test_forged_next_hops_cost_a_bounded_number_of_sockets_and_slots(shm_dir):
    """Paths come from messages: a flood of made-up next hops must not grow sockets or slots
    without bound, and the hops the last topology update listed are never the ones closed."""
    from blockflow.tensormq.transport import MAX_UNLISTED_HOPS
    ctx = zmq.Context()
    t = Transport(ctx, "prod", "tensormq", shm_dir, window=2, send_timeout=1)
    try:
        keep = "ipc:///nonexistent/listed.sock"
        t.set_topology([keep])
        t.send_tensor(keep, {"t": "data"}, torch.zeros(4))  # nobody listens: ZeroMQ queues it
        for i in range(MAX_UNLISTED_HOPS + 40):
            t.send_tensor(f"ipc:///nonexistent/forged-{i}.sock", {"t": "data"}, torch.zeros(4))
        assert keep in t.pushers
        assert len(t.pushers) == MAX_UNLISTED_HOPS + 1
        assert len(t.pool.edges) == MAX_UNLISTED_HOPS + 1
        assert t.in_flight() == MAX_UNLISTED_HOPS + 1  # the closed hops' slots were reclaimed
        assert len(os.listdir(shm_dir)) == (MAX_UNLISTED_HOPS + 1) * 2  # a window of 2 per edge
        assert "ipc:///nonexistent/forged-0.sock" not in t.pushers  # least recently used went first
    finally:
        t.close()
        ctx.term()
    assert os.listdir(shm_dir) == []


def test_the_slot_of_a_message_never_sent_is_given_back(shm_dir):
    ctx = zmq.Context()
    t = Transport(ctx, "prod", "tensormq", shm_dir, window=1, send_timeout=1)
    mapper = SlotMapper(shm_dir)
    try:
        x, _ = t.encode(torch.ones(8), "ipc:///nonexistent/next.sock")
        assert t.in_flight() == 1
        t.discard(x)  # the send failed: the handle never left this process
        assert t.in_flight() == 0
        with pytest.raises(WireError, match="stale"):
            mapper.open(TensorDesc.parse(x))
        # a forwarded input handle goes back to its producer the same way
        other = SlotPool(shm_dir, "up", window=1)
        d = other.put("e", torch.ones(8), timeout=1).to_json()
        t.discard(d)
        assert other.in_flight() == 0
        other.close()
    finally:
        mapper.close()
        t.close()
        ctx.term()


def test_reclaim_frees_slots_of_a_dead_consumer_and_invalidates_handles(shm_dir):
    pool = SlotPool(shm_dir, "prod", window=2)
    mapper = SlotMapper(shm_dir)
    try:
        d = pool.put("e", torch.ones(4), timeout=1)
        assert pool.reclaim("e") == 2  # the whole window, one of them in flight
        with pytest.raises(WireError):
            mapper.open(TensorDesc.parse(d.to_json()))
        assert os.listdir(shm_dir) == []
    finally:
        mapper.close()
        pool.close()


def test_forged_handles_are_refused(shm_dir):
    pool = SlotPool(shm_dir, "prod", window=2)
    mapper = SlotMapper(shm_dir)
    try:
        good = pool.put("e", torch.ones(16), timeout=1).to_json()
        forged = [
            dict(good, seg="../../etc/passwd"),
            dict(good, seg="nosuchslot"),
            dict(good, gen=good["gen"] + 5),
            dict(good, off=1 << 40),
            dict(good, shape=[1 << 20], stride=[1]),
            dict(good, nbytes=-1),
        ]
        for f in forged:
            with pytest.raises(WireError):
                mapper.open(TensorDesc.parse(f))
        # a plain file in the directory that is not a slot
        with open(os.path.join(shm_dir, "plain"), "wb") as fh:
            fh.write(b"x" * 100)
        with pytest.raises(WireError, match="not a TensorMQ slot"):
            mapper.open(TensorDesc.parse(dict(good, seg="plain")))
    finally:
        mapper.close()
        pool.close()


def test_slot_grows_for_a_larger_tensor_under_a_new_name(shm_dir):
    pool = SlotPool(shm_dir, "prod", window=1)
    mapper = SlotMapper(shm_dir)
    try:
        d1 = pool.put("e", torch.ones(10), timeout=1).to_json()
        _, lease = mapper.open(TensorDesc.parse(d1))
        lease.release()
        d2 = pool.put("e", torch.ones(1 << 20), timeout=1).to_json()
        assert d2["seg"] != d1["seg"]
        assert len(os.listdir(shm_dir)) == 1  # the small slot was unlinked
        y, lease = mapper.open(TensorDesc.parse(d2))
        assert y.numel() == 1 << 20 and bool((y == 1).all())
        lease.release()
    finally:
        mapper.close()
        pool.close()


def test_view_of_a_slot_is_forwarded_without_copy(shm_dir):
    ctx = zmq.Context()
    t = Transport(ctx, "fwd", "tensormq", shm_dir)
    pool = SlotPool(shm_dir, "prod", window=2)
    try:
        d = pool.put("e", torch.arange(24, dtype=torch.float32).view(2, 3, 4), timeout=1).to_json()
        x, lease = t.decode(d, [None])
        y = x.flatten(1)  # a view: same memory
        out, payload = t.encode(y, "ipc:///tmp/next.sock", lease)
        assert payload is None and out["seg"] == d["seg"] and out["shape"] == [2, 12]
        assert lease.released  # the duty to release went along with the handle
        z, lease2 = t.decode(out, [None])
        assert torch.equal(z, torch.arange(24, dtype=torch.float32).view(2, 12))
        lease2.release()
        assert pool.in_flight() == 0
        # bytes to a remote hop: copied, then the slot can be released at once
        d = pool.put("e", torch.ones(3), timeout=1).to_json()
        x, lease = t.decode(d, [None])
        out, payload = t.encode(x, "tcp://10.0.0.9:5000", lease)
        assert out["loc"] == "bytes" and payload is not None
    finally:
        t.close()
        pool.close()
        ctx.term()


_CONSUMER = r"""
import json, sys
from blockflow.tensormq.shm import SlotMapper
from blockflow.tensormq.wire import TensorDesc, WireError
mapper, opened, refused = SlotMapper(sys.argv[1]), 0, []
print("ready", flush=True)
for line in sys.stdin:
    try:
        _t, lease = mapper.open(TensorDesc.parse(json.loads(line)))
    except WireError as exc:
        refused.append(str(exc))
        continue
    opened += 1
    lease.release()
mapper.close()
print(json.dumps({"opened": opened, "refused": refused[:5], "n_refused": len(refused)}))
"""


def test_a_release_never_frees_a_slot_the_producer_has_reused(shm_dir):
    """Two processes race on one edge as fast as they can: the consumer releases each slot
    while the producer spins waiting to reuse it. Every handle the producer sends must still
    be in flight when the consumer opens it. (With one shared state word, a consumer
    preempted inside its two-store write could free the slot's next generation: a few
    handles per 10,000 came back "stale"; this test caught that in about a third of its runs
    on a 2-core machine, and the fixed header never fails it.)"""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    consumer = subprocess.Popen([sys.executable, "-c", _CONSUMER, shm_dir], cwd=root, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    pool = SlotPool(shm_dir, "race", window=4)
    x = torch.arange(4, dtype=torch.float32)
    sent = 0
    burners: list[subprocess.Popen] = []
    try:
        # the race starts once the consumer has imported torch
        assert consumer.stdout.readline().strip() == "ready"
        # then busy processes oversubscribe the cores, so that the consumer is preempted
        # mid-release now and then, as it is in a pipeline of five processes on two cores (started
        # only now: burning through the consumer's torch import too cost the machine ~10 s of CPU)
        burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                   for _ in range(2 * (os.cpu_count() or 2))]
        deadline = time.monotonic() + 6.0
        while time.monotonic() < deadline and sent < 100_000:
            desc = pool.put("edge", x, timeout=10.0)
            consumer.stdin.write(json.dumps(desc.to_json()) + "\n")
            consumer.stdin.flush()
            sent += 1
        out, _ = consumer.communicate(timeout=60)
    finally:
        for p in burners + [consumer]:
            if p.poll() is None:
                p.kill()
                p.wait()
        pool.close()
    report = json.loads(out)
    assert report["n_refused"] == 0, report
    assert report["opened"] == sent > 1000
