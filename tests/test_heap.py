"""A served block keeps its freed activations between requests (blocks/heap.py, issue 11): with
glibc's defaults a ResNet50 block1 process took ~4,000 minor page faults per request (its heap
top given back to the kernel after every request), each one a zeroed page inside the inference."""
from __future__ import annotations

import pytest
import torch

from blockflow.blocks.heap import MMAP_THRESHOLD, keep_freed_memory
from blockflow.client import Client

from experiments.pipeline_latency import minor_faults


def test_keep_freed_memory_is_applied_and_zero_leaves_glibc_alone():
    assert keep_freed_memory(0) is False
    assert keep_freed_memory(256 << 20) is True  # glibc: mallopt accepts both thresholds
    assert MMAP_THRESHOLD == 32 << 20


@pytest.mark.parametrize("trim, most", [(None, 100), ("0", None)], ids=["default", "glibc-default"])
def test_a_served_block_does_not_page_fault_its_activations_back_in(server_factory, model_repo, trim, most):
    srv = server_factory(model_repo, env={"BLOCKFLOW_MALLOC_TRIM": trim} if trim else None)
    srv.call("POST", "/system/update", {"transport": "tensormq", "blocks": [
        {"name": "b1", "model": "resnet50/block1.pt", "threads": 1}], "tasks": [{"id": "t", "path": ["b1"]}]})
    pid = srv.call("GET", "/system")["blocks"][0]["pid"]
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    n = 4
    with Client(srv.dispatcher, timeout=60) as c:
        for _ in range(3):  # the first requests map slots and grow the heap once
            c.infer("t", x)
        before = minor_faults(pid)
        for _ in range(n):
            c.infer("t", x)
        per_request = (minor_faults(pid) - before) / n
    if most is not None:
        assert per_request < most, f"block1 took {per_request:.0f} minor page faults per request"
    else:  # what the setting is for: glibc's own trimming faults the activations back in each time
        assert per_request > 1000, f"block1 took {per_request:.0f} minor page faults per request"
