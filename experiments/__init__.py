"""The thesis's chapter 4 experiments, one module each (``python -m experiments.NAME [--quick]``).

``blockflow bench NAME|all [--quick]`` calls :func:`run_all`. Each experiment runs in its own
interpreter (``python -m experiments.NAME``) so that torch thread settings, CherryPy engines and
memory measurements of one cannot leak into the next. Results go to
``experiments/results/<machine>/`` (see experiments/common.py and experiments/README.md).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

#: In the order ``all`` runs them (cheap and independent first, the memory model last but one).
EXPERIMENTS = [
    "offline_blocks",    # Table 4.2, Fig 4.2
    "rtt",               # Table 4.3
    "pipeline_latency",  # Figs 4.3-4.5
    "hop_overhead",      # per-hop cost of the data plane (identity blocks)
    "batch_scaling",     # Figs 4.7-4.8
    "multiclient",       # Fig 4.11
    "throughput",        # Figs 4.12-4.13
    "utilization",       # Fig 4.6
    "energy",            # Fig 4.10 (GPU only)
    "memory_model",      # Section 4.3, Tables 4.4-4.6
    "multi_gpu",         # Figs 4.15-4.16 (>= 2 GPUs only)
    "kserve_cost",       # the Open Inference Protocol against the ZeroMQ client
    "batching",          # dynamic batching at shared blocks (issue 15)
    "peers",             # Ray Serve beside BlockFlow (issue 16; skipped without the [peers] extra)
]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def available(name: str) -> bool:
    return importlib.util.find_spec(f"experiments.{name}") is not None


def run_one(name: str, quick: bool, args: list[str] | None = None) -> int:
    cmd = [sys.executable, "-m", f"experiments.{name}", *(["--quick"] if quick else []), *(args or [])]
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return subprocess.call(cmd, cwd=ROOT, env=env)


def run_all(name: str, quick: bool = False, args: list[str] | None = None) -> int:
    """Run experiment ``name`` (or every one for ``all``); 0 when all of them succeeded."""
    if name == "all":
        names = list(EXPERIMENTS)
    elif name in EXPERIMENTS or (name and available(name)):
        names = [name]
    else:
        print(f"unknown experiment {name!r}; choose 'all' or one of: {', '.join(EXPERIMENTS)}", file=sys.stderr)
        return 2
    results = []
    t_all = time.monotonic()
    for n in names:
        if not available(n):
            print(f"== {n}: not available (experiments/{n}.py is missing); skipped", file=sys.stderr)
            results.append((n, "missing", 0.0))
            continue
        print(f"== {n}{' (quick)' if quick else ''}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        code = run_one(n, quick, args)
        results.append((n, code, time.monotonic() - t0))
    total = time.monotonic() - t_all
    if len(names) > 1:
        print("\nexperiment         exit   seconds", file=sys.stderr)
        for n, code, secs in results:
            print(f"{n:18s} {code!s:>6s} {secs:9.1f}", file=sys.stderr)
        print(f"{'total':18s} {'':>6s} {total:9.1f}", file=sys.stderr)
    failed = [n for n, code, _ in results if code not in (0, "missing")]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
