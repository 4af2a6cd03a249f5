"""What a first request would pay is done before a block serves (Note [Ready to serve] in
blocks/process.py; issue 40, item 5). How much a first request costs against a steady one is a
figure for experiments/first_request.py; these tests check the work itself, without timing:
TorchScript has optimised its graph when the warm-up ends, and the first request after an
update makes no shared-memory slot in any process on its way."""
from __future__ import annotations

import torch

from blockflow.blocks.runner import BlockRunner, warm_calls


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
