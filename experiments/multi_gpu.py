"""Blocks spread over several GPUs (thesis 4.2.3, Figs. 4.15 and 4.16). Needs 2 or more GPUs.

The 4-block ResNet50 (+head, which stays with block4) is deployed with its blocks spread evenly
over 1, 2 and 4 GPUs, i.e. path distribution index PDI = N_GPU / N_blocks = 25, 50 and 100 %:

    PDI 25    block1..block4 on cuda:0
    PDI 50    block1, block2 on cuda:0; block3, block4 on cuda:1
    PDI 100   block k on cuda:k-1

over ``zeromq`` and ``tensormq``. One client sends batch-1 tensors as a Poisson process of rate
L (the thesis: 300 tensors/s) for D seconds; from every block's KPI log (joined per request) the
mean compute time m_b (inf) and overhead o_b (eq. 4.1: deser + dev + share + fwd) per block are
reported, the queue wait w_b apart; the first min(250, n/4) requests are dropped as warm-up
(min(5, n/4) in --quick). The thesis
found TensorMQ's overhead 5.26x, 3.56x and 2.96x below ZeroMQ's at PDI 25, 50 and 100: it grows
with the PDI (tensors must cross devices) while ZeroMQ's shrinks.

A configuration that needs more GPUs than are visible is skipped and the JSON says so; with fewer
than 2 GPUs the whole experiment has nothing to compare, so it says why, writes a JSON recording
the skip, and exits 0.

    python -m experiments.multi_gpu [--quick] [--rate L] [--duration S] [--pdi 25,50,100]
"""
from __future__ import annotations

import logging
import sys

import torch

from experiments import common
from experiments.pipeline_latency import BLOCK_NAMES, block_components, kpi_requests

log = logging.getLogger("experiments.multi_gpu")

NAME = "multi_gpu"
PDI_GPUS = {25: 1, 50: 2, 100: 4}
#: Fig. 4.16 text: ZeroMQ overhead / TensorMQ overhead per PDI on the L40S server (Awenode).
THESIS = {"overhead_ratio_zeromq_over_tensormq": {25: 5.26, 50: 3.56, 100: 2.96}, "rate_per_s": 300}


def devices_for(gpus: int) -> list[str]:
    """Devices for b1, b2, b3, b4, head: blocks spread evenly, the head with block4."""
    per_block = [f"cuda:{k * gpus // 4}" for k in range(4)]
    return per_block + [per_block[-1]]


def poisson_details(address: str, x: torch.Tensor, rate: float, duration: float, seed: int, label: str) -> list:
    """Poisson load (blockflow.loadgen) asking for the hops' details: one Result or exception per request."""
    from blockflow.client import BlockFlowError
    from blockflow.loadgen import generate_load
    with common.Progress(int(duration), label) as bar:
        run = generate_load(address, common.TASK, inputs=x, rate=rate, duration=duration, seed=seed, timeout=120,
                            drain=300, details=True, keep_results=True, progress=bar.to)
    return [r.result if r.ok else BlockFlowError(r.message or r.status, r.status) for r in run.records]


def summarise(results: list, kpi: list[dict], quick: bool) -> dict:
    """Replies counted from the client's side; m_b, o_b (eq. 4.1) and w_b from the KPI records."""
    ok = [r for r in results if not isinstance(r, Exception)]
    kept = common.discard_warmup(ok, quick)
    comp = block_components(common.discard_warmup(kpi, quick))
    blocks = {b: {"compute_ms": c["inference_ms"], "overhead_ms": c["overhead_ms"], "wait_ms": c["wait_ms"],
                  "components_ms": {k: v.get("mean") for k, v in c["components_ms"].items()}}
              for b, c in comp.items()}
    return {"sent": len(results), "ok": len(ok), "dropped": len(ok) - len(kept), "errors": len(results) - len(ok),
            "overhead_definition": "eq. 4.1: deser + dev + share + fwd per block (KPI logs); wait apart",
            "server_ms": common.describe([r.server_ms for r in kept if r.server_ms is not None]), "blocks": blocks,
            "total_overhead_ms": sum(blocks[b]["overhead_ms"].get("mean", 0.0) for b in BLOCK_NAMES),
            "total_wait_ms": sum(blocks[b]["wait_ms"].get("mean", 0.0) for b in BLOCK_NAMES),
            "total_compute_ms": sum(blocks[b]["compute_ms"].get("mean", 0.0) for b in BLOCK_NAMES)}


def plot(rows: list[dict], out: str, machine: str) -> None:
    plt = common.pyplot()
    for key, fig_name, title in (("compute_ms", "fig4_15", "computing time (Fig. 4.15)"),
                                 ("overhead_ms", "fig4_16", "overhead time o_b, eq. 4.1 (Fig. 4.16)")):
        fig, ax = plt.subplots(figsize=(7, 3.4))
        width = 0.8 / max(1, len(rows))
        for k, r in enumerate(rows):
            xs = [i + (k - (len(rows) - 1) / 2) * width for i in range(len(BLOCK_NAMES))]
            ax.bar(xs, [r["blocks"][b][key].get("mean", 0.0) for b in BLOCK_NAMES], width,
                   label=f"{r['transport']} PDI {r['pdi']}")
        ax.set_xticks(range(len(BLOCK_NAMES)), BLOCK_NAMES)
        ax.set_xlabel("block")
        ax.set_ylabel("mean time per block (ms)")
        ax.set_title(f"Blocks' average {title} - {machine}", fontsize=9)
        ax.legend(fontsize=7)
        common.save_fig(fig, out, f"{NAME}_{fig_name}.png")


def main(argv=None) -> int:
    ap = common.parser(NAME, __doc__)
    ap.add_argument("--rate", type=float, default=300.0, help="Poisson rate in tensors/s (default 300, the thesis)")
    ap.add_argument("--duration", type=float, help="seconds per configuration (default 60, --quick 5)")
    ap.add_argument("--pdi", type=lambda s: [int(v) for v in s.split(",") if v],
                    help="comma-separated PDIs among 25,50,100 (default all)")
    ap.add_argument("--transports", default=",".join(common.TRANSPORTS))
    args = ap.parse_args(argv)
    common.setup_logging(args.verbose)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    pdis = args.pdi or list(PDI_GPUS)
    duration = args.duration or (5.0 if args.quick else 60.0)
    transports = [t for t in args.transports.split(",") if t]
    settings = {"pdi": pdis, "rate_per_s": args.rate, "duration_s": duration, "transports": transports,
                "batch": 1, "quick": args.quick, "n": args.n, "gpus_visible": gpus,
                "placement": {p: devices_for(g) for p, g in PDI_GPUS.items()}}
    env = common.env_info(settings)
    if gpus < 2:
        reason = (f"{gpus} CUDA GPU(s) visible; spreading blocks over 1, 2 and 4 GPUs (PDI 25/50/100) needs at "
                  "least 2 to compare anything" + ("" if gpus else " (this is a CPU-only machine)"))
        print(f"multi_gpu: skipped: {reason}")
        common.write_json(args.out, NAME, {"env": env, "settings": settings, "skipped": True, "reason": reason,
                                           "thesis": THESIS})
        return 0
    repo = common.ensure_repo(args.repo)
    x = common.input_tensor(1)
    rows, skipped = [], {}
    with common.blockflow_server(repo) as server:
        for pdi in pdis:
            need = PDI_GPUS[pdi]
            if need > gpus:
                skipped[pdi] = f"needs {need} GPUs, {gpus} visible"
                print(f"multi_gpu: PDI {pdi} skipped: {skipped[pdi]}")
                continue
            for t in transports:
                server.update(common.pipeline_update(t, devices=devices_for(need)))
                from blockflow.client import Client
                with Client(server.dispatcher, timeout=120) as c:
                    for _ in range(5):
                        c.infer(common.TASK, x)
                since = time.time()
                res = poisson_details(server.dispatcher, x, args.rate, duration, pdi, f"{t} PDI {pdi}")
                kpi = kpi_requests(server, since)
                rows.append({"pdi": pdi, "gpus": need, "transport": t, "devices": devices_for(need),
                             **summarise(res, kpi, args.quick)})
    ratios = {}
    for pdi in {r["pdi"] for r in rows}:
        z = next((r for r in rows if r["pdi"] == pdi and r["transport"] == "zeromq"), None)
        tm = next((r for r in rows if r["pdi"] == pdi and r["transport"] == "tensormq"), None)
        if z and tm and tm["total_overhead_ms"]:
            ratios[pdi] = z["total_overhead_ms"] / tm["total_overhead_ms"]
    common.write_json(args.out, NAME, {"env": env, "settings": settings, "skipped": False, "skipped_pdi": skipped,
                                       "rows": rows, "overhead_ratio_zeromq_over_tensormq": ratios, "thesis": THESIS})
    plot(rows, args.out, env["machine"])
    print(f"\nFigs. 4.15-4.16 on {env['machine']} ({gpus} GPUs, Poisson {args.rate:g}/s, {duration:g} s each):")
    for r in rows:
        print(f"PDI {r['pdi']:3d} {r['transport']:9s} compute {r['total_compute_ms']:7.2f} ms, overhead (eq. 4.1) "
              f"{r['total_overhead_ms']:7.2f} ms, wait {r['total_wait_ms']:7.2f} ms ({r['ok']} ok, {r['errors']} errors)")
    for pdi, v in sorted(ratios.items()):
        print(f"PDI {pdi}: ZeroMQ / TensorMQ overhead = {v:.2f}x (thesis {THESIS['overhead_ratio_zeromq_over_tensormq'][pdi]}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
