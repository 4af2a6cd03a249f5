"""``blockflow``: the one entry point. ``blockflow --help`` lists the subcommands."""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import warnings
from blockflow import settings


def _export(args) -> int:
    from blockflow.blocks.repository import export_model
    variants = {}
    if args.variant:
        if not args.variant_blocks:
            print("--variant needs --variant-blocks (e.g. block4,head)", file=sys.stderr)
            return 2
        variants[args.variant] = [b.strip() for b in args.variant_blocks.split(",") if b.strip()]
    path = export_model(args.model, args.out, blocks=args.blocks, method=args.method, variants=variants or None,
                        seed=args.seed)
    print(f"exported {args.model} ({args.method}, {args.blocks} blocks) -> {path}")
    return 0


def _serve(args) -> int:
    from .server import serve
    token = args.token or settings.TOKEN
    serve(host=args.host, port=args.port, dispatcher_host=args.dispatcher_host, dispatcher_port=args.dispatcher_port,
          repo=args.repo, state_dir=args.state_dir, token=token, ready_file=args.ready_file, window=args.window,
          quiet=args.quiet)
    return 0


def _update(args) -> int:
    from .restclient import RestError, call
    with open(args.file) as f:
        body = json.load(f)
    try:
        print(json.dumps(call("POST", f"{args.url}/system/update", body, args.token), indent=2))
    except RestError as exc:
        print(json.dumps(exc.body, indent=2), file=sys.stderr)
        return 1
    return 0


def _status(args) -> int:
    from .restclient import call
    print(json.dumps(call("GET", f"{args.url}/system"), indent=2))
    return 0


def _load(args) -> int:
    from .loadgen import format_summary, run_load
    shape = tuple(int(s) for s in args.shape.split(","))
    s = run_load(args.address, args.task, clients=args.clients, batch=args.batch, duration=args.duration,
                 rate=args.rate, shape=shape, token=args.token or settings.TOKEN,
                 timeout=args.timeout, out=args.out)
    print(format_summary(s))
    return 0 if s["ok"] else 1


def _kpi(args) -> int:
    from .kpi import blocks_in, format_table, summarize_block
    names = blocks_in(args.run_dir)
    if not names:
        print(f"no KPI logs (*.latency.jsonl) in {args.run_dir}", file=sys.stderr)
        return 1
    summaries = [summarize_block(args.run_dir, n, skip=args.skip) for n in names]
    print(json.dumps(summaries, indent=2) if args.json else format_table(summaries))
    return 0


def _demo(args) -> int:
    from .demo import run_demo
    return run_demo(repo=args.repo, config=args.config, requests=args.requests)


#: The experiments are not installed with the product: they live in a checkout's experiments/.
EXPERIMENT_NAMES = ["offline_blocks", "rtt", "pipeline_latency", "hop_overhead", "batch_scaling", "multiclient",
                    "throughput", "utilization", "energy", "memory_model", "multi_gpu"]


def _experiments_dir(given: str | None) -> str | None:
    """The checkout holding experiments/: --checkout, else the current directory, else the one this
    package was installed from in editable mode."""
    candidates = [given] if given else [os.getcwd(), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    for root in candidates:
        if os.path.isfile(os.path.join(root, "experiments", "__main__.py")):
            return root
    return None


def _bench(args) -> int:
    root = _experiments_dir(args.checkout)
    if root is None:
        print("blockflow bench: no experiments/ folder found (it ships with a checkout of the repository, not "
              "with the installed package); run it from the checkout or pass --checkout DIR", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "experiments", args.name, *(["--quick"] if args.quick else []),
           *(["--out", args.out] if args.out else [])]
    return subprocess.call(cmd, cwd=root)


def _block(args) -> int:
    from blockflow.blocks.process import main
    return main(["--spec", args.spec])


def _dispatcher(args) -> int:
    from blockflow.dispatcher.process import main
    return main(["--spec", args.spec])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="blockflow", description=(
        "BlockFlow serves DNNs split into blocks, one process per block, with tensors passed between "
        "processes as shared-memory / CUDA IPC handles (TensorMQ). Typical use: `blockflow export`, "
        "`blockflow serve`, POST an update (`blockflow update`), send tasks (`blockflow load` or "
        "blockflow.Client), read KPIs (`blockflow kpi`)."))
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", required=True)

    e = sub.add_parser("export", help="split a torchvision model into TorchScript blocks (seeded weights)")
    e.add_argument("--model", default="resnet50", choices=["resnet18", "resnet50", "resnet152"])
    e.add_argument("--blocks", type=int, default=4, choices=[1, 2, 4], help="4: block1..block4+head; 2: fused")
    e.add_argument("--method", default="script", choices=["script", "trace"])
    e.add_argument("--out", default="model_repo", help="model repository directory (default: model_repo)")
    e.add_argument("--variant", help="also export task-specialised copies under this name (another seed)")
    e.add_argument("--variant-blocks", help="comma-separated blocks to specialise, e.g. block4,head")
    e.add_argument("--seed", type=int, default=0)
    e.set_defaults(fn=_export)

    s = sub.add_parser("serve", help="run the REST API, manager, controller and dispatcher")
    s.add_argument("--host", default="127.0.0.1", help="REST bind address (default loopback; others are explicit)")
    s.add_argument("--port", type=int, default=8080, help="REST port (0: any free port)")
    s.add_argument("--dispatcher-host", default="127.0.0.1", help="dispatcher bind address (default loopback)")
    s.add_argument("--dispatcher-port", type=int, default=5580, help="dispatcher port (0: any free port)")
    s.add_argument("--repo", default="model_repo", help="model repository (default: model_repo)")
    s.add_argument("--state-dir", help="sockets, state and KPI runs (default: a private dir under "
                                       "$XDG_RUNTIME_DIR or the temp dir)")
    s.add_argument("--token", help="require this bearer token for mutating REST calls and from clients "
                                   "(or set BLOCKFLOW_TOKEN)")
    s.add_argument("--ready-file", help="write the bound addresses here as JSON once serving")
    s.add_argument("--window", type=int, default=settings.WINDOW,
                   help=f"TensorMQ slots in flight per edge (default {settings.WINDOW}, BLOCKFLOW_WINDOW)")
    s.add_argument("--quiet", action="store_true", help="no CherryPy access log on screen")
    s.set_defaults(fn=_serve)

    u = sub.add_parser("update", help="POST a system update (JSON file) to a running server")
    u.add_argument("file")
    u.add_argument("--url", default="http://127.0.0.1:8080")
    u.add_argument("--token", default=settings.TOKEN)
    u.set_defaults(fn=_update)

    st = sub.add_parser("status", help="print GET /system of a running server")
    st.add_argument("--url", default="http://127.0.0.1:8080")
    st.set_defaults(fn=_status)

    ld = sub.add_parser("load", help="generate load for a task (synchronous clients or Poisson arrivals)")
    ld.add_argument("--address", default="tcp://127.0.0.1:5580", help="dispatcher address")
    ld.add_argument("--task", required=True)
    ld.add_argument("--clients", type=int, default=1)
    ld.add_argument("--batch", type=int, default=1)
    ld.add_argument("--duration", type=float, default=10.0, help="seconds")
    ld.add_argument("--rate", type=float, help="Poisson arrivals per second (default: synchronous clients)")
    ld.add_argument("--shape", default="3,224,224", help="input shape without the batch dimension")
    ld.add_argument("--timeout", type=float, default=30.0, help="deadline per request, seconds")
    ld.add_argument("--token", help="client token (or BLOCKFLOW_TOKEN)")
    ld.add_argument("--out", help="CSV file for every request's round-trip time")
    ld.set_defaults(fn=_load)

    k = sub.add_parser("kpi", help="per-block latency/resource table from a run directory's KPI logs")
    k.add_argument("run_dir")
    k.add_argument("--skip", type=int, default=0, help="drop this many warm-up records per block")
    k.add_argument("--json", action="store_true")
    k.set_defaults(fn=_kpi)

    d = sub.add_parser("demo", help="end to end: export, serve, deploy two tasks, send requests, print KPIs")
    d.add_argument("--repo", default="model_repo")
    d.add_argument("--config", default=None, help="update to apply (default: configs/resnet50_shared.json)")
    d.add_argument("--requests", type=int, default=20, help="requests per task")
    d.set_defaults(fn=_demo)

    b = sub.add_parser("bench", help="run the experiments (experiments/); `all` runs every one",
                       description="Run the thesis's chapter 4 experiments from a checkout's experiments/ folder, "
                                   "each in its own interpreter. Experiments: " + ", ".join(EXPERIMENT_NAMES) + ".")
    b.add_argument("name", help="experiment name or 'all' (" + ", ".join(EXPERIMENT_NAMES) + ")")
    b.add_argument("--checkout", help="repository checkout holding experiments/ (default: the current directory)")
    b.add_argument("--quick", action="store_true", help="short settings for a smoke run")
    b.add_argument("--out", help="results directory (default experiments/results/<machine>, where the "
                                 "committed results live; give another one for smoke runs)")
    b.set_defaults(fn=_bench)

    bl = sub.add_parser("block", help="run one block process by hand (the manager normally does)")
    bl.add_argument("--spec", required=True, help="BlockSpec as JSON")
    bl.set_defaults(fn=_block)

    dp = sub.add_parser("dispatcher", help="run the dispatcher by hand (the server normally does)")
    dp.add_argument("--spec", required=True, help="DispatcherSpec as JSON")
    dp.set_defaults(fn=_dispatcher)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else settings.LOG_LEVEL,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.jit")
    return args.fn(args) or 0


if __name__ == "__main__":
    sys.exit(main())
