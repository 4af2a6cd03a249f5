"""TensorMQ on the GPU (issue 13): CUDA IPC slots, hops between CPU and GPU, leaks on error paths.

Every test here is marked ``cuda`` and needs a GPU (``make gpu-check`` runs them): two real
processes, the producer in the test process and a consumer started with ``python -c``, talking
JSON lines. What the CUDA path decides before torch touches a GPU is checked on any machine by
tests/unit/test_cuda_ipc_cpu.py.
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

from blockflow.tensormq.transport import Transport
from blockflow.tensormq.wire import WireError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CUDA = pytest.mark.cuda
MiB = 2 ** 20


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
