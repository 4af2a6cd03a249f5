"""Pipeline latency of the served 4-block ResNet50 (thesis 4.2.2, Figs. 4.3, 4.4 and 4.5).

One synchronous client (the next request leaves when the previous reply is back) sends a seeded
batch-1 input through ``blockflow serve`` deploying block1..block4 + head as five processes,
once over ``zeromq`` (tensors serialised into the messages) and once over ``tensormq`` (tensors
in shared memory, handles in the messages). Against it are measured:

  http*       the monolithic model (full.pt) behind a CherryPy REST endpoint (the thesis's HTTP*
              bar: one process, the tensor in the POST body), see experiments/servers.py;
  offline     the sum of the per-block inference times with the blocks run back to back in this
              process, without any transport (the thesis's "offline" baseline, 11.703 ms);
  monolithic  full.pt run in this process with the same torch threads as one block.

Every request's reply carries what each block measured (``hops``): queue wait, tensor rebuild
(deser), device move (dev), model inference (inf) and output share/serialise (share). Per block,
inference = inf and overhead = wait + deser + dev + share (Fig. 4.4); per request, pipeline
inference = the sum of inf and pipeline overhead = client round trip - pipeline inference, i.e.
everything that is not model compute, transit between processes included (Fig. 4.5).

To make the ratio against the monolithic model fair on a shared machine, the monolithic model
runs interleaved with the pipeline: request i through the pipeline, then inference i of full.pt
in this process, so that both see the same background load. The script prints

    ratio = median pipeline round trip / median monolithic latency   (goal <= 1.10x)

for each transport. The first min(250, N/4) samples of every series are dropped as warm-up (5 in
--quick), as in the thesis. The thesis ran each transport for 120 s (the default here); --n N
runs exactly N requests per series instead (what --quick and the committed medium run use).

    python -m experiments.pipeline_latency [--quick] [--n N | --duration S] [--threads T]
                                           [--transports zeromq,tensormq] [--no-http] [--out DIR]
"""
from __future__ import annotations

import logging
import math
import statistics
import sys
import time

import torch

from experiments import common

log = logging.getLogger("experiments.pipeline_latency")

NAME = "pipeline_latency"
BLOCK_NAMES = [n for n, _ in common.PIPELINE]
BLOCK_STEMS = dict(common.PIPELINE)
COMPONENTS = ("wait", "deser", "dev", "inf", "share")
#: The thesis's figures on the GV100 (FullSuper), ms. TensorMQ is given as "~2.8x less than
#: ZeroMQ" (44.9 / 2.8) and as "approximately 18 ms" RTT in the multi-client test.
THESIS = {"http_full_ms": 200.0, "zeromq_ms": 44.9, "tensormq_ms": 44.9 / 2.8, "offline_ms": 11.703,
          "zeromq_overhead_ms": 21.18, "tensormq_overhead_ms": 2.55}
RATIO_GOAL = 1.10
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


def series_from_args(args, quick_n: int = QUICK_N, full_duration: float = 120.0) -> Series:
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
    """One synchronous request through the pipeline with the per-block components."""
    t0 = time.perf_counter()
    r = client.infer_details(common.TASK, x, timeout=timeout)
    rtt = (time.perf_counter() - t0) * 1e3
    hops = {h["b"]: {k: float(h.get(k, 0.0)) for k in COMPONENTS} for h in r.hops or []}
    inf = sum(h["inf"] for h in hops.values())
    return {"rtt": rtt, "server": float(r.server_ms or 0.0), "inf": inf, "overhead": rtt - inf, "hops": hops}


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
                    series: Series) -> tuple[list[dict], dict]:
    from blockflow.client import Client
    server.update(common.pipeline_update(transport, threads=threads, device=device))
    pids = server.block_pids()
    with Client(server.dispatcher, timeout=120) as c:
        c.infer(common.TASK, x)  # the first request maps slots and connects sockets

        def step(_):
            rec = pipeline_sample(c, x)
            rec["mono"] = time_call(lambda: full(x), device)
            return rec
        recs = series.run(step, f"pipeline {transport}")
    rss = {n: common.process_tree_rss([pid]) for n, pid in pids.items()}
    return recs, {"block_rss_mb": rss, "block_pids": pids}


def http_phase(repo: str, threads: int, full, x: torch.Tensor, device: str, series: Series) -> list[dict]:
    from experiments.servers import HttpTensorClient, spawn
    with spawn("http", "--model", "resnet50/full.pt", "--repo", repo, "--threads", str(threads)) as h:
        client = HttpTensorClient(h["url"])
        try:
            client.infer(x)

            def step(_):
                t0 = time.perf_counter()
                _, hdr = client.infer(x)
                rtt = (time.perf_counter() - t0) * 1e3
                return {"rtt": rtt, "inf": float(hdr.get("X-Inf-Ms", "nan")),
                        "mono": time_call(lambda: full(x), device)}
            return series.run(step, "http* monolithic")
        finally:
            client.close()


# -- summaries -----------------------------------------------------------------------------
def summarise_transport(recs: list[dict], quick: bool) -> dict:
    kept = common.discard_warmup(recs, quick)
    blocks = {}
    for b in BLOCK_NAMES:
        comp = {k: common.describe([r["hops"][b][k] for r in kept]) for k in COMPONENTS}
        over = [sum(r["hops"][b][k] for k in COMPONENTS if k != "inf") for r in kept]
        blocks[b] = {"components_ms": comp, "inference_ms": comp["inf"], "overhead_ms": common.describe(over)}
    rtt = common.describe([r["rtt"] for r in kept])
    mono = common.describe([r["mono"] for r in kept])
    return {"n": len(recs), "dropped": len(recs) - len(kept), "rtt_ms": rtt,
            "server_ms": common.describe([r["server"] for r in kept]),
            "inference_ms": common.describe([r["inf"] for r in kept]),
            "overhead_ms": common.describe([r["overhead"] for r in kept]),
            "transit_ms": common.describe([r["rtt"] - sum(sum(h.values()) for h in r["hops"].values()) for r in kept]),
            "monolithic_interleaved_ms": mono, "ratio_p50": rtt["p50"] / mono["p50"],
            "ratio_mean": rtt["mean"] / mono["mean"], "blocks": blocks}


def plot(summary: dict, raw: dict, out: str, machine: str) -> None:
    plt = common.pyplot()
    transports = [t for t in common.TRANSPORTS if t in summary["transports"]]
    # Fig. 4.3: average pipeline computing time
    labels, means, stds = [], [], []
    if summary.get("http"):
        labels.append("HTTP*\n(full.pt, REST)")
        means.append(summary["http"]["rtt_ms"]["mean"])
        stds.append(summary["http"]["rtt_ms"]["std"])
    for t in transports:
        labels.append(f"{t}\n(4 blocks + head)")
        means.append(summary["transports"][t]["rtt_ms"]["mean"])
        stds.append(summary["transports"][t]["rtt_ms"]["std"])
    labels += ["offline\n(sum of blocks)", "monolithic\n(full.pt, in-process)"]
    means += [summary["offline"]["sum_ms"]["mean"], summary["offline"]["monolithic_ms"]["mean"]]
    stds += [summary["offline"]["sum_ms"]["std"], summary["offline"]["monolithic_ms"]["std"]]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    bars = ax.bar(labels, means, yerr=stds, capsize=3,
                  color=["tab:gray"] * (1 if summary.get("http") else 0) + ["tab:blue", "tab:orange"][:len(transports)]
                  + ["tab:green", "tab:olive"])
    ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_ylabel("mean round trip / compute (ms)")
    ax.set_title(f"ResNet50 pipeline, 1 synchronous client, batch 1 (Fig. 4.3) - {machine}", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    common.save_fig(fig, out, f"{NAME}_fig4_3.png")

    # Fig. 4.4: time components per block
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / max(1, len(transports))
    for k, t in enumerate(transports):
        blocks = summary["transports"][t]["blocks"]
        xs = [i + (k - (len(transports) - 1) / 2) * width for i in range(len(BLOCK_NAMES))]
        inf = [blocks[b]["inference_ms"]["mean"] for b in BLOCK_NAMES]
        over = [blocks[b]["overhead_ms"]["mean"] for b in BLOCK_NAMES]
        ax.bar(xs, inf, width, label=f"{t} inference", color=["tab:blue", "tab:orange"][k], alpha=0.6)
        bars = ax.bar(xs, over, width, bottom=inf, label=f"{t} overhead", color=["tab:blue", "tab:orange"][k],
                      hatch="//", edgecolor="black", linewidth=0.3)
        ax.bar_label(bars, labels=[f"{o:.2f}" for o in over], fontsize=7)
    ax.set_xticks(range(len(BLOCK_NAMES)), [BLOCK_STEMS[b] for b in BLOCK_NAMES])
    ax.set_ylabel("mean time per block (ms)")
    ax.set_title("Time components per block: inference vs overhead (Fig. 4.4)", fontsize=9)
    ax.legend(fontsize=7)
    common.save_fig(fig, out, f"{NAME}_fig4_4.png")

    # Fig. 4.5: distributions of pipeline inference and overhead
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    for k, t in enumerate(transports):
        kept = raw[t]
        for ax, key, title in ((axes[0], "inf", "pipeline inference"), (axes[1], "overhead", "pipeline overhead")):
            ax.hist([r[key] for r in kept], bins=30, density=True, alpha=0.55, label=t,
                    color=["tab:blue", "tab:orange"][k])
            ax.set_title(f"{title} (ePDF)", fontsize=9)
            ax.set_xlabel("ms")
    axes[0].legend(fontsize=8)
    common.save_fig(fig, out, f"{NAME}_fig4_5.png")


def main(argv=None) -> int:
    ap = common.parser(NAME, __doc__)
    ap.add_argument("--duration", type=float, help="seconds per series instead of a count (default 120, as the "
                                                   "thesis; ignored with --n or --quick)")
    common.add_pipeline_args(ap, "torch threads per block and for the monolithic model (default 1)")
    ap.add_argument("--no-http", action="store_true", help="skip the HTTP* monolithic endpoint")
    args = ap.parse_args(argv)
    common.setup_logging(args.verbose)
    device, transports = common.device_and_transports(args)
    series = series_from_args(args)
    repo = common.ensure_repo(args.repo)
    settings = {"series": series.describe(), "n": series.n, "duration_s": series.duration, "threads": args.threads,
                "device": device, "batch": 1, "transports": transports, "http": not args.no_http,
                "warmup_rule": f"first min({common.WARMUP_QUICK if args.quick else common.WARMUP_FULL}, N/4) "
                               "samples of every series dropped",
                "client": "1 synchronous client (blockflow.client.Client.infer_details)",
                "monolithic": "full.pt in the client process, interleaved with every pipeline request",
                "quick": args.quick}
    env = common.env_info(settings)
    x = common.input_tensor(1)
    blocks, full = load_models(repo, device, args.threads)
    xd = x.to(device)

    offline = offline_phase(blocks, full, xd, device, series)
    raw, runs = {}, {}
    with common.blockflow_server(repo) as server:
        for t in transports:
            raw[t], runs[t] = transport_phase(server, t, args.threads, device, full, x, series)
    http = None if args.no_http else http_phase(repo, args.threads, full, x, device, series)

    kept_off = common.discard_warmup(offline, args.quick)
    summary = {"offline": {"n": len(offline), "dropped": len(offline) - len(kept_off),
                           "blocks_ms": {b: common.describe([r[b] for r in kept_off]) for b in BLOCK_NAMES},
                           "sum_ms": common.describe([r["sum"] for r in kept_off]),
                           "monolithic_ms": common.describe([r["mono"] for r in kept_off])},
               "transports": {t: {**summarise_transport(raw[t], args.quick), **runs[t]} for t in transports}}
    if http is not None:
        kept = common.discard_warmup(http, args.quick)
        rtt = common.describe([r["rtt"] for r in kept])
        mono = common.describe([r["mono"] for r in kept])
        summary["http"] = {"n": len(http), "dropped": len(http) - len(kept), "rtt_ms": rtt,
                           "server_inference_ms": common.describe([r["inf"] for r in kept]),
                           "monolithic_interleaved_ms": mono, "ratio_p50": rtt["p50"] / mono["p50"]}
    mono_alone = summary["offline"]["monolithic_ms"]["p50"]
    ratios = {t: {"pipeline_p50_ms": s["rtt_ms"]["p50"], "monolithic_p50_ms": s["monolithic_interleaved_ms"]["p50"],
                  "ratio": s["ratio_p50"], "monolithic_alone_p50_ms": mono_alone,
                  "ratio_vs_alone": s["rtt_ms"]["p50"] / mono_alone, "goal": RATIO_GOAL,
                  "meets_goal": s["ratio_p50"] <= RATIO_GOAL}
              for t, s in summary["transports"].items()}
    data = {"env": env, "settings": settings, "summary": summary, "ratio_pipeline_vs_monolithic": ratios,
            "thesis_gv100": THESIS}
    common.write_json(args.out, NAME, data)
    header = ["series", "i", "kept", "rtt_ms", "server_ms", "inference_ms", "overhead_ms", "monolithic_ms"]
    header += [f"{b}.{k}" for b in BLOCK_NAMES for k in COMPONENTS]
    rows = []
    for t in transports:
        drop = summary["transports"][t]["dropped"]
        for i, r in enumerate(raw[t]):
            rows.append([t, i, int(i >= drop), r["rtt"], r["server"], r["inf"], r["overhead"], r["mono"]]
                        + [r["hops"][b][k] for b in BLOCK_NAMES for k in COMPONENTS])
    for i, r in enumerate(http or []):
        rows.append(["http", i, int(i >= summary["http"]["dropped"]), r["rtt"], "", r["inf"], r["rtt"] - r["inf"],
                     r["mono"]] + [""] * (len(BLOCK_NAMES) * len(COMPONENTS)))
    for i, r in enumerate(offline):
        rows.append(["offline", i, int(i >= summary["offline"]["dropped"]), "", "", r["sum"], "", r["mono"]]
                    + [r[b] if k == "inf" else "" for b in BLOCK_NAMES for k in COMPONENTS])
    common.write_csv(args.out, f"{NAME}_samples.csv", header, rows)
    plot(summary, {t: common.discard_warmup(raw[t], args.quick) for t in transports}, args.out, env["machine"])
    report(summary, ratios, env, settings)
    return 0


def report(summary: dict, ratios: dict, env: dict, settings: dict) -> None:
    f = lambda d: f"{d['mean']:8.2f} {d['p50']:8.2f} {d['p99']:8.2f}"
    print(f"\nFig. 4.3-4.5 on {env['machine']} ({settings['device']}, {settings['threads']} thread(s), "
          f"{settings['series']} per series):")
    print(f"{'series':26s} {'mean':>8s} {'p50':>8s} {'p99':>8s}   thesis (GV100) mean")
    if "http" in summary:
        print(f"{'HTTP* full.pt round trip':26s} {f(summary['http']['rtt_ms'])}   ~{THESIS['http_full_ms']:.0f}")
    for t, s in summary["transports"].items():
        print(f"{t + ' round trip':26s} {f(s['rtt_ms'])}   {THESIS[t + '_ms']:.1f}")
        print(f"{'  inference (sum of inf)':26s} {f(s['inference_ms'])}")
        print(f"{'  overhead (rtt - inf)':26s} {f(s['overhead_ms'])}   {THESIS[t + '_overhead_ms']:.2f}")
    print(f"{'offline sum of blocks':26s} {f(summary['offline']['sum_ms'])}   {THESIS['offline_ms']:.3f}")
    print(f"{'monolithic full.pt':26s} {f(summary['offline']['monolithic_ms'])}")
    print("\nper-block mean inference / overhead (ms):")
    for t, s in summary["transports"].items():
        print(f"  {t:9s} " + "  ".join(f"{BLOCK_STEMS[b]} {s['blocks'][b]['inference_ms']['mean']:.2f}/"
                                         f"{s['blocks'][b]['overhead_ms']['mean']:.2f}" for b in BLOCK_NAMES))
    print()
    for t, r in ratios.items():
        print(f"RATIO {t}: median pipeline {r['pipeline_p50_ms']:.2f} ms / median monolithic "
              f"{r['monolithic_p50_ms']:.2f} ms (interleaved) = {r['ratio']:.3f}x "
              f"(goal <= {RATIO_GOAL:.2f}x: {'met' if r['meets_goal'] else 'NOT met'}; "
              f"vs monolithic alone {r['ratio_vs_alone']:.3f}x)")


if __name__ == "__main__":
    sys.exit(main())
