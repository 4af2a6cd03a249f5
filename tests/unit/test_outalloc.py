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
        takes = lender.disarm()
    return lent, y, takes


def test_an_output_made_in_a_lent_slot_travels_without_a_copy(lender, shm_dir):
    pool, mapper = SlotPool(shm_dir, "prod", window=2), SlotMapper(shm_dir)
    try:
        x = torch.randn(4, 256, 7, 7)
        (slot,), y, takes = run_lent(lender, pool, torch.jit.script(AddOne()), x)
        base = slot.data.data_ptr()
        assert takes == 1 and y.data_ptr() == base and lender.held(base)  # the model's own output lives in the slot
        assert SlotPool.holder([slot], y) == 0 and SlotPool.holder([slot], x) == -1
        desc = pool.adopt(slot, y)
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
            assert lender.disarm() == 1  # one allocation was given the region
        assert other_size.data_ptr() != base and from_thread[0].data_ptr() != base and second.data_ptr() != base
        assert taken.data_ptr() == base
        del taken
        assert not lender.held(base)
        after = torch.empty(nbytes, dtype=torch.uint8)  # disarmed: the heap again
        assert after.data_ptr() != base
    finally:
        pool.close()


def test_with_enough_lent_slots_the_output_lands_in_the_last_one(lender, shm_dir):
    """Tensors of the output's size that are alive together take one region each, in order:
    with too few regions the output is made on the heap (and every region was taken, which is
    how a block learns to lend one more); with enough, it is made in the last one."""
    class ThreeAlive(torch.nn.Module):
        def forward(self, x):
            a = x * 2
            b = a + x
            return b - a  # made while a and b are alive

    model = torch.jit.script(ThreeAlive())
    pool = SlotPool(shm_dir, "prod", window=4)
    try:
        x = torch.randn(16, 32)
        lent, y, takes = run_lent(lender, pool, model, x, count=2)
        assert takes == 2 and SlotPool.holder(lent, y) == -1 and torch.allclose(y, x)
        del y
        lent, y, takes = run_lent(lender, pool, model, x, count=3)
        assert takes == 3 and SlotPool.holder(lent, y) == 2 and torch.allclose(y, x)
        assert not any(lender.held(s.data.data_ptr()) for s in lent[:2])  # a and b are gone
        assert pool.adopt(lent[2], y) is not None
        assert [s.state for s in lent] == [FREE, FREE, IN_FLIGHT]
    finally:
        pool.close()


def test_a_slot_the_model_keeps_is_retired_not_overwritten(lender, shm_dir, caplog):
    pool = SlotPool(shm_dir, "prod", window=2)
    model = torch.jit.script(KeepsTwice())
    x = torch.randn(8, 64)
    (slot,), y, takes = run_lent(lender, pool, model, x)
    assert takes == 1 and model.kept.data_ptr() == slot.data.data_ptr()  # the kept intermediate took it
    assert SlotPool.holder([slot], y) == -1  # the output lives elsewhere: it is copied as before
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


@pytest.mark.parametrize("plant", ["writable", "link"])
def test_a_library_others_could_have_written_is_never_loaded(lender, tmp_path, monkeypatch, plant):
    """The library is code every block runs: one in a directory or file that another user could
    have written, or behind a symbolic link, is refused with the reason (blocks then copy)."""
    real = outalloc.built()
    assert real is not None
    ext = tmp_path / "ext"
    ext.mkdir(mode=0o700)
    monkeypatch.setattr(outalloc.settings, "EXT_DIR", str(ext))
    target = outalloc.build_dir(str(ext))
    os.mkdir(target, 0o700)
    planted = os.path.join(target, os.path.basename(real))
    if plant == "writable":
        shutil.copy(real, planted)
        os.chmod(planted, 0o666)
        reason = "can be written by other users"
    else:
        os.symlink(real, planted)
        reason = "symbolic link"
    assert outalloc.built() is None
    assert reason in outalloc.why_not() and planted in outalloc.why_not()
    os.chmod(target, 0o777)
    assert outalloc.built() is None and target in outalloc.why_not()


def test_a_larger_size_grows_only_the_slots_it_is_short_of(shm_dir):
    """After a new, larger output size, lending takes the slots already grown for it before it
    grows another one: a new batch size reaches its steady state after one request instead of
    growing one more slot (a fresh file whose pages the model faults in) every request."""
    pool = SlotPool(shm_dir, "prod", window=4)
    try:
        small, large = 16 * 1024, 1024 * 1024
        assert len(pool.lend(EDGE, small, 1)) == 1  # the edge's first use: four small slots
        assert len(pool.edges[EDGE]) == 4
        first = pool.lend(EDGE, large, 3)
        assert len(first) == 3 and all(s.capacity >= large for s in first)
        names = {s.name for s in pool.edges[EDGE]}
        again = pool.lend(EDGE, large, 3)
        assert {s.name for s in again} == {s.name for s in first}
        assert {s.name for s in pool.edges[EDGE]} == names  # nothing grown, the small slot kept
        assert sum(s.capacity < large for s in pool.edges[EDGE]) == 1
    finally:
        pool.close()
    assert os.listdir(shm_dir) == []
