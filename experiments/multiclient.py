"""Pipeline scalability with several synchronous clients (thesis Fig. 4.11).

K = 1..10 synchronous clients (each its own ``blockflow.client.Client``, in its own thread of this
process, sending the next request when the previous reply is back) share the same task and so
the same 4-block ResNet50 (+head) path, over ``zeromq`` and ``tensormq``. For each K the clients
run for D seconds; reported is the mean round trip of each client (its first min(250, n/4)
samples dropped as warm-up, min(5, n/4) in --quick), their average, and the delivered throughput.

On the GV100 the thesis saw a plateau for 1-4 clients (about 18 ms with TensorMQ, ZeroMQ going
from 45 to 35 ms) and a linear rise from 5 clients on. On a 2-core CPU the pipeline saturates the
cores with 2 clients already, so the rise starts early: K clients wait about K/2 inference times.

Defaults: K = 1, 2, 3, 4, 6, 8, 10 (the thesis: 1..10), D = 6 s per K (the thesis gives no
length for this figure; the run fits in 2 minutes on a 2-core machine); --quick (a smoke
run): K = 1, 2 for 2 s each.

    python -m experiments.multiclient [--quick] [--clients 1,2,...] [--duration S] [--threads T]
"""
from __future__ import annotations

import logging
import statistics
import sys

import torch

from experiments import common

log = logging.getLogger("experiments.multiclient")

NAME = "multiclient"
#: Default client counts and seconds per count: 14 windows fit in 2 minutes on a 2-core machine.
CLIENTS = (1, 2, 3, 4, 6, 8, 10)
DEFAULT_DURATION = 6.0
QUICK_CLIENTS = (1, 2)
#: Read off the thesis's Fig. 4.11 text (GV100): mean RTT per client, ms.
THESIS = {"tensormq_1_to_4_clients_ms": 18.0, "zeromq_1_client_ms": 45.0, "zeromq_4_clients_ms": 35.0}


def run_clients(address: str, k: int, duration: float, x: torch.Tensor,
                timeout: float = 120.0) -> tuple[list[list[tuple]], float]:
    """``k`` synchronous clients for ``duration`` seconds (blockflow.loadgen), each waiting for its
    last reply; per client a list of (t_sent in s from the start, rtt_ms or None, ok)."""
    from blockflow.loadgen import generate_load
    with common.Progress(int(duration), f"{k} client(s)") as bar:
        run = generate_load(address, common.TASK, inputs=x, clients=k, duration=duration, timeout=timeout,
                            drain=timeout, progress=bar.to)
    for status, n in run.statuses().items():
        if status != "ok":
            log.warning("%d client(s): %d request(s) %s", k, n, status)
    return [[(r.sent, r.rtt_ms, r.ok) for r in rs] for rs in run.by_client()], run.elapsed_s


def summarise(records: list[list[tuple]], elapsed: float, quick: bool) -> dict:
    per_client = []
    for rs in records:
        ok = [r[1] for r in rs if r[2]]
        kept = common.discard_warmup(ok, quick)
        per_client.append({"n": len(rs), "ok": len(ok), "dropped": len(ok) - len(kept),
                           "mean_rtt_ms": statistics.fmean(kept) if kept else None,
                           "p50_rtt_ms": common.pct(kept, 0.5)})
    means = [c["mean_rtt_ms"] for c in per_client if c["mean_rtt_ms"] is not None]
    all_kept = [v for rs in records for v in common.discard_warmup([r[1] for r in rs if r[2]], quick)]
    return {"clients": len(records), "per_client": per_client,
            "mean_rtt_per_client_ms": statistics.fmean(means) if means else None,
            "rtt_ms": common.describe(all_kept), "throughput_rps": sum(c["ok"] for c in per_client) / elapsed,
            "errors": sum(c["n"] - c["ok"] for c in per_client), "elapsed_s": elapsed}


def plot(rows: list[dict], out: str, machine: str) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(8.5, 3.4))
    for t, color in (("zeromq", "tab:blue"), ("tensormq", "tab:orange")):
        rs = [r for r in rows if r["transport"] == t]
        if not rs:
            continue
        ks = [r["clients"] for r in rs]
        axes[0].plot(ks, [r["mean_rtt_per_client_ms"] for r in rs], marker="o", color=color, label=t)
        axes[1].plot(ks, [r["throughput_rps"] for r in rs], marker="o", color=color, label=t)
    axes[0].set_ylabel("mean RTT per client (ms)")
    axes[0].set_title(f"Multi-client scalability (Fig. 4.11) - {machine}", fontsize=9)
    axes[1].set_ylabel("delivered throughput (req/s)")
    axes[1].set_title("throughput, all clients together", fontsize=9)
    for ax in axes:
        ax.set_xlabel("synchronous clients")
        ax.legend(fontsize=8)
    common.save_fig(fig, out, f"{NAME}_fig4_11.png")


def main(argv=None) -> int:
    ap = common.parser(NAME, __doc__)
    ap.add_argument("--clients", type=lambda s: [int(v) for v in s.split(",") if v],
                    help="comma-separated client counts (default 1,2,3,4,6,8,10; --quick 1,2)")
    ap.add_argument("--duration", type=float,
                    help=f"seconds per client count (default {DEFAULT_DURATION:g}, --quick 2)")
    common.add_pipeline_args(ap)
    args = ap.parse_args(argv)
    common.setup_logging(args.verbose)
    device, transports = common.device_and_transports(args)
    ks = args.clients or list(QUICK_CLIENTS if args.quick else CLIENTS)
    duration = args.duration or (2.0 if args.quick else DEFAULT_DURATION)
    repo = common.ensure_repo(args.repo)
    settings = {"clients": ks, "duration_s": duration, "transports": transports, "threads": args.threads,
                "device": device, "batch": 1, "quick": args.quick, "n": args.n,
                "warmup_rule": f"first min({common.WARMUP_QUICK if args.quick else common.WARMUP_FULL}, n/4) "
                               "samples of every client dropped",
                "clients_run_as": "threads of one process, one blockflow Client (DEALER socket) each"}
    if args.n:
        log.info("--n is not used here: each client count runs for --duration seconds")
    env = common.env_info(settings)
    x = common.input_tensor(1)
    rows, csv_rows = [], []
    with common.blockflow_server(repo) as server:
        for t in transports:
            server.update(common.pipeline_update(t, threads=args.threads, device=device))
            from blockflow.client import Client
            with Client(server.dispatcher, timeout=120) as c:
                for _ in range(3):
                    c.infer(common.TASK, x)
            for k in ks:
                records, elapsed = run_clients(server.dispatcher, k, duration, x, 30.0 if args.quick else 120.0)
                row = {"transport": t, **summarise(records, elapsed, args.quick)}
                rows.append(row)
                csv_rows += [[t, k, cid, r[0], "" if r[1] is None else r[1], int(r[2])]
                             for cid, rs in enumerate(records) for r in rs]
                log.info("%s, %d client(s): mean RTT per client %.1f ms, %.2f req/s", t, k,
                         row["mean_rtt_per_client_ms"] or float("nan"), row["throughput_rps"])
    common.write_json(args.out, NAME, {"env": env, "settings": settings, "rows": rows, "thesis_gv100": THESIS})
    common.write_csv(args.out, f"{NAME}_samples.csv", ["transport", "clients", "client", "sent_s", "rtt_ms", "ok"],
                     csv_rows)
    plot(rows, args.out, env["machine"])
    print(f"\nFig. 4.11 on {env['machine']} ({device}, {args.threads} thread(s) per block, {duration:g} s per point):")
    print(f"{'clients':>7s} " + " ".join(f"{t + ' RTT ms':>16s} {t + ' req/s':>15s}" for t in transports))
    for k in ks:
        line = f"{k:7d} "
        for t in transports:
            r = next(r for r in rows if r["transport"] == t and r["clients"] == k)
            line += f"{r['mean_rtt_per_client_ms'] or float('nan'):16.2f} {r['throughput_rps']:15.2f} "
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
