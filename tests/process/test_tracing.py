"""OpenTelemetry traces (blockflow/core/tracing.py) received by a real OTLP/HTTP endpoint
(experiments/otlp.py decodes what the SDK's exporter sends with opentelemetry-proto)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest
import torch

from blockflow.client import Client
from blockflow.core.tracing import traceparent

from conftest import wait_for

CLIENT_TRACE = 0x4BF92F3577B34DA6A3CE929D0E0E4736
CLIENT_SPAN = 0x00F067AA0BA902B7


def test_with_tracing_off_no_process_imports_opentelemetry():
    code = ("import sys; import blockflow.dispatcher.process, blockflow.blocks.process, blockflow.client; "
            "from blockflow.core.tracing import tracer_for; assert tracer_for('x') is None; "
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    env = {k: v for k, v in os.environ.items() if k != "BLOCKFLOW_OTLP_ENDPOINT"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


@pytest.fixture
def receiver():
    from experiments.otlp import OtlpReceiver
    with OtlpReceiver() as r:
        yield r


def traced_server(server_factory, repo, receiver, ratio: float):
    return server_factory(repo, env={"BLOCKFLOW_OTLP_ENDPOINT": receiver.endpoint, "BLOCKFLOW_TRACE_RATIO": str(ratio),
                                     "BLOCKFLOW_TRACE_EXPORT_DELAY": "0.1"})


def kpi_records(state_dir: str, process: str) -> dict[str, dict]:
    """The block's KPI latency records by request id (what /metrics reads)."""
    run_dirs = [os.path.join(root, process + ".latency.jsonl") for root, _, files in os.walk(state_dir)
                if process + ".latency.jsonl" in files]
    out = {}
    for path in run_dirs:
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                out[str(rec["rid"])] = rec
    return out


@pytest.mark.parametrize("transport", ["tensormq", "zeromq"])
def test_one_trace_per_request_with_a_span_per_block(server_factory, identity_repo, receiver, transport):
    srv = traced_server(server_factory, identity_repo, receiver, ratio=1.0)
    srv.call("POST", "/system/update", {
        "transport": transport,
        "blocks": [{"name": "a", "model": "toy/identity.pt"},
                   {"name": "d", "model": "toy/double.pt", "replicas": 2},
                   {"name": "bt", "model": "toy/double.pt", "batching": {"max_batch": 4, "max_queue_delay_us": 20000}}],
        "tasks": [{"id": "t", "path": ["a", "d"]}, {"id": "b", "path": ["a", "bt"]}]}, timeout=120)
    parent = traceparent(CLIENT_TRACE, CLIENT_SPAN)
    with Client(srv.dispatcher, timeout=30) as c:
        for i in range(4):
            assert torch.equal(c.infer("t", torch.full((3,), float(i))), torch.full((3,), 2.0 * i))
        assert torch.equal(c.infer("t", torch.ones(3), traceparent=parent), torch.full((3,), 2.0))
        futures = [c.submit("b", torch.full((2,), float(i))) for i in range(6)]  # batched together
        for i, f in enumerate(futures):
            assert torch.equal(f.result(), torch.full((2,), 2.0 * i))
    n_requests, n_block_spans = 11, 22

    spans = wait_for(lambda: (s := receiver.spans()) and len(s) >= n_requests + n_block_spans and s, 60,
                     "every span exported")
    roots = [s for s in spans if s["parent_span_id"] is None or s["name"] == "blockflow request"]
    blocks = [s for s in spans if s["name"].startswith("block ")]
    assert len(roots) == n_requests and len(blocks) == n_block_spans, [s["name"] for s in spans]
    by_id = {s["span_id"]: s for s in roots}
    # one trace per request; every block span a child of its request's root, in the same trace
    assert len({s["trace_id"] for s in roots}) == n_requests
    for s in blocks:
        root = by_id[s["parent_span_id"]]
        assert s["trace_id"] == root["trace_id"]
        # (a last block's span may end after its root: it ends when its send returned, and the
        # dispatcher may answer before the block's thread reads its clock again)
        assert root["start_ns"] <= s["start_ns"] <= root["end_ns"], (root, s)
    per_trace = {}
    for s in blocks:
        per_trace.setdefault(s["trace_id"], []).append(s["attributes"]["blockflow.block"])
    assert sorted(map(sorted, per_trace.values())) == sorted([["a", "d"]] * 5 + [["a", "bt"]] * 6)
    # the client's traceparent is the parent of its request's root span
    mine = [s for s in roots if s["trace_id"] == f"{CLIENT_TRACE:032x}"]
    assert len(mine) == 1 and mine[0]["parent_span_id"] == f"{CLIENT_SPAN:016x}"
    assert {s["attributes"]["blockflow.task"] for s in roots} == {"t", "b"}
    # replicas and the batch are attributes; the batching block batched some of its six requests
    assert {s["attributes"]["blockflow.replica"] for s in blocks if s["attributes"]["blockflow.block"] == "d"} \
        <= {0, 1}
    assert max(s["attributes"]["blockflow.requests_in_batch"] for s in blocks
               if s["attributes"]["blockflow.block"] == "bt") > 1

    # a block's span is its KPI record: the same stage numbers, adding up to the span's length
    srv.call("POST", "/blocks/a/kpi")
    records = kpi_records(srv.state_dir, "a")
    for s in (s for s in blocks if s["attributes"]["blockflow.block"] == "a"):
        a = s["attributes"]
        rec = records[a["blockflow.rid"]]
        for k in ("wait", "deser", "dev", "inf", "share", "fwd", "total"):
            assert a[f"blockflow.{k}_ms"] == pytest.approx(rec[k], abs=1e-3), k
        stages = sum(a[f"blockflow.{k}_ms"] for k in ("wait", "deser", "dev", "inf", "share", "fwd"))
        assert stages == pytest.approx(a["blockflow.total_ms"], rel=0.05, abs=0.05)
        assert (s["end_ns"] - s["start_ns"]) / 1e6 == pytest.approx(a["blockflow.total_ms"], abs=0.01)


def test_sampling_follows_the_ratio_and_the_clients_flag(server_factory, identity_repo, receiver):
    srv = traced_server(server_factory, identity_repo, receiver, ratio=0.0)
    srv.call("POST", "/system/update", {"blocks": [{"name": "a", "model": "toy/identity.pt"}],
                                        "tasks": [{"id": "t", "path": ["a"]}]}, timeout=120)
    with Client(srv.dispatcher, timeout=30) as c:
        for _ in range(5):
            c.infer("t", torch.ones(2))  # ratio 0: not traced
            c.infer("t", torch.ones(2), traceparent=traceparent(CLIENT_TRACE, CLIENT_SPAN, sampled=False))
            c.infer("t", torch.ones(2), traceparent="garbage")  # unreadable: our own decision (ratio 0)
        c.infer("t", torch.ones(2), traceparent=traceparent(CLIENT_TRACE, CLIENT_SPAN))  # sampled by the client
    spans = wait_for(lambda: len(receiver.spans()) >= 2 and receiver.spans(), 60, "the sampled request's spans")
    assert srv.call("POST", "/blocks/a/kpi")  # the block flushed: every span it made is out
    srv.stop()  # a clean stop exports what is left
    spans = receiver.spans()
    assert len(spans) == 2 and {s["trace_id"] for s in spans} == {f"{CLIENT_TRACE:032x}"}, spans


def test_the_open_inference_protocol_takes_a_traceparent_header(server_factory, identity_repo, receiver):
    srv = traced_server(server_factory, identity_repo, receiver, ratio=0.0)
    srv.call("POST", "/system/update", {"blocks": [{"name": "a", "model": "toy/double.pt"}],
                                        "tasks": [{"id": "t", "path": ["a"]}]}, timeout=120)
    body = json.dumps({"inputs": [{"name": "input", "shape": [2], "datatype": "FP32", "data": [1, 2]}]}).encode()
    req = urllib.request.Request(srv.url + "/v2/models/t/infer", data=body, method="POST",
                                 headers={"Content-Type": "application/json",
                                          "traceparent": traceparent(CLIENT_TRACE, CLIENT_SPAN)})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert json.load(resp)["outputs"][0]["data"] == [2, 4]
    spans = wait_for(lambda: len(receiver.spans()) >= 2 and receiver.spans(), 60, "the request's spans")
    assert {s["trace_id"] for s in spans} == {f"{CLIENT_TRACE:032x}"}
    assert {s["name"] for s in spans} == {"blockflow request", "block a"}
