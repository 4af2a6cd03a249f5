"""Dynamic batching at shared blocks (issue 15): throughput and p99 against offered load.

The shared ResNet50 topology of configs/resnet50_shared.json (two tasks, ``classify`` and
``special``, sharing block1-3) under one asynchronous client sending batch-1 requests as a
Poisson process, the two tasks in turn. Every offered rate runs twice on the same server:
without batching (today's behaviour) and with ``batching`` on every block
(``--max-batch``, ``max_queue_delay_us`` from ``--delay``, default ``auto``). Per rate: delivered
throughput (replies inside the sending window / window) and p50/p99 round trip.

Goals (issue 15): saturation throughput with batching >= 1.3x without on a CPU (>= 3x on a GPU);
at 50 % of the unbatched saturation rate, p99 with ``auto`` no worse than 1.1x unbatched.

    python -m experiments.batching [--quick] [--rates 4,8,...] [--duration S] [--max-batch 8] [--delay auto|US]
"""
from __future__ import annotations

import copy
import json
import logging
import os
import sys

from experiments import common
from experiments.throughput import measure_rate, saturation

log = logging.getLogger("experiments.batching")

NAME = "batching"
CONFIG = os.path.join(common.ROOT, "configs", "resnet50_shared.json")
TASKS = ["classify", "special"]
CPU_RATES = (4, 8, 12, 16, 20, 24, 28, 32)
GPU_RATES = (50, 100, 200, 300, 400, 600, 800)
QUICK_RATES = (6, 30)


def topology(max_batch: int | None, delay, device: str, threads: int | None) -> dict:
    with open(CONFIG) as f:
        update = json.load(f)
    update = copy.deepcopy(update)
    for b in update["blocks"]:
        b["device"] = device
        if threads:
            b["threads"] = threads
        if max_batch:
            b["batching"] = {"max_batch": max_batch, "max_queue_delay_us": delay}
    return update


def plot(results: dict, out: str, machine: str) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for (label, rows), color in zip(results.items(), ("tab:blue", "tab:green")):
        xs = [r["offered_rps"] for r in rows]
        axes[0].plot(xs, [r["delivered_rps"] for r in rows], marker="o", color=color, label=label)
        axes[1].plot(xs, [r["latency_ms"].get("p99") for r in rows], marker="x", color=color, label=f"{label} p99")
    axes[0].set_xlabel("offered rate (req/s, Poisson, two tasks)")
    axes[0].set_ylabel("delivered throughput (req/s)")
    axes[0].set_title(f"Batching at shared blocks - {machine}", fontsize=9)
    axes[1].set_xlabel("offered rate (req/s, Poisson, two tasks)")
    axes[1].set_ylabel("p99 round trip (ms)")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.legend(fontsize=7)
    common.save_fig(fig, out, f"{NAME}.png")


def main(argv=None) -> int:
    ap = common.parser(NAME, __doc__)
    ap.add_argument("--rates", type=lambda s: [float(v) for v in s.split(",") if v],
                    help="comma-separated offered rates in req/s (default: 4..32 on CPU, 50..800 on GPU)")
    ap.add_argument("--duration", type=float, help="seconds per rate (default 30, --quick 4)")
    ap.add_argument("--max-batch", type=int, default=8, help="max_batch of every block when batching (default 8)")
    ap.add_argument("--delay", default="auto", help="max_queue_delay_us: 'auto' (default) or microseconds")
    common.add_pipeline_args(ap, transports=False)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    common.setup_logging(args.verbose)
    device, _ = common.device_and_transports(args)
    delay = args.delay if args.delay == "auto" else int(args.delay)
    rates = args.rates or list(QUICK_RATES if args.quick else (GPU_RATES if device.startswith("cuda") else CPU_RATES))
    duration = args.duration or (4.0 if args.quick else 30.0)
    repo = common.ensure_repo(args.repo)
    settings = {"rates": rates, "duration_s": duration, "device": device, "threads": args.threads,
                "max_batch": args.max_batch, "max_queue_delay_us": delay, "tasks": TASKS, "seed": args.seed,
                "quick": args.quick, "client": "1 asynchronous client, Poisson arrivals, tasks in turn"}
    env = common.env_info(settings)
    x = common.input_tensor(1)
    results: dict[str, list[dict]] = {}
    with common.blockflow_server(repo) as server:
        for label, mb in (("unbatched", None), (f"batched (max {args.max_batch}, {delay})", args.max_batch)):
            server.update(topology(mb, delay, device, args.threads))
            from blockflow.client import Client
            with Client(server.dispatcher, timeout=120) as c:
                for t in TASKS * 2:
                    c.infer(t, x)
            watch = dict(server.block_pids())
            results[label] = []
            for k, rate in enumerate(rates):
                row = measure_rate(server, watch, x, rate, duration, args.quick, args.seed + k, f"{label} {rate:g}/s",
                                   tasks=TASKS)
                row.pop("samples", None)
                results[label].append(row)
                log.info("%s offered %.1f/s: delivered %.2f/s, p50 %.1f ms, p99 %.1f ms", label, rate,
                         row["delivered_rps"], row["latency_ms"].get("p50", float("nan")),
                         row["latency_ms"].get("p99", float("nan")))
    sat = {label: saturation(rows) for label, rows in results.items()}
    (base, base_rows), (batched, batched_rows) = list(results.items())
    gain = sat[batched]["saturation_rps"] / sat[base]["saturation_rps"] if sat[base]["saturation_rps"] else None
    half = sat[base]["saturation_rps"] / 2
    k_half = min(range(len(rates)), key=lambda k: abs(rates[k] - half))
    p99_b, p99_u = (batched_rows[k_half]["latency_ms"].get("p99"), base_rows[k_half]["latency_ms"].get("p99"))
    summary = {"saturation_gain": gain, "half_load_rate": rates[k_half],
               "p99_ratio_at_half_load": (p99_b / p99_u) if p99_b and p99_u else None,
               "goals": {"saturation_gain_cpu": 1.3, "saturation_gain_gpu": 3.0, "p99_ratio_at_half_load": 1.1}}
    common.write_json(args.out, NAME, {"env": env, "settings": settings, "rows": results, "saturation": sat,
                                       "summary": summary})
    plot(results, args.out, env["machine"])
    print(f"\nBatching at shared blocks on {env['machine']} ({device}, {duration:g} s per rate):")
    print(f"{'offered':>8s} " + " ".join(f"{lbl[:22]:>22s} {'p50':>8s} {'p99':>8s}" for lbl in results))
    for k, rate in enumerate(rates):
        line = f"{rate:8.1f} "
        for rows in results.values():
            r = rows[k]
            line += (f"{r['delivered_rps']:22.2f} {r['latency_ms'].get('p50', float('nan')):8.1f} "
                     f"{r['latency_ms'].get('p99', float('nan')):8.1f} ")
        print(line)
    for label, s in sat.items():
        print(f"saturation {label}: {s['saturation_rps']:.2f} req/s")
    print(f"saturation gain {gain:.2f}x (goal >= 1.3x on a CPU); p99 batched/unbatched at {rates[k_half]:g} req/s: "
          f"{summary['p99_ratio_at_half_load'] or float('nan'):.2f} (goal <= 1.1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
