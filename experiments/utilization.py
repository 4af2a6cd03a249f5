"""CPU (and GPU) utilisation over time for both transports (thesis Fig. 4.6).

One synchronous client sends batch-1 requests back to back (the next as soon as the previous
reply is in: the maximum rate a synchronous client allows) through the 4-block ResNet50 (+head)
pipeline for D seconds per transport. Meanwhile psutil samples each block process's CPU% every
0.25 s; as in the thesis the per-process timelines are summed element-wise and divided by the
number of blocks ("CPU per block", 100 % = one core). The dispatcher's CPU and the sum over all
blocks (100 % = one core; this machine has ``os.cpu_count()`` cores) are recorded too. Where a GPU
is present, NVML's device utilisation is sampled at the same rate (the left half of Fig. 4.6);
on a CPU-only machine the GPU timeline is absent and the JSON says so. The first seconds are
dropped as warm-up (the samples taken while the first min(250, n/4) requests ran, min(5, n/4)
in --quick).

Defaults: D = 32 s per transport (the thesis gives no length for Fig. 4.6; the run fits in 1.5
minutes on a 2-core machine); --quick: 4 s.

    python -m experiments.utilization [--quick] [--duration S] [--interval S] [--threads T]
"""
from __future__ import annotations

import logging
import statistics
import sys
import threading
import time

import torch

from experiments import common

log = logging.getLogger("experiments.utilization")

NAME = "utilization"
#: The thesis's Fig. 4.6 text: TensorMQ's GPU utilisation about 2.0x ZeroMQ's, for 2.8x less time.
THESIS = {"gpu_util_ratio_tensormq_over_zeromq": 2.0, "latency_ratio_zeromq_over_tensormq": 2.8}


class GpuSampler:
    """NVML samples every ``interval`` s: device utilisation %, memory used, power, and the memory
    each of ``pids`` holds on the device. Does nothing (``available`` False) without NVML/CUDA."""

    def __init__(self, pids: dict[str, int] | None = None, interval: float = 0.25, index: int | None = None):
        self.pids = pids or {}
        self.interval = interval
        self.samples: list[dict] = []
        self.available, self.reason = False, None
        self.handles = []
        try:
            if not torch.cuda.is_available():
                raise RuntimeError("torch sees no CUDA device")
            import pynvml
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            idx = range(count) if index is None else [index]
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in idx]
            self.nvml = pynvml
            self.available = True
        except Exception as exc:  # no driver, no GPU, no pynvml: CPU-only machine
            self.reason = f"{type(exc).__name__}: {exc}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="gpu-sampler")
        self.t0 = time.monotonic()

    def energy_mj(self) -> float | None:
        """Total energy (mJ) the devices consumed since the driver loaded, where NVML offers it."""
        if not self.available:
            return None
        try:
            return float(sum(self.nvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in self.handles))
        except Exception:
            return None

    def _loop(self):
        nv = self.nvml
        while not self._stop.wait(self.interval):
            rec = {"t": time.monotonic() - self.t0, "util": [], "mem_used_mb": [], "power_w": []}
            per_pid = {}
            for h in self.handles:
                try:
                    rec["util"].append(nv.nvmlDeviceGetUtilizationRates(h).gpu)
                    rec["mem_used_mb"].append(nv.nvmlDeviceGetMemoryInfo(h).used / 2**20)
                    rec["power_w"].append(nv.nvmlDeviceGetPowerUsage(h) / 1e3)
                    for p in nv.nvmlDeviceGetComputeRunningProcesses(h):
                        if p.usedGpuMemory is not None:
                            per_pid[p.pid] = per_pid.get(p.pid, 0.0) + p.usedGpuMemory / 2**20
                except Exception as exc:
                    log.debug("NVML sample failed: %s", exc)
            for name, pid in self.pids.items():
                rec[name + ".vram_mb"] = per_pid.get(pid)
            self.samples.append(rec)

    def __enter__(self):
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2)


def sync_client_run(address: str, x: torch.Tensor, duration: float, label: str) -> list[tuple[float, float]]:
    """Back-to-back requests for ``duration`` s; (t_sent since start, rtt ms) per request."""
    from blockflow.client import Client
    out = []
    with Client(address, timeout=120) as c, common.Progress(int(duration), label) as bar:
        t_start = time.monotonic()
        shown = 0
        while time.monotonic() - t_start < duration:
            t0 = time.monotonic()
            c.infer(common.TASK, x, timeout=120)
            out.append((t0 - t_start, (time.monotonic() - t0) * 1e3))
            now = min(int(time.monotonic() - t_start), int(duration))
            if now > shown:
                bar.update(now - shown)
                shown = now
    return out


def measure(server, transport: str, duration: float, interval: float, threads: int, device: str, quick: bool,
            x: torch.Tensor) -> dict:
    from blockflow.client import Client
    server.update(common.pipeline_update(transport, threads=threads, device=device))
    pids = server.block_pids()
    blocks = sorted(pids)
    dpid = server.dispatcher_pid()
    watch = dict(pids, **({"dispatcher": dpid} if dpid else {}))
    with Client(server.dispatcher, timeout=120) as c:
        c.infer(common.TASK, x)
    with common.CpuSampler(watch, interval) as cpu, GpuSampler(pids, interval) as gpu:
        # the samplers' clocks start at construction; align the request times with theirs
        t_offset = time.monotonic() - cpu.t0
        reqs = sync_client_run(server.dispatcher, x, duration, f"{transport} sync client")
    warm_n = common.warmup_count(len(reqs), quick)
    t_warm = (reqs[warm_n][0] if warm_n < len(reqs) else 0.0) + t_offset
    timeline = []
    for s in cpu.samples:
        vals = [s.get(b) for b in blocks]
        if any(v is None for v in vals):
            continue
        timeline.append({"t": s["t"], "cpu_per_block": sum(vals) / len(blocks), "cpu_blocks_total": sum(vals),
                         "cpu_dispatcher": s.get("dispatcher"), **{f"cpu.{b}": s[b] for b in blocks},
                         "rss_blocks_mb": sum(s.get(b + ".rss_mb") or 0.0 for b in blocks)})
    gpu_timeline = [{"t": g["t"], "gpu_util": statistics.fmean(g["util"]) if g["util"] else None,
                     "gpu_mem_used_mb": sum(g["mem_used_mb"]) if g["mem_used_mb"] else None,
                     "gpu_power_w": sum(g["power_w"]) if g["power_w"] else None} for g in gpu.samples]
    kept = [r for r in timeline if r["t"] >= t_warm]
    kept_gpu = [r for r in gpu_timeline if r["t"] >= t_warm and r["gpu_util"] is not None]
    rtts = [r[1] for r in reqs[warm_n:]]
    span = (reqs[-1][0] + reqs[-1][1] / 1e3 - reqs[warm_n][0]) if len(reqs) > warm_n else duration
    res = {"transport": transport, "requests": len(reqs), "dropped_requests": warm_n, "warmup_until_s": t_warm,
           "rtt_ms": common.describe(rtts), "inferences_per_s": len(rtts) / span if span > 0 else None,
           "cpu_per_block_pct": common.describe([r["cpu_per_block"] for r in kept]),
           "cpu_blocks_total_pct": common.describe([r["cpu_blocks_total"] for r in kept]),
           "cpu_dispatcher_pct": common.describe([r["cpu_dispatcher"] for r in kept
                                                  if r["cpu_dispatcher"] is not None]),
           "cpu_per_process_mean_pct": {b: statistics.fmean(r[f"cpu.{b}"] for r in kept) if kept else None
                                        for b in blocks},
           "gpu": {"available": gpu.available, "reason": gpu.reason,
                   "util_pct": common.describe([r["gpu_util"] for r in kept_gpu]) if gpu.available else None},
           "timeline": timeline, "gpu_timeline": gpu_timeline}
    return res


def plot(results: dict, out: str, machine: str) -> None:
    plt = common.pyplot()
    has_gpu = any(r["gpu"]["available"] for r in results.values())
    fig, axes = plt.subplots(1, 2 if has_gpu else 1, figsize=(9 if has_gpu else 6, 3.4), squeeze=False)
    axes = axes[0]
    colors = {"zeromq": "tab:blue", "tensormq": "tab:orange"}
    ax_cpu = axes[-1]
    for t, r in results.items():
        ax_cpu.plot([s["t"] for s in r["timeline"]], [s["cpu_per_block"] for s in r["timeline"]], color=colors[t],
                    label=f"{t} (mean {r['cpu_per_block_pct'].get('mean', float('nan')):.1f} %)", lw=1)
        ax_cpu.axvline(r["warmup_until_s"], color=colors[t], ls=":", lw=0.8)
        if has_gpu:
            axes[0].plot([s["t"] for s in r["gpu_timeline"]], [s["gpu_util"] for s in r["gpu_timeline"]],
                         color=colors[t], label=t, lw=1)
    ax_cpu.set_xlabel("time (s)")
    ax_cpu.set_ylabel("CPU per block (%, sum / blocks)")
    ax_cpu.set_title(f"CPU utilisation (Fig. 4.6 right) - {machine}", fontsize=9)
    ax_cpu.legend(fontsize=8)
    if has_gpu:
        axes[0].set_xlabel("time (s)")
        axes[0].set_ylabel("GPU utilisation (%)")
        axes[0].set_title("GPU utilisation (Fig. 4.6 left)", fontsize=9)
        axes[0].legend(fontsize=8)
    common.save_fig(fig, out, f"{NAME}_fig4_6.png")


def main(argv=None) -> int:
    ap = common.parser(NAME, __doc__)
    ap.add_argument("--duration", type=float, help="seconds per transport (default 32, --quick 4)")
    ap.add_argument("--interval", type=float, default=0.25, help="sampling interval in seconds (default 0.25)")
    common.add_pipeline_args(ap)
    args = ap.parse_args(argv)
    common.setup_logging(args.verbose)
    device, transports = common.device_and_transports(args)
    duration = args.duration or (4.0 if args.quick else 32.0)
    repo = common.ensure_repo(args.repo)
    settings = {"duration_s": duration, "interval_s": args.interval, "transports": transports,
                "threads": args.threads, "device": device, "batch": 1, "quick": args.quick, "n": args.n,
                "client": "1 synchronous client, back to back",
                "cpu_per_block": "sum of the block processes' CPU% / number of blocks (thesis 4.2.2)"}
    env = common.env_info(settings)
    x = common.input_tensor(1)
    results = {}
    with common.blockflow_server(repo) as server:
        for t in transports:
            results[t] = measure(server, t, duration, args.interval, args.threads, device, args.quick, x)
    summary = {t: {k: v for k, v in r.items() if k not in ("timeline", "gpu_timeline")} for t, r in results.items()}
    gpu_note = None if any(r["gpu"]["available"] for r in results.values()) else \
        f"no GPU timeline: {next(iter(results.values()))['gpu']['reason']}"
    common.write_json(args.out, NAME, {"env": env, "settings": settings, "summary": summary, "gpu_note": gpu_note,
                                       "timelines": {t: r["timeline"] for t, r in results.items()},
                                       "gpu_timelines": {t: r["gpu_timeline"] for t, r in results.items()},
                                       "thesis_gv100": THESIS})
    blocks = [n for n, _ in common.PIPELINE]
    common.write_csv(args.out, f"{NAME}_timeline.csv",
                     ["transport", "t_s", "cpu_per_block", "cpu_blocks_total", "cpu_dispatcher",
                      *[f"cpu.{b}" for b in blocks]],
                     ([t, s["t"], s["cpu_per_block"], s["cpu_blocks_total"], s["cpu_dispatcher"],
                       *[s.get(f"cpu.{b}") for b in blocks]] for t, r in results.items() for s in r["timeline"]))
    plot(results, args.out, env["machine"])
    print(f"\nFig. 4.6 on {env['machine']} ({device}, {duration:g} s per transport, sampled every {args.interval} s):")
    for t, r in summary.items():
        gpu = (f", GPU util mean {r['gpu']['util_pct']['mean']:.1f} %" if r["gpu"]["available"] and
               r["gpu"]["util_pct"].get("n") else "")
        print(f"{t:9s} CPU per block mean {r['cpu_per_block_pct'].get('mean', float('nan')):5.1f} %, "
              f"all blocks {r['cpu_blocks_total_pct'].get('mean', float('nan')):5.1f} % of one core, dispatcher "
              f"{r['cpu_dispatcher_pct'].get('mean', float('nan')):4.1f} %; {r['inferences_per_s'] or 0:.2f} "
              f"inferences/s, RTT p50 {r['rtt_ms'].get('p50', float('nan')):.1f} ms{gpu}")
    if gpu_note:
        print(gpu_note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
