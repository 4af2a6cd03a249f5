"""Pipeline computing time under different batch sizes (thesis Figs. 4.7 and 4.8).

The 4-block ResNet50 (+head) pipeline served by ``blockflow serve``, one synchronous client,
batch sizes 1, 2, 4, 8, 16 and 32, over ``zeromq`` and ``tensormq``. For every batch size the
client sends requests (after two untimed requests that size the slots and buffers, whose
round trips and overheads are reported apart: the cost of a new batch size); reported are the
round trip, the pipeline inference sum_b m_b and the pipeline overhead sum_b o_b of eq. 4.1
(deser + dev + share + fwd per block, from the blocks' KPI logs; the queue wait apart), and as a
reference full.pt run in this process on the same batch with the same torch threads. The thesis's argument is that ZeroMQ's overhead grows with the batch
(the serialised tensor grows) while TensorMQ's stays flat (the handle has a fixed size).

On this CPU a batch of 32 takes seconds, so by default every (series, batch size) gets
``BUDGET_S`` seconds of requests, at least ``MIN_SAMPLES`` and at most ``MAX_SAMPLES`` (the
thesis gives no count; the whole run fits in 2 minutes on a 2-core machine); --n N sends
exactly N per batch size instead; --quick sends 2 per batch size for batches 1, 4, 16. The
first min(250, N/4) samples of every batch size are dropped as warm-up (min(5, N/4) in
--quick), on top of the untimed sizing requests.

    python -m experiments.batch_scaling [--quick] [--n N | --budget S] [--batches 1,2,4,8,16,32] [--threads T]
"""
from __future__ import annotations

import logging
import sys
import time

import torch

from experiments import common
from experiments.pipeline_latency import eq41, kpi_requests, load_models, pipeline_sample, sync, time_call

log = logging.getLogger("experiments.batch_scaling")

NAME = "batch_scaling"
BATCHES = (1, 2, 4, 8, 16, 32)
QUICK_BATCHES = (1, 4, 16)
#: Default sample count: as many as fit in BUDGET_S seconds per (series, batch), within these bounds.
BUDGET_S, MIN_SAMPLES, MAX_SAMPLES = 3.0, 2, 300
#: untimed requests per batch size before the samples: they size the slots (reported apart)
SIZING_REQUESTS = 2


def count_for(n: int | None, budget: float):
    """A ``more(done, elapsed)`` test: exactly ``n`` samples, or the budget's rule."""
    if n:
        return lambda done, elapsed: done < n
    return lambda done, elapsed: done < MIN_SAMPLES or (elapsed < budget and done < MAX_SAMPLES)


def measure_transport(server, transport: str, batches, more, threads: int, device: str, label: str) -> dict:
    """Per batch size: the client's samples and the blocks' KPI records of the same requests."""
    from blockflow.client import Client
    server.update(common.pipeline_update(transport, threads=threads, device=device))
    out = {}
    with Client(server.dispatcher, timeout=600) as c, common.Progress(len(batches), label) as bar:
        for b in batches:
            x = common.input_tensor(b, seed=b)
            sizing_since = time.time()
            # untimed: a new size's first output is copied into a slot grown for it (its size is
            # learnt from it); the second is made in slots grown for it (Note [Outputs made in a
            # slot]); from the third on the pipeline is in its steady state for this batch size
            sizing = [pipeline_sample(c, x, timeout=600) for _ in range(SIZING_REQUESTS)]
            since, t0 = time.time(), time.monotonic()
            recs = []
            while more(len(recs), time.monotonic() - t0):
                recs.append(pipeline_sample(c, x, timeout=600))
            kpi = kpi_requests(server, since, time.time())
            out[b] = (recs, kpi, sizing, kpi_requests(server, sizing_since, since))
            bar.update()
    return out


def measure_monolithic(full, batches, more, device: str) -> dict:
    out = {}
    with common.Progress(len(batches), "full.pt in-process") as bar:
        for b in batches:
            x = common.input_tensor(b, seed=b).to(device)
            time_call(lambda: full(x), device)
            vals, t0 = [], time.monotonic()
            while more(len(vals), time.monotonic() - t0):
                vals.append(time_call(lambda: full(x), device))
            out[b] = vals
            bar.update()
    return out


def plot(rows: list[dict], out: str, machine: str) -> None:
    plt = common.pyplot()
    colors = {"zeromq": "tab:blue", "tensormq": "tab:orange", "monolithic": "tab:olive"}
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for series in ("zeromq", "tensormq", "monolithic"):
        rs = [r for r in rows if r["series"] == series]
        if rs:
            ax.errorbar([r["batch"] for r in rs], [r["rtt_ms"]["mean"] for r in rs],
                        yerr=[r["rtt_ms"]["std"] for r in rs], marker="o", capsize=3, color=colors[series],
                        label=series if series != "monolithic" else "full.pt in-process (reference)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("mean pipeline time (ms)")
    ax.set_title(f"Pipeline computing time vs batch size (Fig. 4.7) - {machine}", fontsize=9)
    ax.legend(fontsize=8)
    common.save_fig(fig, out, f"{NAME}_fig4_7.png")

    fig, axes = plt.subplots(1, 2, figsize=(8, 3.4))
    for series in ("zeromq", "tensormq"):
        rs = [r for r in rows if r["series"] == series]
        if not rs:
            continue
        axes[0].plot([r["batch"] for r in rs], [r["overhead_ms"]["mean"] for r in rs], marker="o",
                     color=colors[series], label=series)
        axes[1].plot([r["batch"] for r in rs], [r["rtt_ms"]["mean"] / r["batch"] for r in rs], marker="o",
                     color=colors[series], label=series)
    mono = [r for r in rows if r["series"] == "monolithic"]
    axes[1].plot([r["batch"] for r in mono], [r["rtt_ms"]["mean"] / r["batch"] for r in mono], marker="o",
                 color=colors["monolithic"], label="full.pt in-process")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("mean pipeline overhead (ms)")
    axes[0].set_title("overhead: sum of o_b = deser+dev+share+fwd (eq. 4.1)", fontsize=9)
    axes[1].set_ylabel("round trip per image (ms)")
    axes[1].set_title("time per image", fontsize=9)
    fig.suptitle("Zoom on the overhead (Fig. 4.8)", fontsize=9)
    common.save_fig(fig, out, f"{NAME}_fig4_8.png")


def main(argv=None) -> int:
    ap = common.parser(NAME, __doc__)
    ap.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",") if b],
                    help=f"comma-separated batch sizes (default {','.join(map(str, BATCHES))}; "
                         f"--quick: {','.join(map(str, QUICK_BATCHES))})")
    ap.add_argument("--budget", type=float, default=BUDGET_S,
                    help=f"seconds of requests per series and batch size when --n is not given (default {BUDGET_S:g})")
    common.add_pipeline_args(ap, "torch threads per block and for full.pt (default 1)")
    args = ap.parse_args(argv)
    common.setup_logging(args.verbose)
    device, transports = common.device_and_transports(args)
    batches = [int(b) for b in (args.batches or (QUICK_BATCHES if args.quick else BATCHES))]
    n = args.n or (2 if args.quick else None)
    more = count_for(n, args.budget)
    repo = common.ensure_repo(args.repo)
    settings = {"n": n, "samples": f"{n} per batch size" if n else
                f"{args.budget:g} s per series and batch size, {MIN_SAMPLES}-{MAX_SAMPLES} samples",
                "batches": batches, "transports": transports, "threads": args.threads, "device": device,
                "warmup_rule": "first min(250, N/4) samples of every batch size dropped",
                "untimed_sizing_requests_per_batch": SIZING_REQUESTS, "client": "1 synchronous client",
                "overhead": "eq. 4.1: sum_b deser + dev + share + fwd (KPI logs)", "quick": args.quick}
    env = common.env_info(settings)
    _, full = load_models(repo, device, args.threads)
    mono = measure_monolithic(full, batches, more, device)
    del full
    raw = {}
    with common.blockflow_server(repo) as server:
        for t in transports:
            raw[t] = measure_transport(server, t, batches, more, args.threads, device, f"{t} batches")
    sync(device)
    rows, csv_rows = [], []
    for b in batches:
        warm = common.warmup_count(len(mono[b]), args.quick)
        rows.append({"series": "monolithic", "batch": b, "n": len(mono[b]), "dropped": warm,
                     "rtt_ms": common.describe(mono[b][warm:])})
        csv_rows += [["monolithic", b, i, int(i >= warm), v, v, "", ""] for i, v in enumerate(mono[b])]
    for t in transports:
        for b in batches:
            recs, kpi, sizing, sizing_kpi = raw[t][b]
            warm = common.warmup_count(len(recs), args.quick)
            kept, sums = recs[warm:], [eq41(r) for r in kpi[common.warmup_count(len(kpi), args.quick):]]
            rows.append({"series": t, "batch": b, "n": len(recs), "dropped": warm,
                         "rtt_ms": common.describe([r["rtt"] for r in kept]),
                         "inference_ms": common.describe([s["inf"] for s in sums]),
                         "overhead_ms": common.describe([s["overhead"] for s in sums]),
                         "wait_ms": common.describe([s["wait"] for s in sums]),
                         "tensor_mb_block1_out": b * 256 * 56 * 56 * 4 / 2**20,
                         # the untimed requests that sized the slots, in order
                         "sizing_rtt_ms": [r["rtt"] for r in sizing],
                         "sizing_overhead_ms": [eq41(r)["overhead"] for r in sizing_kpi]})
            csv_rows += [[t, b, i, int(i >= warm), r["rtt"], "", "", ""] for i, r in enumerate(recs)]
            csv_rows += [[f"{t}.kpi", b, i, "", "", s["inf"], s["overhead"], s["wait"]] for i, s in enumerate(sums)]
    common.write_json(args.out, NAME, {"env": env, "settings": settings, "rows": rows})
    common.write_csv(args.out, f"{NAME}_samples.csv",
                     ["series", "batch", "i", "kept", "rtt_ms", "inference_ms", "overhead_ms", "wait_ms"], csv_rows)
    plot(rows, args.out, env["machine"])
    print(f"\nFigs. 4.7-4.8 on {env['machine']} ({device}, {args.threads} thread(s), {settings['samples']}; "
          "overhead = eq. 4.1):")
    print(f"{'batch':>5s} " + " ".join(f"{t + ' rtt':>14s} {t + ' ovh':>14s}" for t in transports)
          + f" {'full.pt':>10s}")
    for b in batches:
        line = f"{b:5d} "
        for t in transports:
            r = next(r for r in rows if r["series"] == t and r["batch"] == b)
            line += f"{r['rtt_ms']['mean']:14.2f} {r['overhead_ms']['mean']:14.2f} "
        m = next(r for r in rows if r["series"] == "monolithic" and r["batch"] == b)
        print(line + f"{m['rtt_ms']['mean']:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
