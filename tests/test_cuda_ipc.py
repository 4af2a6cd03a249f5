"""TensorMQ on the GPU (issue 13): CUDA IPC slots, hops between CPU and GPU, leaks on error paths.

Two layers:
- tests without a mark run everywhere: everything the CUDA path decides before torch touches a
  GPU (device spelling, which hop gets which kind of slot, checks of forged handles, slots given
  back on error paths, NVML device mapping, the KPI's word on per-process VRAM);
- tests marked ``cuda`` need a GPU (``make gpu-check`` runs them): two real processes, the
  producer in the test process and a consumer started with ``python -c``, talking JSON lines.
"""
from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch
import zmq

from blockflow.tensormq.shm import FREE, IN_FLIGHT, KIND_CUDA, Slot, SlotMapper, SlotPool
from blockflow.tensormq.transport import Transport
from blockflow.tensormq.wire import TensorDesc, WireError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA = pytest.mark.cuda
MiB = 2 ** 20


@pytest.fixture
def shm_dir():
    d = tempfile.mkdtemp(prefix="bftest-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


# -- defect 1: 'cuda' means 'cuda:0', once, in the schema and in the device map ----------------
def test_schema_spells_cuda_as_cuda_0():
    from blockflow.schema import validate_update
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


# =================================================================================================
# On a GPU: two processes
# =================================================================================================
_CONSUMER = r"""
import json, os, sys, time
import torch
init = sys.argv[2] == "1"
if init:
    torch.cuda.set_device(0)
from blockflow.tensormq.cuda_ipc import CudaMapper
from blockflow.tensormq.shm import SlotMapper
from blockflow.tensormq.wire import TensorDesc, WireError

def out(obj):
    sys.stdout.write(json.dumps(obj) + "\n"); sys.stdout.flush()

mapper, shm = CudaMapper(sys.argv[1]), SlotMapper(sys.argv[1])
held = []
out({"ready": True, "pid": os.getpid(), "cuda_initialized": torch.cuda.is_initialized()})
for line in sys.stdin:
    msg = json.loads(line)
    op = msg["op"]
    if op == "end":
        break
    try:
        if op in ("read", "hold", "forward_t"):
            desc = TensorDesc.parse(msg["x"])
            t, lease = (mapper if desc.loc == "cuda" else shm).open(desc)
            if op == "hold":
                held.append((t, lease)); torch.cuda.synchronize(); out({"held": len(held)}); continue
            if op == "forward_t":  # a view of the slot travels on: its handle, not a copy
                v = t.t() if t.dim() == 2 else t
                d = lease.forward_desc(v).to_json(); out({"x": d}); continue
            res = {"shape": list(t.shape), "stride": list(t.stride()), "dtype": str(t.dtype),
                   "device": str(t.device), "values": t.detach().cpu().double().flatten().tolist()}
            torch.cuda.synchronize()
            lease.release()
            out(res)
        elif op == "reserved":
            torch.cuda.synchronize()
            out({"reserved": torch.cuda.memory_reserved(), "mappings": len(mapper.storages)})
        elif op == "stream":  # many handles, one reply at the end: exact values or the first wrong one
            bad, n = None, 0
            for _ in range(msg["n"]):
                m = json.loads(sys.stdin.readline())
                t, lease = mapper.open(TensorDesc.parse(m["x"]))
                ok = bool((t == m["v"]).all())
                torch.cuda.synchronize()
                lease.release()
                n += 1
                if not ok and bad is None:
                    bad = m["seq"]
            out({"n": n, "bad": bad})
    except WireError as exc:
        out({"refused": str(exc)})
mapper.close(); shm.close()
out({"bye": True})
"""


class Consumer:
    """A consumer process; every read of its answers has a deadline."""

    def __init__(self, shm: str, init_cuda: bool = True):
        self.p = subprocess.Popen([sys.executable, "-c", _CONSUMER, shm, "1" if init_cuda else "0"], cwd=ROOT,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.q: queue.Queue = queue.Queue()
        self.err: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=lambda: self.err.extend(self.p.stderr), daemon=True).start()
        self.hello = self.recv(120)

    def _pump(self):
        for line in self.p.stdout:
            self.q.put(line)
        self.q.put(None)  # end of output: the process is gone

    def send(self, obj) -> None:
        self.p.stdin.write(json.dumps(obj) + "\n")
        self.p.stdin.flush()

    def recv(self, timeout: float = 60):
        try:
            line = self.q.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"consumer said nothing within {timeout}s; stderr: {''.join(self.err)[-1500:]}")
        if line is None:
            raise AssertionError(f"consumer exited ({self.p.wait()}); stderr: {''.join(self.err)[-1500:]}")
        return json.loads(line)

    def ask(self, obj, timeout: float = 60):
        self.send(obj)
        return self.recv(timeout)

    def close(self) -> int:
        if self.p.poll() is None:
            try:
                self.send({"op": "end"})
                self.recv(30)
            except (AssertionError, BrokenPipeError, OSError):
                pass
        try:
            return self.p.wait(30)
        except subprocess.TimeoutExpired:
            self.p.kill()
            return self.p.wait()

    def kill9(self) -> None:
        os.kill(self.p.pid, signal.SIGKILL)
        self.p.wait(30)


@pytest.fixture
def gpu_pool(shm_dir):
    from blockflow.tensormq.cuda_ipc import CudaSlotPool
    torch.cuda.set_device(0)
    pool = CudaSlotPool(shm_dir, "prod", window=8, device="cuda:0")
    yield pool
    pool.close()


def settle() -> int:
    torch.cuda.synchronize()
    torch.cuda.ipc_collect()
    return torch.cuda.memory_allocated(0)


CASES = {
    "f32": lambda: torch.randn(3, 5),
    "f16-transposed": lambda: torch.randn(4, 6).half().t(),
    "bf16": lambda: torch.randn(9).bfloat16(),
    "f64": lambda: torch.randn(2, 2, 2).double(),
    "i64": lambda: torch.arange(10),
    "i8": lambda: torch.arange(-5, 5, dtype=torch.int8),
    "bool": lambda: torch.rand(7, generator=torch.Generator().manual_seed(3)) > 0.5,
    "u8": lambda: torch.randint(0, 255, (5,), dtype=torch.uint8),
    "empty": lambda: torch.empty(0, 5),
    "scalar": lambda: torch.tensor(3.5),
    "strided": lambda: torch.randn(8, 8)[::2, 1::3],
}


@CUDA
def test_gpu_roundtrip_of_dtypes_strides_empty_and_0d(gpu_pool, shm_dir):
    c = Consumer(shm_dir)
    try:
        for name, make in CASES.items():
            x = make().cuda()
            d = gpu_pool.put("rt", x, timeout=5).to_json()
            assert d["loc"] == "cuda"
            r = c.ask({"op": "read", "x": d})
            assert "refused" not in r, (name, r)
            assert r["shape"] == list(x.shape) and r["dtype"] == str(x.dtype) and r["device"] == "cuda:0", name
            assert r["values"] == x.cpu().double().flatten().tolist(), name
        assert gpu_pool.in_flight() == 0
        # a strided view forwarded by handle reaches a third process intact
        x = torch.arange(12, dtype=torch.float32, device="cuda:0").view(3, 4)
        fwd = c.ask({"op": "forward_t", "x": gpu_pool.put("rt", x, timeout=5).to_json()})["x"]
        assert fwd["shape"] == [4, 3] and fwd["stride"] == [1, 4]
        c2 = Consumer(shm_dir)
        try:
            r = c2.ask({"op": "read", "x": fwd})
            assert r["values"] == x.t().cpu().double().flatten().tolist()
        finally:
            assert c2.close() == 0
        assert gpu_pool.in_flight() == 0  # the third process released what the second forwarded
    finally:
        assert c.close() == 0


@CUDA
def test_a_consumer_that_never_touched_cuda_opens_a_handle(gpu_pool, shm_dir):
    """Defect 3: _new_shared_cuda before CUDA is initialised crashed the process."""
    c = Consumer(shm_dir, init_cuda=False)
    try:
        assert c.hello["cuda_initialized"] is False
        x = torch.arange(4096, dtype=torch.float32, device="cuda:0")
        r = c.ask({"op": "read", "x": gpu_pool.put("e", x, timeout=5).to_json()})
        assert r["values"] == x.cpu().double().tolist()
    finally:
        code = c.close()
    assert code == 0, f"consumer exit {code}: {''.join(c.err)[-800:]}"


@CUDA
def test_stale_and_forged_cuda_handles_are_refused(gpu_pool, shm_dir):
    c = Consumer(shm_dir)
    try:
        x = torch.ones(64, device="cuda:0")
        d = gpu_pool.put("e", x, timeout=5).to_json()
        assert c.ask({"op": "read", "x": d})["values"] == [1.0] * 64
        forged = [d,  # stale: already released
                  dict(d, gen=d["gen"] + 7), dict(d, off=1 << 36), dict(d, shape=[1 << 28], stride=[1], nbytes=1 << 30),
                  dict(d, off=2), dict(d, seg="nosuchslot"), dict(d, loc="shm"),
                  dict(d, handle="00" * 66, size=1 << 40)]  # fields the consumer no longer reads from messages
        d2 = gpu_pool.put("e", x * 3, timeout=5).to_json()
        for f in forged[:-1]:
            r = c.ask({"op": "read", "x": f})
            assert "refused" in r, (f, r)
        r = c.ask({"op": "read", "x": forged[-1] | {"gen": d2["gen"], "seg": d2["seg"]}})
        assert r["values"] == [3.0] * 64  # the message's handle/size fields are ignored
        assert c.ask({"op": "reserved"})["mappings"] >= 1  # its CUDA context is still fine
    finally:
        assert c.close() == 0


@CUDA
def test_hops_between_cpu_and_gpu(shm_dir, ctx):
    """CPU->GPU in shared memory, GPU->CPU as a host copy, GPU->GPU as a CUDA handle."""
    torch.cuda.set_device(0)
    gpu_hop, cpu_hop = "ipc:///nonexistent/gpu.sock", "ipc:///nonexistent/cpu.sock"
    t = Transport(ctx, "p", "tensormq", shm_dir, window=2)
    c = Consumer(shm_dir)
    try:
        t.set_topology([gpu_hop, cpu_hop], {gpu_hop: "cuda", cpu_hop: "cpu"})
        x = torch.randn(2, 3, 4)
        for tensor, hop, loc in [(x, gpu_hop, "shm"), (x.cuda(), cpu_hop, "shm"), (x.cuda(), gpu_hop, "cuda"),
                                 (x.cuda(), "ipc:///nonexistent/dispatcher-0.sock", "shm")]:
            d, payload = t.encode(tensor, hop)
            assert payload is None and d["loc"] == loc, (hop, d["loc"])
            r = c.ask({"op": "read", "x": d})
            assert r["values"] == x.double().flatten().tolist()
        assert t.in_flight() == 0
    finally:
        assert c.close() == 0
        t.close()


@CUDA
def test_gpu_to_gpu_hop_across_devices_lands_on_the_consumer_device(shm_dir, ctx):
    """Thesis Fig. 3.9: the producer allocates the edge's slots on the next hop's GPU."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two GPUs; {torch.cuda.device_count()} visible (the single-GPU path is tested above)")
    hop = "ipc:///nonexistent/gpu1.sock"
    t = Transport(ctx, "p", "tensormq", shm_dir, window=2)
    c = Consumer(shm_dir)
    try:
        t.set_topology([hop], {hop: "cuda:1"})
        x = torch.randn(3, 4, device="cuda:0")
        d, _ = t.encode(x, hop)
        assert d["loc"] == "cuda"
        r = c.ask({"op": "read", "x": d})
        assert r["device"] == "cuda:1" and r["values"] == x.cpu().double().flatten().tolist()
    finally:
        assert c.close() == 0
        t.close()


@CUDA
def test_discard_of_ones_own_cuda_slot(shm_dir, ctx):
    """Defect 5: opening one's own IPC handle fails, so discard must go through the header."""
    torch.cuda.set_device(0)
    hop = "ipc:///nonexistent/gpu.sock"
    t = Transport(ctx, "p", "tensormq", shm_dir, window=1)
    c = Consumer(shm_dir)
    try:
        t.set_topology([hop], {hop: "cuda:0"})
        d, _ = t.encode(torch.ones(1024, device="cuda:0"), hop)
        assert d["loc"] == "cuda" and t.in_flight() == 1
        t.discard(d)  # the send failed
        assert t.in_flight() == 0
        assert "refused" in c.ask({"op": "read", "x": d})  # the discarded handle is stale
        d2, _ = t.encode(torch.full((1024,), 2.0, device="cuda:0"), hop, timeout=0)  # window 1: free again
        assert c.ask({"op": "read", "x": d2})["values"] == [2.0] * 1024
    finally:
        assert c.close() == 0
        t.close()


@CUDA
def test_vram_is_flat_over_10000_requests(gpu_pool, shm_dir):
    n, shape = 10_000, (1, 256, 56, 56)  # ResNet50 block1's output at batch 1, 3.2 MB
    c = Consumer(shm_dir)
    try:
        c.send({"op": "stream", "n": n})
        mem = {}
        for i in range(n):
            v = float(i % 2048)
            x = torch.full(shape, v, device="cuda:0") if i % 97 else torch.full((56, 56), v, device="cuda:0").half().t()
            c.send({"seq": i, "v": v, "x": gpu_pool.put("load", x, timeout=30).to_json()})
            if i in (500, n - 1):
                del x
                mem[i] = (settle(), torch.cuda.mem_get_info(0)[0])
        r = c.recv(300)
        assert r == {"n": n, "bad": None}
        grown_alloc = (mem[n - 1][0] - mem[500][0]) / MiB
        lost_free = (mem[500][1] - mem[n - 1][1]) / MiB  # device-wide: both processes
        print(f"\nproducer allocated +{grown_alloc:.1f} MiB, device free -{lost_free:.1f} MiB over {n - 501} requests")
        assert grown_alloc < 1 and lost_free < 64
        assert len(gpu_pool.edges["load"]) == 8
    finally:
        assert c.close() == 0


@CUDA
def test_kill_9_of_a_consumer_holding_slots_gives_the_producer_its_vram_back(gpu_pool, shm_dir):
    """Defect 4: without releasing torch's IPC counter, reclaim left window x slot size in limbo."""
    baseline = settle()
    c = Consumer(shm_dir)
    try:
        for i in range(8):
            x = torch.full((1, 256, 112, 112), float(i), device="cuda:0")  # 12.8 MB -> 16 MiB slots
            assert c.ask({"op": "hold", "x": gpu_pool.put("e", x, timeout=5).to_json()})["held"] == i + 1
        del x
        holding = settle()
        assert holding - baseline >= 8 * 16 * MiB
        c.kill9()
        assert gpu_pool.reclaim("e") == 8
        deadline = time.monotonic() + 10
        while settle() - baseline > MiB and time.monotonic() < deadline:
            time.sleep(0.05)
        after = settle()
        print(f"\nslots {(holding - baseline) / MiB:.0f} MiB; after kill -9 and reclaim {(after - baseline) / MiB:.1f} MiB")
        assert after - baseline <= MiB, f"{(after - baseline) / MiB:.0f} MiB still held after reclaim"
    finally:
        c.close()


# -- the manager path: blockflow serve, POST /system/update with GPU blocks ------------------------
BRANCHY = {"blocks": [{"name": n, "model": f"resnet18/{m}.pt", "device": d} for n, m, d in [
    ("b1", "block1", "cuda"), ("b2", "block2", "cuda:0"), ("b3", "block3", "cuda"), ("b4", "block4", "cuda"),
    ("h", "head", "cpu"), ("b4x", "block4-x", "cuda"), ("hx", "head-x", "cuda")]],
    "tasks": [{"id": "classify", "path": ["b1", "b2", "b3", "b4", "h"]},
              {"id": "special", "path": ["b1", "b2", "b3", "b4x", "hx"]}]}


def _reference(model_repo, stems, device):
    from blockflow.blocks.repository import load_block
    mods = [load_block(model_repo, f"resnet18/{s}.pt", device) for s in stems]

    def run(x):
        with torch.inference_mode():
            x = x.to(device)
            for m in mods:
                x = m(x)
            return x.cpu()
    return run


@CUDA
def test_manager_path_with_gpu_blocks_equals_the_monolithic_model(server_factory, model_repo):
    """Plain 'cuda' blocks start (defect 1), the dispatcher reaches a GPU first block (defect 2),
    a GPU block hands a CPU block a host copy, and 64 requests with every slot in flight all
    come back exact."""
    from blockflow.client import Client
    srv = server_factory(model_repo, extra=["--window", "4"], env={"NVIDIA_TF32_OVERRIDE": "0"})
    res = srv.call("POST", "/system/update", BRANCHY, timeout=180)
    assert res["version"] == 1
    blocks = {b["name"]: b for b in srv.call("GET", "/system")["blocks"]}
    assert all(b["status"] == "ready" for b in blocks.values()), blocks
    assert blocks["b1"]["device"] == "cuda:0"
    full = _reference(model_repo, ["full"], "cuda:0")
    special = _reference(model_repo, ["block1", "block2", "block3", "block4-x", "head-x"], "cuda:0")
    xs = [torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(i)) for i in range(64)]
    with Client(srv.dispatcher, timeout=120) as c:
        y = c.infer("classify", xs[0])
        z = c.infer("special", xs[0])
        old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        try:
            want_y, want_z = full(xs[0]), special(xs[0])
            assert torch.allclose(y, want_y, atol=1e-3, rtol=1e-3), (y - want_y).abs().max()
            assert torch.allclose(z, want_z, atol=1e-3, rtol=1e-3), (z - want_z).abs().max()
            assert not torch.allclose(y, z)
            futures = [c.submit("classify" if i % 2 else "special", x) for i, x in enumerate(xs)]  # window 4: all in flight
            for i, (x, f) in enumerate(zip(xs, futures)):
                want = full(x) if i % 2 else special(x)
                got = f.result(120)
                assert torch.allclose(got, want, atol=1e-3, rtol=1e-3), f"request {i}: {(got - want).abs().max()}"
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
    for name in ("b1", "b2", "b3"):
        assert srv.call("GET", f"/blocks/{name}")["status"] == "ready"


@CUDA
@pytest.mark.parametrize("victim", ["b2", "b3"], ids=["producer", "consumer"])
def test_a_block_killed_under_load_never_yields_garbage(server_factory, model_repo, victim):
    """kill -9 of b2 while b3 holds handles into b2's slots (the producer), or of b3 while its
    stream waits on b2's events (the consumer): replies are exact or errors, the manager
    respawns the block, and the pipeline serves exact results again."""
    from blockflow.client import Client
    srv = server_factory(model_repo, env={"NVIDIA_TF32_OVERRIDE": "0"})
    body = {"blocks": [b for b in BRANCHY["blocks"] if b["name"] in ("b1", "b2", "b3", "b4", "h")],
            "tasks": [BRANCHY["tasks"][0]]}
    srv.call("POST", "/system/update", body, timeout=180)
    full = _reference(model_repo, ["full"], "cpu")
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(5))
    want = full(x)
    killed = srv.call("GET", f"/blocks/{victim}")
    outcomes = {"exact": 0, "error": 0, "wrong": 0}
    with Client(srv.dispatcher, timeout=60) as c:
        futures = [c.submit("classify", x) for _ in range(32)]
        os.kill(killed["pid"], signal.SIGKILL)
        futures += [c.submit("classify", x) for _ in range(32)]
        for f in futures:
            try:
                y = f.result(120)
            except Exception:
                outcomes["error"] += 1
                continue
            outcomes["exact" if torch.allclose(y, want, atol=1e-3, rtol=1e-3) else "wrong"] += 1
        assert outcomes["wrong"] == 0, outcomes
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            b = srv.call("GET", f"/blocks/{victim}")
            if b["status"] == "ready" and b["pid"] != killed["pid"]:
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"{victim} was not respawned within 60 s")
        ok = 0
        deadline = time.monotonic() + 60
        while ok < 5 and time.monotonic() < deadline:
            try:
                y = c.infer("classify", x)
            except Exception:
                time.sleep(0.2)
                continue
            assert torch.allclose(y, want, atol=1e-3, rtol=1e-3)
            ok += 1
        assert ok == 5, f"the pipeline did not serve again after the respawn ({outcomes})"
    print(f"\nkill -9 of a GPU producer under load: {outcomes}")


@CUDA
def test_a_slot_of_this_process_is_opened_without_ipc_and_refused_once_closed(gpu_pool, shm_dir):
    """Blocks sharing a process (blocks/host.py) hand over through their own slots: CUDA cannot
    open an IPC handle where it was exported, so the mapper takes the buffer and event from
    LOCAL_SLOTS. Seen on an H100: a group's second block refused every request (issue 28)."""
    from blockflow.tensormq.cuda_ipc import LOCAL_SLOTS, CudaMapper
    mapper = CudaMapper(shm_dir)
    try:
        x = torch.arange(1024, dtype=torch.float32, device="cuda:0").view(32, 32)
        desc = gpu_pool.put("local", x, timeout=5)
        seg = desc.fields["seg"]
        assert seg in LOCAL_SLOTS
        y, lease = mapper.open(desc)
        assert torch.equal(y, x) and y.data_ptr() == LOCAL_SLOTS[seg][0].data_ptr() + desc.fields["off"]
        assert seg not in mapper.storages  # never cached: it leaves with its slot
        lease.release()
        assert gpu_pool.in_flight() == 0
        with pytest.raises(WireError):  # the generation it named is over
            mapper.open(desc)
    finally:
        mapper.close()
    gpu_pool.close()
    assert not [s for s in LOCAL_SLOTS if s.startswith("prod.")]
