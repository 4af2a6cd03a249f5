"""The first request after an update against a steady one (issue 40, item 5).

    python -m experiments.first_request [--quick] [--updates U] [--n N] [--transports zeromq,tensormq]
                                        [--device cpu|cuda] [--out DIR]

One ``blockflow serve`` and one client connected before anything is updated, per transport:
the ResNet50 ``classify`` path (4 blocks + head, TorchScript, one torch thread per block) is
deployed, then replaced ``U`` times by an update that changes every block's declaration (its
``max_inference_s`` alternates, which changes nothing on a request's way), so every update
starts five new block processes, and the dispatcher sends the task to new endpoints. After each
update returns, the same client sends ``N`` requests one at a time: request 1 is the first after
the update, the steady figure is the median of requests 3..N (request 2 is reported apart).

Reported per transport and device: per update the first request's round trip over the steady
median (``ratio``), and the median of those ratios over the updates (``ratio_median``); and
where the first request's extra time went, per block, from the hop records its reply carries
(``wait``, ``deser``, ``dev``, ``inf``, ``share``: Result.hops), the way in (the client's send
to the first block's ``t_in``), the transits between blocks (a block's ``t_out`` to the next
one's ``t_in``: its send, the socket and the next block's wake-up) and the way out, each as
request 1 minus the steady median of the same component, medians over the updates.

Without a first-request cost every ratio is about 1: a block that is ready has run its model
(TorchScript's profiling executor optimises its graph after its profiled runs, so warm-up runs
it more than once: blocks/runner.py), and its sockets to its next hops and their shared-memory
slots exist before the manager switches tasks to it (Note [Ready to serve] in blocks/process.py).
"""
from __future__ import annotations

import statistics
import time

from . import common

#: Components of a block's hop record, in the order of a request's way through a block.
HOP_PARTS = ("wait", "deser", "dev", "inf", "share")


def update_body(transport: str, device: str, threads: int, k: int) -> dict:
    """The pipeline update number ``k``: every block's declaration differs from update k-1's."""
    body = common.pipeline_update(transport, threads=threads, device=device)
    for b in body["blocks"]:
        b["max_inference_s"] = 60.0 + (k % 2)
    return body


def components(r, t_send: float, t_back: float) -> dict[str, float]:
    """Where one round trip went, in ms: per block its hop record's parts, the way in, every
    transit between two blocks and the way out (Note [Hop timestamps] in blocks/kpilog.py)."""
    hops = r.hops
    out = {"rtt": (t_back - t_send) * 1e3, "way_in": (hops[0]["t_in"] - t_send) * 1e3,
           "way_out": (t_back - hops[-1]["t_out"]) * 1e3}
    for i, h in enumerate(hops):
        for part in HOP_PARTS:
            out[f"{h['b']}.{part}"] = h[part]
        if i + 1 < len(hops):
            out[f"{h['b']}->{hops[i + 1]['b']}"] = (hops[i + 1]["t_in"] - h["t_out"]) * 1e3
    return out


def after_update(client, x, n: int) -> list[dict]:
    """``n`` requests one at a time, each one's components."""
    rows = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = client.infer_details(common.TASK, x)
        rows.append(components(r, t0, time.perf_counter()))
    return rows


def quartiles(values: list[float]) -> list[float]:
    """The first and third quartiles of ``values`` (the spread a median over the updates is read
    with); both the one value when there is one."""
    if len(values) < 2:
        return [values[0], values[0]] if values else []
    q = statistics.quantiles(values, n=4, method="inclusive")
    return [q[0], q[2]]


def summarise(rounds: list[list[dict]]) -> dict:
    """Per update: request 1 and 2 over the steady median (requests 3..N); over the updates:
    the medians of those ratios and of each component's extra time in request 1."""
    ratios, second, extra = [], [], {}
    for rows in rounds:
        steady = rows[2:]
        med = {k: statistics.median(r[k] for r in steady) for k in rows[0]}
        ratios.append(rows[0]["rtt"] / med["rtt"])
        second.append(rows[1]["rtt"] / med["rtt"])
        for k in rows[0]:
            extra.setdefault(k, []).append(rows[0][k] - med[k])
    return {"ratio": ratios, "ratio_median": statistics.median(ratios), "ratio_quartiles": quartiles(ratios),
            "second_ratio": second, "second_ratio_median": statistics.median(second),
            "first_ms": [rows[0]["rtt"] for rows in rounds],
            "steady_ms": [statistics.median(r["rtt"] for r in rows[2:]) for rows in rounds],
            "extra_ms": {k: statistics.median(v) for k, v in extra.items()},
            "rounds": rounds}


def main(argv: list[str] | None = None) -> int:
    ap = common.parser("first_request", __doc__)
    common.add_pipeline_args(ap)
    ap.add_argument("--updates", type=int, help="updates per transport (default 11; 2 with --quick). One "
                                                 "update's ratio varies by 20 %% and more on a shared machine: "
                                                 "fewer give a median that cannot settle a 1x goal")
    args = ap.parse_args(argv)
    common.setup_logging(args.verbose)
    import torch
    torch.set_num_threads(1)
    device, transports = common.device_and_transports(args)
    updates = args.updates or (2 if args.quick else 11)
    n = max(args.n or (5 if args.quick else 12), 4)
    out = common.results_dir(args.out)
    repo = common.ensure_repo(args.repo)
    x = common.input_tensor()
    settings = {"updates": updates, "n": n, "quick": args.quick, "threads": args.threads, "device": device,
                "transports": transports, "batch": 1,
                "client": "1 synchronous client, connected before the first update",
                "steady": "median of requests 3..n after each update"}
    result = {"experiment": "first_request", "env": common.env_info(settings), "settings": settings, "series": {}}
    from blockflow.client import Client
    with common.blockflow_server(repo) as server, Client(server.dispatcher, timeout=120) as client:
        for transport in transports:
            rounds = []
            server.update(update_body(transport, device, args.threads, 0))
            client.infer(common.TASK, x)  # the deployment before the measured updates has served
            for k in range(1, updates + 1):
                server.update(update_body(transport, device, args.threads, k))
                rounds.append(after_update(client, x, n))
                common.log.info("%s/%s update %d: first %.1f ms, second %.1f ms, steady %.1f ms", transport,
                                device, k, rounds[-1][0]["rtt"], rounds[-1][1]["rtt"],
                                statistics.median(r["rtt"] for r in rounds[-1][2:]))
            row = summarise(rounds)
            result["series"][f"{transport}/{device}"] = row
            top = sorted(row["extra_ms"].items(), key=lambda kv: -kv[1])[:6]
            q1, q3 = row["ratio_quartiles"]
            print(f"{transport}/{device}: first request / steady median = {row['ratio_median']:.2f}x "
                  f"(quartiles {q1:.2f}-{q3:.2f}; per update {', '.join(f'{v:.2f}' for v in row['ratio'])}; second request "
                  f"{row['second_ratio_median']:.2f}x); first request's extra ms, largest: "
                  + ", ".join(f"{k} {v:+.1f}" for k, v in top), flush=True)
    common.write_json(out, "first_request", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
