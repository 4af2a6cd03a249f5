"""Throughput and memory under Poisson arrivals at increasing rate (thesis Figs. 4.12 and 4.13).

One client sends batch-1 requests asynchronously as a Poisson process of rate L (exponential
gaps, seeded) for D seconds per rate, through the 4-block ResNet50 (+head) pipeline, over
``zeromq`` and ``tensormq``. Per offered rate L:

  delivered throughput  replies received inside the D-second sending window / D (the thesis's
                        "results received from a Collector per time unit");
  latency percentiles   p50/p90/p99 of the round trip of the requests sent in the window (the
                        first min(250, n/4) dropped as warm-up, min(5, n/4) in --quick);
  RAM                   mean and peak RSS of the block processes plus the dispatcher, sampled
                        every 0.25 s while the rate runs (queued tensors live there);
  VRAM                  the same for device memory per process where a GPU is present (NVML).

After each window the script waits for the backlog to drain before the next rate starts. The
saturation point of a transport is its largest delivered throughput; the knee is the largest
offered rate whose delivered throughput is still at least 90 % of the rate actually sent.

On the GV100 the thesis saw ZeroMQ saturate near 160 tensors/s and TensorMQ near 217 tensors/s.
Here a 2-core CPU saturates around 2 cores / (CPU time of one inference), about 20 req/s, so
the default rates are 2..25 req/s on a CPU and 20..400 on a GPU; D = 6 s per rate (the thesis
gives no length; the CPU run fits in 2.5 minutes on 2 cores). --quick (a smoke run): one rate,
6 req/s, for 2 s.

    python -m experiments.throughput [--quick] [--rates 2,4,...] [--duration S] [--threads T]
"""
from __future__ import annotations

import logging
import sys
import time

import torch

from experiments import common
from experiments.utilization import GpuSampler

log = logging.getLogger("experiments.throughput")

NAME = "throughput"
#: Default rates and seconds per rate on a CPU: 14 windows and their drains fit in 2.5 minutes on 2 cores.
CPU_RATES = (2, 4, 8, 12, 16, 20, 25)
DEFAULT_DURATION = 6.0
GPU_RATES = tuple(range(20, 401, 20))
QUICK_RATES = (6,)
KNEE = 0.90
#: Fig. 4.12 text (GV100): maximum delivered throughput, tensors/s.
THESIS = {"zeromq_saturation_rps": 160.0, "tensormq_saturation_rps": 217.0}


def poisson_run(address: str, x: torch.Tensor, rate: float, duration: float, seed: int, label: str,
                drain_timeout: float = 300.0, tasks: list[str] | None = None) -> tuple[list[dict], float]:
    """Send for ``duration`` s at ``rate``/s (Poisson, blockflow.loadgen), then wait for the replies;
    one dict per request (sent/done in s from the start, rtt in ms, status, task). With several
    ``tasks``, requests take them in turn."""
    from blockflow.loadgen import generate_load
    with common.Progress(int(duration), label) as bar:
        run = generate_load(address, tasks or [common.TASK], inputs=x, rate=rate, duration=duration, seed=seed,
                            timeout=drain_timeout, drain=drain_timeout, progress=bar.to)
    recs = [{"sent": r.sent, "task": r.task, "status": r.status,
             **({"done": r.done, "rtt": r.rtt_ms} if r.done is not None else {})} for r in run.records]
    return recs, run.drain_s


def measure_rate(server, watch: dict, x, rate: float, duration: float, quick: bool, seed: int, label: str,
                 tasks: list[str] | None = None) -> dict:
    with common.CpuSampler(watch, 0.25) as cpu, GpuSampler(watch, 0.25) as gpu:
        t_cpu0 = cpu.t0
        t_run0 = time.monotonic()
        recs, drain = poisson_run(server.dispatcher, x, rate, duration, seed, label, tasks=tasks)
    offset = t_run0 - t_cpu0
    in_window = [s for s in cpu.samples if offset <= s["t"] <= offset + duration]
    rss = [sum(s.get(n + ".rss_mb") or 0.0 for n in watch) for s in in_window]
    vram = [sum(s.get(n + ".vram_mb") or 0.0 for n in watch) for s in gpu.samples
            if offset <= s["t"] <= offset + duration]
    ok = [r for r in recs if r["status"] == "ok"]
    kept = common.discard_warmup(ok, quick)
    delivered = sum(1 for r in ok if r["done"] <= duration) / duration
    statuses = {}
    for r in recs:
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
    lat = common.describe([r["rtt"] for r in kept])
    return {"offered_rps": rate, "sent": len(recs), "sent_rps": len(recs) / duration, "ok": len(ok),
            "dropped": len(ok) - len(kept), "statuses": statuses, "delivered_rps": delivered,
            "completed_rps_incl_drain": len(ok) / (duration + max(drain, 0.0)), "drain_s": drain,
            "latency_ms": lat, "ram_mb_mean": sum(rss) / len(rss) if rss else None,
            "ram_mb_max": max(rss) if rss else None,
            "vram_mb_mean": (sum(vram) / len(vram)) if (gpu.available and vram) else None,
            "vram_mb_max": max(vram) if (gpu.available and vram) else None, "gpu_reason": gpu.reason,
            "samples": [[r["sent"], r.get("rtt"), r["status"]] for r in recs]}


def saturation(rows: list[dict]) -> dict:
    best = max(rows, key=lambda r: r["delivered_rps"])
    knee = [r["offered_rps"] for r in rows if r["delivered_rps"] >= KNEE * r["sent_rps"]]
    return {"saturation_rps": best["delivered_rps"], "at_offered_rps": best["offered_rps"],
            "knee_offered_rps": max(knee) if knee else None,
            "rule": f"saturation = largest delivered throughput; knee = largest offered rate with delivered >= "
                    f"{KNEE:.0%} of sent"}


def plot(results: dict, sat: dict, out: str, machine: str, has_gpu: bool) -> None:
    plt = common.pyplot()
    colors = {"zeromq": "tab:blue", "tensormq": "tab:orange"}
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    top = 0
    for t, rows in results.items():
        xs = [r["offered_rps"] for r in rows]
        top = max(top, max(xs))
        axes[0].plot(xs, [r["delivered_rps"] for r in rows], marker="o", color=colors[t],
                     label=f"{t} (max {sat[t]['saturation_rps']:.1f}/s)")
        axes[1].plot(xs, [r["latency_ms"].get("p50") for r in rows], marker="o", color=colors[t], label=f"{t} p50")
        axes[1].plot(xs, [r["latency_ms"].get("p99") for r in rows], marker="x", ls="--", color=colors[t],
                     label=f"{t} p99")
    axes[0].plot([0, top], [0, top], color="gray", ls=":", lw=0.8, label="delivered = offered")
    axes[0].set_xlabel("offered rate (req/s, Poisson)")
    axes[0].set_ylabel("delivered throughput (req/s)")
    axes[0].set_title(f"Pipeline throughput (Fig. 4.12) - {machine}", fontsize=9)
    axes[1].set_xlabel("offered rate (req/s, Poisson)")
    axes[1].set_ylabel("round trip (ms)")
    axes[1].set_yscale("log")
    axes[1].set_title("latency percentiles", fontsize=9)
    for ax in axes:
        ax.legend(fontsize=7)
    common.save_fig(fig, out, f"{NAME}_fig4_12.png")

    fig, ax = plt.subplots(figsize=(6, 3.4))
    key, label = ("vram_mb_mean", "mean VRAM of blocks + dispatcher (MB)") if has_gpu else \
        ("ram_mb_mean", "mean RSS of blocks + dispatcher (MB)")
    for t, rows in results.items():
        ax.plot([r["offered_rps"] for r in rows], [r[key] for r in rows], marker="o", color=colors[t], label=t)
    ax.set_xlabel("offered rate (req/s, Poisson)")
    ax.set_ylabel(label)
    ax.set_title("Memory under different arrival rates (Fig. 4.13" + ("" if has_gpu else ", RAM: no GPU here") + ")",
                 fontsize=9)
    ax.legend(fontsize=8)
    common.save_fig(fig, out, f"{NAME}_fig4_13.png")


def main(argv=None) -> int:
    ap = common.parser(NAME, __doc__)
    ap.add_argument("--rates", type=lambda s: [float(v) for v in s.split(",") if v],
                    help="comma-separated offered rates in req/s (default: 2..25 on CPU, 20..400 on GPU)")
    ap.add_argument("--duration", type=float, help=f"seconds per rate (default {DEFAULT_DURATION:g}, --quick 2)")
    common.add_pipeline_args(ap)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    common.setup_logging(args.verbose)
    device, transports = common.device_and_transports(args)
    rates = args.rates or list(QUICK_RATES if args.quick else (GPU_RATES if device.startswith("cuda") else CPU_RATES))
    duration = args.duration or (2.0 if args.quick else DEFAULT_DURATION)
    repo = common.ensure_repo(args.repo)
    settings = {"rates": rates, "duration_s": duration, "transports": transports, "threads": args.threads,
                "device": device, "batch": 1, "seed": args.seed, "quick": args.quick, "n": args.n,
                "warmup_rule": f"first min({common.WARMUP_QUICK if args.quick else common.WARMUP_FULL}, n/4) "
                               "replies of every rate dropped from the latency percentiles",
                "client": "1 asynchronous client, Poisson arrivals (exponential gaps)"}
    env = common.env_info(settings)
    x = common.input_tensor(1)
    results, has_gpu = {}, False
    with common.blockflow_server(repo) as server:
        for t in transports:
            server.update(common.pipeline_update(t, threads=args.threads, device=device))
            from blockflow.client import Client
            with Client(server.dispatcher, timeout=120) as c:
                for _ in range(3):
                    c.infer(common.TASK, x)
            watch = dict(server.block_pids())
            dpid = server.dispatcher_pid()
            if dpid:
                watch["dispatcher"] = dpid
            results[t] = []
            for k, rate in enumerate(rates):
                row = measure_rate(server, watch, x, rate, duration, args.quick, args.seed + k, f"{t} {rate:g}/s")
                has_gpu = has_gpu or row["vram_mb_mean"] is not None
                results[t].append(row)
                log.info("%s offered %.1f/s: delivered %.2f/s, p50 %.1f ms, p99 %.1f ms, RSS %.0f MB (drain %.1fs)",
                         t, rate, row["delivered_rps"], row["latency_ms"].get("p50", float("nan")),
                         row["latency_ms"].get("p99", float("nan")), row["ram_mb_mean"] or 0, row["drain_s"])
    sat = {t: saturation(rows) for t, rows in results.items()}
    samples = {t: [r.pop("samples") for r in rows] for t, rows in results.items()}
    common.write_json(args.out, NAME, {"env": env, "settings": settings, "rows": results, "saturation": sat,
                                       "vram_note": None if has_gpu else "no GPU here: VRAM columns are null, "
                                                                         "Fig. 4.13 shows RAM instead",
                                       "thesis_gv100": THESIS})
    common.write_csv(args.out, f"{NAME}_samples.csv", ["transport", "offered_rps", "sent_s", "rtt_ms", "status"],
                     ([t, rates[k], s[0], "" if s[1] is None else s[1], s[2]]
                      for t, per_rate in samples.items() for k, ss in enumerate(per_rate) for s in ss))
    plot(results, sat, args.out, env["machine"], has_gpu)
    print(f"\nFigs. 4.12-4.13 on {env['machine']} ({device}, {duration:g} s per rate):")
    print(f"{'offered':>8s} " + " ".join(f"{t + ' deliv':>14s} {'p50':>8s} {'p99':>8s} {'RSS MB':>7s}"
                                         for t in transports))
    for k, rate in enumerate(rates):
        line = f"{rate:8.1f} "
        for t in transports:
            r = results[t][k]
            line += (f"{r['delivered_rps']:14.2f} {r['latency_ms'].get('p50', float('nan')):8.1f} "
                     f"{r['latency_ms'].get('p99', float('nan')):8.1f} {r['ram_mb_mean'] or 0:7.0f} ")
        print(line)
    for t, s in sat.items():
        print(f"saturation {t}: {s['saturation_rps']:.2f} req/s (at offered {s['at_offered_rps']:g}/s); knee at "
              f"offered {s['knee_offered_rps']}/s; thesis GV100 {THESIS[t + '_saturation_rps']:.0f}/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
