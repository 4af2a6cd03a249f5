"""What a first request would pay is done before a block serves (Note [Ready to serve] in
blocks/process.py; issue 40, item 5). How much a first request costs against a steady one is a
figure for experiments/first_request.py; these tests check the work itself, without timing:
TorchScript has optimised its graph when the warm-up ends, and the first request after an
update makes no shared-memory slot in any process on its way."""
from __future__ import annotations

import os

import torch

from blockflow.blocks.runner import BlockRunner, warm_calls
from blockflow.client import Client
from conftest import slot_files_of


class Affine(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x * 2 + 1)


class Same(torch.nn.Module):
    def forward(self, x):
        return x


def test_warm_up_leaves_torchscript_optimised():
    """After the warm-up the profiling executor has run its optimised graph, not the profiled
    one a first request would run (with one warm-up call the graph still holds prim::profile)."""
    runner = BlockRunner(torch.jit.script(Affine()), "cpu")
    assert warm_calls() >= 2  # the profiled run(s), then the one that optimises
    assert runner.warm_up([[2, 8]]) == 1
    kinds = {n.kind() for n in torch.jit.last_executed_optimized_graph().nodes()}
    assert "prim::profile" not in kinds, kinds
    # what the warm-up made, for the output lender and the slots towards the next hop
    assert runner.outputs == {(torch.float32, torch.Size([2, 8])): 2 * 8 * 4}


def test_warm_up_knows_a_view_of_the_input_needs_no_slot():
    runner = BlockRunner(torch.jit.script(Same()), "cpu")
    runner.warm_up([[3, 4]])
    assert runner.outputs == {(torch.float32, torch.Size([3, 4])): 0}


def _update(k: int) -> dict:
    """ResNet50's block4 and head as the task ``t``; update k > 0 replaces the head only (its
    max_inference_s changes), so the kept block4 and the dispatcher's kept edge meet a new head."""
    return {"transport": "tensormq", "protocol": "ipc",
            "blocks": [{"name": "b4", "model": "resnet50/block4.pt", "threads": 1},
                       {"name": "h", "model": "resnet50/head.pt", "threads": 1, "max_inference_s": 60.0 + k}],
            "tasks": [{"id": "t", "path": ["b4", "h"]}]}


def test_first_request_after_an_update_makes_no_slot(server_factory, model_repo):
    """Before the manager switches the task to new blocks, the dispatcher, every new block and
    every kept block that sends to a new one have made their slots towards their next hops:
    the first request after the update finds them (no slot file appears), and its answer is right."""
    from blockflow.blocks.repository import load_block
    srv = server_factory(model_repo)
    x = torch.randn(1, 1024, 14, 14, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = load_block(model_repo, "resnet50/head.pt")(load_block(model_repo, "resnet50/block4.pt")(x))
    with Client(srv.dispatcher, timeout=60) as client:  # connected before any update, as a client is
        for k in range(2):
            res = srv.call("POST", "/system/update", _update(k), timeout=120)
            assert res["diff"]["replaced" if k else "spawned"] == (["h"] if k else ["b4", "h"]), res
            system = srv.call("GET", "/system")
            pids = {b["name"]: b["pid"] for b in system["blocks"]}
            pids["dispatcher"] = system["dispatcher"]["pid"]
            before = {n: set(slot_files_of(pid)) for n, pid in pids.items()}
            assert all(before.values()), f"update {k}: a process has no slots towards its next hop: {before}"
            y = client.infer("t", x)
            # the slots the dispatcher lends this client (dispatcher/lending.py) are the client's lease,
            # asked for once per client in the background, not a cost of the update: left out
            made = {n: {f for f in set(slot_files_of(pid)) - before[n] if "-lent." not in os.path.basename(f)}
                    for n, pid in pids.items()}
            assert not any(made.values()), f"update {k}: the first request made slots {made}"
            assert torch.allclose(y, expected, atol=1e-4), (y - expected).abs().max()
