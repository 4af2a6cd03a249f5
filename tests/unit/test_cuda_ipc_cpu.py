"""TensorMQ's CUDA path on any machine (issue 13): everything it decides before torch touches a
GPU (device spelling, which hop gets which kind of slot, checks of forged handles, slots given back
on error paths, NVML device mapping, the KPI's word on per-process VRAM), in this process.
What needs a GPU (two real processes on one GPU) is tests/cuda/test_cuda_ipc.py.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import pytest
import torch
import zmq

from blockflow.tensormq.shm import FREE, IN_FLIGHT, KIND_CUDA, Slot, SlotMapper, SlotPool
from blockflow.tensormq.transport import Transport
from blockflow.tensormq.wire import TensorDesc, WireError

MiB = 2 ** 20


# -- defect 1: 'cuda' means 'cuda:0', once, in the schema and in the device map ----------------
def test_schema_spells_cuda_as_cuda_0():
    from blockflow.core.schema import validate_update
    body = {"blocks": [{"name": "a", "model": "toy/identity.pt", "device": "cuda"},
                       {"name": "b", "model": "toy/identity.pt", "device": "cuda:01"},
                       {"name": "c", "model": "toy/identity.pt", "device": "cpu"}],
            "tasks": [{"id": "t", "path": ["a", "b", "c"]}]}
    upd = validate_update(body, gpus=2)
    assert [upd.blocks[n].device for n in "abc"] == ["cuda:0", "cuda:1", "cpu"]
    # so that an update that only re-spells a device changes nothing
    again = validate_update(dict(body, blocks=[dict(b, device=d) for b, d in
                                               zip(body["blocks"], ["cuda:0", "cuda:1", "cpu"])]),
                            gpus=2)
    assert again.blocks == upd.blocks


def test_device_map_is_spelled_one_way(shm_dir, ctx):
    t = Transport(ctx, "p", "tensormq", shm_dir)
    try:
        t.set_topology(["ipc:///x/a.sock", "ipc:///x/b.sock"], {"ipc:///x/a.sock": "cuda", "ipc:///x/b.sock": "cpu"})
        assert t.hop_device("ipc:///x/a.sock") == "cuda:0"
        assert t.hop_device("ipc:///x/b.sock") == "cpu"
        assert t.hop_device("ipc:///x/dispatcher-0.sock") == "cpu"  # a hop the map does not name
    finally:
        t.close()


# -- defect 2: a CPU tensor towards a GPU hop travels in shared memory --------------------------
def test_cpu_tensor_to_a_gpu_hop_takes_a_shared_memory_slot(shm_dir, ctx):
    """The dispatcher's case under ``blockflow serve``: its first block runs on a GPU. Before the
    fix this raised after the slot was marked in flight; now the consumer moves the tensor."""
    t = Transport(ctx, "disp", "tensormq", shm_dir, window=2, cuda_handles=False)
    mapper = SlotMapper(shm_dir)
    gpu_hop = "ipc:///nonexistent/b1.sock"
    try:
        t.set_topology([gpu_hop], {gpu_hop: "cuda"})
        for i in range(5):  # more than the window: every slot comes back
            x = torch.randn(1, 3, 8, 8)
            d, payload = t.encode(x, gpu_hop, timeout=0)
            assert payload is None and d["loc"] == "shm"
            assert t.in_flight() == 1
            y, lease = mapper.open(TensorDesc.parse(d))
            assert torch.equal(y, x)
            lease.release()
            assert t.in_flight() == 0, f"request {i} leaked its slot"
    finally:
        mapper.close()
        t.close()
    assert os.listdir(shm_dir) == []


def test_a_cpu_process_refuses_cuda_handles(shm_dir, ctx):
    t = Transport(ctx, "disp", "tensormq", shm_dir, cuda_handles=False)
    try:
        with pytest.raises(WireError, match="runs on the CPU"):
            t.decode({"dtype": "float32", "shape": [1], "stride": [1], "loc": "cuda", "seg": "s", "gen": 1,
                      "off": 0, "nbytes": 4}, [None])
    finally:
        t.close()


# -- hardening: what comes from the wire is checked before torch sees it -------------------------
def _handle(version=2, kind=b"c", n=64):
    return bytes([version]) + kind + bytes(range(n))


def test_forged_cuda_ipc_handles_are_refused_by_length_and_kind():
    from blockflow.tensormq.cuda_ipc import check_ipc_handle, check_ref_counter
    assert check_ipc_handle(_handle()) == _handle()
    for bad, word in [(_handle(n=63), "bytes"), (bytes(64), "bytes"), (b"", "bytes"), (_handle(n=65), "bytes"),
                      (_handle(kind=b"e"), "type 'e'"), (_handle(version=0), "version"), ("c" * 66, "bytes")]:
        with pytest.raises(WireError, match=word):
            check_ipc_handle(bad)
    check_ref_counter(b"/torch_1234_987654321", 9999)
    check_ref_counter(b"/torch_598_3352458246_0", 0)  # torch 2.11 numbers its counter files
    for name, off in [(b"/dev/shm/blockflow-x/slot", 0), (b"/torch_1_2/../../etc/passwd", 0), (b"torch_1_2", 0),
                      (b"/torch_1_2_3_4", 0), (b"/torch_1_2_", 0),
                      (b"/torch_1_2", -1), (b"/torch_1_2", 10000), (b"/torch_1_2", True), ("/torch_1_2", 0)]:
        with pytest.raises(WireError):
            check_ref_counter(name, off)


def test_share_record_roundtrip_and_forged_records():
    from blockflow.tensormq.cuda_ipc import RECORD_BYTES, ShareRecord
    rec = ShareRecord(dev=1, handle=_handle(), size=1 << 20, soff=4096, rc=b"/torch_77_123", rco=17)
    raw = rec.pack()
    assert len(raw) == RECORD_BYTES and ShareRecord.unpack(raw, "s") == rec
    for forged in (ShareRecord(0, _handle(kind=b"e"), 1 << 20, 0, b"/torch_1_2", 0),
                   ShareRecord(0, _handle(), 1 << 20, 0, b"/dev/shm/x", 0),
                   ShareRecord(0, _handle(), 0, 0, b"/torch_1_2", 0),
                   ShareRecord(99, _handle(), 1 << 20, 0, b"/torch_1_2", 0)):
        with pytest.raises(WireError):
            ShareRecord.unpack(forged.pack(), "s")
    with pytest.raises(WireError, match="version"):
        ShareRecord.unpack(bytes(RECORD_BYTES), "s")


class _CudaKindSlot(Slot):
    """A real slot file of kind cuda whose share record the test writes itself: what a
    consumer reads before it would open anything on a GPU (no GPU is needed to read it)."""

    loc, kind = "cuda", KIND_CUDA

    def __init__(self, directory, name, record: bytes):
        from blockflow.tensormq.cuda_ipc import RECORD_BYTES
        super().__init__(directory, name, RECORD_BYTES)
        self.data[:] = torch.frombuffer(bytearray(record), dtype=torch.uint8)


def test_cuda_mapper_takes_the_handle_from_the_producer_header_and_checks_it(shm_dir):
    """A forged record (an expandable-segment handle, a ref-counter name pointing elsewhere)
    and handles of the wrong kind of slot are refused with WireError: on a machine without a
    GPU, anything that reached torch would fail with a CUDA error instead."""
    from blockflow.tensormq.cuda_ipc import CudaMapper, ShareRecord
    forged = {"e-handle": ShareRecord(0, _handle(kind=b"e"), 1 << 20, 0, b"/torch_1_2", 0),
              "rc-elsewhere": ShareRecord(0, _handle(), 1 << 20, 0, b"/blockflow-x", 0)}
    slots = {k: _CudaKindSlot(shm_dir, f"forged-{k}", r.pack()) for k, r in forged.items()}
    host = SlotPool(shm_dir, "host", window=1)
    mapper = CudaMapper(shm_dir)
    try:
        for key, slot in slots.items():
            gen = slot.mark_in_flight()
            desc = {"dtype": "float32", "shape": [4], "stride": [1], "loc": "cuda", "seg": slot.name, "gen": gen,
                    "off": 0, "nbytes": 16}
            with pytest.raises(WireError, match="handle type|ref-counter"):
                mapper.open(TensorDesc.parse(desc))
        shm_handle = host.put("e", torch.ones(4), timeout=1).to_json()
        with pytest.raises(WireError, match="not a cuda slot"):
            mapper.open(TensorDesc.parse(dict(shm_handle, loc="cuda")))
        cuda_kind = slots["e-handle"]
        with pytest.raises(WireError, match="not a shm slot"):
            SlotMapper(shm_dir).open(TensorDesc.parse({"dtype": "uint8", "shape": [16], "stride": [1], "loc": "shm",
                                                       "seg": cuda_kind.name, "gen": cuda_kind.generation,
                                                       "off": 0, "nbytes": 16}))
    finally:
        mapper.close()
        host.close()
        for s in slots.values():
            s.close()


def test_a_host_pool_and_a_gpu_pool_of_one_owner_name_their_slots_apart(shm_dir):
    """Seen on an H200: a transport's host pool and its GPU pool both named their first slot
    <owner>.<pid>.1, so the second to fill its window failed with FileExistsError."""
    from blockflow.tensormq.cuda_ipc import CudaSlotPool

    class HostBackedGpuPool(CudaSlotPool):  # the GPU pool's naming, host memory (no GPU here)
        def _make_slot(self, name, capacity):
            return SlotPool._make_slot(self, name, capacity)

    host, gpu = SlotPool(shm_dir, "p", window=2), HostBackedGpuPool(shm_dir, "p", window=2, device="cuda:0")
    try:
        host.put("e", torch.ones(4), timeout=1)
        gpu.put("e", torch.ones(4), timeout=1)
        names = sorted(os.listdir(shm_dir))
        pid = os.getpid()
        assert names == sorted([f"p.{pid}.1", f"p.{pid}.2", f"p.{pid}.cuda0-1", f"p.{pid}.cuda0-2"])
        assert all(n.rsplit(".", 2)[1] == str(pid) for n in names)  # what the manager's sweep parses
    finally:
        host.close()
        gpu.close()


# -- defects 5 and 6: slots come back on every error path ----------------------------------------
def test_a_failed_copy_gives_the_slot_back(shm_dir):
    pool = SlotPool(shm_dir, "p", window=1)
    try:
        with pytest.raises(NotImplementedError):
            pool.put("e", torch.empty(4, device="meta"), timeout=1)  # acquired, then the copy fails
        assert pool.in_flight() == 0
        with pytest.raises(WireError, match="cannot travel"):
            pool.put("e", torch.zeros(4, dtype=torch.complex64), timeout=1)
        assert pool.in_flight() == 0
        d = pool.put("e", torch.ones(4), timeout=0)  # window 1: the slot really is free
        assert d.fields["loc"] == "shm"
    finally:
        pool.close()


def test_discard_and_refusal_release_through_the_header_only(shm_dir, ctx):
    """A CUDA handle that was never sent (forwarded input) or that a block refused is released
    without opening its memory: before the fix, discard decoded the handle, which needs a GPU
    (and for one's own slot fails: CUDA refuses to open one's own IPC handle)."""
    from blockflow.tensormq.cuda_ipc import ShareRecord
    upstream = _CudaKindSlot(shm_dir, "up.1.c1", ShareRecord(0, _handle(), 1 << 20, 0, b"/torch_1_2", 0).pack())
    t = Transport(ctx, "b", "tensormq", shm_dir)
    try:
        for _ in range(2):
            gen = upstream.mark_in_flight()
            x = {"dtype": "float32", "shape": [4], "stride": [1], "loc": "cuda", "seg": upstream.name, "gen": gen,
                 "off": 0, "nbytes": 16}
            assert upstream.state == IN_FLIGHT
            t.discard(x)
            assert upstream.state == FREE
        assert t.release_handle(x) is False  # twice is harmless
        # our own host slot of a message never sent
        own, _ = t.encode(torch.ones(3), "ipc:///nonexistent/n.sock")
        assert t.in_flight() == 1
        assert t.release_handle(own) is True and t.in_flight() == 0
    finally:
        t.close()
        upstream.close()


# -- monitor: NVML index by UUID / PCI bus id; per-process VRAM in a PID namespace ---------------
NVML_DEVICES = [{"uuid": "GPU-0a0a0a0a-0000-0000-0000-000000000000", "pci_bus_id": "00000000:1B:00.0"},
                {"uuid": "GPU-1b1b1b1b-0000-0000-0000-000000000000", "pci_bus_id": "00000000:43:00.0"},
                {"uuid": b"GPU-2c2c2c2c-0000-0000-0000-000000000000", "pci_bus_id": b"00000000:52:00.0"},
                {"uuid": "GPU-3d3d3d3d-0000-0000-0000-000000000000", "pci_bus_id": "00000000:61:00.0"}]


def test_nvml_device_is_found_by_uuid_or_pci_bus_id_not_by_index():
    from blockflow.blocks.monitor import nvml_index_for
    # CUDA_VISIBLE_DEVICES=2,0: torch's cuda:0 is NVML's 2
    assert nvml_index_for("2c2c2c2c-0000-0000-0000-000000000000", None, NVML_DEVICES) == 2
    assert nvml_index_for("GPU-0A0A0A0A-0000-0000-0000-000000000000", None, NVML_DEVICES) == 0
    assert nvml_index_for(None, (0, 0x61, 0), NVML_DEVICES) == 3
    assert nvml_index_for("ffffffff-0000-0000-0000-000000000000", "0000:43:00.0", NVML_DEVICES) == 1
    assert nvml_index_for("ffffffff-0000-0000-0000-000000000000", (0, 0x99, 0), NVML_DEVICES) is None


def test_the_kpi_says_when_per_process_vram_is_unavailable(tmp_path):
    from blockflow.blocks.monitor import process_vram
    from blockflow.kpi import format_table, summarize_block
    assert process_vram([(4242, 300 * MiB), (17, 512 * MiB)], {17}) == (512.0, None)
    vram, why = process_vram([(4242, 300 * MiB)], {17})  # NVML names host pids; we are pid 17 in a container
    assert vram is None and "PID namespace" in why
    with open(tmp_path / "b1.resources.jsonl", "w") as f:
        for k in range(3):
            f.write(json.dumps({"ts": k, "cpu_percent": 50.0, "rss_mb": 900.0, "torch_reserved_mb": 40.0,
                                "vram_unavailable": why}) + "\n")
    summary = summarize_block(str(tmp_path), "b1")
    assert "PID namespace" in summary["resources"]["vram_unavailable"]
    table = format_table([summary])
    assert "n/a" in table and "PID namespace" in table
