"""Replicas for throughput (issue 28): the fused ResNet50 block run as 1 and as 2 processes.

One ``blockflow serve``, three layouts deployed side by side under their own task (an idle
block costs no CPU), each the five ResNet50 files (block1..block4 + head) fused in one block:

  r1           ``replicas: 1``, 1 torch thread: one request at a time (the default layout);
  r2           ``replicas: 2``, 1 torch thread each: the dispatcher spreads requests over them;
  r1_threads2  ``replicas: 1``, 2 torch threads: the other way to give one block two cores.

Each layout gets ``--clients`` (4) closed-loop synchronous clients for ``--duration`` seconds
in ``--rounds`` windows, the layouts taking turns window by window (the order flips every
round) so all see the same background load; answers inside the windows count. Reported per
layout: requests/s, round-trip p50/p99, errors, and how many inferences each replica's KPI log
holds (the spread). The goal (issue 28): r2 / r1 >= 1.6 with 4 clients on 2 cores.

    python -m experiments.replicas [--quick] [--clients N] [--duration S] [--rounds R] [--out DIR]
"""
from __future__ import annotations

import contextlib

from experiments import common
from experiments.peers import interleaved_throughput

NAME = "replicas"
#: (task and block name, replicas, torch threads per process)
LAYOUTS = (("r1", 1, 1), ("r2", 2, 1), ("r1_threads2", 1, 2))
GOAL_RATIO = 1.6


def update(layouts=LAYOUTS) -> dict:
    files = [f"resnet50/{stem}.pt" for _, stem in common.PIPELINE]
    return {"transport": "tensormq", "protocol": "ipc",
            "blocks": [{"name": name, "model": files, "device": "cpu", "threads": threads, "replicas": replicas}
                       for name, replicas, threads in layouts],
            "tasks": [{"id": name, "path": [name]} for name, _, _ in layouts]}


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(NAME, __doc__)
    ap.add_argument("--clients", type=int, default=4, help="closed-loop clients per layout (default 4)")
    ap.add_argument("--duration", type=float, help="seconds of windows per layout (default 30, quick 2)")
    ap.add_argument("--rounds", type=int, help="windows per layout, taken in turn (default 3, quick 1)")
    args = ap.parse_args(argv)
    common.setup_logging(args.verbose)
    from blockflow.client import Client
    duration = args.duration or (2.0 if args.quick else 30.0)
    rounds = args.rounds or (1 if args.quick else 3)
    out = common.results_dir(args.out)
    repo = common.ensure_repo(args.repo)
    x = common.input_tensor(1)
    settings = {"quick": args.quick, "clients": args.clients, "duration_s": duration, "rounds": rounds, "batch": 1,
                "transport": "tensormq", "layouts": [list(lay) for lay in LAYOUTS]}
    result = {"experiment": NAME, "env": common.env_info(settings), "settings": settings, "goal_ratio": GOAL_RATIO}
    with common.blockflow_server(repo) as server:
        res = server.update(update())
        common.log.info("three layouts deployed in %.1f s", res["seconds"])

        def caller(task: str):
            @contextlib.contextmanager
            def open_caller():
                with Client(server.dispatcher, timeout=120) as c:
                    yield lambda: c.infer(task, x)
            return open_caller

        with Client(server.dispatcher, timeout=120) as c:  # every replica loads and warms its model at start
            want = {name: c.infer(name, x) for name, _, _ in LAYOUTS}
        thr = interleaved_throughput({name: caller(name) for name, _, _ in LAYOUTS}, args.clients, duration, rounds)
        server.flush_kpi()
        system = server.call("GET", "/system")
        spread = {b["name"]: server.kpi(b["name"])["count"] for b in system["blocks"]}
    import torch
    # the same threads give the very same tensor; two threads sum in another order (float rounding)
    result["same_results"] = torch.equal(want["r2"], want["r1"])
    result["max_abs_diff_threads2"] = float((want["r1_threads2"] - want["r1"]).abs().max())
    result["layouts"] = {name: {"replicas": replicas, "threads": threads, **thr[name],
                                "inferences_by_process": {p: n for p, n in spread.items()
                                                          if p == name or p.startswith(f"{name}.r")}}
                         for name, replicas, threads in LAYOUTS}
    for row in result["layouts"].values():
        row.pop("rtts", None)
    r1 = result["layouts"]["r1"]["throughput_rps"]
    result["ratio_r2_r1"] = result["layouts"]["r2"]["throughput_rps"] / r1 if r1 else None
    result["ratio_r2_r1_threads2"] = (result["layouts"]["r2"]["throughput_rps"]
                                      / result["layouts"]["r1_threads2"]["throughput_rps"]
                                      if result["layouts"]["r1_threads2"]["throughput_rps"] else None)
    result["meets_goal"] = result["ratio_r2_r1"] is not None and result["ratio_r2_r1"] >= GOAL_RATIO
    common.log.info("r2 / r1 = %s, r2 / r1_threads2 = %s", result["ratio_r2_r1"], result["ratio_r2_r1_threads2"])
    common.write_json(out, NAME, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
