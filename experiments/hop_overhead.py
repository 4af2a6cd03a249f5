"""Per-hop overhead of the data plane: chains of identity and of copying blocks, both transports.

A hop's overhead is what one more block on the path costs: for each tensor size we time the
round trip through chains of 1 and K blocks (real processes, real sockets) and report
((RTT_K - RTT_1) / (K - 1)), median and p99 over paired samples, plus the components the
blocks record (queue wait, reconstruct, inference, share).

Two kinds of block:

- ``identity`` returns its input: a TensorMQ hop forwards the handle it received and moves no
  tensor bytes, so its cost is the floor of the data plane.
- ``copy`` returns ``x + 1``, a new tensor, as real blocks do: TensorMQ writes it into a slot
  of its own. Its *transport cost* is the per-hop time minus the block's own compute (the
  median ``inf`` component the blocks record).

Sizes: ResNet50's stage outputs at batch 1 and 32. Run:

    python -m experiments.hop_overhead [--quick] [--device cpu|cuda] [--out DIR]
        [--blocks identity,copy] [--batches 1,32] [--stages block1,block4]
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

log = logging.getLogger("experiments.hop_overhead")

STAGES = {"block1": (256, 56, 56), "block2": (512, 28, 28), "block3": (1024, 14, 14), "block4": (2048, 7, 7)}


class Identity(torch.nn.Module):
    def forward(self, x):
        return x


class Copy(torch.nn.Module):
    def forward(self, x):
        return x + 1


KINDS = {"identity": Identity, "copy": Copy}


def _toy_repo(kind: str) -> str:
    repo = tempfile.mkdtemp(prefix="bf-hop-")
    os.makedirs(os.path.join(repo, "toy"))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.save(torch.jit.script(KINDS[kind]()), os.path.join(repo, "toy", f"{kind}.pt"))
    return repo


def _pct(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def measure(transport: str, sizes: list[tuple], n: int, chain: int, device: str = "cpu",
            kind: str = "identity") -> list[dict]:
    repo = _toy_repo(kind)
    names = [f"i{k}" for k in range(chain)]
    blocks = {nm: f"toy/{kind}.pt" for nm in names}
    tasks = {"short": names[:1], "long": names}
    try:
        return _measure(repo, blocks, tasks, transport, sizes, n, chain, device, kind)
    finally:
        shutil.rmtree(repo, ignore_errors=True)


def _measure(repo, blocks, tasks, transport, sizes, n, chain, device, kind) -> list[dict]:
    from blockflow.client import Client
    from blockflow.standalone import StandalonePipeline

    rows = []
    env = {"BLOCKFLOW_KPI_FLUSH_EVERY": "100000"}
    # its own shared-memory prefix: on a shared machine, other runs' leak checks sweep blockflow-*
    with StandalonePipeline(repo, blocks, tasks, transport=transport, threads=1, env=env, device=device,
                            shm_prefix="bfbench-hop") as p:
        with Client(p.address, timeout=120) as c:
            for shape in sizes:
                x = torch.randn(*shape)
                for _ in range(max(3, n // 10)):  # warm-up: slots, mappings, sockets
                    c.infer("short", x)
                    c.infer("long", x)
                short, long_, comps = [], [], []
                for i in range(n):
                    t0 = time.perf_counter()
                    c.infer("short", x)
                    t1 = time.perf_counter()
                    r = c.infer_details("long", x)
                    t2 = time.perf_counter()
                    short.append((t1 - t0) * 1e3)
                    long_.append((t2 - t1) * 1e3)
                    comps.append(r.hops[1:])  # hops after the first (its wait includes dispatcher ingress)
                per_hop = sorted((l - s) / (chain - 1) for s, l in zip(short, long_))
                def comp(key):
                    vals = [h.get(key, 0.0) for hs in comps for h in hs]
                    return statistics.median(vals) if vals else None
                per_hop_ms = (statistics.median(long_) - statistics.median(short)) / (chain - 1)
                row = {"transport": transport, "block": kind, "batch": shape[0], "device": device, "shape": list(shape),
                       "mbytes": x.numel() * 4 / 1e6, "n": n, "chain": chain,
                       "rtt1_median_ms": statistics.median(short), "rttK_median_ms": statistics.median(long_),
                       "per_hop_median_ms": per_hop_ms,
                       "per_hop_paired_median_ms": statistics.median(per_hop),
                       "per_hop_p99_ms": _pct(per_hop, 0.99),
                       "hop_wait_ms": comp("wait"), "hop_deser_ms": comp("deser"), "hop_inf_ms": comp("inf"),
                       "hop_share_ms": comp("share")}
                # what the hop costs beyond the block's own compute (inf includes x + 1)
                row["transport_ms"] = row["per_hop_paired_median_ms"] - (row["hop_inf_ms"] or 0.0)
                rows.append(row)
                print(f"{transport:8s} {kind:8s} {str(list(shape)):22s} {row['mbytes']:8.1f} MB  per hop median "
                      f"{row['per_hop_median_ms']:.3f} ms (paired {row['per_hop_paired_median_ms']:.3f}, "
                      f"p99 {row['per_hop_p99_ms']:.3f}, inf {row['hop_inf_ms'] or 0:.3f}, transport "
                      f"{row['transport_ms']:.3f})  rtt1 {row['rtt1_median_ms']:.3f} ms", flush=True)
        left = p.stop()
        if left["left"] != {"slots": [], "sockets": []}:
            log.warning("left behind: %s", left["left"])
    return rows


def plot(rows: list[dict], out: str) -> None:
    """One panel per kind of block; in each, one line per transport and batch size."""
    from experiments.common import pyplot, save_fig
    plt = pyplot()
    kinds = [k for k in KINDS if any(r.get("block", "identity") == k for r in rows)]
    fig, axes = plt.subplots(1, len(kinds), figsize=(7 * len(kinds), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for t in sorted({r["transport"] for r in rows}):
            for b in sorted({r["shape"][0] for r in rows}):
                rs = sorted((r for r in rows if r["transport"] == t and r["shape"][0] == b
                             and r.get("block", "identity") == kind), key=lambda r: r["mbytes"])
                if not rs:
                    continue
                key = "per_hop_paired_median_ms" if kind == "identity" else "transport_ms"
                ax.plot([r["mbytes"] for r in rs], [max(r[key], 1e-3) for r in rs], "o-" if t == "tensormq" else "s--",
                        label=f"{t}, batch {b}")
        if kind == "identity":
            ax.axhline(0.10, color="grey", lw=0.8, ls="--", label="goal 0.10 ms")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tensor size (MB)")
        ax.set_ylabel("per hop, median (ms)" if kind == "identity" else "per hop minus compute, median (ms)")
        ax.set_title("identity blocks (handle forwarded)" if kind == "identity" else "copying blocks (x + 1)")
        ax.legend(fontsize=8)
    save_fig(fig, out, "hop_overhead.png")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.hop_overhead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer samples and sizes (smoke run)")
    ap.add_argument("--n", type=int, help="samples per size (default 200, quick 20)")
    ap.add_argument("--chain", type=int, default=4, help="identity blocks in the long chain (default 4)")
    ap.add_argument("--transports", default="tensormq,zeromq")
    ap.add_argument("--device", default="cpu", help="where the blocks run: cpu, cuda or cuda:N")
    ap.add_argument("--blocks", default="identity,copy", help="kinds of block: identity, copy (default both)")
    ap.add_argument("--batches", help="batch sizes (default 1,32; quick 1)")
    ap.add_argument("--stages", help=f"ResNet50 stage outputs to send (default all; quick block1,block4): "
                                     f"{','.join(STAGES)}")
    ap.add_argument("--out", help="results directory (default experiments/results/<machine>)")
    args = ap.parse_args(argv)
    n = args.n or (20 if args.quick else 200)
    batches = [int(b) for b in args.batches.split(",")] if args.batches else ([1] if args.quick else [1, 32])
    stages = args.stages.split(",") if args.stages else (["block1", "block4"] if args.quick else list(STAGES))
    unknown = [s for s in stages if s not in STAGES] + [k for k in args.blocks.split(",") if k not in KINDS]
    if unknown:
        ap.error(f"unknown stage or block kind: {', '.join(unknown)}")
    sizes = [(b, *STAGES[s]) for b in batches for s in stages]
    rows = []
    for kind in args.blocks.split(","):
        for t in args.transports.split(","):
            rows += measure(t, sizes, n, args.chain, args.device, kind)
    from experiments.common import env_info, results_dir, write_json
    out = results_dir(args.out)
    write_json(out, "hop_overhead", {"env": env_info(),
                                     "settings": {"n": n, "chain": args.chain, "quick": args.quick,
                                                  "device": args.device, "blocks": args.blocks, "batches": batches,
                                                  "stages": stages},
                                     "rows": rows})
    try:
        plot(rows, out)
    except ImportError:  # matplotlib is in the [bench] extra
        log.warning("matplotlib is missing; no plot written")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
