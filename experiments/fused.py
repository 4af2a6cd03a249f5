"""Fused blocks against the monolithic model (issue 11; the thesis's B12/B34 fusion, section 4.3).

    python -m experiments.fused [--quick] [--n N] [--out DIR]

One ``blockflow serve``, three deployments of the same ResNet50 ``classify`` path in turn, each with
one torch thread per block and the tensormq transport:

  five blocks      block1, block2, block3, block4, head: one process each (the unfused pipeline)
  two fused        block1-3 in one process, block4+head in another (a block's ``model`` is a list)
  one fused        all five files in one process

Every series is measured with one synchronous client at batch 1, interleaved with ``full.pt`` run
in this process with the same one thread (request i through the server, then inference i of the
monolithic model), so both see the same machine state. Reported per series: p50/p99 of the round
trip, the ratio of medians to the interleaved monolithic model (goals: one fused <= 1.05x, two
fused <= 1.15x, five blocks <= 1.20x), where the round trip's time went (the blocks' inference
from their hop records, against the monolithic model; the rest, and of it the way in from the
client's send to the first block and the way out from the last block to the client), and each
block process's RSS and USS after the run: the measured fused processes the memory model
(``experiments/memory_model.py``) can use.
"""
import os
import time

from . import common

SERIES = {
    "five blocks": [("b1", ["block1"]), ("b2", ["block2"]), ("b3", ["block3"]), ("b4", ["block4"]), ("h", ["head"])],
    "two fused": [("b123", ["block1", "block2", "block3"]), ("b4h", ["block4", "head"])],
    "one fused": [("all", ["block1", "block2", "block3", "block4", "head"])],
}
GOALS = {"five blocks": 1.20, "two fused": 1.15, "one fused": 1.05}


def update_for(blocks, model: str = "resnet50") -> dict:
    decl = []
    for name, stems in blocks:
        files = [f"{model}/{s}.pt" for s in stems]
        decl.append({"name": name, "model": files[0] if len(files) == 1 else files, "threads": 1})
    return {"transport": "tensormq", "protocol": "ipc", "blocks": decl,
            "tasks": [{"id": common.TASK, "path": [n for n, _ in blocks]}]}


def block_memory(pids: dict[str, int]) -> dict:
    import psutil
    mem = {}
    for name, pid in pids.items():
        try:
            info = psutil.Process(pid).memory_full_info()
            mem[name] = {"rss_mb": info.rss / 2**20, "uss_mb": info.uss / 2**20}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            mem[name] = None
    return mem


def measure(server, full, x, n: int, quick: bool) -> dict:
    """Interleaved round trips and monolithic runs, and where a round trip's time goes: the
    blocks' inference (the sum of the ``inf`` their hop records carry), the way in (the client's
    send to the first block's ``t_in``) and the way out (the last block's ``t_out`` to the reply
    in the client's hands), on the one CLOCK_MONOTONIC of the host (Note [Hop timestamps])."""
    import torch

    from blockflow.client import Client
    rtt, mono, inf, way_in, way_out = [], [], [], [], []
    with Client(server.dispatcher, timeout=120) as c, torch.inference_mode():
        c.infer(common.TASK, x)  # connects sockets, maps slots
        full(x)
        for _ in range(n):
            t0 = time.perf_counter()
            r = c.infer_details(common.TASK, x)
            t1 = time.perf_counter()
            full(x)
            t2 = time.perf_counter()
            rtt.append((t1 - t0) * 1e3)
            mono.append((t2 - t1) * 1e3)
            inf.append(sum(h["inf"] for h in r.hops))
            way_in.append((r.hops[0]["t_in"] - t0) * 1e3)
            way_out.append((t1 - r.hops[-1]["t_out"]) * 1e3)
    keep = [common.discard_warmup(v, quick) for v in (rtt, mono, inf, way_in, way_out)]
    r, m, i, w_in, w_out = (common.describe(v) for v in keep)
    return {"rtt_ms": r, "monolithic_interleaved_ms": m, "ratio_p50": r["p50"] / m["p50"],
            "inference_ms": i, "inference_ratio_p50": i["p50"] / m["p50"],
            "rest_ms": common.describe([a - b for a, b in zip(keep[0], keep[2])]),
            "way_in_ms": w_in, "way_out_ms": w_out}


def plot(result: dict, out: str) -> None:
    plt = common.pyplot()
    names = list(result["series"])
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    xs = range(len(names))
    ax.bar([i - 0.2 for i in xs], [result["series"][s]["rtt_ms"]["p50"] for s in names], 0.4, label="BlockFlow p50")
    ax.bar([i + 0.2 for i in xs], [result["series"][s]["monolithic_interleaved_ms"]["p50"] for s in names], 0.4,
           label="monolithic full.pt p50 (interleaved)")
    for i, s in enumerate(names):
        ax.annotate(f"{result['series'][s]['ratio_p50']:.3f}x", (i, result["series"][s]["rtt_ms"]["p50"]),
                    ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("latency per request, batch 1 (ms)")
    ax.set_title("ResNet50: fused blocks vs the monolithic model (1 thread per process)")
    ax.legend(fontsize=8, loc="lower right")
    common.save_fig(fig, out, "fused.png")


def main(argv: list[str] | None = None) -> int:
    ap = common.parser("fused", __doc__)
    args = ap.parse_args(argv)
    common.setup_logging(args.verbose)
    import torch
    torch.set_num_threads(1)
    n = args.n or (8 if args.quick else 200)
    out = common.results_dir(args.out)
    repo = common.ensure_repo(args.repo)
    full = torch.jit.load(os.path.join(repo, "resnet50", "full.pt")).eval()
    x = common.input_tensor()
    settings = {"n": n, "quick": args.quick, "threads": 1, "batch": 1, "transport": "tensormq",
                "client": "1 synchronous client, each request followed by full.pt in the client process",
                "series": {s: [[name, stems] for name, stems in blocks] for s, blocks in SERIES.items()
                           if not args.quick or s == "two fused"}}
    result = {"experiment": "fused", "env": common.env_info(settings), "settings": settings, "series": {}}
    # --quick (the smoke test) runs the two-fused deployment only: one update, a few requests
    series = {"two fused": SERIES["two fused"]} if args.quick else SERIES
    with common.blockflow_server(repo) as server:
        for label, blocks in series.items():
            res = server.update(update_for(blocks))
            common.log.info("%s: update applied in %.2fs", label, res["seconds"])
            row = measure(server, full, x, n, args.quick)
            row["update_s"] = res["seconds"]
            row["goal_ratio"] = GOALS[label]
            row["meets_goal"] = row["ratio_p50"] <= GOALS[label]
            row["block_memory"] = block_memory(server.block_pids())
            result["series"][label] = row
            common.log.info("%s: p50 %.1f ms, monolithic %.1f ms, ratio %.3f (inference %.3fx, rest %.2f ms)",
                            label, row["rtt_ms"]["p50"], row["monolithic_interleaved_ms"]["p50"], row["ratio_p50"],
                            row["inference_ratio_p50"], row["rest_ms"]["p50"])
    common.write_json(out, "fused", result)
    plot(result, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
