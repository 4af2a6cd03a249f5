"""A TensorMQ slot file's size and name (tensormq/sizing.py): what the manager reckons without
torch (manager/state.py: slot_budget, remove_slots_of, sweep_orphans) is what a pool makes."""
import os

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
