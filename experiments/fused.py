"""Fused blocks against the monolithic model (issue 11; the thesis's B12/B34 fusion, section 4.3).

    python -m experiments.fused [--quick] [--n N] [--out DIR] [--series NAME ...] [--device cuda]

One ``blockflow serve``, three deployments of the same ResNet50 ``classify`` path in turn, each with
one torch thread per block and the tensormq transport:

  five blocks      block1, block2, block3, block4, head: one process each (the unfused pipeline)
  two fused        block1-3 in one process, block4+head in another (a block's ``model`` is a list)
  one fused        all five files in one process
  one group        the five blocks in one shared process (``process: g``), each a block of its
                   own (issue 40 item 4: they hand over by reference, blocks/handover.py, and on a
                   CPU run to completion on the first block's thread: blocks/process.py),
                   deployed beside the five-block processes in the same update: every round is a
                   request through each, in turn, then the monolithic model, and the JSON has the
                   group's ratio to both (``ratio_p50``, ``ratio_to_five_blocks_p50``)

Every series is measured with one synchronous client at batch 1, interleaved with ``full.pt`` run
in this process with the same one thread (request i through the server, then inference i of the
monolithic model), so both see the same machine state. Reported per series: p50/p99 of the round
trip, the ratio of medians to the interleaved monolithic model (goals: one fused <= 1.05x, two
fused <= 1.15x, five blocks <= 1.20x), where the round trip's time went (the blocks' inference
from their hop records, against the monolithic model; the rest, and of it the way in from the
client's send to the first block and the way out from the last block to the client), and each
block process's RSS and USS after the run: the measured fused processes the memory model
(``experiments/memory_model.py``) can use.

``--device cuda`` puts every block on the GPU and runs the monolithic model as one CUDA graph
(its input copied in, its output copied to the host, as a client gets it): with ``--series "one
group"`` that is issue 40's GPU goal for a group (p50 <= 1.3x the whole model as one CUDA graph,
in the same run; ``make gpu-check STEPS=groups``).
"""
import os
import time

from . import common

SERIES = {
    "five blocks": [("b1", ["block1"]), ("b2", ["block2"]), ("b3", ["block3"]), ("b4", ["block4"]), ("h", ["head"])],
    "two fused": [("b123", ["block1", "block2", "block3"]), ("b4h", ["block4", "head"])],
    "one fused": [("all", ["block1", "block2", "block3", "block4", "head"])],
}
GOALS = {"five blocks": 1.20, "two fused": 1.15, "one fused": 1.05, "one group": 1.05}
#: The task through the group in the "one group" series (common.TASK goes through the five processes).
GROUP_TASK = "grouped"


def update_for(blocks, model: str = "resnet50", process: str | None = None, device: str = "cpu") -> dict:
    decl = []
    for name, stems in blocks:
        files = [f"{model}/{s}.pt" for s in stems]
        decl.append({"name": name, "model": files[0] if len(files) == 1 else files, "threads": 1, "device": device})
        if process is not None:
            decl[-1]["process"] = process
    return {"transport": "tensormq", "protocol": "ipc", "blocks": decl,
            "tasks": [{"id": common.TASK, "path": [n for n, _ in blocks]}]}


def group_update(model: str = "resnet50", device: str = "cpu") -> dict:
    """The five blocks as five processes (task common.TASK) and, renamed ``g<name>``, in one
    shared process ``g`` (task GROUP_TASK), in one update."""
    body = update_for(SERIES["five blocks"], model, device=device)
    grouped = update_for([(f"g{name}", stems) for name, stems in SERIES["five blocks"]], model, "g", device)
    body["blocks"] += grouped["blocks"]
    body["tasks"].append({"id": GROUP_TASK, "path": grouped["tasks"][0]["path"]})
    return body


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


def measure(server, full, x, n: int, quick: bool, tasks: tuple[str, ...] = (common.TASK,)) -> dict:
    """Interleaved round trips and monolithic runs, and where a round trip's time goes: the
    blocks' inference (the sum of the ``inf`` their hop records carry), the way in (the client's
    send to the first block's ``t_in``) and the way out (the last block's ``t_out`` to the reply
    in the client's hands), on the one CLOCK_MONOTONIC of the host (Note [Hop timestamps]).
    Several ``tasks``: a round is a request of each (their order turns every round), then the
    monolithic model; returns one row per task, by task."""
    import torch

    from blockflow.client import Client
    mono = []
    rows = {t: ([], [], [], []) for t in tasks}  # rtt, inf, way_in, way_out
    with Client(server.dispatcher, timeout=120) as c, torch.inference_mode():
        for task in tasks:
            c.infer(task, x)  # connects sockets, maps slots
        full(x)
        for i in range(n):
            for task in tasks[i % len(tasks):] + tasks[:i % len(tasks)]:
                rtt, inf, way_in, way_out = rows[task]
                t0 = time.perf_counter()
                r = c.infer_details(task, x)
                t1 = time.perf_counter()
                rtt.append((t1 - t0) * 1e3)
                inf.append(sum(h["inf"] for h in r.hops))
                way_in.append((r.hops[0]["t_in"] - t0) * 1e3)
                way_out.append((t1 - r.hops[-1]["t_out"]) * 1e3)
            t1 = time.perf_counter()
            full(x)
            mono.append((time.perf_counter() - t1) * 1e3)
    m_keep = common.discard_warmup(mono, quick)
    m = common.describe(m_keep)
    out = {}
    for task, series in rows.items():
        keep = [common.discard_warmup(v, quick) for v in series]
        r, i, w_in, w_out = (common.describe(v) for v in keep)
        out[task] = {"rtt_ms": r, "monolithic_interleaved_ms": m, "ratio_p50": r["p50"] / m["p50"],
                     "ratio_p50_parts": common.ratio_parts(keep[0], m_keep),
                     "inference_ms": i, "inference_ratio_p50": i["p50"] / m["p50"],
                     "rest_ms": common.describe([a - b for a, b in zip(keep[0], keep[1])]),
                     "way_in_ms": w_in, "way_out_ms": w_out}
    return out if len(tasks) > 1 else out[tasks[0]]


def measure_group(server, full, x, n: int, quick: bool) -> dict:
    """The "one group" row: the group's round trips, with the five processes' of the same rounds
    beside them and the group's hops (``deser``, ``share`` and ``fwd`` of each member: what a
    hand-over by reference costs)."""
    rows = measure(server, full, x, n, quick, (GROUP_TASK, common.TASK))
    row, separate = rows[GROUP_TASK], rows[common.TASK]
    row["five_blocks_same_rounds"] = separate
    row["ratio_to_five_blocks_p50"] = row["rtt_ms"]["p50"] / separate["rtt_ms"]["p50"]
    row["hand_over_ms_p50"] = {}
    for name, _ in SERIES["five blocks"]:
        for label, block in (("group", f"g{name}"), ("five blocks", name)):
            kpi = server.call("POST", f"/blocks/{block}/kpi")["latency_ms"]
            row["hand_over_ms_p50"].setdefault(label, {})[block] = {k: kpi[k]["p50"] for k in ("deser", "share", "fwd")}
    return row


def graphed(full, x, device: str):
    """``full`` as one CUDA graph on ``device``: a callable that copies a host input in, replays
    and copies the output back (experiments/gpu_floor.py's mono_graph row)."""
    import torch

    from .gpu_floor import _capture
    static_in = x.to(device)
    graph, static_out = _capture(lambda: full(static_in), torch.cuda.Stream(device))

    def run(x):
        static_in.copy_(x)
        graph.replay()
        return static_out.cpu()
    return run


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
    ap.add_argument("--series", action="append", choices=list(SERIES) + ["one group"],
                    help="run only this series (repeat for several; default: all)")
    ap.add_argument("--device", default="cpu", help="the blocks' device; on cuda the monolithic model is one CUDA graph")
    args = ap.parse_args(argv)
    common.setup_logging(args.verbose)
    import torch
    torch.set_num_threads(1)
    n = args.n or (8 if args.quick else 200)
    out = common.results_dir(args.out)
    repo = common.ensure_repo(args.repo)
    full = torch.jit.load(os.path.join(repo, "resnet50", "full.pt"), map_location=args.device).eval()
    x = common.input_tensor()
    if args.device != "cpu":
        with torch.inference_mode():
            full = graphed(full, x, args.device)
    # --quick (the smoke test) runs the two-fused deployment only: one update, a few requests
    names = args.series or (["two fused"] if args.quick else [*SERIES, "one group"])
    series = {s: SERIES.get(s, SERIES["five blocks"]) for s in names}
    settings = {"n": n, "quick": args.quick, "threads": 1, "batch": 1, "transport": "tensormq", "device": args.device,
                "client": "1 synchronous client, each request followed by full.pt in the client process",
                "series": {s: [[name, stems] for name, stems in blocks] for s, blocks in series.items()}}
    result = {"experiment": "fused", "env": common.env_info(settings), "settings": settings, "series": {}}
    with common.blockflow_server(repo) as server:
        for label, blocks in series.items():
            grouped = label == "one group"
            res = server.update(group_update(device=args.device) if grouped
                                else update_for(blocks, device=args.device))
            common.log.info("%s: update applied in %.2fs", label, res["seconds"])
            row = measure_group(server, full, x, n, args.quick) if grouped else measure(server, full, x, n, args.quick)
            row["update_s"] = res["seconds"]
            row["goal_ratio"] = GOALS[label]
            row["meets_goal"] = row["ratio_p50"] <= GOALS[label]
            row["block_memory"] = block_memory(server.block_pids())
            result["series"][label] = row
            common.log.info("%s: p50 %.1f ms, monolithic %.1f ms, ratio %.3f (inference %.3fx, rest %.2f ms)",
                            label, row["rtt_ms"]["p50"], row["monolithic_interleaved_ms"]["p50"], row["ratio_p50"],
                            row["inference_ratio_p50"], row["rest_ms"]["p50"])
            if grouped:
                sep = row["five_blocks_same_rounds"]
                print(f"one group: p50 {row['rtt_ms']['p50']:.2f} ms, five processes {sep['rtt_ms']['p50']:.2f} ms, "
                      f"monolithic {row['monolithic_interleaved_ms']['p50']:.2f} ms (same rounds): "
                      f"group/monolithic {row['ratio_p50']:.3f}x, five processes/monolithic {sep['ratio_p50']:.3f}x, "
                      f"group/five processes {row['ratio_to_five_blocks_p50']:.3f}x")
    common.write_json(out, "fused", result)
    plot(result, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
