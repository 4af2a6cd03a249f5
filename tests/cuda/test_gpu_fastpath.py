"""The GPU fast path (issue 27): CUDA graphs per block, stream-ordered hand-overs, warm-up.

Every test here is marked ``cuda`` and needs a GPU (``make gpu-check``): graphs against eager per
shape (plain, fused, batched), a model that cannot be captured, hand-overs under random GPU delays
in both processes (kill -9 of a producer or a consumer block under load: tests/cuda/test_cuda_ipc.py).
On any machine: the runner on a CPU, the update fields that steer it and the share record that
carries a slot's event (tests/unit/test_gpu_fastpath_cpu.py), the settings of the hand-over
(tests/process/test_gpu_settings.py).
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from blockflow.core.schema import BatchPolicy
from blockflow.blocks.runner import BlockRunner, warmup_shapes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CUDA = pytest.mark.cuda
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is visible here")


# -- on a GPU ------------------------------------------------------------------------------------

def _blocks(model_repo, stems, device="cuda:0"):
    from blockflow.blocks.repository import open_block
    model, _ = open_block(model_repo, [f"resnet18/{s}.pt" for s in stems] if len(stems) > 1 else
                          f"resnet18/{stems[0]}.pt", device)
    return model


def _assert_same(got, want, what):
    diff = (got.float() - want.float()).abs().max().item()
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), f"{what}: graph differs from eager by {diff}"


@CUDA
@needs_gpu
def test_a_trimmed_cuda_context_runs_a_graph_exactly(model_repo):
    from blockflow.blocks.runner import trim_cuda_context
    assert trim_cuda_context(torch.device("cuda:0"), 256)["stack_bytes"] == 256
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    model = _blocks(model_repo, ["block3"])
    runner = BlockRunner(model, "cuda:0", "t")
    with torch.inference_mode():
        x = torch.randn(1, 128, 28, 28, device="cuda:0")
        _assert_same(runner(x).clone(), model(x), "block3 with a 256-byte stack limit")


@CUDA
@needs_gpu
@pytest.mark.parametrize("stems", [["block1"], ["block2", "block3"], ["head"]], ids=["plain", "fused", "head"])
def test_graph_results_equal_eager_results_per_shape(model_repo, stems):
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    model = _blocks(model_repo, stems)
    shape = {"block1": (3, 224, 224), "block2": (64, 56, 56), "head": (512, 7, 7)}[stems[0]]
    runner = BlockRunner(model, "cuda:0", "t", cuda_graphs=True)
    with torch.inference_mode():
        for batch in (1, 2, 5, 1, 5):  # a shape seen again replays its graph
            x = torch.randn(batch, *shape, device="cuda:0", generator=torch.Generator("cuda:0").manual_seed(batch))
            want = model(x).clone()
            got = runner(x).clone()
            _assert_same(got, want, f"{stems} batch {batch}")
        torch.cuda.synchronize()
    st = runner.stats()
    assert len(st["graphs"]) == 3 and st["replays"] == 5 and st["eager_calls"] == 0 and not st["refused"], st


@CUDA
@needs_gpu
def test_a_batched_block_replays_one_graph_per_batch_size(model_repo):
    """run_batch through the runner: the batch is a shape, each request gets its own rows."""
    from blockflow.blocks.batching import run_batch
    model = _blocks(model_repo, ["block4", "head"])
    runner = BlockRunner(model, "cuda:0", "t")
    runner.warm_up(warmup_shapes([1, 256, 14, 14], None, BatchPolicy.parse({"max_batch": 4, "max_queue_delay_us": 0})))
    assert len(runner.stats()["graphs"]) == 4
    with torch.inference_mode():
        xs = [torch.randn(1, 256, 14, 14, device="cuda:0", generator=torch.Generator("cuda:0").manual_seed(i))
              for i in range(3)]
        outs = [y.clone() for y in run_batch(runner, xs)]
        for x, y in zip(xs, outs):
            _assert_same(y, model(x), "a request of a batch of 3")
    assert runner.stats()["eager_calls"] == 0


@CUDA
@needs_gpu
def test_a_model_that_cannot_be_captured_runs_eager_with_one_logged_reason(caplog):
    class Branchy(torch.nn.Module):
        def forward(self, x):
            if bool(x.sum() > 0):  # data-dependent: a host sync inside the capture
                return x * 2
            return x - 1

    model = torch.jit.script(Branchy()).cuda().eval()
    runner = BlockRunner(model, "cuda:0", "branchy")
    with caplog.at_level(logging.WARNING, logger="blockflow.block"), torch.inference_mode():
        for v in (1.0, -1.0, 3.0):
            x = torch.full((2, 4), v, device="cuda:0")
            assert torch.equal(runner(x), model(x))
    reasons = [r.getMessage() for r in caplog.records if "no CUDA graph" in r.getMessage()]
    assert len(reasons) == 1 and "runs eager" in reasons[0], reasons
    st = runner.stats()
    assert st["graphs"] == [] and len(st["refused"]) == 1 and st["eager_calls"] == 3, st
    assert torch.randn(4, device="cuda:0").isfinite().all()  # the device's RNG was never left capturing


_SLOW_CONSUMER = r"""
import json, random, sys, torch
from blockflow.tensormq.cuda_ipc import CudaMapper
from blockflow.tensormq.wire import TensorDesc
random.seed(int(sys.argv[2]))
torch.cuda.set_device(0)
mapper = CudaMapper(sys.argv[1])
print(json.dumps({"ready": True}), flush=True)
bad, n = [], 0
for line in sys.stdin:
    m = json.loads(line)
    if m.get("end"):
        break
    t, lease = mapper.open(TensorDesc.parse(m["x"]))
    if random.random() < 0.5:  # the consumer's GPU is late: the read is queued behind a spin
        torch.cuda._sleep(random.randrange(1, 200_000))
    ok = bool((t == m["v"]).all().item())
    lease.release()  # waits for the stream: the producer may overwrite the slot after this
    n += 1
    if not ok:
        bad.append(m["seq"])
print(json.dumps({"n": n, "bad": bad[:10]}), flush=True)
mapper.close()
"""


@CUDA
@needs_gpu
@pytest.mark.parametrize("mode", ["event", "sync"])
def test_stream_ordered_hand_overs_under_random_gpu_delays_are_exact(tmp_path, monkeypatch, mode):
    """The producer sends each handle before its (delayed) copy ran on the GPU; the consumer's
    read is delayed at random too; a window of 2 slots makes every slot come back many times.
    Every one of 3000 requests must read exactly its own value."""
    import random
    from blockflow.tensormq.cuda_ipc import CudaSlotPool
    from blockflow.core import settings
    monkeypatch.setattr(settings, "CUDA_HANDOVER", mode)
    shm = str(tmp_path)
    torch.cuda.set_device(0)
    pool = CudaSlotPool(shm, "prod", window=2, device="cuda:0")
    p = subprocess.Popen([sys.executable, "-c", _SLOW_CONSUMER, shm, "7"], cwd=ROOT, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert json.loads(p.stdout.readline()) == {"ready": True}
        rnd, n = random.Random(3), 3000
        src = torch.empty(1, 64, 56, 56, device="cuda:0")
        for i in range(n):
            v = float(i % 1000)
            if rnd.random() < 0.5:  # the producer's GPU is late: the copy runs after a spin
                torch.cuda._sleep(rnd.randrange(1, 200_000))
            src.fill_(v)
            desc = pool.put("e", src, timeout=60)
            p.stdin.write(json.dumps({"seq": i, "v": v, "x": desc.to_json()}) + "\n")
            p.stdin.flush()
        p.stdin.write(json.dumps({"end": True}) + "\n")
        p.stdin.flush()
        line = p.stdout.readline()
        assert line, p.stderr.read()[-2000:]
        assert json.loads(line) == {"n": n, "bad": []}
        assert p.wait(60) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        pool.close()


@CUDA
@needs_gpu
def test_a_model_returning_a_view_of_its_input_keeps_it_and_gets_no_graph():
    """An identity or reshaping block forwards its input's handle; a graph would turn that
    into a copy out of its static input, so such a shape runs eager, its output a view."""
    class Flat(torch.nn.Module):
        def forward(self, x):
            return x.flatten(1)

    runner = BlockRunner(torch.jit.script(Flat()).eval(), "cuda:0", "flat")
    with torch.inference_mode():
        x = torch.randn(2, 3, 4, device="cuda:0")
        for _ in range(2):
            y = runner(x)
            assert y.data_ptr() == x.data_ptr() and y.shape == (2, 12)
    st = runner.stats()
    assert st["graphs"] == [] and st["views"] == [["float32", [2, 3, 4]]] and not st["refused"], st


class _MaskedBlock(torch.nn.Module):
    """A transformer's middle block as blockflow export writes it: takes the attention mask and
    the hidden states, hands the mask on as it came and computes new hidden states."""

    def __init__(self, hidden: int = 32):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)

    def forward(self, mask: torch.Tensor, h: torch.Tensor):
        scores = (h @ h.transpose(1, 2)).masked_fill(~mask[:, 0], -1e4).softmax(-1)
        return mask, self.proj(scores @ h) + h


@CUDA
@needs_gpu
def test_a_block_that_takes_several_tensors_replays_a_graph_per_bucket_and_hands_its_mask_on():
    """Issue 43: BERT's blocks take a bundle (mask, hidden states); each declared bucket of the
    sequence length gets its graph, answers equal eager, and the member handed on unchanged is
    the request's own tensor (it goes on by the handle it came with), not a static copy."""
    torch.manual_seed(0)
    model = torch.jit.script(_MaskedBlock().cuda().eval())
    runner = BlockRunner(model, "cuda:0", "mid")
    shapes = [[[1, 1, s, s], [1, s, 32]] for s in (8, 32)]
    assert runner.warm_up(shapes, [torch.bool, torch.float32]) == 2
    with torch.inference_mode():
        for s in (8, 32, 8, 17):  # 17 is no bucket: captured too, while there is room
            mask = torch.rand(1, 1, s, s, device="cuda:0") > 0.2
            h = torch.randn(1, s, 32, device="cuda:0")
            want = model(mask, h)
            got = runner((mask, h))
            assert got[0] is mask, "the mask goes on as it came"
            _assert_same(got[1].clone(), want[1], f"S = {s}")
        torch.cuda.synchronize()
    st = runner.stats()
    assert [m[0][1] for m in st["graphs"]] == [[1, 1, 8, 8], [1, 1, 32, 32], [1, 1, 17, 17]], st
    assert st["eager_calls"] == 0 and not st["refused"] and not st["views"], st
    runner.drop_graphs()  # parked and restored (blocks/cache.py): the same bundle graphs again
    runner.recapture()
    assert len(runner.stats()["graphs"]) == 3
