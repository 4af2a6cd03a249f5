"""A served block keeps its freed activations between requests (blocks/heap.py, issue 11): with
glibc's defaults a ResNet50 block1 process took ~4,000 minor page faults per request (its heap
top given back to the kernel after every request), each one a zeroed page inside the inference."""
from __future__ import annotations

import statistics

import pytest
import torch

from blockflow.blocks.heap import MMAP_THRESHOLD, keep_freed_memory
from blockflow.client import Client

from experiments.pipeline_latency import minor_faults


def test_keep_freed_memory_is_applied_and_zero_leaves_glibc_alone():
    assert keep_freed_memory(0) is False
    assert keep_freed_memory(256 << 20) is True  # glibc: mallopt accepts both thresholds
    assert MMAP_THRESHOLD == 32 << 20


# The bound sits between the two regimes, not at the best figure: on this 2-core VM a block that keeps its
# heap takes ~20 faults per request and one with glibc's trimming ~4,000 (~12,900 with its thresholds pinned,
# as below); CI's machine measured ~200 for
# the first (another CPU, other oneDNN scratch sizes). Each request is counted on its own and the median
# taken, so one request that also flushes the KPI log or grows a buffer does not decide the test.
SPLIT = 1000


@pytest.mark.parametrize("trim", [None, "0"], ids=["default", "glibc-trimming"])
def test_a_served_block_does_not_page_fault_its_activations_back_in(server_factory, model_repo, trim):
    # outputs copied (BLOCKFLOW_OUTPUT_IN_SLOT=0): made in slots, block1's largest activations are
    # not on the heap at all (Note [Outputs made in a slot]), and this test is about the heap
    # Left alone, glibc moves its own thresholds as a process frees memory, and one run in many
    # (which arena the inference thread got, what it freed first) ends up trimming nothing: the
    # pipeline_latency smoke test once saw 2.25 faults a request where the bench sees thousands.
    # So both cases pin them where they start (128 KiB, no dynamic threshold): glibc trims every
    # time, unless BLOCKFLOW_MALLOC_TRIM (on by default) sets its own thresholds over them.
    env = {"BLOCKFLOW_OUTPUT_IN_SLOT": "0",
           "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072:glibc.malloc.trim_threshold=131072"}
    srv = server_factory(model_repo, env={**env, **({"BLOCKFLOW_MALLOC_TRIM": trim} if trim else {})})
    srv.call("POST", "/system/update", {"transport": "tensormq", "blocks": [
        {"name": "b1", "model": "resnet50/block1.pt", "threads": 1}], "tasks": [{"id": "t", "path": ["b1"]}]})
    pid = srv.call("GET", "/system")["blocks"][0]["pid"]
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    faults = []
    with Client(srv.dispatcher, timeout=60) as c:
        for _ in range(3):  # the first requests map slots and grow the heap once
            c.infer("t", x)
        for _ in range(7):
            before = minor_faults(pid)
            c.infer("t", x)
            faults.append(minor_faults(pid) - before)
    per_request = statistics.median(faults)
    if trim is None:
        assert per_request < SPLIT, f"block1 took {per_request:.0f} minor page faults per request: {faults}"
    else:  # what the setting is for: glibc's trimming faults the activations back in each time
        assert per_request > SPLIT, f"block1 took {per_request:.0f} minor page faults per request: {faults}"
