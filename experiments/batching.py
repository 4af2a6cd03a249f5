"""Dynamic batching at shared blocks (issue 15): throughput and p99 against offered load.

The shared ResNet50 topology of configs/resnet50_shared.json (two tasks, ``classify`` and
``special``, sharing block1-3) deployed twice on one server, side by side: once without batching
(today's behaviour; blocks and tasks named ``<name>-plain``) and once with ``batching`` on every
block (``--max-batch``, ``max_queue_delay_us`` from ``--delay``, default ``auto``; ``<name>-batched``).
Only one of the two gets load at a time (the other's blocks sit idle), so the modes alternate
without respawning anything and run on the same processes, memory and machine state.

1. Sweep: one asynchronous client sends batch-1 requests as a Poisson process, the two tasks in
   turn; every offered rate runs on both modes, one right after the other. Per rate: delivered
   throughput (replies inside the sending window / window) and p50/p99 round trip; saturation is
   the largest delivered throughput.
2. Half load, in rounds: at half the unbatched saturation (``--half-rate``), ``--rounds`` rounds
   of one ``--window``-second window per mode, the order alternating between rounds and both
   windows of a round replaying the same seeded arrival times, so a drift of the shared machine
   hits both modes alike. Per round: p99 of each mode and their ratio; overall: the median and
   min/max of the round ratios, and the p99 ratio of all rounds' samples pooled (hundreds per
   mode) with a bootstrap 95 % interval. The default (6 rounds of 12 s at ~4.5 req/s) gives
   about 320 samples per mode in 2.5 minutes.

Beside the served runs it records what bounds them: each block of the path run alone, in this
process, with the blocks' thread count, at batch 1, 4 and ``--max-batch`` (``compute`` in the
JSON: ms per image, and the throughput the machine's cores allow at that batch size,
cores x 1000 / ms per image of the whole path). Per rate and block it also keeps the KPI logs'
view (``blocks``): requests per batch, batcher wait, inference, copy (``share``) and send
(``fwd``) ms per request.

Goals (issue 15): saturation throughput with batching >= 1.3x without on a CPU (>= 3x on a GPU);
at 50 % of the unbatched saturation rate, p99 with ``auto`` no worse than 1.1x unbatched.

    python -m experiments.batching [--quick] [--rates 4,8,...] [--duration S] [--max-batch 8] [--delay auto|US]
                                   [--rounds 6] [--window 15] [--half-rate R]
"""
from __future__ import annotations

import copy
import json
import logging
import os
import statistics
import sys
import time

from experiments import common
from experiments.throughput import measure_rate, saturation

log = logging.getLogger("experiments.batching")

NAME = "batching"
CONFIG = os.path.join(common.ROOT, "configs", "resnet50_shared.json")
TASKS = ["classify", "special"]
#: ResNet50 on 2 cores saturates near 10 req/s: 5 is half load, 20 twice saturation (<= 3 min in all)
CPU_RATES = (5, 10, 15, 20)
GPU_RATES = (50, 100, 200, 300, 400, 600, 800)
QUICK_RATES = (4, 16)
#: the blocks of one task's path (the other task's b4x/hx have the same shapes and cost)
PATH = ("block1", "block2", "block3", "block4", "head")


#: the two deployments side by side: suffix of their block and task names
MODES = ("plain", "batched")


def topology(max_batch: int, delay, device: str, threads: int | None) -> dict:
    """Both deployments in one update: every block and task of the config twice, ``-plain``
    without batching and ``-batched`` with it."""
    with open(CONFIG) as f:
        config = json.load(f)
    update = {k: v for k, v in config.items() if k not in ("blocks", "tasks")}
    update["blocks"], update["tasks"] = [], []
    for mode in MODES:
        for b in config["blocks"]:
            b = dict(b, name=f"{b['name']}-{mode}", device=device)
            if threads:
                b["threads"] = threads
            if mode == "batched":
                b["batching"] = {"max_batch": max_batch, "max_queue_delay_us": delay}
            update["blocks"].append(b)
        for t in config["tasks"]:
            update["tasks"].append({"id": f"{t['id']}-{mode}", "path": [f"{n}-{mode}" for n in t["path"]]})
    return update


def path_blocks() -> list[str]:
    """The config's block names on the first task's path (one request's blocks)."""
    with open(CONFIG) as f:
        return list(json.load(f)["tasks"][0]["path"])


def tasks_of(mode: str) -> list[str]:
    return [f"{t}-{mode}" for t in TASKS]


def pids_of(server, mode: str) -> dict[str, int]:
    return {n: pid for n, pid in server.block_pids().items() if n.endswith(f"-{mode}")}


def compute_scaling(repo: str, device: str, threads: int, batches: tuple[int, ...], reps: int) -> dict:
    """Each block of the path alone, at each batch size, with ``threads`` torch threads: what a
    batch saves per image on this machine, and the throughput the cores allow at that size."""
    import torch

    from blockflow.blocks.repository import load_block
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        models = [load_block(repo, f"resnet50/{b}.pt", device) for b in PATH]
        inputs = {n: common.input_tensor(n).to(device) for n in batches}
        times = {n: {b: [] for b in PATH} for n in batches}
        cats = {n: {b: [] for b in PATH} for n in batches}
        with torch.inference_mode():
            # rounds over the batch sizes, so a load that comes and goes on a shared machine
            # weighs on every size alike; the first round warms up and is not kept
            for rep in range(reps + 1):
                for n in batches:
                    y = inputs[n]
                    for name, m in zip(PATH, models):
                        # what a block adds to build a batch of n requests: torch.cat of n rows
                        t = time.perf_counter()
                        if n > 1:
                            torch.cat(list(y.split(1)))
                        t_cat = time.perf_counter()
                        y = m(y)
                        if device.startswith("cuda"):
                            torch.cuda.synchronize()
                        if rep:
                            times[n][name].append((time.perf_counter() - t_cat) * 1e3 / n)
                            cats[n][name].append((t_cat - t) * 1e3 / n)
        rows = []
        for n in batches:
            per_block = {b: statistics.median(v) for b, v in times[n].items()}
            cat = sum(statistics.median(v) for v in cats[n].values())
            rows.append({"batch": n, "ms_per_image": sum(per_block.values()), "blocks_ms_per_image": per_block,
                         "cat_ms_per_image": cat})
    finally:
        torch.set_num_threads(saved)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    for r in rows:
        # one request runs every block of its path once; blocks run in parallel on the cores
        r["bound_rps"] = (cores * 1000 / r["ms_per_image"]) if not device.startswith("cuda") else None
    base = rows[0]["ms_per_image"]
    for r in rows:
        r["speedup_per_image"] = base / r["ms_per_image"]
    return {"device": device, "threads": threads, "cores": cores, "reps": reps, "rows": rows,
            "note": "blocks run alone in the experiment's process before the server starts; median of reps"}


def block_view(server, mode: str, t0_wall: float, t1_wall: float) -> dict:
    """The KPI records of ``mode``'s blocks for requests that arrived in [t0_wall, t1_wall]: per
    block (named as in the config), requests per batch, batcher wait, and per request the
    inference (a batch's inference shared by its requests), the copy of its output into the next
    hop's slot (``share``) and the send (``fwd``), in ms."""
    out = {}
    names = sorted(pids_of(server, mode))
    for name in names:
        server.kpi(name)  # writes the block's records out
    for name in names:
        path = os.path.join(server.run_dir, f"{name}.latency.jsonl")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            recs = [r for r in map(json.loads, filter(str.strip, f))
                    if "error" not in r and t0_wall <= r["ts"] <= t1_wall]
        if not recs:
            continue
        sizes = [r.get("requests_in_batch", 1) for r in recs]
        waits = [r.get("batch_wait", 0.0) for r in recs]
        out[name.rsplit("-", 1)[0]] = {
            "requests": len(recs), "mean_requests_in_batch": statistics.fmean(sizes),
            "max_requests_in_batch": max(sizes), "batch_wait_ms_p50": statistics.median(waits),
            "batch_wait_ms_p99": common.pct(waits, 0.99), "wait_ms_p50": statistics.median(r["wait"] for r in recs),
            "inf_ms_per_request": statistics.fmean(r["inf"] / s for r, s in zip(recs, sizes)),
            "share_ms_p50": statistics.median(r["share"] for r in recs),
            "share_ms_mean": statistics.fmean(r["share"] for r in recs),
            "fwd_ms_mean": statistics.fmean(r["fwd"] for r in recs)}
    return out


def half_load_rounds(server, x, rate: float, rounds: int, window: float, seed: int) -> dict:
    """Both modes at ``rate`` in alternating rounds (see the module note): per round the p99 of
    each mode and their ratio; overall the median and spread of the ratios and the pooled ratio
    with a bootstrap 95 % interval."""
    import random

    from blockflow.loadgen import generate_load
    pooled: dict[str, list[float]] = {m: [] for m in MODES}
    per_round, failed = [], {m: 0 for m in MODES}
    t0_wall = time.time()
    for r in range(rounds):
        row = {"round": r + 1, "order": list(MODES if r % 2 == 0 else MODES[::-1])}
        for mode in row["order"]:
            with common.Progress(int(window), f"half load {rate:.1f}/s round {r + 1} {mode}") as bar:
                run = generate_load(server.dispatcher, tasks_of(mode), inputs=x, rate=rate, duration=window,
                                    seed=seed * 1000 + r, timeout=120, drain=120, progress=bar.to)
            rtts = [q.rtt_ms for q in run.records if q.ok]
            failed[mode] += len(run.records) - len(rtts)
            pooled[mode] += rtts
            row[mode] = {"n": len(rtts), "p50": common.pct(rtts, 0.5), "p99": common.pct(rtts, 0.99)}
        pu, pb = row["plain"]["p99"], row["batched"]["p99"]
        row["p99_ratio"] = pb / pu if pu and pb else None
        log.info("half load round %d: p99 plain %.0f ms (n %d), batched %.0f ms (n %d), ratio %.2f", r + 1,
                 pu or float("nan"), row["plain"]["n"], pb or float("nan"), row["batched"]["n"],
                 row["p99_ratio"] or float("nan"))
        per_round.append(row)
    t1_wall = time.time()
    ratios = [row["p99_ratio"] for row in per_round if row["p99_ratio"]]
    p99 = {m: common.pct(v, 0.99) for m, v in pooled.items()}
    boot = []
    rng = random.Random(seed)
    if all(pooled.values()):
        for _ in range(2000):
            u = common.pct([rng.choice(pooled["plain"]) for _ in pooled["plain"]], 0.99)
            b = common.pct([rng.choice(pooled["batched"]) for _ in pooled["batched"]], 0.99)
            boot.append(b / u)
    return {"rate": rate, "rounds": rounds, "window_s": window, "per_round": per_round,
            "p99_ratio_median": statistics.median(ratios) if ratios else None,
            "p99_ratio_min": min(ratios, default=None), "p99_ratio_max": max(ratios, default=None),
            "pooled": {m: common.describe(v) for m, v in pooled.items()},
            "pooled_p99_ratio": (p99["batched"] / p99["plain"]) if p99["plain"] and p99["batched"] else None,
            "pooled_p99_ratio_ci95": [common.pct(boot, 0.025), common.pct(boot, 0.975)] if boot else None,
            "failed": failed, "blocks": {m: block_view(server, m, t0_wall, t1_wall) for m in MODES},
            "note": "same seeded arrival times for both modes in a round; order alternates; bootstrap: "
                    "2000 resamples of each mode's pooled samples, percentile interval"}


def _cpu_seconds(pids: dict[str, int]) -> float:
    """User + system CPU seconds of the block processes so far (a vanished one counts 0)."""
    import psutil
    total = 0.0
    for pid in pids.values():
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def plot(results: dict, out: str, machine: str, compute: dict | None = None) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 3 if compute else 2, figsize=(13 if compute else 9, 3.6))
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
    if compute:
        rows = compute["rows"]
        for r, style in zip((rows[0], rows[-1]), (":", "--")):
            if r.get("bound_rps"):
                axes[0].axhline(r["bound_rps"], color="grey", linestyle=style, linewidth=1,
                                label=f"compute bound, batch {r['batch']}")
        axes[2].plot([r["batch"] for r in rows], [r["ms_per_image"] for r in rows], marker="s", color="tab:red")
        axes[2].set_xlabel(f"batch size (each block alone, {compute['threads']} thread(s))")
        axes[2].set_ylabel("compute per image, whole path (ms)")
        axes[2].set_ylim(bottom=0)
        axes[2].set_title("what a batch saves per image", fontsize=9)
    for ax in axes[:2]:
        ax.legend(fontsize=7)
    common.save_fig(fig, out, f"{NAME}.png")


def main(argv=None) -> int:
    ap = common.parser(NAME, __doc__)
    ap.add_argument("--rates", type=lambda s: [float(v) for v in s.split(",") if v],
                    help="comma-separated offered rates in req/s (default: 5..20 on CPU, 50..800 on GPU)")
    ap.add_argument("--duration", type=float, help="seconds per rate (default 8, --quick 2)")
    ap.add_argument("--max-batch", type=int, default=8, help="max_batch of every block when batching (default 8)")
    ap.add_argument("--delay", default="auto", help="max_queue_delay_us: 'auto' (default) or microseconds")
    ap.add_argument("--rounds", type=int, help="half-load rounds (default 6, --quick 2; 0 skips them)")
    ap.add_argument("--window", type=float, help="seconds per mode and round at half load (default 12, --quick 1)")
    ap.add_argument("--half-rate", type=float, help="rate of the half-load rounds (default: half the unbatched "
                                                    "saturation the sweep measured)")
    common.add_pipeline_args(ap, transports=False)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    common.setup_logging(args.verbose)
    device, _ = common.device_and_transports(args)
    delay = args.delay if args.delay == "auto" else int(args.delay)
    rates = args.rates or list(QUICK_RATES if args.quick else (GPU_RATES if device.startswith("cuda") else CPU_RATES))
    duration = args.duration or (2.0 if args.quick else 8.0)
    rounds = args.rounds if args.rounds is not None else (2 if args.quick else 6)
    window = args.window or (1.0 if args.quick else 12.0)
    repo = common.ensure_repo(args.repo)
    batches = tuple(sorted({1, min(4, args.max_batch), args.max_batch}))
    compute = compute_scaling(repo, device, args.threads or 1, batches, 1 if args.quick else 3)
    for r in compute["rows"]:
        log.info("compute alone, batch %d: %.1f ms per image (%.2fx batch 1), bound %s req/s", r["batch"],
                 r["ms_per_image"], r["speedup_per_image"], f"{r['bound_rps']:.1f}" if r["bound_rps"] else "-")
    settings = {"rates": rates, "duration_s": duration, "device": device, "threads": args.threads,
                "max_batch": args.max_batch, "max_queue_delay_us": delay, "tasks": TASKS, "seed": args.seed,
                "rounds": rounds, "window_s": window, "half_rate": args.half_rate, "quick": args.quick,
                "client": "1 asynchronous client, Poisson arrivals, tasks in turn",
                "deployment": "both modes deployed side by side on one server (-plain, -batched); one loaded at a time"}
    env = common.env_info(settings)
    x = common.input_tensor(1)
    labels = {"plain": "unbatched", "batched": f"batched (max {args.max_batch}, {delay})"}
    results: dict[str, list[dict]] = {label: [] for label in labels.values()}
    from blockflow.client import Client
    with common.blockflow_server(repo) as server:
        server.update(topology(args.max_batch, delay, device, args.threads))
        with Client(server.dispatcher, timeout=120) as c:
            for mode in MODES:
                for t in tasks_of(mode) * (1 if args.quick else 2):
                    c.infer(t, x)
        # each rate runs unbatched and then batched, one right after the other, so that the load
        # other work puts on a shared machine weighs on both alike (rather than on one whole sweep)
        for k, rate in enumerate(rates):
            for mode, label in labels.items():
                watch = pids_of(server, mode)
                cpu0, t0_wall = _cpu_seconds(watch), time.time()
                row = measure_rate(server, watch, x, rate, duration, args.quick, args.seed + k, f"{label} {rate:g}/s",
                                   tasks=tasks_of(mode))
                row.pop("samples", None)
                # CPU the blocks spent per reply (drain included): what a request costs, whatever
                # else runs on the machine
                row["block_cpu_ms_per_reply"] = (_cpu_seconds(watch) - cpu0) * 1e3 / row["ok"] if row["ok"] else None
                row["blocks"] = block_view(server, mode, t0_wall, t0_wall + duration)
                results[label].append(row)
                log.info("%s offered %.1f/s: delivered %.2f/s, p50 %.1f ms, p99 %.1f ms, %.0f CPU ms per reply", label,
                         rate, row["delivered_rps"], row["latency_ms"].get("p50", float("nan")),
                         row["latency_ms"].get("p99", float("nan")), row["block_cpu_ms_per_reply"] or float("nan"))
        sat = {label: saturation(rows) for label, rows in results.items()}
        half_rate = args.half_rate or sat[labels["plain"]]["saturation_rps"] / 2
        half = half_load_rounds(server, x, half_rate, rounds, window, args.seed) if rounds and half_rate else None
    (base, base_rows), (batched, batched_rows) = list(results.items())
    gain = sat[batched]["saturation_rps"] / sat[base]["saturation_rps"] if sat[base]["saturation_rps"] else None
    summary = {"saturation_gain": gain, "half_load_rate": half["rate"] if half else None,
               "p99_ratio_at_half_load": half["p99_ratio_median"] if half else None,
               "p99_ratio_at_half_load_rule": "median over the half-load rounds of p99 batched / p99 unbatched",
               "goals": {"saturation_gain_cpu": 1.3, "saturation_gain_gpu": 3.0, "p99_ratio_at_half_load": 1.1}}
    c_rows = compute["rows"]
    cpu_u, cpu_b = base_rows[-1]["block_cpu_ms_per_reply"], batched_rows[-1]["block_cpu_ms_per_reply"]
    summary["block_cpu_ms_per_reply_at_top_rate"] = {base: cpu_u, batched: cpu_b}
    summary["block_cpu_saving_at_top_rate"] = (cpu_u / cpu_b) if cpu_u and cpu_b else None
    summary["compute_speedup_per_image_at_max_batch"] = c_rows[-1]["speedup_per_image"]
    best = max(c_rows, key=lambda r: r["speedup_per_image"])
    summary["compute_best"] = {"batch": best["batch"], "speedup_per_image": best["speedup_per_image"],
                               "bound_rps": best["bound_rps"]}
    summary["compute_bound_rps"] = {str(r["batch"]): r["bound_rps"] for r in c_rows}
    common.write_json(args.out, NAME, {"env": env, "settings": settings, "rows": results, "saturation": sat,
                                       "half_load": half, "summary": summary, "compute": compute,
                                       "path_blocks": path_blocks()})
    plot(results, args.out, env["machine"], compute)
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
    for r in c_rows:
        bound = f", bound {r['bound_rps']:.1f} req/s" if r["bound_rps"] else ""
        print(f"compute alone at batch {r['batch']}: {r['ms_per_image']:.1f} ms per image "
              f"({r['speedup_per_image']:.2f}x batch 1){bound}; torch.cat of the batch at every block "
              f"{r['cat_ms_per_image']:.2f} ms per image")
    for label, rows in results.items():
        last = rows[-1]["blocks"]
        if last:
            print(f"{label} at {rates[-1]:g} req/s, per block: requests per batch / inference / copy / send ms "
                  "per request: " + ", ".join(
                      f"{b} {v['mean_requests_in_batch']:.1f}/{v['inf_ms_per_request']:.0f}/{v['share_ms_mean']:.1f}"
                      f"/{v['fwd_ms_mean']:.1f}" for b, v in last.items()))
    print(f"block CPU per reply at {rates[-1]:g} req/s: " + ", ".join(
        f"{lbl} {v:.0f} ms" for lbl, v in summary["block_cpu_ms_per_reply_at_top_rate"].items() if v))
    print(f"saturation gain {gain if gain is not None else float('nan'):.2f}x (goal >= 1.3x on a CPU)")
    if half:
        f = lambda v: float("nan") if v is None else v
        print(f"half load, {half['rate']:.2f} req/s, {rounds} rounds of {window:g} s per mode: p99 batched/unbatched "
              "per round " + ", ".join(f"{f(r['p99_ratio']):.2f}" for r in half["per_round"])
              + f"; median {f(half['p99_ratio_median']):.2f} (goal <= 1.1), min {f(half['p99_ratio_min']):.2f}, "
              f"max {f(half['p99_ratio_max']):.2f}; pooled ({half['pooled']['plain']['n']} / "
              f"{half['pooled']['batched']['n']} samples) {f(half['pooled_p99_ratio']):.2f}"
              + (", bootstrap 95%% [%.2f, %.2f]" % tuple(half["pooled_p99_ratio_ci95"])
                 if half["pooled_p99_ratio_ci95"] else ""))
        print("batched blocks at half load, requests per batch / batcher wait p99 ms: " + ", ".join(
            f"{b} {v['mean_requests_in_batch']:.2f}/{f(v['batch_wait_ms_p99']):.2f}"
            for b, v in half["blocks"]["batched"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
