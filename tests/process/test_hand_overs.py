"""A block handed what its model cannot take, as an operator meets it: refused at the update where
the manifests say so (Note [Hand-overs checked at the update] in manager/models.py), and
otherwise one line naming the cause in the request's error, not the model's TorchScript
traceback cut off before it (blocks/process.py ``model_error``)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from blockflow.blocks.manifest import write_manifest
from blockflow.client import BlockFlowError, Client
from blockflow.restclient import RestError
from conftest import wait_for
from test_cli import blockflow


def _save(module: nn.Module, path) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.manual_seed(0)
    torch.jit.save(torch.jit.script(module.eval()), str(path))


@pytest.fixture
def conv_repo(tmp_path):
    """``pair/``: a (3 -> 4 channels) and b (takes 8 channels), a manifest declaring their shapes;
    ``loose/``: the same b with no manifest (nothing declared)."""
    _save(nn.Conv2d(3, 4, 3), tmp_path / "pair" / "a.pt")
    _save(nn.Conv2d(8, 2, 3), tmp_path / "pair" / "b.pt")
    _save(nn.Conv2d(4, 8, 1), tmp_path / "pair" / "widen.pt")
    path = write_manifest(tmp_path / "pair")
    manifest = json.loads(path.read_text())
    shapes = {"a.pt": ([1, 3, 8, 8], [1, 4, 6, 6]), "b.pt": ([1, 8, 6, 6], [1, 2, 4, 4]),
              "widen.pt": ([1, 4, 6, 6], [1, 8, 6, 6])}
    for name, (taken, made) in shapes.items():
        manifest["blocks"][name].update(dtype="float32", input_shape=taken, output_shape=made)
    path.write_text(json.dumps(manifest))
    _save(nn.Conv2d(8, 2, 3), tmp_path / "loose" / "b.pt")
    return str(tmp_path)


def test_a_path_whose_next_block_cannot_take_the_tensor_is_refused_naming_both(server_factory, conv_repo):
    srv = server_factory(conv_repo)
    blocks = [{"name": "a", "model": "pair/a.pt"}, {"name": "b", "model": "pair/b.pt"},
              {"name": "w", "model": "pair/widen.pt"}]
    with pytest.raises(RestError) as info:
        srv.call("POST", "/system/update", {"blocks": blocks, "tasks": [{"id": "t", "path": ["a", "w"]},
                                                                         {"id": "u", "path": ["a", "b"]}]}, timeout=60)
    err = info.value
    assert err.status == 400 and err.body["field"] == "tasks[1].path", err.body
    assert err.body["error"] == ("tasks[1].path: task 'u', block 'a' -> block 'b': pair/a.pt hands on [N, 4, 6, 6] but "
                                 "pair/b.pt takes [N, 8, 6, 6] (their manifests); fix the path, or export the blocks "
                                 "from one split of the model"), err.body
    assert srv.call("GET", "/system")["blocks"] == []  # nothing was started
    # a fused block's own files are checked the same way, and a path that fits is served
    fused = [{"name": "ab", "model": ["pair/a.pt", "pair/b.pt"]}]
    with pytest.raises(RestError) as info:
        srv.call("POST", "/system/update", {"blocks": fused, "tasks": [{"id": "t", "path": ["ab"]}]}, timeout=60)
    assert "block 'ab', file 1 -> file 2: pair/a.pt hands on [N, 4, 6, 6]" in info.value.body["error"], info.value.body
    srv.call("POST", "/system/update", {"blocks": blocks, "tasks": [{"id": "t", "path": ["a", "w", "b"]}]}, timeout=60)
    with Client(srv.dispatcher, timeout=60) as c:
        assert tuple(c.infer("t", torch.randn(1, 3, 8, 8)).shape) == (1, 2, 4, 4)


def test_a_model_that_fails_inside_torchscript_answers_its_cause_in_one_line(server_factory, conv_repo):
    srv = server_factory(conv_repo)
    srv.call("POST", "/system/update", {"blocks": [{"name": "b", "model": "loose/b.pt"}],
                                        "tasks": [{"id": "t", "path": ["b"]}]}, timeout=60)
    with Client(srv.dispatcher, timeout=60) as c:
        for _ in range(2):  # the second too (the traceback goes to the block's log once)
            with pytest.raises(BlockFlowError) as info:
                c.infer("t", torch.randn(1, 4, 6, 6))
            text = str(info.value)
            assert "block b: RuntimeError: Given groups=1, weight of size [2, 8, 3, 3], expected input[1, 4, 6, 6] " \
                   "to have 8 channels, but got 4 channels instead" in text, text
            assert "Traceback" not in text and "\n" not in text, text
        assert tuple(c.infer("t", torch.randn(1, 8, 6, 6)).shape) == (1, 2, 4, 4)  # and it serves on
    # blockflow kpi counts the failures (records are written at least every second)
    def kpi():
        res = blockflow("kpi", srv.state_dir, "--warmup", "0")
        return res if "block b: 2 request(s) failed (error: 2); the server's log says why" in res.stderr else None
    res = wait_for(kpi, 30, "blockflow kpi naming the failures")
    row = next(line.split() for line in res.stdout.splitlines() if line.split()[:1] == ["b"])
    assert row[1:3] == ["1", "2"], res.stdout  # count, errors
    assert "no records yet" not in res.stderr, res.stderr
