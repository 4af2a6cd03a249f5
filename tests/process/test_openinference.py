"""The Open Inference Protocol (KServe v2) on a real server, driven by the real tritonclient."""
from __future__ import annotations

import json
import os
import urllib.request

import numpy as np
import pytest
import torch

tritonclient_http = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

TOY_UPDATE = {"blocks": [{"name": "a", "model": "toy/identity.pt"}, {"name": "d", "model": "toy/double.pt"}],
              "tasks": [{"id": "t", "path": ["a", "d"]}]}


def triton(srv):
    return tritonclient_http.InferenceServerClient(srv.url.removeprefix("http://"), network_timeout=30)


def infer(client, task, x: np.ndarray, binary_in: bool, binary_out: bool | None, datatype="FP32"):
    inp = tritonclient_http.InferInput("input", list(x.shape), datatype)
    inp.set_data_from_numpy(x, binary_data=binary_in)
    outputs = None if binary_out is None else [tritonclient_http.InferRequestedOutput("output", binary_data=binary_out)]
    return client.infer(task, [inp], outputs=outputs).as_numpy("output")


def test_tritonclient_health_metadata_and_infer(server_factory, identity_repo):
    srv = server_factory(identity_repo)
    c = triton(srv)
    assert c.is_server_live()
    assert c.is_server_ready()  # nothing deployed yet: the dispatcher is up, no block is missing
    meta = c.get_server_metadata()
    assert meta["name"] == "blockflow" and "binary_tensor_data" in meta["extensions"]
    assert not c.is_model_ready("t")
    srv.call("POST", "/system/update", TOY_UPDATE, timeout=60)
    assert c.is_model_ready("t") and c.is_model_ready("t", model_version="1")

    meta = c.get_model_metadata("t")
    assert meta["name"] == "t" and meta["inputs"][0]["name"] == "input" and meta["outputs"][0]["name"] == "output"
    assert meta["inputs"][0]["shape"][0] == -1

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5)).astype(np.float32)
    # every combination of JSON and binary tensors, both ways; the default asks for binary output
    for binary_in in (False, True):
        for binary_out in (False, True, None):
            y = infer(c, "t", x, binary_in, binary_out)
            np.testing.assert_array_equal(y, 2 * x)
    for dtype, datatype in ((np.int64, "INT64"), (np.float64, "FP64"), (np.uint8, "UINT8")):
        xi = np.arange(6, dtype=dtype).reshape(2, 3)
        y = infer(c, "t", xi, True, True, datatype)
        assert y.dtype == dtype
        np.testing.assert_array_equal(y, 2 * xi)

    # errors: the server's own message, as tritonclient shows it
    with pytest.raises(InferenceServerException) as e:
        infer(c, "nope", x, True, True)
    assert "unknown task" in str(e.value) and "t" in str(e.value)
    with pytest.raises(InferenceServerException) as e:
        c.get_model_metadata("nope")
    assert "tasks served now: t" in str(e.value)
    assert not c.is_model_ready("nope")
    assert not c.is_model_ready("t", model_version="2")
    c.close()


def post(srv, path, body: bytes, headers: dict) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(srv.url + path, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_v2_rejects_malformed_requests_with_json_errors(server_factory, identity_repo):
    srv = server_factory(identity_repo)
    srv.call("POST", "/system/update", TOY_UPDATE, timeout=60)
    good = {"inputs": [{"name": "input", "shape": [2], "datatype": "FP32", "data": [1.0, 2.0]}]}
    status, _, body = post(srv, "/v2/models/t/infer", json.dumps(good).encode(), {"Content-Type": "application/json"})
    assert status == 200 and json.loads(body)["outputs"][0]["data"] == [2.0, 4.0]
    cases = [
        (b"{", {}, 400, "not valid JSON"),
        (json.dumps({"inputs": []}).encode(), {}, 400, "1 to 16 input"),
        (json.dumps({"inputs": [dict(good["inputs"][0], datatype="BYTES")]}).encode(), {}, 400, "datatype"),
        (json.dumps({"inputs": [dict(good["inputs"][0], shape=[3])]}).encode(), {}, 400, "needs 3"),
        (json.dumps({"inputs": [dict(good["inputs"][0], shape=[-1])]}).encode(), {}, 400, "shape"),
        # in our words (what is wrong, what is expected), not numpy's ("too many dimensions 'str'")
        (json.dumps({"inputs": [dict(good["inputs"][0], data=["x", "y"])]}).encode(), {}, 400,
         'inputs[0].data[0] is "x"; FP32 data holds numbers only'),
        (json.dumps({"inputs": [dict(good["inputs"][0], data=[[1.0], [2.0, 3.0]])]}).encode(), {}, 400,
         "data[1] is a list of 2 but data[0] is a list of 1; send the values flattened"),
        (json.dumps({"inputs": [dict(good["inputs"][0], datatype="UINT8", data=[1, 300])]}).encode(), {}, 400,
         "out of the range of UINT8"),
        # the task's input is 'input' (GET /v2/models/t): any other name, or a second one, is refused
        (json.dumps({"inputs": [dict(good["inputs"][0], name="image")]}).encode(), {}, 400,
         "task t takes input 'input', got input 'image'; name the inputs as GET /v2/models/t lists them"),
        # (no manifest describes toy/identity.pt: several inputs are input_0, input_1, ...)
        (json.dumps({"inputs": [good["inputs"][0], good["inputs"][0]]}).encode(), {}, 400,
         "takes inputs 'input_0', 'input_1', got inputs 'input', 'input'"),
        (json.dumps({"inputs": [dict(good["inputs"][0], name=None)]}).encode(), {}, 400, "got input null"),
        (json.dumps(good).encode(), {"Inference-Header-Content-Length": "9999"}, 400, "does not fit"),
        (json.dumps({"inputs": [{"name": "input", "shape": [2], "datatype": "FP32",
                                 "parameters": {"binary_data_size": 8}}]}).encode() + b"\0" * 4,
         {"Inference-Header-Content-Length": None}, 400, "binary_data_size"),
    ]
    for body, headers, want, words in cases:
        if headers.get("Inference-Header-Content-Length", "") is None:
            headers = {"Inference-Header-Content-Length": str(len(body) - 4)}
        status, hdrs, answer = post(srv, "/v2/models/t/infer", body, headers)
        assert status == want, (body[:80], status, answer)
        assert hdrs["Content-Type"].startswith("application/json")
        assert words in json.loads(answer)["error"], answer
        assert "dimensions" not in json.loads(answer)["error"], answer  # numpy's words
    status, _, answer = post(srv, "/v2/models/t/versions/7/infer", json.dumps(good).encode(), {})
    assert status == 404
    # the data plane still serves
    status, _, body = post(srv, "/v2/models/t/infer", json.dumps(good).encode(), {})
    assert status == 200


def test_v2_resnet18_metadata_and_result(server_factory, model_repo):
    from blockflow.blocks.repository import load_block
    srv = server_factory(model_repo)
    update = {"blocks": [{"name": f"b{i}", "model": f"resnet18/block{i}.pt", "threads": 1} for i in range(1, 5)]
              + [{"name": "h", "model": "resnet18/head.pt", "threads": 1}],
              "tasks": [{"id": "classify", "path": ["b1", "b2", "b3", "b4", "h"]}]}
    srv.call("POST", "/system/update", update, timeout=120)
    c = triton(srv)
    meta = c.get_model_metadata("classify")
    assert meta["inputs"][0] == {"name": "input", "datatype": "FP32", "shape": [-1, 3, 224, 224]}
    assert meta["outputs"][0] == {"name": "output", "datatype": "FP32", "shape": [-1, 1000]}
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    y = infer(c, "classify", x.numpy(), True, True)
    full = load_block(model_repo, "resnet18/full.pt")
    with torch.inference_mode():
        want = full(x)
    torch.testing.assert_close(torch.from_numpy(y.copy()), want, rtol=1e-4, atol=1e-4)
    c.close()
