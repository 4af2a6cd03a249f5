"""The block cache on a GPU (issue 44): parked blocks keep their weights in pinned host memory,
a swap-in copies them back and captures the block's CUDA graphs again; answers equal the model
run directly, eager, on the same GPU. Needs a GPU (``make gpu-check``); the same cache on a CPU:
tests/process/test_block_cache.py and tests/unit/test_block_cache_units.py."""
from __future__ import annotations

import os

import pytest
import torch

from blockflow.blocks.cache import BlockCache, Entry, Weights
from blockflow.blocks.runner import BlockRunner
from blockflow.client import Client

from test_block_cache import HEADS, _body, _cache, heads_repo  # noqa: F401  (a fixture)

pytestmark = pytest.mark.cuda  # skipped where no GPU is visible (tests/conftest.py)


def test_a_parked_block_comes_back_with_its_graphs_recaptured():
    dev = torch.device("cuda:0")
    torch.manual_seed(0)
    model = torch.jit.script(torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU()).eval()).to(dev)
    runner = BlockRunner(model, dev, "b")
    x = torch.randn(8, 1024, device=dev)
    with torch.inference_mode(), runner.on_stream():
        runner.warm_up([[8, 1024]])
        want = runner(x).clone()
        eager = model(x).clone()
    assert runner.stats()["graphs"], runner.stats()
    w = Weights(model, dev, "unused")
    cache = BlockCache(w.nbytes + 1024)
    cache.add(Entry("b", w, w.nbytes, False, on_park=runner.drop_graphs, on_restore=runner.recapture))
    before = torch.cuda.memory_allocated(dev)
    cache._park(cache.entries["b"])
    assert torch.cuda.memory_allocated(dev) <= before - w.nbytes  # the weights left the GPU
    assert not runner.stats()["graphs"]
    with torch.inference_mode(), runner.on_stream():
        cache._restore(cache.entries["b"])
        assert runner.stats()["graphs"], "the graph was captured again"
        got = runner(x)
        torch.cuda.current_stream().synchronize()
    assert torch.equal(got, want) and torch.allclose(got, eager, atol=1e-5, rtol=1e-5)


def test_more_blocks_than_the_budget_on_a_gpu_answer_as_the_model_does(server_factory, heads_repo):  # noqa: F811
    srv = server_factory(heads_repo)
    body = _body()
    for b in body["blocks"]:
        b["device"] = "cuda:0"
    srv.call("POST", "/system/update", body, timeout=180)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(5))
    dev = torch.device("cuda:0")
    bb = torch.jit.load(os.path.join(heads_repo, "cache", "backbone.pt"), map_location=dev)
    with Client(srv.dispatcher, timeout=60) as c:
        for _round in range(2):
            for t in range(HEADS):
                head = torch.jit.load(os.path.join(heads_repo, "cache", f"head{t}.pt"), map_location=dev)
                with torch.inference_mode():
                    want = head(bb(x.to(dev))).cpu()
                y = c.infer(f"t{t}", x)
                assert torch.allclose(y, want, atol=1e-5, rtol=1e-5), (t, (y - want).abs().max())
    stats = [_cache(srv, f"h{i}") for i in range(HEADS)]
    assert sum(s["misses"] for s in stats) >= HEADS // 2, stats
    swaps = [s["swap_in_ms"]["last"] for s in stats if s["swap_in_ms"]["last"] is not None]
    print(f"\nswap-in of a 1 MiB head on the GPU: {sorted(swaps)} ms")
