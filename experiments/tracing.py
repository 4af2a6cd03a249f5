"""What tracing costs a request, and one traced request drawn as a waterfall (issue 45, item 4).

    python -m experiments.tracing [--quick] [--rounds R] [--n N] [--transport tensormq|zeromq] [--out DIR]

Three ``blockflow serve`` at once, each with the ResNet50 ``classify`` path (4 blocks + head,
TorchScript, one torch thread per block): tracing off, tracing at ratio 0.01 and at ratio 1.0,
the last two exporting to an OTLP/HTTP receiver in this process (experiments/otlp.py). ``R``
interleaved rounds send ``N`` requests one at a time to each server in turn, so the three see
the same machine. Reported: per setting the median of the rounds' p50 and p99 and the range of
the p50s, and each traced setting's p50 over the untraced one's in the same round (median of
those ratios). The waterfall (``tracing_waterfall.png``) is the traced request whose round trip
is the median of the last round at ratio 1.0: the dispatcher's root span and each block's span,
its stages (wait, deser, dev, inf, share, fwd) from the span's attributes, drawn on the trace's
own time axis.
"""
from __future__ import annotations

import contextlib
import statistics
import time

from . import common

STAGES = ("wait", "deser", "dev", "inf", "share", "fwd")
ROOT_SPAN = "blockflow request"  # the dispatcher's span of a request (blockflow/core/tracing.py)
SETTINGS = (("off", None), ("ratio 0.01", 0.01), ("ratio 1.0", 1.0))


def waterfall(spans: list[dict], out: str) -> str | None:
    """Draw one trace: a bar per span on the trace's time axis, a block's bar split by stage."""
    plt = common.pyplot()
    if plt is None:
        return None
    root = next(s for s in spans if s["name"] == ROOT_SPAN)
    t0 = root["start_ns"]
    blocks = sorted((s for s in spans if s is not root), key=lambda s: s["start_ns"])
    fig, ax = plt.subplots(figsize=(9, 0.5 * (len(blocks) + 2) + 1))
    colours = dict(zip(STAGES, ("#9e9e9e", "#8d6e63", "#ffb300", "#1e88e5", "#43a047", "#8e24aa")))
    rows = [("dispatcher (request)", root)] + [(s["name"], s) for s in blocks]
    for y, (label, s) in enumerate(reversed(rows)):
        start = (s["start_ns"] - t0) / 1e6
        if s is root:
            ax.barh(y, (s["end_ns"] - s["start_ns"]) / 1e6, left=start, color="#cfd8dc", edgecolor="#607d8b")
            continue
        left = start
        for stage in STAGES:
            width = s["attributes"].get(f"blockflow.{stage}_ms", 0.0)
            ax.barh(y, width, left=left, color=colours[stage], label=stage if y == 0 else None)
            left += width
    ax.set_yticks(range(len(rows)), [label for label, _ in reversed(rows)])
    ax.set_xlabel("ms since the dispatcher received the request")
    ax.set_title(f"one traced request, {root['attributes'].get('blockflow.task')}: "
                 f"{(root['end_ns'] - root['start_ns']) / 1e6:.2f} ms at the dispatcher")
    ax.legend(loc="lower right", ncols=len(STAGES), fontsize=8)
    fig.tight_layout()
    return common.save_fig(fig, out, "tracing_waterfall.png")


def main(argv: list[str] | None = None) -> int:
    ap = common.parser("tracing", __doc__)
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5, --quick 1)")
    ap.add_argument("--transport", choices=common.TRANSPORTS, default="tensormq")
    args = ap.parse_args(argv)
    common.setup_logging(args.verbose)
    rounds = args.rounds or (1 if args.quick else 5)
    n = args.n or (5 if args.quick else 50)
    repo = common.ensure_repo(args.repo)

    from blockflow.client import Client

    from .otlp import OtlpReceiver

    x = common.input_tensor()
    lat = {name: [] for name, _ in SETTINGS}  # per round: (p50, p99)
    last_traced: list[tuple[float, int]] = []
    with OtlpReceiver() as receiver, contextlib.ExitStack() as stack:
        servers = {}
        for name, ratio in SETTINGS:
            env = {} if ratio is None else {"BLOCKFLOW_OTLP_ENDPOINT": receiver.endpoint,
                                            "BLOCKFLOW_TRACE_RATIO": str(ratio), "BLOCKFLOW_TRACE_EXPORT_DELAY": "0.5"}
            srv = stack.enter_context(common.blockflow_server(repo, env=env))
            srv.call("POST", "/system/update", common.pipeline_update(args.transport), timeout=600)
            servers[name] = (srv, stack.enter_context(Client(srv.dispatcher, timeout=60)))
        for name, (_, client) in servers.items():  # warm-up: connections, first requests
            for _ in range(common.warmup_count(n, args.quick)):
                client.infer(common.TASK, x)
        for r in range(rounds):
            for name, (_, client) in servers.items():
                ms = []
                for _ in range(n):
                    t = time.perf_counter()
                    client.infer(common.TASK, x)
                    ms.append((time.perf_counter() - t) * 1e3)
                lat[name].append((common.pct(ms, 0.5), common.pct(ms, 0.99)))
                if name == "ratio 1.0" and r == rounds - 1:
                    last_traced = ms
            common.log.info("round %d/%d: %s", r + 1, rounds,
                            ", ".join(f"{k} p50 {v[-1][0]:.2f} ms" for k, v in lat.items()))
        # every request at ratio 1.0 is traced: wait until that many traces are whole (each process
        # exports on its own, so a trace's spans arrive apart)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(_whole(_traces(receiver.spans()))) < rounds * n:
            time.sleep(0.2)
        spans = receiver.spans()
    traces = _traces(spans)
    settings = {"transport": args.transport, "rounds": rounds, "n": n, "quick": args.quick,
                "ratios": {name: ratio for name, ratio in SETTINGS}}
    result = {"experiment": "tracing", "env": common.env_info(settings), "settings": settings, "series": {}}
    off = [p50 for p50, _ in lat["off"]]
    for name, ratio in SETTINGS:
        p50s, p99s = [p for p, _ in lat[name]], [p for _, p in lat[name]]
        row = {"ratio": ratio, "p50_ms": statistics.median(p50s), "p99_ms": statistics.median(p99s),
               "p50_range_ms": [min(p50s), max(p50s)]}
        if ratio is not None:
            row["p50_over_off"] = statistics.median(p / o for p, o in zip(p50s, off))
        result["series"][name] = row
    result["traces_received"] = len(traces)
    result["spans_per_trace"] = statistics.median(len(v) for v in traces.values()) if traces else None
    whole = _whole(traces)
    result["whole_traces"] = len(whole)
    if whole and last_traced:
        # the median request of the last traced round, by the root span's own length
        last = sorted(whole, key=lambda v: max(s["end_ns"] for s in v))[-n:]
        last.sort(key=lambda v: next(s["end_ns"] - s["start_ns"] for s in v if s["name"] == ROOT_SPAN))
        chosen = last[len(last) // 2]
        result["waterfall"] = {"spans": [{k: s[k] for k in ("name", "start_ns", "end_ns", "attributes")}
                                         for s in chosen]}
        result["waterfall_png"] = waterfall(chosen, common.results_dir(args.out))
    else:
        result["waterfall"] = None
        result["waterfall_missing"] = f"no whole trace arrived within 30 s ({len(traces)} traces, some spans only)"
    path = common.write_json(args.out, "tracing", result)
    for name, row in result["series"].items():
        extra = f", {row['p50_over_off']:.3f}x off" if "p50_over_off" in row else ""
        print(f"{name:>11}: p50 {row['p50_ms']:.2f} ms (range {row['p50_range_ms'][0]:.2f}-"
              f"{row['p50_range_ms'][1]:.2f}), p99 {row['p99_ms']:.2f} ms{extra}")
    print(f"traces received {len(traces)}, spans per trace {result['spans_per_trace']}; wrote {path}")
    return 0


def _whole(traces: dict[str, list[dict]]) -> list[list[dict]]:
    """The traces that hold the dispatcher's root span and one span per block of the path."""
    return [v for v in traces.values()
            if sum(s["name"] == ROOT_SPAN for s in v) == 1 and len(v) == 1 + len(common.PIPELINE)]


def _traces(spans: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for s in spans:
        out.setdefault(s["trace_id"], []).append(s)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
