"""The block cache without processes (blocks/cache.py): real modules' weights parked to a file and
back, the policies' order, and the rules a swap keeps under threads (never a pinned block, never
one with a request in flight, one swap at a time)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from blockflow.blocks.cache import (BlockCache, CacheWaitTimeout, Entry, LruPolicy, Residency, SharingLruPolicy,
                                    Weights)

MB = 2**20


def _module(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.jit.script(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.BatchNorm1d(256)).eval())


def _cache(tmp_path, n: int, room: int, policy=None, pinned=()) -> tuple[BlockCache, dict]:
    """``n`` blocks of one real module each; the budget holds ``room`` of them."""
    blocks = {}
    for i in range(n):
        m = _module(i)
        w = Weights(m, torch.device("cpu"), str(tmp_path / f"b{i}.parked"))
        blocks[f"b{i}"] = (m, Entry(f"b{i}", w, w.nbytes, f"b{i}" in pinned))
    size = next(iter(blocks.values()))[1].nbytes
    cache = BlockCache(room * size + size // 2, policy)
    for _m, e in blocks.values():
        cache.add(e)
    return cache, blocks


def _resident(cache) -> set[str]:
    return {n for n, e in cache.entries.items() if e.state is Residency.RESIDENT}


def test_parked_weights_come_back_bit_for_bit_and_a_parked_model_refuses_to_run(tmp_path):
    m = _module(3)
    x = torch.randn(4, 256)
    with torch.inference_mode():
        want = m(x)
    w = Weights(m, torch.device("cpu"), str(tmp_path / "m.parked"))
    assert w.nbytes == (256 * 256 + 256) * 4 + 4 * 256 * 4 + 8  # weights, bias, BN's four vectors and its count
    w.park()
    assert all(t.numel() == 0 for t in w.tensors)
    with pytest.raises(Exception), torch.inference_mode():
        m(x)  # a parked model fails, it never reads freed memory
    w.restore()
    with torch.inference_mode():
        assert torch.equal(m(x), want)
    w.park()  # the warm copy is written once; later parks reuse it
    w.restore()
    with torch.inference_mode():
        assert torch.equal(m(x), want)
    w.remove()
    assert not (tmp_path / "m.parked").exists()


def test_blocks_that_do_not_fit_start_parked_and_a_request_swaps_one_in(tmp_path):
    cache, blocks = _cache(tmp_path, 4, room=2)
    assert _resident(cache) == {"b0", "b1"}
    assert cache.used() <= cache.budget
    ms = cache.acquire("b3", timeout=5)
    assert ms > 0 and "b3" in _resident(cache) and len(_resident(cache)) == 2
    cache.release("b3")
    assert cache.acquire("b3", timeout=5) == 0.0  # a hit
    cache.release("b3")
    e = cache.entries["b3"]
    assert (e.hits, e.misses, sum(e.swap_counts)) == (1, 1, 1)
    assert sum(x.evictions for x in cache.entries.values()) == 1


@pytest.mark.parametrize("policy, evicted", [(LruPolicy(), "s"), (SharingLruPolicy(), "a")])
def test_the_policy_decides_who_goes(tmp_path, policy, evicted):
    """s is on two tasks' paths, a, c, d on one each; room for three. After s, a, c were used in
    that order, d needs room: plain LRU parks s (used longest ago), the sharing policy a."""
    cache, _ = _cache(tmp_path, 4, room=3, policy=policy)
    names = {"b0": "s", "b1": "a", "b2": "c", "b3": "d"}
    cache.set_tasks("b0", 2)
    for b in ("b1", "b2"):
        cache.set_tasks(b, 1)
    for b in ("b0", "b1", "b2"):  # b3 started parked
        cache.acquire(b, timeout=5)
        cache.release(b)
        time.sleep(0.002)  # distinct last-use times on a coarse clock
    cache.acquire("b3", timeout=5)
    cache.release("b3")
    parked = {names[n] for n, e in cache.entries.items() if e.state is Residency.PARKED}
    assert parked == {evicted}, parked


def test_a_block_in_flight_or_pinned_is_never_evicted(tmp_path):
    cache, _ = _cache(tmp_path, 3, room=2, pinned=("b0",))
    assert _resident(cache) == {"b0", "b1"}
    cache.acquire("b1", timeout=5)  # b1 has a request in flight; b0 is pinned: nothing can make room
    with pytest.raises(CacheWaitTimeout) as e:
        cache.acquire("b2", timeout=0.3)
    assert "b1" in str(e.value) and "memory_budget_mb" in str(e.value)
    got = {}

    def want_b2():
        got["ms"] = cache.acquire("b2", timeout=10)

    t = threading.Thread(target=want_b2)
    t.start()
    t.join(0.3)
    assert t.is_alive() and cache.entries["b1"].state is Residency.RESIDENT  # it waits for b1's request
    cache.release("b1")
    t.join(10)
    assert got["ms"] > 0 and _resident(cache) == {"b0", "b2"}
    assert cache.entries["b0"].evictions == 0


def test_many_threads_never_run_a_parked_block_and_stay_within_the_budget(tmp_path):
    cache, blocks = _cache(tmp_path, 5, room=2)
    x = torch.randn(2, 256)
    with torch.inference_mode():
        want = {}
        for n, (m, e) in blocks.items():
            cache.acquire(n, timeout=10)
            want[n] = m(x)
            cache.release(n)
    errors, over = [], []

    def worker(seed):
        rng = torch.Generator().manual_seed(seed)
        for _ in range(40):
            n = f"b{int(torch.randint(0, 5, (1,), generator=rng))}"
            cache.acquire(n, timeout=30)
            try:
                if cache.used() > cache.budget:
                    over.append(cache.used())
                with torch.inference_mode():
                    if not torch.equal(blocks[n][0](x), want[n]):
                        errors.append(n)
            except Exception as exc:  # a parked model's weights are empty: it raises
                errors.append(f"{n}: {exc}")
            finally:
                cache.release(n)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not over, (errors[:3], over[:3])
    assert sum(e.misses for _m, e in blocks.values()) > 0


def test_two_groups_on_one_device_swap_one_at_a_time(tmp_path):
    """The device lock (a flock in the server's socket directory) serialises swaps across the
    shared processes of a device: while one holds it, another's miss waits, its hits do not."""
    from blockflow.blocks.cache import DeviceLock
    cache, _ = _cache(tmp_path, 3, room=2)
    cache.device_lock = DeviceLock(str(tmp_path / "swap-cpu.lock"))
    other = DeviceLock(str(tmp_path / "swap-cpu.lock"))  # another group's, its own descriptor
    got = {}
    with other:
        assert cache.acquire("b0", timeout=5) == 0.0  # a hit takes no lock
        cache.release("b0")
        t = threading.Thread(target=lambda: got.setdefault("ms", cache.acquire("b2", timeout=10)))
        t.start()
        t.join(0.3)
        assert t.is_alive() and cache.entries["b2"].state is Residency.PARKED
    t.join(10)
    assert got["ms"] > 0 and cache.entries["b2"].state is Residency.RESIDENT
