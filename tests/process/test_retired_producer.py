"""What a consumer keeps of a producer that an update retired (found by the soak's per-process
RSS split, README "Nothing leaks"): its mappings of the producer's slot files, unlinked when the
producer exited, stayed open until the consumer's mapper evicted them (an LRU of 256 in
tensormq/shm.py), and with them the pages the consumer read. A block now closes them within
SWEEP_INTERVAL (blocks/process.py, SlotMapper.forget_unlinked)."""
from __future__ import annotations

import pytest
import torch

from blockflow.client import Client
from conftest import gone, wait_for


class _Copy(torch.nn.Module):
    """A new output tensor: the next block reads it from this block's slot."""

    def forward(self, x):
        return x * 1.0


def _deleted_slot_mappings(pid: int) -> list[str]:
    with open(f"/proc/{pid}/maps") as f:
        return [line for line in f if "(deleted)" in line and "blockflow" in line]


def _lets_go(pid: int, who: str) -> None:
    """A consumer may take a moment to notice: poll, then say what it still maps of p."""
    try:
        wait_for(lambda: not _deleted_slot_mappings(pid), 15, f"{who} drops its mappings of p's unlinked slots")
    except AssertionError:
        raise AssertionError(f"{who} still maps {len(_deleted_slot_mappings(pid))} unlinked slot file(s) of the "
                             f"retired p: {_deleted_slot_mappings(pid)[:2]}") from None


@pytest.fixture
def copy_repo(tmp_path):
    (tmp_path / "toy").mkdir()
    torch.jit.save(torch.jit.script(_Copy()), str(tmp_path / "toy" / "copy.pt"))
    return str(tmp_path)


def _update(srv, middle: str) -> None:
    srv.call("POST", "/system/update", {
        "transport": "tensormq",
        "blocks": [{"name": n, "model": "toy/copy.pt", "threads": 1} for n in ("a", middle, "h")],
        "tasks": [{"id": "t", "path": ["a", middle, "h"]}]}, timeout=60)


def test_a_consumer_lets_go_of_a_retired_producers_slots(server_factory, copy_repo):
    srv = server_factory(copy_repo)
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    _update(srv, "p")
    with Client(srv.dispatcher, timeout=30) as c:
        for _ in range(3):
            assert torch.equal(c.infer("t", x), x)
        old = {b["name"]: b["pid"] for b in srv.call("GET", "/system")["blocks"]}
        _update(srv, "q")  # p is retired: drained, stopped, its slot files unlinked
        wait_for(lambda: gone(old["p"]), 30, "the retired block p exits")
        h = {b["name"]: b["pid"] for b in srv.call("GET", "/system")["blocks"]}["h"]
        assert h == old["h"], "h must be the same process across the update"
        for _ in range(3):
            assert torch.equal(c.infer("t", x), x)
    _lets_go(h, "h")


def test_the_dispatcher_lets_go_of_a_retired_last_blocks_slots(server_factory, copy_repo):
    """The same for the dispatcher, which reads the last block's outputs from its slots."""
    srv = server_factory(copy_repo)
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(1))

    def update(last: str) -> None:
        srv.call("POST", "/system/update", {
            "transport": "tensormq",
            "blocks": [{"name": n, "model": "toy/copy.pt", "threads": 1} for n in ("a", last)],
            "tasks": [{"id": "t", "path": ["a", last]}]}, timeout=60)

    update("p")
    dispatcher = srv.call("GET", "/system")["dispatcher"]["pid"]
    with Client(srv.dispatcher, timeout=30) as c:
        for _ in range(3):
            assert torch.equal(c.infer("t", x), x)
        p = {b["name"]: b["pid"] for b in srv.call("GET", "/system")["blocks"]}["p"]
        update("q")
        wait_for(lambda: gone(p), 30, "the retired last block p exits")
        assert srv.call("GET", "/system")["dispatcher"]["pid"] == dispatcher
        for _ in range(3):
            assert torch.equal(c.infer("t", x), x)
    _lets_go(dispatcher, "the dispatcher")
