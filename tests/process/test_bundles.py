"""Several tensors per hop (tensormq/bundle.py): a tuple or a dict of tensors crosses every
hop in one message, as handles (TensorMQ) or bytes frames (ZeroMQ), through plain, batching
and passing-through blocks, from a client's tuple to a client's dict."""
from __future__ import annotations

import os
import re
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Tuple

import pytest
import torch
import zmq

from blockflow.tensormq import bundle
from blockflow.tensormq.transport import LeaseSet, Transport, bytes_fields, read_bytes_value
from blockflow.core.protocol import PROTOCOL_VERSION
from blockflow.tensormq.wire import ClientRequest, WireError, dumps, loads_data_header, member_descs


class Fork(torch.nn.Module):
    """One tensor in, two out: what a cut crossed by a skip connection hands on."""

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x + 1


class Carry(torch.nn.Module):
    """Two in, two out: the first is worked on, the second passes through untouched (a skip
    connection jumping over this block), so its handle is forwarded."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(a), b


class Join(torch.nn.Module):
    """Two in, a dict of two out: a model with two outputs."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {"sum": a + b, "diff": a - b}


def whole(x: torch.Tensor) -> dict:
    a, b = Fork()(x)
    return Join()(*Carry()(a, b))


@pytest.fixture(scope="module")
def bundle_repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("bundle_repo")
    os.makedirs(repo / "toy")
    for name, mod in (("fork", Fork()), ("carry", Carry()), ("join", Join())):
        torch.jit.save(torch.jit.script(mod), str(repo / "toy" / f"{name}.pt"))
    return str(repo)


# -- the value and the wire --------------------------------------------------------------------

def test_flatten_names_what_cannot_travel():
    with pytest.raises(TypeError, match=r"\[1\] is a int"):
        bundle.flatten((torch.ones(1), 3))
    with pytest.raises(ValueError, match="1 to 16"):
        bundle.flatten(tuple(torch.ones(1) for _ in range(17)))
    with pytest.raises(ValueError, match="dict key"):
        bundle.flatten({"not a name": torch.ones(1)})
    members, keys = bundle.flatten({"a": torch.ones(1), "b": torch.zeros(2)})
    assert keys == ["a", "b"] and [m.shape[0] for m in members] == [1, 2]


def test_bytes_fields_round_trip_a_dict_and_refuse_forged_headers():
    value = {"logits": torch.randn(2, 5), "mask": torch.arange(6).reshape(2, 3)}
    fields, payloads = bytes_fields(value)
    frames = [b"header", *[bytes(p) for p in payloads]]
    # the fields as a client's request carries them (and the dispatcher's reply: the same three)
    msg = ClientRequest(PROTOCOL_VERSION, 1, task="t", **fields)
    back = read_bytes_value(msg, frames)
    assert list(back) == ["logits", "mask"] and all(torch.equal(back[k], value[k]) for k in value)
    with pytest.raises(WireError, match="frame"):
        read_bytes_value(msg, frames[:-1])  # a member's frame is missing
    with pytest.raises(WireError, match="not both"):
        read_bytes_value(ClientRequest(PROTOCOL_VERSION, 1, x=fields["xs"][0], **fields), frames)
    with pytest.raises(WireError, match="keys"):
        member_descs(fields["xs"], ["logits", "logits"])
    with pytest.raises(WireError, match="1 to 16"):
        member_descs([], None)


def test_a_typed_data_header_refuses_what_a_block_must_not_take():
    """Blocks decode data headers into DataHeader (Note [Typed header]): msgspec's checks and
    ours name the field."""
    ok = {"v": 1, "t": "data", "rid": 7, "task": "t", "path": [["b", "ipc:///tmp/bf-b.sock"]],
          "xs": [{"dtype": "float32", "shape": [1], "stride": [1], "loc": "bytes"}], "keys": ["a"]}
    header = loads_data_header(dumps(ok))
    assert header.path == [("b", "ipc:///tmp/bf-b.sock")] and header.keys == ["a"] and header.x is None
    for bad, words in (({"rid": -1}, "$.rid"), ({"rid": True}, "$.rid"), ({"t": "error"}, "$.t"),
                       ({"path": [["b c", "ipc:///x"]]}, "path[0]"), ({"path": []}, "$.path"),
                       ({"x": ok["xs"][0]}, "not both"), ({"keys": ["a", "b"]}, "keys"), ({"v": 2}, "$.v")):
        with pytest.raises(WireError, match=re.escape(words)):
            loads_data_header(dumps({**ok, **bad}))


@pytest.fixture
def shm_pair(leak_check):
    """A producer's and a consumer's Transport over one real shared-memory directory."""
    shm_dir = tempfile.mkdtemp(prefix="bftest-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ctx = zmq.Context()
    producer = Transport(ctx, "producer", "tensormq", shm_dir)
    consumer = Transport(ctx, "consumer", "tensormq", shm_dir)
    yield producer, consumer
    producer.close()
    consumer.close()
    ctx.term()
    import shutil
    shutil.rmtree(shm_dir, ignore_errors=True)


def test_a_bundle_travels_by_handles_and_a_passed_member_keeps_its_slot(shm_pair):
    producer, consumer = shm_pair
    hop = "ipc:///tmp/bf-next.sock"
    a, b = torch.randn(1, 8), torch.randn(1, 4)
    fields, payloads = producer.encode_value((a, b), hop)
    assert payloads == [] and [x["loc"] for x in fields["xs"]] == ["shm", "shm"]
    (ra, rb), leases = consumer.decode_value(None, fields["xs"], None, [b"h"])
    assert torch.equal(ra, a) and torch.equal(rb, b) and isinstance(leases, LeaseSet)
    assert producer.in_flight() == 2
    # the consumer sends the second member on untouched: its handle travels, the slot stays taken
    out, _ = consumer.encode_value((torch.tanh(ra), rb), "ipc:///tmp/bf-after.sock", leases)
    assert out["xs"][1]["seg"] == fields["xs"][1]["seg"] and out["xs"][1]["gen"] == fields["xs"][1]["gen"]
    leases.release()  # the first member's slot only: the second's duty went with its handle
    assert producer.in_flight() == 1
    consumer.discard(out["xs"])  # never sent: every slot it names is given back
    assert producer.in_flight() == 0


def test_a_member_that_finds_no_slot_gives_back_the_ones_taken_before(shm_pair):
    producer, _ = shm_pair
    hop = "ipc:///tmp/bf-full.sock"
    held = [producer.encode_value(torch.ones(1, 4), hop, timeout=0)[0] for _ in range(producer.window - 1)]
    with pytest.raises(TimeoutError):
        producer.encode_value((torch.ones(1, 4), torch.ones(1, 4)), hop, timeout=0)
    assert producer.in_flight() == producer.window - 1  # the first member's slot was given back
    for fields in held:
        producer.discard(fields["x"])
    assert producer.in_flight() == 0


# -- served: both transports, plain and batching ----------------------------------------------

@pytest.mark.parametrize("transport", ["tensormq", "zeromq"])
def test_served_bundles_equal_the_whole_model_for_two_concurrent_tasks(server_factory, bundle_repo, transport):
    from blockflow import Client

    srv = server_factory(bundle_repo)
    srv.call("POST", "/system/update", {
        "transport": transport,
        "blocks": [{"name": "fork", "model": "toy/fork.pt", "threads": 1},
                   {"name": "carry", "model": "toy/carry.pt", "threads": 1},
                   {"name": "join", "model": "toy/join.pt", "threads": 1},
                   {"name": "forkcarry", "model": ["toy/fork.pt", "toy/carry.pt"], "threads": 1},
                   {"name": "bjoin", "model": "toy/join.pt", "threads": 1,
                    "batching": {"max_batch": 4, "max_queue_delay_us": 20_000}}],
        "tasks": [{"id": "three", "path": ["fork", "carry", "join"]},
                  {"id": "batched", "path": ["fork", "carry", "bjoin"]},
                  {"id": "fused", "path": ["forkcarry", "join"]},
                  {"id": "pair_in", "path": ["carry", "join"]}]}, timeout=120)
    xs = [torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(i)) for i in range(12)]

    def run(i):
        with Client(srv.dispatcher, timeout=60) as c:
            return c.infer(("three", "batched", "fused")[i % 3], xs[i])

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, range(len(xs))))
    for x, y in zip(xs, results):
        want = whole(x)
        assert isinstance(y, dict) and list(y) == ["sum", "diff"], y
        assert all((y[k] - want[k]).abs().max().item() <= 1e-6 for k in want)
    with Client(srv.dispatcher, timeout=60) as c:
        a, b = torch.randn(2, 4), torch.randn(2, 4)
        y = c.infer("pair_in", (a, b))  # a client sends a tuple to a block that takes two tensors
        assert torch.allclose(y["sum"], torch.tanh(a) + b) and torch.allclose(y["diff"], torch.tanh(a) - b)
        from blockflow import BlockFlowError
        with pytest.raises(BlockFlowError):
            c.infer("pair_in", torch.randn(2, 4))  # one tensor for a block that takes two: its error comes back
        assert c.infer("three", xs[0])["sum"].shape == (1, 3, 8, 8)


def test_a_batch_of_bundles_concatenates_each_member_and_splits_each_output():
    from blockflow.blocks.batching import plan_batches, run_batch
    from blockflow.core.schema import BatchPolicy
    from blockflow.blocks.runner import BlockRunner, warmup_shapes

    runner = BlockRunner(torch.jit.script(Join()), torch.device("cpu"))
    pairs = [(torch.randn(1, 4), torch.randn(1, 4)) for _ in range(3)] + [(torch.randn(2, 4), torch.randn(1, 4))]
    policy = BatchPolicy.parse({"max_batch": 8})
    # members that disagree on rows run alone; the others form one batch
    assert plan_batches(pairs, policy) == [[0, 1, 2], [3]]
    copied = []
    outs = run_batch(runner, pairs[:3], inputs_copied=lambda: copied.append(True))
    assert copied == [True]
    for (a, b), y in zip(pairs, outs):
        assert torch.equal(y["sum"], a + b) and torch.equal(y["diff"], a - b)
    # a block taking two tensors warms up on both, at every batch size
    shapes = warmup_shapes([[1, 4], [1, 4]], None, BatchPolicy.parse({"max_batch": 2}))
    assert shapes == [[[1, 4], [1, 4]], [[2, 4], [2, 4]]]
    assert runner.warm_up(shapes) == 2


def test_open_inference_protocol_takes_several_inputs_and_returns_several_outputs(server_factory, bundle_repo):
    """Through tritonclient: two inputs (one JSON, one binary) to a block taking two tensors,
    and a dict result as two named outputs (one asked for in binary)."""
    import numpy as np
    http = pytest.importorskip("tritonclient.http")
    srv = server_factory(bundle_repo)
    srv.call("POST", "/system/update", {
        "blocks": [{"name": "carry", "model": "toy/carry.pt", "threads": 1},
                   {"name": "join", "model": "toy/join.pt", "threads": 1}],
        "tasks": [{"id": "pair_in", "path": ["carry", "join"]}]}, timeout=60)
    c = http.InferenceServerClient(srv.url.removeprefix("http://"), network_timeout=30)
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((2, 3)).astype(np.float32) for _ in range(2))
    # given out of order: input_N names say where each goes
    inputs = [http.InferInput("input_1", [2, 3], "FP32"), http.InferInput("input_0", [2, 3], "FP32")]
    inputs[0].set_data_from_numpy(b, binary_data=True)
    inputs[1].set_data_from_numpy(a, binary_data=False)
    outputs = [http.InferRequestedOutput("sum", binary_data=True), http.InferRequestedOutput("diff", binary_data=False)]
    res = c.infer("pair_in", inputs, outputs=outputs)
    np.testing.assert_allclose(res.as_numpy("sum"), np.tanh(a) + b, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(res.as_numpy("diff"), np.tanh(a) - b, rtol=1e-6, atol=1e-6)


def test_a_local_client_sends_and_reads_bundles_in_lent_slots(bundle_repo):
    """Each member of a client's bundle goes in a lent slot of its own, and each member of a
    bundle result is read from its slot (Note [Lent slots] in dispatcher/lending.py): exact
    results, through a block that passes a member on untouched (its handle is the client's
    slot) and one that makes a dict, and every slot comes back."""
    import time
    from blockflow.client import Client
    from blockflow.core.protocol import DISPATCHER
    from blockflow.standalone import StandalonePipeline
    with StandalonePipeline(bundle_repo, {"c": "toy/carry.pt", "j": "toy/join.pt"},
                            {"carry": ["c"], "cj": ["c", "j"]}, shm_prefix="bftest-bundle-lent") as p:
        with Client(p.address, timeout=30) as c:
            c.infer("cj", (torch.randn(2, 8), torch.randn(2, 8)))
            deadline = time.monotonic() + 20
            while c.lent is None and time.monotonic() < deadline:
                time.sleep(0.02)
            assert c.lent is not None
            before = dict(c.stats)
            for i in range(12):  # more requests than slots: every slot comes back free
                g = torch.Generator().manual_seed(i)
                a, b = torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)
                got = c.infer("cj", (a, b))
                want = Join()(*Carry()(a, b))
                assert list(got) == ["sum", "diff"] and all(torch.equal(got[k], want[k]) for k in want), i
                got = c.infer("carry", (a, b))
                assert isinstance(got, tuple) and torch.equal(got[0], torch.tanh(a)) and torch.equal(got[1], b)
            assert c.stats["in_slot"] - before["in_slot"] == 24 and c.stats["out_slot"] - before["out_slot"] == 24, c.stats
            assert c.stats["duplicates"] == 0
        assert p.command(DISPATCHER, "ping")["lent_slots"] == 0
        assert p.command("c", "ping")["in_flight"] == 0 and p.command("j", "ping")["in_flight"] == 0
        left = p.stop()
        assert left["left"] == {"slots": [], "sockets": []}, left
