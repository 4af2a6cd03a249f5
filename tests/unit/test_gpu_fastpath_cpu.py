"""The GPU fast path (issue 27) on any machine: the runner on a CPU (what a block calls, what it
warms up), the update fields that steer it, the share record that carries a slot's event. What
needs a GPU is tests/cuda/test_gpu_fastpath.py.
"""
from __future__ import annotations

import pytest
import torch

from blockflow.core.schema import BatchPolicy
from blockflow.blocks.runner import BlockRunner, warm_calls, warmup_shapes
from blockflow.core.schema import UpdateError, validate_update


# -- on any machine ---------------------------------------------------------------------------------

def test_the_cuda_context_is_left_alone_on_a_cpu():
    from blockflow.blocks.runner import trim_cuda_context
    assert trim_cuda_context(torch.device("cpu")) == {"stack_bytes": "driver default"}
    assert trim_cuda_context(torch.device("cpu"), 256) == {"stack_bytes": "driver default"}


class _Pair(torch.nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + 2 * b


def test_a_torchscript_block_is_called_at_its_compiled_forward():
    """Note [The model's own forward]: a TorchScript model's ``forward`` is called directly (one
    tensor or a bundle's members), with the same answers; any other module is called whole, so
    its hooks still run."""
    scripted = torch.jit.script(_Pair())
    r = BlockRunner(scripted, "cpu", "b")
    assert r.forward is not scripted and r.forward.name == "forward"
    a, b = torch.arange(4.0), torch.ones(4)
    assert torch.equal(r((a, b)), scripted(a, b))
    assert torch.equal(r({"a": a, "b": b}), a + 2 * b)
    seen = []
    plain = torch.nn.Linear(4, 2)
    plain.register_forward_hook(lambda mod, inp, out: seen.append(out.shape))
    r = BlockRunner(plain, "cpu", "b")
    assert r.forward is plain
    r(torch.zeros(3, 4))
    assert seen == [torch.Size([3, 2])]


def test_a_cpu_runner_calls_the_model_and_warms_up_each_shape():
    calls = []

    def model(x):
        calls.append(tuple(x.shape))
        return x * 2

    r = BlockRunner(model, "cpu", "b", cuda_graphs=True)
    assert r.graphs is None and r.clock is None and not r.stream_ordered
    assert r.stats() == {"cuda_graphs": False}
    x = torch.arange(6.0).view(2, 3)
    assert torch.equal(r(x), x * 2)
    assert r.to_device(x) is x
    r.mark("ready")  # a no-op on a CPU
    assert r.warm_up([[1, 3], [4, 3]]) == 2
    # each shape as often as TorchScript's profiling executor needs (Note [Ready to serve])
    assert calls == [(2, 3)] + [(1, 3)] * warm_calls() + [(4, 3)] * warm_calls()


def test_blocks_sharing_a_process_warm_up_one_at_a_time():
    """Note [One block sets up CUDA at a time]: warm-ups started together on the threads of one
    process (a group's blocks) run one after the other; each still runs all its shapes."""
    import threading
    import time
    inside, most, lock = [0], [0], threading.Lock()

    def model(x):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.01)  # long enough that unserialised warm-ups would overlap
        with lock:
            inside[0] -= 1
        return x + 1

    runners = [BlockRunner(model, "cpu", f"b{i}") for i in range(4)]
    done = []
    threads = [threading.Thread(target=lambda r=r: done.append(r.warm_up([[1, 4], [2, 4], [3, 4]])))
               for r in runners]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert done == [3, 3, 3, 3] and most[0] == 1, (done, most)


def test_warmup_shapes_come_from_the_update_else_the_manifest_and_cover_batch_sizes():
    assert warmup_shapes([1, 3, 224, 224], None, None) == [[1, 3, 224, 224]]
    assert warmup_shapes([1, 3, 224, 224], [[1, 3, 64, 64]], None) == [[1, 3, 64, 64]]
    assert warmup_shapes(None, None, None) == []
    small = BatchPolicy.parse({"max_batch": 4, "max_queue_delay_us": 100})
    assert warmup_shapes([1, 8], None, small) == [[1, 8], [2, 8], [3, 8], [4, 8]]
    big = BatchPolicy.parse({"max_batch": 64, "max_queue_delay_us": 100, "preferred": [16, 32]})
    assert warmup_shapes([1, 8], None, big) == [[1, 8], [16, 8], [32, 8], [64, 8]]


def _update(**fields):
    return {"blocks": [{"name": "b", "model": "resnet18/block1.pt", "device": "cuda", **fields}],
            "tasks": [{"id": "t", "path": ["b"]}]}


def test_update_fields_cuda_graphs_and_warmup_shapes():
    decl = validate_update(_update(), gpus=1).blocks["b"]
    assert decl.cuda_graphs is True and decl.warmup_shapes is None
    decl = validate_update(_update(cuda_graphs=False, warmup_shapes=[[1, 3, 224, 224], [8, 3, 224, 224]]),
                           gpus=1).blocks["b"]
    assert decl.cuda_graphs is False and decl.warmup_shapes == ((1, 3, 224, 224), (8, 3, 224, 224))
    assert decl.as_dict()["warmup_shapes"] == [[1, 3, 224, 224], [8, 3, 224, 224]]
    for bad, field in (({"cuda_graphs": "yes"}, "cuda_graphs"), ({"warmup_shapes": [[0, 3]]}, "warmup_shapes"),
                       ({"warmup_shapes": [[1] * 9]}, "warmup_shapes"), ({"warmup_shapes": [1, 3]}, "warmup_shapes"),
                       ({"warmup_shapes": [[1, 3]] * 17}, "warmup_shapes")):
        with pytest.raises(UpdateError) as err:
            validate_update(_update(**bad), gpus=1)
        assert err.value.field == f"blocks[0].{field}", err.value


def test_the_share_record_carries_the_slots_event_and_refuses_a_forged_one():
    from blockflow.tensormq.cuda_ipc import RECORD_BYTES, ShareRecord
    from blockflow.tensormq.wire import WireError
    handle = bytes([2, ord("c")]) + bytes(64)
    rec = ShareRecord(0, handle, 1 << 20, 0, b"/torch_1_2", 3, event=bytes(range(64)))
    raw = rec.pack()
    assert len(raw) == RECORD_BYTES and ShareRecord.unpack(raw, "s") == rec
    forged = bytearray(raw)
    forged[56:64] = (63).to_bytes(8, "little")  # an event handle that is not a cudaIpcEventHandle_t
    with pytest.raises(WireError, match="lengths"):
        ShareRecord.unpack(bytes(forged), "s")


def test_a_bundle_has_a_graph_key_of_every_member_and_a_zero_input_for_it():
    """What a GPU block captures a graph for (blocks/runner.py ``graph_key``), checked here on
    the CPU: a bundle's key names every member's dtype and shape and its dict keys, and the
    zero input a parked block recaptures on has that layout again."""
    from blockflow.blocks.runner import graph_key, key_json, key_text, zeros_for_key
    mask, h = torch.ones(1, 1, 8, 8, dtype=torch.bool), torch.zeros(1, 8, 32)
    assert graph_key(h) == (torch.float32, (1, 8, 32)) and key_json(graph_key(h)) == ["float32", [1, 8, 32]]
    key = graph_key((mask, h))
    assert key_json(key) == [["bool", [1, 1, 8, 8]], ["float32", [1, 8, 32]]]
    assert key_text(key) == "(bool [1, 1, 8, 8], float32 [1, 8, 32])"
    assert graph_key((mask, h)) == key != graph_key((mask, torch.zeros(1, 9, 32)))
    assert graph_key({"mask": mask, "h": h}) != key  # a dict's names are part of it
    again = zeros_for_key(key, "cpu")
    assert isinstance(again, tuple) and graph_key(again) == key
    named = zeros_for_key(graph_key({"mask": mask, "h": h}), "cpu")
    assert list(named) == ["mask", "h"] and named["mask"].dtype == torch.bool


def test_what_a_captured_model_hands_on_unchanged_is_told_from_other_views():
    """``_handed_on``: the members a bundle's model returns as they came replay as the request's
    own tensors; any other view of an input (or a tensor model returning its input) runs eager."""
    from blockflow.blocks.runner import _handed_on
    mask, h = torch.ones(1, 1, 4, 4, dtype=torch.bool), torch.randn(1, 4, 8)
    assert _handed_on((mask, h), (mask, h * 2)) == [(0, 0)]
    assert _handed_on((mask, h), {"h": h + 1, "m": mask}) == [(1, 0)]
    assert _handed_on((mask, h), (h * 2, h.sum(-1))) == []
    assert _handed_on((mask, h), (mask[:, :, :2], h * 2)) is None  # a slice of an input
    assert _handed_on(h, h) is None and _handed_on(h, h.flatten(1)) is None
    assert _handed_on(h, h * 2) == []
