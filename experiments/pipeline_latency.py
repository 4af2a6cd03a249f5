"""Pipeline latency of the served 4-block ResNet50 (thesis 4.2.2, Figs. 4.3-4.5, 4.9, 4.14, Appendix B).

One synchronous client (the next request leaves when the previous reply is back) sends a seeded
batch-1 input through ``blockflow serve`` deploying block1..block4 + head as five processes,
once over ``zeromq`` (tensors serialised into the messages) and once over ``tensormq`` (tensors
in shared memory, handles in the messages). Against it are measured:

  http*       the monolithic model (full.pt) behind a CherryPy REST endpoint (the thesis's HTTP*
              bar: one process, the tensor in the POST body), see experiments/servers.py;
  http split  the blocks chained over HTTP: one CherryPy process per block, each POSTing its
              output to the next one's /infer (the thesis's "split" HTTP version, which it
              measured but left out of Fig. 4.3);
  offline     the sum of the per-block inference times with the blocks run back to back in this
              process, without any transport (the thesis's "offline" baseline, 11.703 ms);
  monolithic  full.pt run in this process with the same torch threads as one block.

Every block logs what it measured for every request (its KPI log, blocks/process.py, with the
names of blockflow/blocks/kpilog.py LATENCY_FIELDS): queue wait (``wait``), tensor rebuild
(``deser``), move to the device (``dev``), model inference (``inf``), output share/serialise
(``share``) and the send to the next hop (``fwd``). The overhead is the thesis's eq. 4.1:

    T_b = o_b + m_b + w_b,   o_b = deser + dev + share + fwd,   m_b = inf,   w_b = wait

per block (Fig. 4.4), and per request the pipeline overhead is sum_b o_b and the pipeline
inference sum_b m_b (Fig. 4.5); the queue wait sum_b w_b is reported apart, and so is what the
blocks do not see (``outside_blocks_ms`` = client round trip - sum_b T_b: client and dispatcher
hops, socket transit). Records are joined across blocks by the request id the dispatcher gives.
Appendix B's per-block ePDFs of inf, o_b and w_b are drawn from the same records.

Beside the round trips it records, per block process, RSS and USS (psutil) and, on a GPU, VRAM
(NVML, from the block's resource log) (Fig. 4.14), and the bytes each hop copies (Fig. 4.9): on
the CPU counted from the wire descriptors of the tensors each hop sends (their nbytes) and the
copies the transport's code path makes for that descriptor kind (see ``COPIES_PER_HOP``); on a
GPU the host<->device copies of the zeromq hop path measured with torch.profiler.

To make the ratio against the monolithic model fair on a shared machine, the monolithic model
runs interleaved with the pipeline: request i through the pipeline, then inference i of full.pt
in this process, so that both see the same background load. The script prints

    ratio = median pipeline round trip / median monolithic latency   (goal <= 1.20x)

for each transport. The first min(250, N/4) samples of every series are dropped as warm-up (5 in
--quick), as in the thesis. The thesis ran each transport for 120 s; the default here is
22 s per series (``DEFAULT_DURATION``: five series fit in 3 minutes on a 2-core machine);
--duration S or --n N (exactly N requests per series) change it.

    python -m experiments.pipeline_latency [--quick] [--n N | --duration S] [--threads T]
                                           [--transports zeromq,tensormq] [--no-http] [--out DIR]
                                           [--variants default,no-trim,...] [--variant-n N] [--variant-rounds R]

--variants (issue 11) looks for why a block's inference is slower inside the pipeline than
alone: each variant changes one thing (``VARIANTS``: the blocks' heap trimming, their monitor
and KPI threads, OpenMP's wait policy, CPU pinning) and gets a server of its own; the variants
alternate over rounds, each request again followed by full.pt in this process, and the blocks'
minor page faults per request are counted from /proc. Beside them each block runs alone in this
process back to back, after an idle gap, after a cache flush, after the gap with its weights read
and on a thread of its own (``alone_phase``).

On a GPU (issue 27) the run ends with ``experiments/gpu_floor.py`` in this process, after the
servers are gone: full.pt eager and as one CUDA graph, the five blocks as CUDA graphs back to back,
and the floor of the architecture, five torch-only processes (one block each, a CUDA graph each,
inter-process CUDA events between them), batch 1, fp32, --floor-n requests each (default: the
series' N, else 300). ``summary["gpu_floor"]`` has its figures and ``ratio_pipeline_vs_gpu_floor``
each transport's median round trip against them; the script prints

    pipeline p50 / monolithic eager p50   (goal <= 1.0x)   and   pipeline p50 / floor p50   (stretch <= 1.5x)

--no-floor leaves it out. On a CPU nothing of it runs.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import statistics
import sys
import time

import torch

from experiments import common, gpu_floor

log = logging.getLogger("experiments.pipeline_latency")

NAME = "pipeline_latency"
BLOCK_NAMES = [n for n, _ in common.PIPELINE]
BLOCK_STEMS = dict(common.PIPELINE)
#: The per-block KPI fields of eq. 4.1, as blocks/process.py logs them (kpilog.LATENCY_FIELDS).
COMPONENTS = ("wait", "deser", "dev", "inf", "share", "fwd")
#: o_b of eq. 4.1: tensor rebuild, move to device, share/serialise, send. The wait w_b is apart.
OVERHEAD_PARTS = ("deser", "dev", "share", "fwd")
#: Copies of a hop's tensor bytes on the CPU, by the descriptor kind the transport sends
#: (tensormq/transport.py): ``bytes`` (zeromq) is written into the socket by the sender's
#: ZeroMQ I/O thread (a kernel copy) and read into a message buffer on the other side (a
#: second), the receiver then builds the tensor over that buffer (no copy); ``shm`` (tensormq)
#: copies the output once into a shared-memory slot and the receiver maps it (no copy), unless
#: the model made its output in the slot (``made in slot``: Note [Outputs made in a slot]); a
#: block's ping counts the outputs it sent that way, and the tensormq column uses the share
#: measured in the tensormq phase (the dispatcher always copies the client's bytes into a slot).
COPIES_PER_HOP = {"bytes": 2, "shm": 1, "made in slot": 0}
DEFAULT_DURATION = 22.0
#: The thesis's figures on the GV100 (FullSuper), ms, as its text states them (4.2.2).
THESIS = {"http_full_ms": 200.0, "zeromq_ms": 44.9, "offline_ms": 11.703,
          "zeromq_overhead_ms": 21.18, "tensormq_overhead_ms": 2.55,
          "tensormq_vs_zeromq": 2.8, "tensormq_vs_http_split": 40.0}
#: Figures derived from the thesis's (it gives TensorMQ as "~2.8x" less than ZeroMQ's 44.9 ms,
#: and HTTP split as "up to ~40x" TensorMQ): computed here, not quoted.
THESIS_DERIVED = {"tensormq_ms": 44.9 / 2.8, "http_split_ms": 40.0 * 44.9 / 2.8}
RATIO_GOAL = 1.20  # issue 11: the unfused 5-process pipeline <= 1.20x the monolithic model
#: Consecutive parts of a transport's series whose p50 ratios give the ratio's spread (issue 40
#: item 6): each part is a short run of its own, its requests interleaved with the monolithic
#: model's like the whole series'.
RATIO_PARTS = 5
#: issue 27 on a GPU: the pipeline's p50 <= 1.0x the monolithic model's eager p50 (gpu_floor's
#: mono_eager), and, the stretch goal, <= 1.5x the floor (gpu_floor's five torch-only processes).
FLOOR_GOAL = 1.0
FLOOR_STRETCH = 1.5
QUICK_N = 12


# -- timing helpers shared with the other pipeline experiments ---------------------------------
def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Series:
    """How many samples a measurement takes: exactly ``n``, or as many as fit in ``duration`` s."""

    def __init__(self, n: int | None, duration: float | None):
        if not n and not duration:
            raise ValueError("a series needs a count (n) or a duration")
        self.n, self.duration = n, duration

    def describe(self) -> str:
        return f"{self.n} samples" if self.n else f"{self.duration:g} s"

    def run(self, step, label: str) -> list:
        """Call ``step(i)`` until the series is complete; a progress bar counts samples or seconds."""
        out = []
        t0 = time.monotonic()
        if self.n:
            with common.Progress(self.n, label) as bar:
                for i in range(self.n):
                    out.append(step(i))
                    bar.update()
            return out
        total = int(math.ceil(self.duration))
        shown = 0
        with common.Progress(total, f"{label} (s)") as bar:
            while time.monotonic() - t0 < self.duration:
                out.append(step(len(out)))
                now = int(time.monotonic() - t0)
                if now > shown:
                    bar.update(min(now, total) - shown)
                    shown = min(now, total)
        return out


def series_from_args(args, quick_n: int = QUICK_N, full_duration: float = DEFAULT_DURATION) -> Series:
    if args.n:
        return Series(args.n, None)
    if getattr(args, "duration", None):
        return Series(None, args.duration)
    return Series(quick_n, None) if args.quick else Series(None, full_duration)


def load_models(repo: str, device: str, threads: int) -> tuple[dict, torch.nn.Module]:
    """The five blocks and full.pt loaded in this process, warmed once."""
    from blockflow.blocks.repository import load_block
    torch.set_num_threads(threads)
    blocks = {n: load_block(repo, f"resnet50/{stem}.pt", device) for n, stem in common.PIPELINE}
    full = load_block(repo, "resnet50/full.pt", device)
    x = common.input_tensor(1).to(device)
    with torch.inference_mode():
        for _ in range(2):  # TorchScript's profiling executor specialises on the second call
            full(x)
            y = x
            for m in blocks.values():
                y = m(y)
    sync(device)
    return blocks, full


def time_call(fn, device: str) -> float:
    sync(device)
    t = time.perf_counter()
    with torch.inference_mode():
        fn()
    sync(device)
    return (time.perf_counter() - t) * 1e3


def pipeline_sample(client, x: torch.Tensor, timeout: float = 120.0) -> dict:
    """One synchronous request through the pipeline with the per-block components its reply
    carries (all of eq. 4.1 but ``fwd``, which a block measures after the message has left;
    :func:`kpi_requests` has it). ``rtt_minus_inf`` is everything that is not model compute."""
    t0 = time.perf_counter()
    r = client.infer_details(common.TASK, x, timeout=timeout)
    t_end = time.perf_counter()
    rtt = (t_end - t0) * 1e3
    hops = {h["b"]: {k: float(h.get(k, 0.0)) for k in COMPONENTS} for h in r.hops or []}
    inf = sum(h["inf"] for h in hops.values())
    return {"rtt": rtt, "server": float(r.server_ms or 0.0), "inf": inf, "rtt_minus_inf": rtt - inf, "hops": hops,
            **way_in_and_out(t0, t_end, r.hops)}


def way_in_and_out(t0: float, t_end: float, hops) -> dict:
    """The way in (the client's call until the first block has the message: the client library,
    the dispatcher, its copy into a slot, two socket hops) and the way out (the last block's send
    until the client has the tensor: the dispatcher, its copy into the reply, two socket hops),
    apart, in ms. Every process stamps perf_counter, CLOCK_MONOTONIC on Linux: one clock for
    all of them on one machine (Note [Hop timestamps] in blocks/kpilog.py)."""
    try:
        t_in, t_out = float(hops[0]["t_in"]), float(hops[-1]["t_out"])
    except (TypeError, KeyError, IndexError, ValueError):
        return {}
    if not t0 <= t_in <= t_out <= t_end:
        return {}  # not one clock (another machine) or a hop without stamps: say nothing
    return {"way_in": (t_in - t0) * 1e3, "way_out": (t_end - t_out) * 1e3}


def kpi_requests(server, since: float, until: float | None = None, blocks=BLOCK_NAMES) -> list[dict]:
    """Every request all ``blocks`` logged between wall-clock ``since`` and ``until`` (the block's
    arrival time), in arrival order, as {block: KPI record} joined on the dispatcher's request id.
    The blocks flush their logs first (POST /blocks/NAME/kpi)."""
    import json
    import os
    server.flush_kpi()
    by_rid: dict = {}
    for b in blocks:
        path = os.path.join(server.run_dir, f"{b}.latency.jsonl")
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line cut by a crash
                ts = rec.get("ts")
                if "error" in rec or not isinstance(ts, (int, float)) or ts < since or (until and ts > until):
                    continue
                by_rid.setdefault(rec["rid"], {})[b] = rec
    full = [r for r in by_rid.values() if len(r) == len(blocks)]
    return sorted(full, key=lambda r: r[blocks[0]]["ts"])


def eq41(req: dict) -> dict:
    """Per-request sums of eq. 4.1 over the blocks of one :func:`kpi_requests` entry (ms)."""
    return {"inf": sum(r["inf"] for r in req.values()),
            "overhead": sum(r.get(k, 0.0) for r in req.values() for k in OVERHEAD_PARTS),
            "wait": sum(r["wait"] for r in req.values()),
            "total": sum(r["total"] for r in req.values())}


def block_components(reqs: list[dict], blocks=BLOCK_NAMES) -> dict:
    """Per block: each KPI component, m_b (inference), o_b (overhead, eq. 4.1) and w_b (wait)."""
    out = {}
    for b in blocks:
        recs = [r[b] for r in reqs]
        comp = {k: common.describe([r.get(k, 0.0) for r in recs]) for k in COMPONENTS}
        out[b] = {"components_ms": comp, "inference_ms": comp["inf"], "wait_ms": comp["wait"],
                  "overhead_ms": common.describe([sum(r.get(k, 0.0) for k in OVERHEAD_PARTS) for r in recs])}
    return out


def block_memory(server, pids: dict) -> dict:
    """RSS and USS (MB) of every block process (psutil), and its VRAM and torch-allocated
    memory (MB) where its resource log has them (a GPU block; NVML)."""
    import psutil
    out = {}
    for name, pid in pids.items():
        row = {"rss_mb": None, "uss_mb": None}
        try:
            mem = psutil.Process(pid).memory_full_info()
            row = {"rss_mb": mem.rss / 2**20, "uss_mb": mem.uss / 2**20}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
        try:
            res = server.kpi(name).get("resources", {})
        except Exception as exc:  # the block's KPI answer is an extra, not the measurement
            log.warning("no resource summary from %s: %s", name, exc)
            res = {}
        row["vram_mb"] = res.get("vram_mb")
        row["torch_allocated_mb"] = res.get("torch_allocated_mb")
        out[name] = row
    return out


def data_moved(blocks: dict, x: torch.Tensor, device: str, made_in_slot: dict | None = None) -> dict:
    """Bytes each hop copies per inference (Fig. 4.9). The hop tensors are the real ones (the
    input and every block's output); their size is the ``nbytes`` of the wire descriptor the
    transport builds for them (tensormq.wire.TensorDesc) and the copies per hop are the
    transport's (``COPIES_PER_HOP``). On a GPU the zeromq hop path (encode_bytes: device to
    host; the receiver's .to(device): host to device) runs under torch.profiler and its
    memcpy events are summed; on the CPU that part is recorded as skipped. ``made_in_slot``:
    block -> the share of its outputs it sent from the slot its model made them in."""
    from blockflow.tensormq.transport import decode_bytes, encode_bytes
    from blockflow.tensormq.wire import TensorDesc
    hops, y = [], x.to(device)
    names = ["dispatcher"] + BLOCK_NAMES
    with torch.inference_mode():
        outs = [y]
        for m in blocks.values():
            y = m(y)
            outs.append(y)
    made_in_slot = made_in_slot or {}
    for i, t in enumerate(outs):
        nbytes = TensorDesc.of(t.cpu(), "bytes").numel * t.element_size()
        dst = BLOCK_NAMES[i] if i < len(BLOCK_NAMES) else "dispatcher"
        made = made_in_slot.get(names[i]) or 0.0
        hops.append({"hop": f"{names[i]}->{dst}", "shape": list(t.shape), "nbytes": nbytes,
                     "zeromq_bytes_copied": nbytes * COPIES_PER_HOP["bytes"],
                     "tensormq_made_in_slot": made_in_slot.get(names[i]),
                     "tensormq_bytes_copied": nbytes * ((1 - made) * COPIES_PER_HOP["shm"]
                                                        + made * COPIES_PER_HOP["made in slot"])})
    out = {"hops": hops, "copies_per_hop": COPIES_PER_HOP,
           "per_inference_bytes": {tr: sum(h[f"{tr}_bytes_copied"] for h in hops) for tr in common.TRANSPORTS}}
    if not device.startswith("cuda"):
        out["gpu_copies"] = {"skipped": "no CUDA device: host<->device copies are measured with torch.profiler "
                                        "on a GPU only"}
        return out
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for t in outs:
            desc, payload = encode_bytes(t)                     # sender: device -> host
            decode_bytes(desc, payload).to(device)              # receiver: host -> device
        sync(device)
    counts = {"HtoD": 0, "DtoH": 0, "DtoD": 0}
    for ev in prof.events():  # CUDA runtime memcpy activity: "Memcpy HtoD (Pageable -> Device)" etc.
        for kind in counts:
            if "memcpy" in ev.name.lower() and kind.lower() in ev.name.lower():
                counts[kind] += 1
    out["gpu_copies"] = {"zeromq_memcpy_events": counts, "hops_profiled": len(outs),
                         "zeromq_bytes_per_direction": sum(h["nbytes"] for h in hops),
                         "tensormq": "CUDA IPC handles: no host copy on a one-GPU pipeline (not profiled)"}
    return out


# -- the phases ----------------------------------------------------------------------------
def offline_phase(blocks: dict, full, x: torch.Tensor, device: str, series: Series) -> list[dict]:
    """Blocks back to back in this process (the offline baseline), each followed by full.pt."""
    def step(_):
        rec = {}
        y = x
        for name, m in blocks.items():
            sync(device)
            t = time.perf_counter()
            with torch.inference_mode():
                y = m(y)
            sync(device)
            rec[name] = (time.perf_counter() - t) * 1e3
        rec["sum"] = sum(rec[n] for n in blocks)
        rec["mono"] = time_call(lambda: full(x), device)
        return rec
    return series.run(step, "offline blocks + full")


def transport_phase(server, transport: str, threads: int, device: str, full, x: torch.Tensor,
                    series: Series) -> tuple[list[dict], list[dict], dict]:
    """The client's samples, the blocks' KPI records of the same requests, and the block
    processes' memory after the series."""
    from blockflow.client import Client
    xm = x.to(device)  # the client sends the host tensor; the in-process model reads it on its device
    server.update(common.pipeline_update(transport, threads=threads, device=device))
    pids = server.block_pids()
    with Client(server.dispatcher, timeout=120) as c:
        c.infer(common.TASK, x)  # the first request maps slots and connects sockets
        since = time.time()
        before = made_in_slot_counts(server)

        def step(_):
            rec = pipeline_sample(c, x)
            rec["mono"] = time_call(lambda: full(xm), device)
            return rec
        recs = series.run(step, f"pipeline {transport}")
        after = made_in_slot_counts(server)
    kpi = kpi_requests(server, since)
    if len(kpi) != len(recs):
        log.warning("%s: %d requests timed by the client, %d complete in the blocks' KPI logs",
                    transport, len(recs), len(kpi))
    memory = block_memory(server, pids)
    rss = {n: m["rss_mb"] for n, m in memory.items()}
    made = {n: (after[n][0] - before[n][0]) / (after[n][1] - before[n][1])
            for n in after if n in before and after[n][1] > before[n][1]}
    return recs, kpi, {"block_rss_mb": rss, "block_memory_mb": memory, "block_pids": pids,
                       "made_in_slot": made}


def made_in_slot_counts(server) -> dict[str, tuple[int, int]]:
    """block -> (outputs sent from the slot the model made them in, requests served), from its ping."""
    out = {}
    for name in BLOCK_NAMES:
        ping = server.call("GET", f"/blocks/{name}/ping")
        out[name] = (ping.get("outputs_made_in_slot", 0), ping.get("served", 0))
    return out


def http_split_phase(repo: str, threads: int, x: torch.Tensor, series: Series) -> list[dict]:
    """The blocks chained over HTTP: one CherryPy process per block, each POSTs its output to
    the next block's /infer and answers with what that one answered (the head's logits)."""
    from experiments.servers import HttpTensorClient, spawn
    with contextlib.ExitStack() as stack:
        nxt = None
        for _, stem in reversed(common.PIPELINE):  # the head first: each server needs the next URL
            args = ["--model", f"resnet50/{stem}.pt", "--repo", repo, "--threads", str(threads)]
            h = stack.enter_context(spawn("http", *args, *(["--next", nxt] if nxt else [])))
            nxt = h["url"]
        client = HttpTensorClient(nxt)
        stack.callback(client.close)
        client.infer(x)

        def step(_):
            t0 = time.perf_counter()
            _, hdr = client.infer(x)
            return {"rtt": (time.perf_counter() - t0) * 1e3, "inf": float(hdr.get("X-Inf-Ms", "nan"))}
        return series.run(step, "http split (5 block servers)")


def http_phase(repo: str, threads: int, full, x: torch.Tensor, device: str, series: Series) -> list[dict]:
    from experiments.servers import HttpTensorClient, spawn
    xm = x.to(device)
    with spawn("http", "--model", "resnet50/full.pt", "--repo", repo, "--threads", str(threads)) as h:
        client = HttpTensorClient(h["url"])
        try:
            client.infer(x)

            def step(_):
                t0 = time.perf_counter()
                _, hdr = client.infer(x)
                rtt = (time.perf_counter() - t0) * 1e3
                return {"rtt": rtt, "inf": float(hdr.get("X-Inf-Ms", "nan")),
                        "mono": time_call(lambda: full(xm), device)}
            return series.run(step, "http* monolithic")
        finally:
            client.close()


def floor_phase(repo: str, device: str, n: int) -> dict:
    """experiments/gpu_floor.py's rows on ``device`` (each row guards itself); what goes wrong
    around them is recorded as ``error``, not raised: the series before it are not lost."""
    try:
        return gpu_floor.measure(repo, device, n)
    except Exception as exc:
        log.warning("gpu_floor failed: %s", exc)
        return {"error": f"{type(exc).__name__}: {exc}"}


# -- --variants: why a block is slower inside the pipeline than alone (issue 11) -------------
#: One knob each against the pipeline as served: name -> (server environment, block fields, what
#: it tests). Every variant gets a server of its own: libgomp and glibc read their environment
#: when the server's forkserver starts, and every block then is a fork of it.
VARIANTS = {
    "default": ({}, None, "the pipeline as served"),
    # outputs copied too: made in slots (the default), a block's largest activations are not on the
    # heap, and glibc's trimming no longer costs block1 its page faults (1 per request, not ~4,000)
    "no-trim": ({"BLOCKFLOW_MALLOC_TRIM": "0", "BLOCKFLOW_OUTPUT_IN_SLOT": "0"}, None,
                "glibc's own heap trimming in the blocks, outputs copied into slots (BLOCKFLOW_MALLOC_TRIM=0 "
                "BLOCKFLOW_OUTPUT_IN_SLOT=0: the heap before either setting)"),
    "copy-out": ({"BLOCKFLOW_OUTPUT_IN_SLOT": "0"}, None,
                 "outputs copied into the next slot instead of made there (BLOCKFLOW_OUTPUT_IN_SLOT=0)"),
    "quiet": ({"BLOCKFLOW_MONITOR_INTERVAL": "3600", "BLOCKFLOW_KPI_FLUSH_INTERVAL": "3600",
               "BLOCKFLOW_PING_INTERVAL": "2"}, None,
              "no resource sampler, no timed KPI flush, health pings every 2 s instead of 0.25 s"),
    "omp-passive": ({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}, None,
                    "OpenMP threads sleep at once after a parallel region (libgomp)"),
    "pinned": ({}, "same", "every block pinned to CPU 0"),
    "spread": ({}, "alternate", "blocks pinned to alternating CPUs: the next block always on the other core"),
}
DEFAULT_VARIANTS = "default,no-trim,copy-out,quiet,omp-passive,pinned"
VARIANT_N = 30
VARIANT_ROUNDS = 2
#: untimed requests through a new variant's pipeline before its timed ones (slots, sockets, caches)
VARIANT_WARMUP = 5
#: Idle time before each block call in the "idle_gap" alone series (a block in the 5-block pipeline
#: waits about 4/5 of a round trip between two requests: ~0.13 s here).
IDLE_GAP_S = 0.1
#: Bytes touched before each block call in the "cache_flushed" alone series (> the 32 MB L3 here).
FLUSH_BYTES = 64 << 20
ALONE_MODES = ("back_to_back", "heap_trimmed", "idle_gap", "busy_gap", "cache_flushed", "idle_gap_weights_read",
               "own_thread")


def variant_fields(variant: str, i: int) -> dict:
    cpus = VARIANTS[variant][1]
    if cpus == "same":
        return {"cpus": [0]}
    if cpus == "alternate":
        return {"cpus": [i % min(2, os.cpu_count() or 1)]}
    return {}


def minor_faults(pid: int) -> int:
    """Minor page faults of process ``pid`` so far (/proc/PID/stat field 10)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def thread_names(pid: int) -> list[str]:
    names = []
    for tid in sorted(os.listdir(f"/proc/{pid}/task")):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass  # a thread that ended meanwhile
    return names


def variant_phase(repo: str, names: list[str], transport: str, threads: int, device: str, full,
                  x: torch.Tensor, n: int, rounds: int) -> dict:
    """``rounds`` rounds; in each, every variant in turn (the order rotated by one per round) gets
    a server, deploys the pipeline and times ``n`` requests, each followed by full.pt in this
    process (as the transport series). Per variant and round: the samples, the blocks' KPI
    records of them, each block's minor page faults per request and its threads."""
    from blockflow.client import Client
    xm = x.to(device)
    runs: dict = {v: [] for v in names}
    for r in range(rounds):
        k = r % len(names)
        for v in names[k:] + names[:k]:
            with common.blockflow_server(repo, env=VARIANTS[v][0]) as server:
                update = common.pipeline_update(transport, threads=threads, device=device)
                for i, b in enumerate(update["blocks"]):
                    b.update(variant_fields(v, i))
                server.update(update)
                pids = server.block_pids()
                with Client(server.dispatcher, timeout=120) as c:
                    for _ in range(VARIANT_WARMUP):
                        c.infer(common.TASK, x)
                    f0 = {b: minor_faults(p) for b, p in pids.items()}
                    since = time.time()

                    def step(_):
                        rec = pipeline_sample(c, x)
                        rec["mono"] = time_call(lambda: full(xm), device)
                        return rec
                    recs = Series(n, None).run(step, f"variant {v} ({r + 1}/{rounds})")
                    faults = {b: (minor_faults(p) - f0[b]) / n for b, p in pids.items()}
                runs[v].append({"recs": recs, "kpi": kpi_requests(server, since), "faults": faults,
                                "threads": {b: thread_names(p) for b, p in pids.items()}})
    return runs


def alone_phase(blocks: dict, x: torch.Tensor, device: str, n: int) -> list[dict]:
    """Each block alone in this process seven ways, interleaved in every sample: back to back (as
    the offline series), after the free memory of this process's heap went back to the kernel
    (malloc_trim: what glibc's own trimming does to a block after every request, so the call
    page-faults its activations back in), after ``IDLE_GAP_S`` of sleep (the pipeline's idle time between two
    requests, without the other blocks), after the same gap spent spinning (the process waits
    but its CPU does not go idle), and after writing ``FLUSH_BYTES`` (caches evicted, as the other
    blocks' weights and activations do). Two more ask what the idle gap's loss is: after the same
    gap with every weight and buffer of the block read once just before the call
    (``idle_gap_weights_read``: were the weights what went cold?), and back to back but each
    block called on a thread of its own, handed its input by a queue, as the members of a shared
    process run (``own_thread``: is the loss the thread's, with no process idle?). Minor page
    faults per call beside each time (the process's, the block's thread's included)."""
    import ctypes
    import queue
    import resource
    import threading
    libc = ctypes.CDLL(None)
    inputs, y = {}, x
    with torch.inference_mode():
        for name, m in blocks.items():
            inputs[name] = y
            y = m(y)
    buf = torch.zeros(FLUSH_BYTES // 4)
    weights = {name: list(m.parameters()) + list(m.buffers()) for name, m in blocks.items()}
    threads = torch.get_num_threads()
    own: dict[str, tuple[queue.Queue, queue.Queue]] = {}

    def own_thread(name: str, inbox: queue.Queue, outbox: queue.Queue) -> None:
        torch.set_num_threads(threads)
        m = blocks[name]
        while (item := inbox.get()) is not None:
            outbox.put(time_call(lambda: m(item), device))

    for name in blocks:
        own[name] = (queue.Queue(), queue.Queue())
        threading.Thread(target=own_thread, args=(name, *own[name]), name=f"alone-{name}", daemon=True).start()

    def step(_):
        rec = {}
        for mode in ALONE_MODES:
            for name, m in blocks.items():
                if mode == "heap_trimmed":  # what glibc does to a block process after each request
                    libc.malloc_trim(0)
                elif mode == "idle_gap":
                    time.sleep(IDLE_GAP_S)
                elif mode == "busy_gap":  # the same gap with this CPU kept busy: idle CPU or idle process?
                    end = time.perf_counter() + IDLE_GAP_S
                    while time.perf_counter() < end:
                        pass
                elif mode == "cache_flushed":
                    buf.add_(1.0)
                elif mode == "idle_gap_weights_read":
                    time.sleep(IDLE_GAP_S)
                    with torch.inference_mode():
                        for w in weights[name]:
                            w.sum()
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                if mode == "own_thread":
                    own[name][0].put(inputs[name])
                    rec[f"{mode}.{name}"] = own[name][1].get()
                else:
                    rec[f"{mode}.{name}"] = time_call(lambda: m(inputs[name]), device)
                rec[f"{mode}.{name}.faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
            if mode == "heap_trimmed":  # grow the heap back, untimed: the next mode starts as back to back does
                with torch.inference_mode():
                    for name, m in blocks.items():
                        m(inputs[name])
        return rec
    try:
        return Series(n, None).run(step, "blocks alone: back to back, heap trimmed, after idle, after cache flush, "
                                         "after idle with the weights read, on threads of their own")
    finally:
        for inbox, _ in own.values():
            inbox.put(None)


def summarise_variants(runs: dict, alone: list[dict] | None, offline_blocks: dict, transport: str,
                       n: int, rounds: int) -> dict:
    """Per variant: round trip and interleaved monolithic p50 and their ratio, each block's
    inference p50 and its slowdown against the same block alone (the offline series), minor page
    faults per request and threads per block process. Per alone mode: each block's p50 and faults."""
    alone_p50 = {b: offline_blocks[b]["p50"] for b in BLOCK_NAMES}
    out = {"transport": transport, "n_per_round": n, "rounds": rounds, "warmup_requests": VARIANT_WARMUP,
           "order": "variants alternate, order rotated by one each round; one server per variant and round",
           "slowdown_vs": "each block's p50 in the offline series (back to back in the client's process)",
           "variants": {}}
    for v, rs in runs.items():
        recs = [s for r in rs for s in r["recs"]]
        kpi = [q for r in rs for q in r["kpi"]]
        rtt, mono = common.describe([s["rtt"] for s in recs]), common.describe([s["mono"] for s in recs])
        inf = {b: common.describe([q[b]["inf"] for q in kpi]) for b in BLOCK_NAMES}
        out["variants"][v] = {
            "what": VARIANTS[v][2], "env": VARIANTS[v][0], "block_fields": variant_fields(v, 1), "n": len(recs),
            "kpi_requests": len(kpi), "rtt_ms": rtt, "monolithic_interleaved_ms": mono,
            "ratio_p50": rtt["p50"] / mono["p50"],
            "inference_sum_ms": common.describe([sum(q[b]["inf"] for b in BLOCK_NAMES) for q in kpi]),
            "block_inference_ms": inf,
            "block_slowdown_pct": {b: 100 * (inf[b]["p50"] / alone_p50[b] - 1) for b in BLOCK_NAMES
                                   if inf[b].get("p50") is not None and alone_p50[b]},
            "minor_faults_per_request": {b: statistics.fmean(r["faults"][b] for r in rs) for b in BLOCK_NAMES},
            "threads": rs[0]["threads"]}
    if alone:
        out["alone"] = {"idle_gap_s": IDLE_GAP_S, "flush_bytes": FLUSH_BYTES, "n": len(alone), "modes": {
            mode: {"block_ms": {b: common.describe([a[f"{mode}.{b}"] for a in alone]) for b in BLOCK_NAMES},
                   "minor_faults_per_call": {b: statistics.fmean(a[f"{mode}.{b}.faults"] for a in alone)
                                             for b in BLOCK_NAMES}}
            for mode in ALONE_MODES}}
    return out


# -- summaries -----------------------------------------------------------------------------
def summarise_transport(recs: list[dict], kpi: list[dict], quick: bool) -> dict:
    """The client's round trips and, from the blocks' KPI records of the same requests, eq. 4.1:
    pipeline inference sum_b m_b, overhead sum_b o_b and wait sum_b w_b, per request and per block."""
    kept = common.discard_warmup(recs, quick)
    kept_kpi = common.discard_warmup(kpi, quick)
    sums = [eq41(r) for r in kept_kpi]
    rtt = common.describe([r["rtt"] for r in kept])
    mono = common.describe([r["mono"] for r in kept])
    in_blocks = common.describe([s["total"] for s in sums])
    return {"n": len(recs), "dropped": len(recs) - len(kept), "kpi_requests": len(kpi),
            "overhead_definition": "eq. 4.1: sum over blocks of deser + dev + share + fwd (KPI logs); "
                                   "the queue wait is wait_ms",
            "rtt_ms": rtt, "server_ms": common.describe([r["server"] for r in kept]),
            "inference_ms": common.describe([s["inf"] for s in sums]),
            "overhead_ms": common.describe([s["overhead"] for s in sums]),
            "wait_ms": common.describe([s["wait"] for s in sums]),
            "in_blocks_ms": in_blocks,
            "outside_blocks_ms": (rtt["mean"] - in_blocks["mean"]) if in_blocks.get("mean") is not None else None,
            "way_in_ms": common.describe([r["way_in"] for r in kept if "way_in" in r]),
            "way_out_ms": common.describe([r["way_out"] for r in kept if "way_out" in r]),
            "way_definition": "way in: client call -> first block's arrival; way out: last block's send -> the "
                              "client has the tensor (client library, dispatcher, socket hops)",
            "rtt_minus_inference_ms": common.describe([r["rtt_minus_inf"] for r in kept]),
            "monolithic_interleaved_ms": mono, "ratio_p50": rtt["p50"] / mono["p50"],
            "ratio_p50_parts": common.ratio_parts([r["rtt"] for r in kept], [r["mono"] for r in kept], RATIO_PARTS),
            "ratio_mean": rtt["mean"] / mono["mean"], "blocks": block_components(kept_kpi)}


def floor_ratios(summary: dict) -> dict:
    """Per transport, its median round trip against the rows of ``summary["gpu_floor"]``
    (experiments/gpu_floor.py): the ratios to the monolithic model eager (goal ``FLOOR_GOAL``),
    as one CUDA graph, and to the floor (stretch goal ``FLOOR_STRETCH``); None where a row is
    missing (it failed). Empty without the floor's figures."""
    fl = summary.get("gpu_floor") or {}
    if "skipped" in fl or not fl:
        return {}
    out = {}
    for t, ts in summary.get("transports", {}).items():
        p50 = ts["rtt_ms"]["p50"]
        r = {"pipeline_p50_ms": p50}
        for row in ("mono_eager", "mono_graph", "chain_graph", "floor"):
            ref = fl.get(f"{row}_p50_ms")
            r[f"{row}_p50_ms"] = ref
            r[f"ratio_vs_{row}"] = p50 / ref if ref else None
        r.update({"goal_vs_mono_eager": FLOOR_GOAL, "stretch_vs_floor": FLOOR_STRETCH,
                  "meets_goal": None if r["ratio_vs_mono_eager"] is None else r["ratio_vs_mono_eager"] <= FLOOR_GOAL,
                  "meets_stretch": None if r["ratio_vs_floor"] is None else r["ratio_vs_floor"] <= FLOOR_STRETCH})
        out[t] = r
    return out


def floor_lines(summary: dict) -> list[str]:
    """What :func:`report` prints about ``summary["gpu_floor"]``: its rows, then per transport the
    pipeline's p50 beside the monolithic model eager, as a CUDA graph and the floor, with the
    ratios to the goal (monolithic eager) and the stretch goal (the floor). Empty on a CPU."""
    fl = summary.get("gpu_floor")
    if not fl:
        return []
    lines = gpu_floor.format_rows(fl)
    ms = lambda v: "n/a" if v is None else f"{v:.2f} ms"
    for t, r in floor_ratios(summary).items():
        eager, floor = r["ratio_vs_mono_eager"], r["ratio_vs_floor"]
        goal = ("n/a" if eager is None else
                f"{eager:.3f}x monolithic eager (goal <= {FLOOR_GOAL:.2f}x: {'met' if r['meets_goal'] else 'NOT met'})")
        stretch = ("n/a" if floor is None else
                   f"{floor:.3f}x the floor (stretch <= {FLOOR_STRETCH:.2f}x: "
                   f"{'met' if r['meets_stretch'] else 'NOT met'})")
        lines.append(f"FLOOR {t}: median pipeline {ms(r['pipeline_p50_ms'])}; monolithic eager "
                     f"{ms(r['mono_eager_p50_ms'])}, monolithic CUDA graph {ms(r['mono_graph_p50_ms'])}, "
                     f"floor (5 processes) {ms(r['floor_p50_ms'])}: {goal}, {stretch}")
    return lines


COLORS = {"zeromq": "tab:blue", "tensormq": "tab:orange"}


def plot(summary: dict, raw: dict, out: str, machine: str) -> None:
    """Figs. 4.3, 4.4, 4.5, 4.9, 4.14 and Appendix B. ``raw``: per transport, the kept KPI
    requests (:func:`kpi_requests`)."""
    plt = common.pyplot()
    transports = [t for t in common.TRANSPORTS if t in summary["transports"]]
    # Fig. 4.3: average pipeline computing time
    labels, means, stds, colors = [], [], [], []
    for key, label in (("http_split", "HTTP split\n(5 block servers)"), ("http", "HTTP*\n(full.pt, REST)")):
        if summary.get(key):
            labels.append(label)
            means.append(summary[key]["rtt_ms"]["mean"])
            stds.append(summary[key]["rtt_ms"]["std"])
            colors.append("tab:gray")
    for t in transports:
        labels.append(f"{t}\n(4 blocks + head)")
        means.append(summary["transports"][t]["rtt_ms"]["mean"])
        stds.append(summary["transports"][t]["rtt_ms"]["std"])
        colors.append(COLORS[t])
    labels += ["offline\n(sum of blocks)", "monolithic\n(full.pt, in-process)"]
    means += [summary["offline"]["sum_ms"]["mean"], summary["offline"]["monolithic_ms"]["mean"]]
    stds += [summary["offline"]["sum_ms"]["std"], summary["offline"]["monolithic_ms"]["std"]]
    colors += ["tab:green", "tab:olive"]
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    bars = ax.bar(labels, means, yerr=stds, capsize=3, color=colors)
    ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_ylabel("mean round trip / compute time (ms)")
    ax.set_title(f"ResNet50 pipeline, 1 synchronous client, batch 1 (Fig. 4.3) - {machine}", fontsize=9)
    ax.tick_params(axis="x", labelsize=7)
    common.save_fig(fig, out, f"{NAME}_fig4_3.png")

    # Fig. 4.4: inference m_b and overhead o_b per block (eq. 4.1; the wait w_b is not in the bar)
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / max(1, len(transports))
    for k, t in enumerate(transports):
        blocks = summary["transports"][t]["blocks"]
        xs = [i + (k - (len(transports) - 1) / 2) * width for i in range(len(BLOCK_NAMES))]
        inf = [blocks[b]["inference_ms"]["mean"] for b in BLOCK_NAMES]
        over = [blocks[b]["overhead_ms"]["mean"] for b in BLOCK_NAMES]
        ax.bar(xs, inf, width, label=f"{t} inference m_b", color=COLORS[t], alpha=0.6)
        bars = ax.bar(xs, over, width, bottom=inf, label=f"{t} overhead o_b", color=COLORS[t],
                      hatch="//", edgecolor="black", linewidth=0.3)
        ax.bar_label(bars, labels=[f"{o:.2f}" for o in over], fontsize=7)
    ax.set_xticks(range(len(BLOCK_NAMES)), [BLOCK_STEMS[b] for b in BLOCK_NAMES])
    ax.set_xlabel("block")
    ax.set_ylabel("mean time per block (ms)")
    ax.set_title("Time components per block: inference m_b and overhead o_b = deser+dev+share+fwd "
                 "(Fig. 4.4)", fontsize=8)
    ax.legend(fontsize=7)
    common.save_fig(fig, out, f"{NAME}_fig4_4.png")

    # Fig. 4.5: distributions of pipeline inference and overhead (sums over the blocks)
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    for t in transports:
        sums = [eq41(r) for r in raw[t]]
        for ax, key, title in ((axes[0], "inf", "pipeline inference sum m_b"),
                               (axes[1], "overhead", "pipeline overhead sum o_b")):
            ax.hist([v[key] for v in sums], bins=30, density=True, alpha=0.55, label=t, color=COLORS[t])
            ax.set_title(f"{title} (ePDF)", fontsize=9)
            ax.set_xlabel("time per request (ms)")
            ax.set_ylabel("probability density (1/ms)")
    axes[0].legend(fontsize=8)
    common.save_fig(fig, out, f"{NAME}_fig4_5.png")

    # Appendix B: per-block ePDFs of inference, overhead and queue wait
    parts = (("inf", "inference m_b"), ("overhead", "overhead o_b"), ("wait", "queue wait w_b"))
    fig, axes = plt.subplots(len(BLOCK_NAMES), len(parts), figsize=(9, 1.9 * len(BLOCK_NAMES)), squeeze=False)
    for i, b in enumerate(BLOCK_NAMES):
        for j, (key, title) in enumerate(parts):
            ax = axes[i][j]
            for t in transports:
                recs = [r[b] for r in raw[t]]
                vals = ([sum(r.get(k, 0.0) for k in OVERHEAD_PARTS) for r in recs] if key == "overhead"
                        else [r[key] for r in recs])
                ax.hist(vals, bins=30, density=True, alpha=0.55, label=t, color=COLORS[t])
            ax.set_title(f"{BLOCK_STEMS[b]}: {title}", fontsize=8)
            ax.tick_params(labelsize=7)
            if i == len(BLOCK_NAMES) - 1:
                ax.set_xlabel("time (ms)", fontsize=8)
            if j == 0:
                ax.set_ylabel("density (1/ms)", fontsize=8)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Per-block ePDFs (Appendix B)", fontsize=9)
    common.save_fig(fig, out, f"{NAME}_appendix_b.png")

    # Fig. 4.14: memory per block process
    fig, ax = plt.subplots(figsize=(7, 3.4))
    keys = [("rss_mb", "RSS"), ("uss_mb", "USS"), ("vram_mb", "VRAM")]
    series = [(t, k, lab) for t in transports for k, lab in keys
              if any((summary["transports"][t].get("block_memory_mb") or {}).get(b, {}).get(k) is not None
                     for b in BLOCK_NAMES)]
    width = 0.8 / max(1, len(series))
    for k, (t, key, lab) in enumerate(series):
        mem = summary["transports"][t]["block_memory_mb"]
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(BLOCK_NAMES))]
        ax.bar(xs, [mem.get(b, {}).get(key) or 0.0 for b in BLOCK_NAMES], width, label=f"{t} {lab}",
               color=COLORS[t], alpha=0.35 + 0.3 * (key != "rss_mb"), hatch="//" if key == "vram_mb" else None)
    ax.set_xticks(range(len(BLOCK_NAMES)), [BLOCK_STEMS[b] for b in BLOCK_NAMES])
    ax.set_xlabel("block process")
    ax.set_ylabel("memory (MB)")
    ax.set_title("Memory per block process (Fig. 4.14)", fontsize=9)
    ax.legend(fontsize=7)
    common.save_fig(fig, out, f"{NAME}_fig4_14.png")

    # Fig. 4.9: data copied per inference, per hop
    moved = summary.get("data_moved")
    if moved:
        fig, ax = plt.subplots(figsize=(7, 3.4))
        hops = moved["hops"]
        width = 0.8 / len(transports)
        for k, t in enumerate(transports):
            xs = [i + (k - (len(transports) - 1) / 2) * width for i in range(len(hops))]
            ax.bar(xs, [h[f"{t}_bytes_copied"] / 1e6 for h in hops], width, label=t, color=COLORS[t])
        ax.set_xticks(range(len(hops)), [h["hop"] for h in hops], fontsize=7)
        ax.set_xlabel("hop")
        ax.set_ylabel("bytes copied per inference (MB)")
        ax.set_title("Data copied per hop and inference on the CPU (Fig. 4.9)", fontsize=9)
        ax.legend(fontsize=7)
        common.save_fig(fig, out, f"{NAME}_fig4_9.png")


def main(argv=None) -> int:
    ap = common.parser(NAME, __doc__)
    ap.add_argument("--duration", type=float, help=f"seconds per series instead of a count (default "
                                                   f"{DEFAULT_DURATION:g}; the thesis: 120; ignored with --n or --quick)")
    common.add_pipeline_args(ap, "torch threads per block and for the monolithic model (default 1)")
    ap.add_argument("--no-http", action="store_true", help="skip the HTTP* and HTTP split series")
    ap.add_argument("--variants", default="", help=f"also time the pipeline under these variants, comma-separated "
                    f"({', '.join(VARIANTS)}; 'all'; e.g. {DEFAULT_VARIANTS}) and each block alone after an "
                    "idle gap and after a cache flush (issue 11: why a block is slower inside the pipeline)")
    ap.add_argument("--variant-n", type=int, help=f"requests per variant and round (default {VARIANT_N}, --quick 4)")
    ap.add_argument("--variant-rounds", type=int, help=f"rounds over the variants (default {VARIANT_ROUNDS}, "
                                                       "--quick 1)")
    ap.add_argument("--no-floor", action="store_true", help="on a GPU, leave out the monolithic model as a CUDA "
                    "graph and the floor of five torch-only processes (experiments/gpu_floor.py, issue 27)")
    ap.add_argument("--floor-n", type=int, help=f"requests per gpu_floor row on a GPU (default: the series' --n, "
                                                f"else {gpu_floor.DEFAULT_N})")
    args = ap.parse_args(argv)
    variants = list(VARIANTS) if args.variants == "all" else [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)} or 'all'")
    common.setup_logging(args.verbose)
    device, transports = common.device_and_transports(args)
    series = series_from_args(args)
    repo = common.ensure_repo(args.repo)
    settings = {"series": series.describe(), "n": series.n, "duration_s": series.duration, "threads": args.threads,
                "device": device, "batch": 1, "transports": transports, "http": not args.no_http,
                "http_split": not args.no_http, "overhead": "eq. 4.1: sum_b deser + dev + share + fwd (KPI logs)",
                "warmup_rule": f"first min({common.WARMUP_QUICK if args.quick else common.WARMUP_FULL}, N/4) "
                               "samples of every series dropped",
                "client": "1 synchronous client (blockflow.client.Client.infer_details)",
                "monolithic": "full.pt in the client process, interleaved with every pipeline request",
                "quick": args.quick}
    if variants:
        settings["variants"] = variants
    floor_n = args.floor_n or series.n or gpu_floor.DEFAULT_N
    if device.startswith("cuda"):
        settings["gpu_floor"] = ("off (--no-floor)" if args.no_floor else
                                 {"n": floor_n, "warmup": gpu_floor.WARMUP, "when": "after every series, the servers gone"})
    env = common.env_info(settings)
    x = common.input_tensor(1)
    blocks, full = load_models(repo, device, args.threads)
    xd = x.to(device)

    offline = offline_phase(blocks, full, xd, device, series)
    raw, kpi, runs = {}, {}, {}
    with common.blockflow_server(repo) as server:
        for t in transports:
            raw[t], kpi[t], runs[t] = transport_phase(server, t, args.threads, device, full, x, series)
    moved = data_moved(blocks, x, device, (runs.get("tensormq") or {}).get("made_in_slot"))
    http = None if args.no_http else http_phase(repo, args.threads, full, x, device, series)
    split = None if args.no_http else http_split_phase(repo, args.threads, x, series)

    kept_off = common.discard_warmup(offline, args.quick)
    summary = {"offline": {"n": len(offline), "dropped": len(offline) - len(kept_off),
                           "blocks_ms": {b: common.describe([r[b] for r in kept_off]) for b in BLOCK_NAMES},
                           "sum_ms": common.describe([r["sum"] for r in kept_off]),
                           "monolithic_ms": common.describe([r["mono"] for r in kept_off])},
               "transports": {t: {**summarise_transport(raw[t], kpi[t], args.quick), **runs[t]} for t in transports},
               "data_moved": moved}
    if http is not None:
        kept = common.discard_warmup(http, args.quick)
        rtt = common.describe([r["rtt"] for r in kept])
        mono = common.describe([r["mono"] for r in kept])
        summary["http"] = {"n": len(http), "dropped": len(http) - len(kept), "rtt_ms": rtt,
                           "server_inference_ms": common.describe([r["inf"] for r in kept]),
                           "monolithic_interleaved_ms": mono, "ratio_p50": rtt["p50"] / mono["p50"]}
    if split is not None:
        kept = common.discard_warmup(split, args.quick)
        summary["http_split"] = {"n": len(split), "dropped": len(split) - len(kept),
                                 "rtt_ms": common.describe([r["rtt"] for r in kept]),
                                 "server_inference_ms": common.describe([r["inf"] for r in kept])}
    if variants:
        vt = "tensormq" if "tensormq" in transports else transports[0]
        vn = args.variant_n or (4 if args.quick else VARIANT_N)
        vr = args.variant_rounds or (1 if args.quick else VARIANT_ROUNDS)
        alone = alone_phase(blocks, xd, device, max(4, vn // 2))
        runs = variant_phase(repo, variants, vt, args.threads, device, full, x, vn, vr)
        summary["variants"] = summarise_variants(runs, alone, summary["offline"]["blocks_ms"], vt, vn, vr)
    if device.startswith("cuda"):  # issue 27: the monolithic model and the floor in the same run
        summary["gpu_floor"] = {"skipped": "--no-floor"} if args.no_floor else floor_phase(repo, device, floor_n)
    mono_alone = summary["offline"]["monolithic_ms"]["p50"]
    ratios = {t: {"pipeline_p50_ms": s["rtt_ms"]["p50"], "monolithic_p50_ms": s["monolithic_interleaved_ms"]["p50"],
                  "ratio": s["ratio_p50"], "ratio_parts": s["ratio_p50_parts"],
                  "ratio_spread": [min(s["ratio_p50_parts"]), max(s["ratio_p50_parts"])] if s["ratio_p50_parts"] else None,
                  "monolithic_alone_p50_ms": mono_alone,
                  "ratio_vs_alone": s["rtt_ms"]["p50"] / mono_alone, "goal": RATIO_GOAL,
                  "meets_goal": s["ratio_p50"] <= RATIO_GOAL}
              for t, s in summary["transports"].items()}
    data = {"env": env, "settings": settings, "summary": summary, "ratio_pipeline_vs_monolithic": ratios,
            "thesis_gv100": THESIS, "thesis_gv100_derived": THESIS_DERIVED}
    if floor_ratios(summary):
        data["ratio_pipeline_vs_gpu_floor"] = floor_ratios(summary)
    common.write_json(args.out, NAME, data)
    # client samples (rtt) and, in rows of their own, the blocks' KPI records (eq. 4.1 per block)
    header = ["series", "i", "kept", "rtt_ms", "server_ms", "inference_ms", "overhead_ms", "wait_ms", "monolithic_ms"]
    header += [f"{b}.{k}" for b in BLOCK_NAMES for k in COMPONENTS]
    rows = []
    blank = [""] * (len(BLOCK_NAMES) * len(COMPONENTS))
    for t in transports:
        drop = summary["transports"][t]["dropped"]
        for i, r in enumerate(raw[t]):
            rows.append([t, i, int(i >= drop), r["rtt"], r["server"], "", "", "", r["mono"]] + blank)
        drop = common.warmup_count(len(kpi[t]), args.quick)
        for i, r in enumerate(kpi[t]):
            e = eq41(r)
            rows.append([f"{t}.kpi", i, int(i >= drop), "", "", e["inf"], e["overhead"], e["wait"], ""]
                        + [r[b].get(k, "") for b in BLOCK_NAMES for k in COMPONENTS])
    for name, recs in (("http", http or []), ("http_split", split or [])):
        for i, r in enumerate(recs):
            rows.append([name, i, int(i >= summary[name]["dropped"]), r["rtt"], "", r["inf"], "", "",
                         r.get("mono", "")] + blank)
    for i, r in enumerate(offline):
        rows.append(["offline", i, int(i >= summary["offline"]["dropped"]), "", "", r["sum"], "", r["mono"]]
                    + [r[b] if k == "inf" else "" for b in BLOCK_NAMES for k in COMPONENTS])
    common.write_csv(args.out, f"{NAME}_samples.csv", header, rows)
    plot(summary, {t: common.discard_warmup(kpi[t], args.quick) for t in transports}, args.out, env["machine"])
    report(summary, ratios, env, settings)
    return 0


def report(summary: dict, ratios: dict, env: dict, settings: dict) -> None:
    f = lambda d: f"{d['mean']:8.2f} {d['p50']:8.2f} {d['p99']:8.2f}"
    print(f"\nFig. 4.3-4.5 on {env['machine']} ({settings['device']}, {settings['threads']} thread(s), "
          f"{settings['series']} per series):")
    print(f"{'series':30s} {'mean':>8s} {'p50':>8s} {'p99':>8s}   thesis (GV100) mean, (d) = derived")
    if "http_split" in summary:
        print(f"{'HTTP split, 5 block servers':30s} {f(summary['http_split']['rtt_ms'])}   "
              f"{THESIS_DERIVED['http_split_ms']:.0f} (d)")
    if "http" in summary:
        print(f"{'HTTP* full.pt round trip':30s} {f(summary['http']['rtt_ms'])}   ~{THESIS['http_full_ms']:.0f}")
    for t, s in summary["transports"].items():
        th = f"{THESIS[t + '_ms']:.1f}" if t + "_ms" in THESIS else f"{THESIS_DERIVED[t + '_ms']:.1f} (d)"
        print(f"{t + ' round trip':30s} {f(s['rtt_ms'])}   {th}")
        print(f"{'  inference sum m_b':30s} {f(s['inference_ms'])}")
        print(f"{'  overhead sum o_b (eq. 4.1)':30s} {f(s['overhead_ms'])}   {THESIS[t + '_overhead_ms']:.2f}")
        print(f"{'  queue wait sum w_b':30s} {f(s['wait_ms'])}")
        if s.get("way_in_ms", {}).get("n"):
            print(f"{'  way in (client->1st block)':30s} {f(s['way_in_ms'])}")
            print(f"{'  way out (last block->client)':30s} {f(s['way_out_ms'])}")
    print(f"{'offline sum of blocks':30s} {f(summary['offline']['sum_ms'])}   {THESIS['offline_ms']:.3f}")
    print(f"{'monolithic full.pt':30s} {f(summary['offline']['monolithic_ms'])}")
    print("\nper-block mean inference / overhead (ms):")
    for t, s in summary["transports"].items():
        print(f"  {t:9s} " + "  ".join(f"{BLOCK_STEMS[b]} {s['blocks'][b]['inference_ms']['mean']:.2f}/"
                                         f"{s['blocks'][b]['overhead_ms']['mean']:.2f}" for b in BLOCK_NAMES))
    print()
    for t, r in ratios.items():
        print(f"RATIO {t}: median pipeline {r['pipeline_p50_ms']:.2f} ms / median monolithic "
              f"{r['monolithic_p50_ms']:.2f} ms (interleaved) = {r['ratio']:.3f}x "
              + (f"({len(r['ratio_parts'])} part{'s' * (len(r['ratio_parts']) != 1)} of the series: "
                 f"{r['ratio_spread'][0]:.3f}-{r['ratio_spread'][1]:.3f}x) "
                 if r.get("ratio_spread") else "") +
              f"(goal <= {RATIO_GOAL:.2f}x: {'met' if r['meets_goal'] else 'NOT met'}; "
              f"vs monolithic alone {r['ratio_vs_alone']:.3f}x)")
    lines = floor_lines(summary)
    if lines:
        print()
        print("\n".join(lines))
    var = summary.get("variants")
    if var:
        print(f"\nvariants ({var['transport']}, {var['n_per_round']} requests x {var['rounds']} round(s) each): "
              "ratio p50, block inference p50 slowdown vs alone, minor faults per request")
        for v, r in var["variants"].items():
            print(f"  {v:12s} {r['ratio_p50']:.3f}x  " + "  ".join(
                f"{BLOCK_STEMS[b]} {r['block_slowdown_pct'].get(b, float('nan')):+.0f}%/"
                f"{r['minor_faults_per_request'][b]:.0f}" for b in BLOCK_NAMES))
        for mode, m in var.get("alone", {}).get("modes", {}).items():
            print(f"  alone {mode:14s} " + "  ".join(
                f"{BLOCK_STEMS[b]} {m['block_ms'][b]['p50']:.2f} ms/{m['minor_faults_per_call'][b]:.0f}"
                for b in BLOCK_NAMES))


if __name__ == "__main__":
    sys.exit(main())
