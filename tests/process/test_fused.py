"""Fused blocks (the reference's B12/B34 fusion): a block's ``model`` may be a list of files run
in sequence in one process."""
from __future__ import annotations

import pytest
import torch

from blockflow.client import Client
from blockflow.core.schema import UpdateError, validate_update

from test_control_plane import block_of, rest_error, update_body

R18 = [f"resnet18/{b}.pt" for b in ("block1", "block2", "block3", "block4", "head")]


def test_a_fused_model_is_a_list_of_files_checked_one_by_one():
    upd = validate_update({"blocks": [{"name": "f", "model": R18}], "tasks": [{"id": "t", "path": ["f"]}]})
    assert upd.blocks["f"].files == tuple(R18) and upd.blocks["f"].as_dict()["model"] == R18
    assert validate_update({"blocks": [{"name": "f", "model": [R18[0]]}]}).blocks["f"].model == R18[0]
    for bad, field in (([], "blocks[0].model"), ([R18[0], 3], "blocks[0].model[1]"), ({"a": 1}, "blocks[0].model"),
                       (R18 * 4, "blocks[0].model")):
        with pytest.raises(UpdateError) as e:
            validate_update({"blocks": [{"name": "f", "model": bad}]})
        assert e.value.field == field, (bad, e.value)


def test_fused_resnet18_blocks_equal_the_full_model(server_factory, model_repo):
    srv = server_factory(model_repo)
    err = rest_error(srv, "POST", "/system/update", update_body(
        {"f": {"model": [R18[0], "resnet18/nope.pt"]}}, {"t": ["f"]}))
    assert err.status == 400 and err.body["field"] == "blocks[0].model[1]", err.body
    res = srv.call("POST", "/system/update", update_body(
        {"all": {"model": R18, "threads": 1},                       # one process, five files
         "f13": {"model": R18[:3], "threads": 1}, "f4h": {"model": R18[3:], "threads": 1}},  # two fused blocks
        {"one": ["all"], "two": ["f13", "f4h"]}), timeout=120)
    assert sorted(res["diff"]["spawned"]) == ["all", "f13", "f4h"]
    system = srv.call("GET", "/system")
    assert block_of(system, "all")["model"] == R18 and block_of(system, "f4h")["model"] == R18[3:]
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        full = torch.jit.load(f"{model_repo}/resnet18/full.pt")(x)
    with Client(srv.dispatcher, timeout=60) as c:
        one, two = c.infer("one", x), c.infer("two", x)
    assert one.shape == two.shape == (2, 1000)
    assert torch.allclose(one, full, atol=1e-4), (one - full).abs().max()
    assert torch.allclose(two, full, atol=1e-4), (two - full).abs().max()
