"""A TensorMQ slot file's size and name (tensormq/sizing.py): what the manager reckons without
torch (manager/state.py: slot_budget, remove_slots_of, sweep_orphans) is what a pool makes."""
import os

import pytest
import torch

from blockflow.tensormq.shm import SlotPool
from blockflow.tensormq.sizing import slot_name, slot_pid, window_bytes


def test_a_slot_name_gives_back_its_process():
    assert slot_pid(slot_name("b1", 4242, "7")) == 4242
    assert slot_pid(slot_name("b1.r2", 4242, "cuda1-3")) == 4242  # a replica's owner, a GPU pool's sequence
    for other in ("b1", "b1.owner", "b1.x.7", "lock", ""):
        assert slot_pid(other) is None


def test_the_files_a_pool_makes_are_what_the_manager_reckons(shm_dir):
    pool = SlotPool(shm_dir, "prod.r1", window=3)
    try:
        x = torch.zeros(1000, dtype=torch.float32)
        for _ in range(3):  # the edge's whole window, every slot held
            pool.put("edge", x, timeout=1)
        names = os.listdir(shm_dir)
        assert len(names) == 3 and {slot_pid(n) for n in names} == {os.getpid()}
        on_disk = sum(os.stat(os.path.join(shm_dir, n)).st_size for n in names)
        assert on_disk == window_bytes(x.numel() * x.element_size(), 3)
    finally:
        pool.close()


def test_a_window_of_large_slots_is_made_up_to_its_budget_then_as_traffic_needs_it(shm_dir, monkeypatch):
    """Note [A window made at once, up to a budget]: an edge's first use makes as much of its
    window as fits in BLOCKFLOW_WINDOW_UPFRONT (the whole window where it fits); an acquire that
    finds every slot in flight makes one more, and a lend makes as many as the model needs;
    never more than the window."""
    from blockflow.core import settings
    from blockflow.tensormq.sizing import HEADER, round_capacity
    x = torch.zeros(64 * 1024, dtype=torch.float32)  # 256 KiB: slots of 256 KiB
    cap = round_capacity(x.numel() * x.element_size())
    monkeypatch.setattr(settings, "WINDOW_UPFRONT_BYTES", 3 * cap)
    pool = SlotPool(shm_dir, "prod", window=5)
    try:
        assert pool.prepare("big", x.numel() * x.element_size()) == 3  # 3 of 5 made at first use
        assert len(os.listdir(shm_dir)) == 3
        for _ in range(3):
            pool.put("big", x, timeout=1)  # every slot in flight
        pool.put("big", x, timeout=1)  # one more is made for it
        assert len(pool.edges["big"]) == 4
        lent = pool.lend("lent", x.numel() * x.element_size(), count=2)  # a new edge: 3 made, 2 lent
        assert len(lent) == 2 and len(pool.edges["lent"]) == 3
        pool.put("big", x, timeout=1)
        assert len(pool.edges["big"]) == 5
        with pytest.raises(TimeoutError):  # the window is whole and in flight: back-pressure as before
            pool.put("big", x, timeout=0.05)
        assert len(pool.edges["big"]) == 5
        on_disk = sum(os.stat(os.path.join(shm_dir, n)).st_size for n in os.listdir(shm_dir))
        assert on_disk == 8 * (HEADER + cap)
        # a small tensor's whole window still comes at once
        assert pool.prepare("small", 1024) == 5
    finally:
        pool.close()
