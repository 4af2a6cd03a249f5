"""Note [Outputs made in a slot] (tensormq/outalloc.py): a model's output allocated in a lent
TensorMQ slot travels without a copy; nothing else is ever given a slot, and a slot that a
tensor still holds is never written again."""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading

import pytest
import torch

from blockflow.tensormq import outalloc
from blockflow.tensormq.shm import FREE, IN_FLIGHT, SlotMapper, SlotPool
from blockflow.tensormq.wire import TensorDesc

EDGE = "ipc:///nonexistent/next.sock"


@pytest.fixture(scope="module")
def lender():
    mod = outalloc.load()
    if mod is None:
        if shutil.which(os.environ.get("CXX", "c++")) and shutil.which("ninja"):
            pytest.fail(f"a C++ compiler and ninja are here but the extension does not load: {outalloc.why_not()} "
                        "(`make install` builds it with `blockflow build-ext`)")
        pytest.skip(f"no C++ toolchain to build the extension: {outalloc.why_not()}")
    return mod


@pytest.fixture
def shm_dir():
    d = tempfile.mkdtemp(prefix="bftest-outalloc-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    yield d
    shutil.rmtree(d, ignore_errors=True)


class AddOne(torch.nn.Module):
    def forward(self, x):
        return x + 1


class KeepsTwice(torch.nn.Module):
    """Keeps an intermediate of the output's size in its state: it is made first, so it is
    what takes the lent slot."""

    def __init__(self):
        super().__init__()
        self.kept = torch.zeros(1)

    def forward(self, x):
        self.kept = x * 2
        return x + 1


def run_lent(lender, pool, model, x, count=1):
    """What a block does: lend slots, arm them for the output's size, run the model, disarm."""
    nbytes = x.numel() * x.element_size()
    lent = pool.lend(EDGE, nbytes, count)
    assert len(lent) == count and all(s.state == FREE for s in lent)
    lender.arm([s.data.data_ptr() for s in lent], [s.capacity for s in lent], nbytes)
    try:
        with torch.inference_mode():
            y = model(x)
    finally:
        held = lender.disarm()
    return lent, y, held


def test_an_output_made_in_a_lent_slot_travels_without_a_copy(lender, shm_dir):
    pool, mapper = SlotPool(shm_dir, "prod", window=2), SlotMapper(shm_dir)
    try:
        x = torch.randn(4, 256, 7, 7)
        (slot,), y, held = run_lent(lender, pool, torch.jit.script(AddOne()), x)
        base = slot.data.data_ptr()
        assert held == 1 and y.data_ptr() == base  # the model's own output lives in the slot
        desc = pool.adopt([slot], y)
        assert desc is not None and desc.fields["seg"] == slot.name
        assert slot.state == IN_FLIGHT and pool.in_flight(EDGE) == 1
        got, lease = mapper.open(TensorDesc.parse(desc.to_json()))
        assert torch.equal(got, x + 1)
        lease.release()
        assert slot.state == FREE
        del y, got
        assert not lender.held(base)  # the storage is gone: the slot may be lent or filled again
        (again,), y2, _ = run_lent(lender, pool, torch.jit.script(AddOne()), x)
        assert again is slot and y2.data_ptr() == base
    finally:
        mapper.close()
        pool.close()
    assert os.listdir(shm_dir) == []


def test_only_the_armed_thread_and_size_are_given_the_slot(lender, shm_dir):
    pool = SlotPool(shm_dir, "prod", window=1)
    try:
        nbytes = 64 * 1024
        (slot,) = pool.lend(EDGE, nbytes, 1)
        base = slot.data.data_ptr()
        lender.arm([base], [slot.capacity], nbytes)
        try:
            other_size = torch.empty(nbytes // 4 + 16, dtype=torch.float32)
            from_thread = []
            t = threading.Thread(target=lambda: from_thread.append(torch.empty(nbytes, dtype=torch.uint8)))
            t.start()
            t.join()
            taken = torch.empty(nbytes, dtype=torch.uint8)
            second = torch.empty(nbytes, dtype=torch.uint8)  # the region is held: one storage at a time
        finally:
            assert lender.disarm() == 1
        assert other_size.data_ptr() != base and from_thread[0].data_ptr() != base and second.data_ptr() != base
        assert taken.data_ptr() == base
        del taken
        assert not lender.held(base)
        after = torch.empty(nbytes, dtype=torch.uint8)  # disarmed: the heap again
        assert after.data_ptr() != base
    finally:
        pool.close()


def test_the_output_lands_in_the_last_free_region_of_several(lender, shm_dir):
    """Tensors of the output's size made one after the other (an intermediate first, kept
    alive until the output exists) take one region each; the output is adopted from its own."""
    class TwoStep(torch.nn.Module):
        def forward(self, x):
            a = x * 2
            b = a + x  # made while `a` is alive: the second region
            return b + 0  # made while `b` is alive: `a` is dead by now, so the first region again

    pool = SlotPool(shm_dir, "prod", window=3)
    try:
        x = torch.randn(16, 32)
        lent, y, held = run_lent(lender, pool, torch.jit.script(TwoStep()), x, count=2)
        assert held == 1  # the intermediates are gone; only the output holds a region
        desc = pool.adopt(lent, y)
        assert desc is not None and torch.equal(y, x * 3)
        assert [s.state for s in lent].count(IN_FLIGHT) == 1
    finally:
        pool.close()


def test_a_slot_the_model_keeps_is_retired_not_overwritten(lender, shm_dir, caplog):
    pool = SlotPool(shm_dir, "prod", window=2)
    model = torch.jit.script(KeepsTwice())
    x = torch.randn(8, 64)
    (slot,), y, held = run_lent(lender, pool, model, x)
    assert held == 1 and model.kept.data_ptr() == slot.data.data_ptr()  # the kept intermediate took it
    assert pool.adopt([slot], y) is None  # the output lives elsewhere: it is copied as before
    with caplog.at_level(logging.WARNING, logger="blockflow.tensormq.shm"):
        desc = pool.put(EDGE, y, timeout=1)
    assert desc.fields["seg"] != slot.name and slot in pool.retired
    assert "retired" in caplog.text
    mapper = SlotMapper(shm_dir)
    for i in range(4):  # later outputs never land in the retired slot
        d = desc if i == 0 else pool.put(EDGE, y + i, timeout=1)
        assert d.fields["seg"] != slot.name
        mapper.open(TensorDesc.parse(d.to_json()))[1].release()  # as the consumer does
    assert torch.equal(model.kept, x * 2)
    mapper.close()
    pool.close()
    assert not os.path.exists(slot.path)  # the file goes; the mapping stays while the tensor lives
    assert torch.equal(model.kept, x * 2)
