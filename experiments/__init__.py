"""The thesis's chapter 4 experiments, one module each (``python -m experiments.NAME [--quick]``).

``blockflow bench NAME|all [--quick] [--out DIR]`` calls :func:`run_all`. Each experiment runs in
its own interpreter (``python -m experiments.NAME``) so that torch thread settings, CherryPy
engines and memory measurements of one cannot leak into the next. Without ``--out`` results go
to the git-ignored ``experiments/results/_runs/<machine>/``; the committed results are replaced
only by ``--out experiments/results/<machine>`` (see experiments/common.py and experiments/README.md).

Without ``--quick`` on a machine without a GPU, an experiment runs with the settings of
:data:`CPU_SETTINGS` (unless the command line gives its own), sized so that ``all`` finishes in
about 42 minutes on a 2-core CPU; every setting used is recorded in the result's ``settings``.
``all`` writes ``<out>/bench_all.json``: the commit and each experiment's exit code and seconds.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

#: In the order ``all`` runs them (cheap and independent first, the memory model last but one,
#: then the reliability runs whose numbers the top-level README quotes).
EXPERIMENTS = [
    "offline_blocks",    # Table 4.2, Fig 4.2
    "rtt",               # Table 4.3
    "pipeline_latency",  # Figs 4.3-4.5
    "hop_overhead",      # per-hop cost of the data plane (identity blocks)
    "hop_budget",        # where a request's time goes, step by step (issue 40)
    "first_request",     # the first request after an update against a steady one (issue 40)
    "tracing",           # what OpenTelemetry tracing costs a request, and one trace drawn (issue 45)
    "batch_scaling",     # Figs 4.7-4.8
    "multiclient",       # Fig 4.11
    "throughput",        # Figs 4.12-4.13
    "utilization",       # Fig 4.6
    "energy",            # Fig 4.10 (GPU only)
    "memory_model",      # Section 4.3, Tables 4.4-4.6
    "multi_gpu",         # Figs 4.15-4.16 (>= 2 GPUs only)
    "kserve_cost",       # the Open Inference Protocol against the ZeroMQ client
    "batching",          # dynamic batching at shared blocks (issue 15)
    "fused",             # fused blocks vs the monolithic model (issue 11)
    "transformers",      # a BERT encoder in 3 blocks vs the whole model; a shared encoder's saving (issue 43)
    "replicas",          # one fused block as 1 and 2 processes (issue 28)
    "block_cache",       # more blocks than memory: Rafiqi's Figs 2-4 with a block cache (issue 44)
    "validation_cost",   # hand-written checks vs pydantic/msgspec (issue 11)
    "peers",             # Ray Serve beside BlockFlow (issue 16; skipped without the [peers] extra)
    "chaos",             # faults under load (reliability)
    "fuzz",              # garbage at the data plane (reliability)
    "soak",              # steady load with topology updates (reliability)
]

#: Settings of a full run on a CPU-only machine, sized (from single runs on the 2-core VM) so that
#: ``all`` takes about 42 minutes there (41.9 at cedb8c7); the approximate minutes are in the comments. The thesis's
#: own settings (1000 inferences, 120 s series, ...) would take hours on 2 cores. A GPU machine
#: runs the scripts' defaults, which are the thesis's.
CPU_SETTINGS = {
    "offline_blocks": ["--n", "50", "--export"],                              # 3.5 (the README compares formats)
    "rtt": ["--n", "3000"],                                                   # 1.5
    "pipeline_latency": ["--duration", "20", "--variants", "default,no-trim,pinned"],  # 6 (3.5 of it variants)
    "hop_overhead": ["--budget", "3"],                                        # 4.5 (1 of it the bundle rows)
    "hop_budget": ["--client", "both"],                                       # 2 (the README compares lent slots with bytes)
    "first_request": [],                                                      # 2.5 (11 updates per transport)
    "tracing": [],                                                            # 2 (3 servers, 5 rounds of 50)
    "batch_scaling": [],                                                      # 2 (3 s per series and batch)
    "multiclient": ["--clients", "1,2,4,8", "--duration", "8"],               # 2.5
    "throughput": ["--rates", "2,6,10,14,20", "--duration", "8"],             # 3
    "utilization": ["--duration", "30"],                                      # 1.5
    "memory_model": [],                                                       # 3
    "kserve_cost": [],                                                        # 1
    "fused": [],                                                              # 2.5
    "transformers": [],                                                       # 3 (4 exports, 300 rounds)
    "replicas": [],                                                           # 2
    "block_cache": [],                                                        # 10 (24 cells x 3 deployments)
    "validation_cost": [],                                                    # 0.5 (the typed header)
    "peers": [],                                                              # 5 (skipped without [peers])
    "batching": ["--rates", "6,12,20", "--duration", "8"],                    # 4.5 (2.5 of it half-load rounds)
    "chaos": ["--duration", "60"],                                            # 1.5
    "fuzz": [],                                                               # 0.5
    "soak": ["--minutes", "10"],                                              # 10.5 (Note [Seeing a leak])
}

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def available(name: str) -> bool:
    return importlib.util.find_spec(f"experiments.{name}") is not None


def _has_gpu() -> bool:
    from experiments.common import gpu_names
    return bool(gpu_names())


def command(name: str, quick: bool, out: str | None = None, args: list[str] | None = None,
            gpu: bool = False) -> list[str]:
    """The command line that runs ``name``: sized settings for a full run on a CPU-only machine."""
    sized = [] if quick or gpu else CPU_SETTINGS.get(name, [])
    return [sys.executable, "-m", f"experiments.{name}", *(["--quick"] if quick else []), *sized,
            *(["--out", out] if out else []), *(args or [])]


def run_one(name: str, quick: bool, args: list[str] | None = None, out: str | None = None,
            gpu: bool = False) -> int:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = command(name, quick, out, args, gpu)
    print("$ " + " ".join(["python", *cmd[1:]]), file=sys.stderr, flush=True)
    return subprocess.call(cmd, cwd=ROOT, env=env)


def run_all(name: str, quick: bool = False, args: list[str] | None = None, out: str | None = None) -> int:
    """Run experiment ``name`` (or every one for ``all``) into ``out``; 0 when all of them succeeded.
    ``all`` also writes ``<out>/bench_all.json`` (exit code and seconds per experiment, the commit)."""
    if name == "all":
        names = list(EXPERIMENTS)
    elif name in EXPERIMENTS or (name and available(name)):
        names = [name]
    else:
        print(f"unknown experiment {name!r}; choose 'all' or one of: {', '.join(EXPERIMENTS)}", file=sys.stderr)
        return 2
    gpu = _has_gpu()
    results = []
    t_all = time.monotonic()
    for n in names:
        if not available(n):
            print(f"== {n}: not available (experiments/{n}.py is missing); skipped", file=sys.stderr)
            results.append((n, "missing", 0.0))
            continue
        print(f"== {n}{' (quick)' if quick else ''}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        code = run_one(n, quick, args, out, gpu)
        results.append((n, code, time.monotonic() - t0))
    total = time.monotonic() - t_all
    if len(names) > 1:
        print("\nexperiment         exit   seconds", file=sys.stderr)
        for n, code, secs in results:
            print(f"{n:18s} {code!s:>6s} {secs:9.1f}", file=sys.stderr)
        print(f"{'total':18s} {'':>6s} {total:9.1f}", file=sys.stderr)
        write_summary(out, quick, gpu, results, total, args)
    failed = [n for n, code, _ in results if code not in (0, "missing")]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def write_summary(out: str | None, quick: bool, gpu: bool, results: list[tuple], total: float,
                  args: list[str] | None = None) -> str:
    """``<out>/bench_all.json``: what ran, with which command, how it ended and how long it took."""
    from experiments.common import write_json
    return write_json(out, "bench_all", {
        "quick": quick, "total_s": round(total, 1),
        "experiments": [{"name": n, "exit_code": code, "seconds": round(secs, 1),
                         "command": " ".join(["python", *command(n, quick, out, args, gpu)[1:]])}
                        for n, code, secs in results]})
