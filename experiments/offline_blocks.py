"""Offline block analysis (thesis 4.1.1, Table 4.2 and Fig. 4.2).

Each ResNet50 block (block1..block4, head) and the whole model (full) is loaded alone, scripted,
traced and as a torch.export program (``.pt2``), in a fresh interpreter, and runs N inferences on a seeded batch-1 input. Reported
per block: mean/std/p50/p99 latency, process RSS before and after loading and after the
inferences (the CPU stand-in for the thesis's "process occupied VRAM"), the parameter count and
bytes from the manifest, and torch allocated/reserved memory when the block runs on a GPU.

The sum of the scripted block means (block1..block4 + head) is the offline baseline that
pipeline_latency compares the served pipeline with (thesis: 11.703 ms on the GV100).

N = 100 by default (the thesis: 1000; 12 fresh interpreters of 100 inferences fit in 2 minutes
on a 2-core machine), 20 untimed inferences first; --quick: 20. By default scripted and traced,
as Table 4.2; torch.export programs (seconds to load each) with --export, and in --quick.
--quick (the smoke test) forks each (method, block)'s process from a forkserver that has torch
imported, as the served blocks are, instead of starting a fresh interpreter (2-3 s of torch import
each): every block is still loaded alone in a process that has loaded no other model.

Where torch.export programs are measured (--export, --quick) the two formats that
``blockflow export --format torchscript|export`` writes are also timed being written: the whole
ResNet50 split into 4 blocks plus full (``export_model``, whose work runs in a fresh interpreter,
as ``blockflow export``'s does), --export-rounds rounds (default 3), the two formats interleaved and
their order alternating, the median per format and the ratio reported. --quick times one round of
ResNet18's full model alone (the path, not a figure). README's "Block formats" chooses the default
format from these figures (load time, first inference, latency, export time).

    python -m experiments.offline_blocks [--quick] [--n N] [--threads T] [--device cpu|cuda] [--export]
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from experiments import common

log = logging.getLogger("experiments.offline_blocks")

NAME = "offline_blocks"
BLOCKS = ("block1", "block2", "block3", "block4", "head", "full")
METHODS = ("script", "trace", "export")
#: Table 4.2's methods, the default: loading a torch.export program takes seconds per block,
#: which the 2-minute budget has no room for; --quick (the smoke test) and --export run it too.
DEFAULT_METHODS = ("script", "trace")
SUFFIX = {"script": ".pt", "trace": ".pt", "export": ".pt2"}
QUICK_EXPORT = ("block1", "full")
#: The formats ``blockflow export --format`` writes, timed writing the whole model (the labels of
#: blocks/repository.py's FORMATS; torchscript with --method script, the CLI's default).
FORMATS = ("torchscript", "export")
#: What is exported when the export time is measured: (model, blocks); --quick: the path only.
EXPORT_TIMED = ("resnet50", 4)
QUICK_EXPORT_TIMED = ("resnet18", 1)


def worker(args: dict) -> dict:
    """Runs in a fresh interpreter: load one block, time ``n`` inferences, measure memory."""
    import psutil
    import torch

    from blockflow.blocks.repository import load_block, load_manifest

    torch.set_num_threads(args["threads"])
    proc = psutil.Process()
    dev = torch.device(args["device"])
    fname = args["block"] + SUFFIX[args["method"]]
    entry = load_manifest(args["repo"], "resnet50")["blocks"][fname]
    x = torch.randn(entry["input_shape"], generator=torch.Generator().manual_seed(0))
    if dev.type == "cuda":
        torch.cuda.init()
        torch.zeros(1, device=dev)  # the CUDA context, before "before"
        x = x.to(dev)
    rss0 = proc.memory_info().rss
    t0 = time.perf_counter()
    model = load_block(args["repo"], f"resnet50/{fname}", args["device"])
    load_s = time.perf_counter() - t0
    rss_loaded = proc.memory_info().rss
    times, alloc, reserved = [], [], []

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    with torch.inference_mode():
        t = time.perf_counter()
        model(x)  # the first inference after loading: what a respawned block's first request waits for
        sync()
        first_ms = (time.perf_counter() - t) * 1e3
        for _ in range(args["warmup"] - 1):
            model(x)
        sync()
        for _ in range(args["n"]):
            t = time.perf_counter()
            model(x)
            sync()
            times.append((time.perf_counter() - t) * 1e3)
            if dev.type == "cuda":
                alloc.append(torch.cuda.memory_allocated(dev) / 2**20)
                reserved.append(torch.cuda.memory_reserved(dev) / 2**20)
    mem = proc.memory_full_info()
    out = {"block": args["block"], "method": args["method"], "device": args["device"], "threads": args["threads"],
           "n": args["n"], "warmup": args["warmup"], "load_s": load_s, "first_call_ms": first_ms,
           "latency_ms": common.describe(times),
           "rss_before_load_mb": rss0 / 2**20, "rss_after_load_mb": rss_loaded / 2**20,
           "rss_after_inference_mb": mem.rss / 2**20, "uss_after_inference_mb": mem.uss / 2**20,
           "rss_load_delta_mb": (rss_loaded - rss0) / 2**20, "rss_total_delta_mb": (mem.rss - rss0) / 2**20,
           "params": entry["params"], "param_bytes": entry["param_bytes"],
           "params_mb": entry["param_bytes"] / 2**20, "times_ms": times}
    if dev.type == "cuda":
        out["torch_allocated_mb"] = common.describe(alloc)
        out["torch_reserved_mb"] = common.describe(reserved)
        out["torch_max_allocated_mb"] = torch.cuda.max_memory_allocated(dev) / 2**20
        try:
            import pynvml
            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(dev.index or 0)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                if p.pid == os.getpid() and p.usedGpuMemory is not None:
                    out["process_vram_mb"] = p.usedGpuMemory / 2**20
        except Exception:
            pass
    return out


def run_worker(repo: str, block: str, method: str, n: int, warmup: int, threads: int, device: str) -> dict:
    spec = dict(repo=repo, block=block, method=method, n=n, warmup=warmup, threads=threads, device=device)
    proc = subprocess.run([sys.executable, "-m", "experiments.offline_blocks", "--worker", json.dumps(spec)],
                          cwd=common.ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"worker for {method} {block} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


class ForkedWorkers:
    """--quick: one process per (method, block), forked from a forkserver that imported torch once."""

    def __enter__(self):
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "psutil", "blockflow.blocks.repository", "experiments.offline_blocks"])
        # max_tasks_per_child=1: a fresh process for every worker, so no block shares a process
        self.pool = ProcessPoolExecutor(max_workers=1, mp_context=ctx, max_tasks_per_child=1)
        return self

    def run(self, repo: str, block: str, method: str, n: int, warmup: int, threads: int, device: str) -> dict:
        spec = dict(repo=repo, block=block, method=method, n=n, warmup=warmup, threads=threads, device=device)
        return self.pool.submit(worker, spec).result()

    def __exit__(self, *exc):
        self.pool.shutdown(wait=True)
        from blockflow.manager.launcher import stop_forkserver
        stop_forkserver()  # and its resource tracker: nothing this run started outlives it


def time_exports(model: str, blocks: int, rounds: int) -> dict:
    """Seconds to write ``model`` split into ``blocks`` blocks plus full, in each format, as
    ``blockflow export`` does (``export_model``: its work runs in a fresh interpreter, torch's
    import included), into an empty directory each time. The formats alternate within a round and
    their order alternates between rounds, so a machine shared with other work slows both alike."""
    from blockflow.blocks.repository import export_model
    samples: dict[str, list[float]] = {f: [] for f in FORMATS}
    files: dict[str, dict[str, int]] = {}
    order = []
    with common.Progress(rounds * len(FORMATS), f"export {model} ({' and '.join(FORMATS)})") as bar:
        for i in range(rounds):
            this = list(FORMATS) if i % 2 == 0 else list(reversed(FORMATS))
            order.append(this)
            for fmt in this:
                out = tempfile.mkdtemp(prefix=f"offline-blocks-export-{fmt}-")
                try:
                    t = time.perf_counter()
                    export_model(model, out, blocks=blocks, fmt=fmt)
                    samples[fmt].append(time.perf_counter() - t)
                    d = os.path.join(out, model)
                    files[fmt] = {f: os.path.getsize(os.path.join(d, f)) for f in sorted(os.listdir(d))
                                  if f != "manifest.json"}
                finally:
                    shutil.rmtree(out, ignore_errors=True)
                bar.update()
    median = {f: statistics.median(v) for f, v in samples.items()}
    return {"model": model, "blocks": blocks, "rounds": rounds, "order": order, "samples_s": samples,
            "median_s": median, "files": files, "bytes": {f: sum(v.values()) for f, v in files.items()},
            "export_over_torchscript": median["export"] / median["torchscript"],
            "how": "export_model (blockflow export's work: a fresh interpreter, build, split, compile, write, "
                   "sha256, manifest) into an empty directory; formats interleaved, order alternating per round"}


def plot(rows: list[dict], out: str) -> None:
    plt = common.pyplot()
    scripted = [r for r in rows if r["method"] == "script" and r["block"] != "full"]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    names = [r["block"] for r in scripted]
    vals = [r["params"] / 1e6 for r in scripted]
    bars = ax.bar(names, vals, color="tab:blue")
    ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_ylabel("parameters (millions)")
    ax.set_xlabel("block")
    ax.set_title("ResNet50 parameters per block (Fig. 4.2)")
    common.save_fig(fig, out, "offline_blocks_params.png")

    fig, ax = plt.subplots(figsize=(6, 3.4))
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    width = 0.8 / len(methods)
    labels = {"script": "scripted", "trace": "traced", "export": "torch.export"}
    for k, method in enumerate(methods):
        rs = [r for r in rows if r["method"] == method]
        xs = [i + (k - (len(methods) - 1) / 2) * width for i in range(len(rs))]
        ax.bar(xs, [r["latency_ms"]["mean"] for r in rs], width, yerr=[r["latency_ms"]["std"] for r in rs],
               label=labels[method], capsize=2)
    ax.set_xticks(range(len(BLOCKS)), BLOCKS)
    ax.set_xlabel("block")
    ax.set_ylabel("latency (ms), mean ± std")
    ax.set_title(f"Offline inference latency per block ({rows[0]['device']}, {rows[0]['threads']} thread(s))")
    ax.legend()
    common.save_fig(fig, out, "offline_blocks_latency.png")


def main(argv=None) -> int:
    ap = common.parser(NAME, __doc__)
    common.add_pipeline_args(ap, "torch threads (default 1, as the served blocks)", transports=False)
    ap.add_argument("--worker", help=argparse_hidden())
    ap.add_argument("--export", action="store_true", help="also torch.export programs (.pt2; on with --quick), "
                                                          "and the time to export the whole model in each format")
    ap.add_argument("--export-rounds", type=int, default=None,
                    help="rounds of the export-time measurement, both formats each (default 3; --quick 1; 0: none)")
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    common.setup_logging(args.verbose)
    import torch
    device, _ = common.device_and_transports(args)
    n = args.n or (20 if args.quick else 100)  # the thesis: 1000; 100 x 12 interpreters fit in 2 minutes
    warmup = 3 if args.quick else 20
    methods_run = METHODS if args.quick or args.export else DEFAULT_METHODS
    repos = {"script": common.ensure_repo(args.repo), "trace": common.traced_repo(args.repo)}
    if "export" in methods_run:
        repos["export"] = common.exported_repo(args.repo)
    export_rounds = 0 if "export" not in methods_run else (
        args.export_rounds if args.export_rounds is not None else (1 if args.quick else 3))
    timed_model, timed_blocks = QUICK_EXPORT_TIMED if args.quick else EXPORT_TIMED
    settings = {"n": n, "warmup_runs_untimed": warmup, "threads": args.threads, "device": device,
                "blocks": list(BLOCKS), "methods": list(methods_run), "quick": args.quick,
                "isolation": "one fresh interpreter per (method, block)", "export_rounds": export_rounds}
    if export_rounds:
        settings["export_timed"] = f"{timed_model}, blocks={timed_blocks}"
    env = common.env_info(settings)
    # --quick (a smoke run) loads only block1 and full as .pt2: each .pt2 load costs seconds of
    # torch.export machinery, and two of them exercise the path
    plan = [(m, b) for m in methods_run for b in BLOCKS if not (args.quick and m == "export" and b not in QUICK_EXPORT)]
    settings["plan"] = [f"{m}/{b}" for m, b in plan]
    rows = []
    if args.quick:
        settings["isolation"] = "one process per (method, block), forked from a forkserver with torch imported"
    with common.Progress(len(plan), "offline blocks") as bar, (ForkedWorkers() if args.quick else contextlib.nullcontext()) as forked:
        for method, block in plan:
            rows.append((forked.run if forked else run_worker)(repos[method], block, method, n, warmup,
                                                                args.threads, device))
            bar.update()
    export_time = time_exports(timed_model, timed_blocks, export_rounds) if export_rounds else None
    times = {f"{r['method']}/{r['block']}": r.pop("times_ms") for r in rows}
    offline_sum = {}
    for m in methods_run:  # the sum of the blocks' means, when every block of the method was measured
        means = [r["latency_ms"]["mean"] for r in rows if r["method"] == m and r["block"] != "full"]
        offline_sum[m] = sum(means) if len(means) == len(BLOCKS) - 1 else None
    full_mean = {m: next(r["latency_ms"]["mean"] for r in rows if r["method"] == m and r["block"] == "full")
                 for m in methods_run}
    common.write_json(args.out, NAME, {"env": env, "settings": settings, "rows": rows,
                                       "offline_sum_ms": offline_sum, "full_model_ms": full_mean,
                                       **({"export_time": export_time} if export_time else {})})
    common.write_csv(args.out, f"{NAME}_times.csv", ["method", "block", "i", "ms"],
                     ([k.split("/")[0], k.split("/")[1], i, v] for k, vs in times.items() for i, v in enumerate(vs)))
    plot(rows, args.out)

    print(f"\nTable 4.2 on {env['machine']} ({device}, {args.threads} thread(s), n={n}):")
    print(f"{'type':8s} {'block':7s} {'mean ms':>9s} {'std ms':>8s} {'p99 ms':>8s} {'params M':>9s} "
          f"{'params MB':>9s} {'RSS load Δ MB':>13s} {'RSS total Δ MB':>14s} {'RSS MB':>8s}")
    for r in rows:
        lat = r["latency_ms"]
        print(f"{r['method'].upper():8s} {r['block']:7s} {lat['mean']:9.3f} {lat['std']:8.3f} {lat['p99']:8.3f} "
              f"{r['params'] / 1e6:9.3f} {r['params_mb']:9.2f} {r['rss_load_delta_mb']:13.1f} "
              f"{r['rss_total_delta_mb']:14.1f} {r['rss_after_inference_mb']:8.1f}")
    for m in methods_run:
        total = f"{offline_sum[m]:.3f} ms" if offline_sum[m] is not None else "not measured (--quick)"
        print(f"offline sum of block means ({m}): {total}; full model alone {full_mean[m]:.3f} ms")
    load = {m: {r["block"]: r["load_s"] for r in rows if r["method"] == m} for m in methods_run}
    print("load time, s (" + ", ".join(BLOCKS) + "):")
    for m in methods_run:
        print(f"  {m:7s} " + "  ".join(f"{load[m][b]:.3f}" if b in load[m] else "  –  " for b in BLOCKS))
    if export_time:
        e = export_time
        print(f"export time, {e['model']} blocks={e['blocks']}, median of {e['rounds']} interleaved round(s): "
              + ", ".join(f"{f} {e['median_s'][f]:.1f} s ({e['bytes'][f] / 2**20:.0f} MB)" for f in FORMATS)
              + f"; export/torchscript {e['export_over_torchscript']:.2f}x")
    return 0


def argparse_hidden():
    import argparse
    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
