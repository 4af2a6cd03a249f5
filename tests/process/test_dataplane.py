"""Data plane with real processes: blocks and the dispatcher started on their own (no server),
wired by real ZeroMQ sockets, registering with a real controller."""
from __future__ import annotations

import itertools
import json
import os
import pickle
import time

import pytest
import torch
import zmq

from blockflow.client import BlockFlowError, Client
from blockflow.core.protocol import DISPATCHER
from blockflow.blocks.repository import load_block
from blockflow.standalone import StandalonePipeline
from blockflow.tensormq import outalloc
from conftest import wait_for

BRANCHY = {  # two tasks share block1-3 and own their block4/head (thesis scenario)
    "b1": "resnet18/block1.pt", "b2": "resnet18/block2.pt", "b3": "resnet18/block3.pt",
    "b4": "resnet18/block4.pt", "h": "resnet18/head.pt",
    "b4x": "resnet18/block4-x.pt", "hx": "resnet18/head-x.pt",
}
TASKS = {"classify": ["b1", "b2", "b3", "b4", "h"], "special": ["b1", "b2", "b3", "b4x", "hx"]}


SHM_PREFIX = "bftest-dataplane"
CUDA = pytest.mark.cuda  # the same promises with every block on the GPU; skipped where none is present


@pytest.fixture(scope="module", params=[
    ("tensormq", "cpu"), ("zeromq", "cpu"),
    pytest.param(("tensormq", "cuda"), marks=CUDA), pytest.param(("zeromq", "cuda"), marks=CUDA)],
    ids=lambda p: "-".join(p))
def pipeline(request, model_repo):
    """One pipeline per transport and device for the whole module (7 processes cost ~10 s to start here)."""
    transport, device = request.param
    # its own shared-memory prefix: parallel runs on one machine sweep each other's blockflow-* dirs
    p = StandalonePipeline(model_repo, BRANCHY, TASKS, transport=transport, device=device, shm_prefix=SHM_PREFIX)
    p.tol = 1e-4 if device == "cpu" else 1e-3  # cuDNN kernels differ from the CPU ones
    p.mode = (transport, device)
    yield p
    result = p.stop()
    assert all(c == 0 for c in result["codes"].values()), f"exit codes {result['codes']}"
    assert result["left"] == {"slots": [], "sockets": []}, f"left behind: {result['left']}"


def reference(repo, names):
    mods = [load_block(repo, BRANCHY[n]) for n in names]

    def run(x):
        with torch.inference_mode():
            for m in mods:
                x = m(x)
        return x
    return run


def test_branchy_pipeline_equals_monolithic(pipeline, model_repo):
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    full = load_block(model_repo, "resnet18/full.pt")
    with torch.inference_mode():
        expected = full(x)
    special = reference(model_repo, TASKS["special"])(x)
    with Client(pipeline.address, timeout=30) as c:
        y = c.infer("classify", x)
        z = c.infer("special", x)
    assert torch.allclose(y, expected, atol=pipeline.tol, rtol=pipeline.tol)
    assert torch.allclose(z, special, atol=pipeline.tol, rtol=pipeline.tol)
    assert not torch.allclose(y, z)  # the specialised branch really is another model


def test_every_request_gets_exactly_one_reply(pipeline, model_repo):
    before = pipeline.command(DISPATCHER, "ping")
    inputs = [torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(i)) for i in range(24)]
    full = load_block(model_repo, "resnet18/full.pt")
    special = reference(model_repo, TASKS["special"])
    with Client(pipeline.address, timeout=60) as c:
        futures = [(x, c.submit("classify" if i % 2 else "special", x, details=True)) for i, x in enumerate(inputs)]
        results = [(x, f.result(60)) for x, f in futures]
        # nothing more arrives: a duplicate reply would be left unclaimed in the socket
        time.sleep(0.2)
        assert not c._waiting
    with torch.inference_mode():
        for i, (x, r) in enumerate(results):
            # every reply is checked against its own task's model: a swapped or mixed-up result fails
            want = full(x) if i % 2 else special(x)
            assert torch.allclose(r.tensor, want, atol=pipeline.tol, rtol=pipeline.tol), i
            assert [h["b"] for h in r.hops] == TASKS["classify" if i % 2 else "special"]
    stats = pipeline.command(DISPATCHER, "ping")
    assert stats["ok"] - before["ok"] == 24 and stats["late"] == 0 and stats["outstanding"] == 0
    # every slot came back once its consumer was done: nothing is held in shared or GPU memory
    for name in BRANCHY:
        assert pipeline.command(name, "ping")["in_flight"] == 0, name
    if pipeline.mode == ("tensormq", "cpu") and outalloc.built():
        # Note [Outputs made in a slot]: after the first request of a shape, every ResNet block's
        # output was allocated in a slot of its next hop and sent from there (and equals the model's)
        made = {name: pipeline.command(name, "ping")["outputs_made_in_slot"] for name in BRANCHY}
        assert all(made.values()), made
        # how many slots a block lends is the model's, learnt once: a new batch size copies its
        # first output (its size is not known yet) and makes the second one in a slot
        x3 = torch.randn(3, 3, 224, 224, generator=torch.Generator().manual_seed(3))
        with Client(pipeline.address, timeout=60) as c:
            for _ in range(2):
                c.infer("classify", x3)
        for name in TASKS["classify"]:
            assert pipeline.command(name, "ping")["outputs_made_in_slot"] == made[name] + 1, name


def test_callers_that_wait_and_callers_that_submit_share_one_client(pipeline, model_repo):
    """Note [A caller that waits holds the socket]: threads calling ``infer`` hold the client's
    socket in turn, while another thread's ``submit``s go through the I/O thread; every answer is
    its own request's, once."""
    import threading
    full = load_block(model_repo, "resnet18/full.pt")
    inputs = [torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(100 + i)) for i in range(4)]
    with torch.inference_mode():
        want = [full(x) for x in inputs]
    got, errors = {}, []
    with Client(pipeline.address, timeout=60) as c:
        # alone, a call holds the socket once the I/O thread has let it go (after the first call's
        # slots were lent; on a loaded machine the I/O thread may still hold it for the next call)
        deadline = time.monotonic() + 30
        for i in itertools.count():
            assert torch.allclose(c.infer("classify", inputs[i % 2]), want[i % 2], atol=pipeline.tol,
                                  rtol=pipeline.tol)
            if c._io.held > 0 or time.monotonic() > deadline:
                break
        assert c._io.held > 0, "no call held the socket itself in 30 s of calls one at a time"

        def waiting(k: int) -> None:
            try:
                for j in range(3):
                    got[(k, j)] = c.infer("classify", inputs[(k + j) % 4])
            except Exception as exc:  # the assertion below names it
                errors.append(exc)
        threads = [threading.Thread(target=waiting, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        futures = [(i, c.submit("classify", inputs[i % 4])) for i in range(6)]
        for t in threads:
            t.join(120)
        submitted = [(i, f.result(60)) for i, f in futures]
        assert not errors, errors
        assert c.stats["duplicates"] == 0 and c.stats["late"] == 0 and not c._waiting
    for (k, j), y in got.items():
        assert torch.allclose(y, want[(k + j) % 4], atol=pipeline.tol, rtol=pipeline.tol), (k, j)
    for i, y in submitted:
        assert torch.allclose(y, want[i % 4], atol=pipeline.tol, rtol=pipeline.tol), i
    assert len(got) == 9


def test_hop_records_carry_ordered_instants(pipeline):
    """Note [Hop timestamps] (blocks/kpilog.py): every block stamps t_in and t_out on
    CLOCK_MONOTONIC, one clock for every process here, so the instants of consecutive blocks
    and the client's own line up: each block takes the message after the previous one handed
    it on, and all of them fall inside the client's send/receive window. The KPI latency
    records carry the same two instants."""
    assert time.get_clock_info("perf_counter").implementation == time.get_clock_info("monotonic").implementation
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(3))
    slack = 1e-6  # the instants travel rounded to the microsecond
    seen = []
    with Client(pipeline.address, timeout=30) as c:
        for _ in range(3):
            sent = time.monotonic()
            r = c.infer_details("classify", x)
            got = time.monotonic()
            assert [h["b"] for h in r.hops] == TASKS["classify"]
            before = sent
            for h in r.hops:
                assert before - slack <= h["t_in"] <= h["t_out"] <= got + slack, (sent, r.hops, got)
                # seconds, not milliseconds: the block's own components fit between its two instants
                assert (h["t_out"] - h["t_in"]) * 1e3 >= h["inf"] + h["share"] - 2e-3, h
                before = h["t_out"]
            seen.append(r.hops)
    for i, name in enumerate(TASKS["classify"]):
        def logged() -> bool:
            # a block adds its KPI record just after its send: the reply may reach the client
            # first, so a store right after it can miss the last one; poll
            paths = pipeline.command(name, "store")["paths"]
            with open(paths["latency"]) as f:
                stamps = {(rec.get("t_in"), rec.get("t_out")) for rec in map(json.loads, f)}
            return all((hops[i]["t_in"], hops[i]["t_out"]) in stamps for hops in seen)
        wait_for(logged, 10, f"{name}'s KPI log records the instants of its hop records")


def test_bad_requests_get_error_replies_and_blocks_keep_serving(pipeline):
    x = torch.randn(1, 3, 224, 224)
    with Client(pipeline.address, timeout=30) as c:
        with pytest.raises(BlockFlowError, match="unknown task") as e:
            c.infer("nope", x)
        assert e.value.code == "unknown_task"
        with pytest.raises(BlockFlowError, match="b1") as e:  # wrong shape: the first block says why
            c.infer("classify", torch.randn(1, 5, 7))
        with pytest.raises(BlockFlowError):
            c.infer("classify", torch.randn(1, 3, 224, 224, dtype=torch.float64))
        assert c.infer("classify", x).shape == (1, 1000)

    # raw garbage at the dispatcher: every frame that names a requester gets an error reply
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.linger = 0
    raw.rcvtimeo = 5000
    raw.connect(pipeline.address)
    garbage = [
        [b"\x80\x04not json"],
        [pickle.dumps({"id": 1})],
        [json.dumps({"id": 7, "task": "classify"}).encode()],  # no tensor descriptor
        [json.dumps({"id": 8, "task": "classify", "x": {"dtype": "float32", "shape": [100000, 100000, 100],
                                                          "stride": [10000000, 100, 1], "loc": "bytes"}}).encode(), b"x"],
        [json.dumps({"id": 9, "task": "classify", "x": {"dtype": "float32", "shape": [1, 3, 224, 224],
                                                          "stride": [150528, 50176, 224, 1], "loc": "bytes"}}).encode(),
         b"short"],
        [json.dumps({"id": 10, "task": "classify", "x": {"dtype": "float32", "shape": [4], "stride": [1],
                                                           "loc": "shm", "seg": "../../etc/passwd", "gen": 1,
                                                           "off": 0, "nbytes": 16}}).encode()],
    ]
    garbage.append([json.dumps({"v": 2, "id": 11, "task": "classify"}).encode()])  # another protocol version
    for frames in garbage:
        raw.send_multipart(frames)
        reply = json.loads(raw.recv_multipart()[0])
        assert reply["status"] == "error" and reply["error"], reply
        sent = frames[0][:1] == b"{" and json.loads(frames[0])
        # a request with a readable id gets its error under that id, even when another field is wrong
        assert reply["id"] == (sent["id"] if sent else None), (reply, frames[0][:80])
    assert "protocol version 2" in reply["error"], reply
    raw.close()
    ctx.term()

    # garbage straight into a block's data socket: it logs, answers where it can, keeps serving
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.linger = 0
    push.connect(pipeline.endpoints["b2"])
    push.send_multipart([b"garbage"])
    push.send_multipart([json.dumps({"t": "data", "rid": 5, "path": "nowhere"}).encode()])
    push.send_multipart([json.dumps({"t": "data", "rid": 6, "path": [["@dispatcher", "ipc:///nonexistent/x.sock"]],
                                     "x": {"dtype": "float32", "shape": [1], "stride": [1], "loc": "shm",
                                           "seg": "forged", "gen": 1, "off": 0, "nbytes": 4}}).encode()])
    time.sleep(0.3)
    push.close()
    ctx.term()
    with Client(pipeline.address, timeout=30) as c:
        assert c.infer("special", x).shape == (1, 1000)
    assert pipeline.command("b2", "ping")["pid"] == pipeline.procs["b2"].pid


def test_kpi_logs_are_written_on_store(pipeline):
    with Client(pipeline.address, timeout=30) as c:
        for _ in range(3):
            c.infer("classify", torch.randn(1, 3, 224, 224))
    res = pipeline.command("b1", "store")
    with open(res["paths"]["latency"]) as f:
        records = [json.loads(line) for line in f]
    assert len(records) >= 3
    for key in ("wait", "deser", "dev", "inf", "share", "fwd", "total", "queue"):
        assert key in records[-1]
    assert records[-1]["inf"] > 0 and records[-1]["total"] >= records[-1]["inf"]



# -- liveness: the ping carries the inference thread's heartbeat ---------------------------------

class Spin(torch.nn.Module):
    """Runs for as many rounds as its first input element says: a model that is 'stuck' on demand."""

    def forward(self, x):
        y = x[1:]
        for _ in range(int(x[0].item())):
            y = torch.tanh(y + 0.001)
        return y


@pytest.fixture(scope="module")
def spin_repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("spin_repo")
    os.makedirs(repo / "toy")
    torch.jit.save(torch.jit.script(Spin()), str(repo / "toy" / "spin.pt"))
    return str(repo)


def test_ping_reports_a_block_stuck_in_its_model(spin_repo):
    with StandalonePipeline(spin_repo, {"s": "toy/spin.pt"}, {"t": ["s"]}, shm_prefix=SHM_PREFIX) as p:
        idle = p.command("s", "ping")
        assert idle["busy_s"] == 0.0 and 0.0 <= idle["beat_age_s"] < 2.0, idle
        with Client(p.address, timeout=120) as c:
            # tens of millions of tiny ops: seconds to minutes, longer than this test looks
            fut = c.submit("t", torch.tensor([5e7, 0.0, 0.0, 0.0]))
            busy, deadline = [], time.monotonic() + 30
            while len(busy) < 3 and time.monotonic() < deadline:
                ping = p.command("s", "ping", timeout=2.0)  # the control thread still answers
                if ping["busy_s"] > 0:
                    busy.append(ping)
                    time.sleep(0.3)
            assert len(busy) == 3, busy
            assert busy[0]["busy_s"] < busy[1]["busy_s"] < busy[2]["busy_s"]
            assert busy[2]["beat_age_s"] >= busy[2]["busy_s"] - 0.01  # no beat while inside the model
            assert not fut.done()
            p.procs["s"].kill()  # what the manager does past max_inference_s
            p.stop()
        with pytest.raises(Exception):
            fut.result(10)


def test_the_dispatcher_copies_on_one_thread(pipeline):
    """Note [The dispatcher copies on one thread]: a client's tensor of several MB is copied into
    a slot by the dispatcher's own thread, whatever the number of cores; no OpenMP team is woken
    (its workers would spin on the cores the blocks need)."""
    x = torch.randn(4, 3, 224, 224, generator=torch.Generator().manual_seed(5))  # 2.4 MB
    with Client(pipeline.address, timeout=60) as c:
        c.infer("classify", x)
    assert pipeline.command(DISPATCHER, "ping")["torch_threads"] == 1


def test_headers_between_processes_go_by_datagram_where_handles_travel(pipeline):
    """Note [A datagram beside the socket]: with TensorMQ every hop of a request on this host
    (dispatcher to first block, block to block, last block to dispatcher) is one datagram; the
    zeromq transport's blocks bind none and their messages, bytes and all, go by ZeroMQ."""
    if pipeline.mode[1] != "cpu":
        pytest.skip("the same code on a GPU; the CPU pipelines show it")
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(6))
    before = {n: pipeline.command(n, "ping")["datagrams"] for n in TASKS["classify"]}
    with Client(pipeline.address, timeout=60) as c:
        for _ in range(3):
            c.infer("classify", x)
    after = {n: pipeline.command(n, "ping")["datagrams"] for n in TASKS["classify"]}
    if pipeline.mode[0] == "tensormq":
        for n in TASKS["classify"]:
            assert after[n]["received"] - before[n]["received"] >= 3, (n, before[n], after[n])
            assert after[n]["sent"] - before[n]["sent"] >= 3, (n, before[n], after[n])  # the last one's to the dispatcher
    else:
        for n in TASKS["classify"]:
            assert "received" not in after[n]  # no datagram socket bound
            assert after[n]["sent"] == before[n]["sent"]  # bytes travel in frames: ZeroMQ's


def test_the_output_allocator_loads_once_when_the_blocks_of_a_group_start_together():
    """A shared process's members start on their own threads and each loads the output-in-slot
    extension (tensormq/outalloc.py): eight threads at once in a fresh interpreter all get the
    one installed module (two loading it at once once left a member without ``install``)."""
    import subprocess
    import sys
    code = (
        "import threading\n"
        "from blockflow.tensormq import outalloc\n"
        "if outalloc.built() is None:\n"
        "    print('unbuilt', outalloc.why_not()); raise SystemExit(0)\n"
        "got, go = [], threading.Barrier(8)\n"
        "def load():\n"
        "    go.wait(); got.append(outalloc.load())\n"
        "ts = [threading.Thread(target=load) for _ in range(8)]\n"
        "[t.start() for t in ts]; [t.join(60) for t in ts]\n"
        "assert len(got) == 8 and got[0] is not None and all(m is got[0] for m in got), (got, outalloc.why_not())\n"
        "print('one module')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    if out.stdout.startswith("unbuilt"):
        pytest.skip(f"the extension is not built here: {out.stdout.strip()}")
    assert "one module" in out.stdout
