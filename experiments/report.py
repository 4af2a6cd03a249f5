"""Markdown tables from a results directory: the measured figures beside the thesis's (GV100).

    python -m experiments.report [DIR]            # print them; DIR defaults to results/<machine>
    python -m experiments.report --readme [DIR]   # rewrite the tables in experiments/README.md

experiments/README.md holds each table between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->``;
``--readme`` replaces what is between the markers, so the README says what the JSON files say
(the prose around them is written by hand). A missing JSON is reported as not run.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

from . import common


def _load(out: str, name: str) -> dict | None:
    path = os.path.join(out, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _f(v, digits: int = 2) -> str:
    if v is None:
        return "–"
    if isinstance(v, (int, float)):
        return f"{v:,.{digits}f}"
    return str(v)


def _table(head: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _settings(d: dict) -> str:
    s = {k: v for k, v in d.get("settings", {}).items() if not isinstance(v, (dict, list)) or k in ("batches", "rates",
                                                                                                      "clients")}
    return "settings: " + ", ".join(f"{k}={v}" for k, v in s.items())


def offline_blocks(d: dict) -> str:
    rows = []
    for r in d["rows"]:
        lat = r["latency_ms"]
        rows.append([r["method"], r["block"], _f(lat["mean"]), _f(lat["std"]), _f(r["params"] / 1e6, 2),
                     _f(r["rss_load_delta_mb"], 1), _f(r["rss_total_delta_mb"], 1)])
    t = _table(["method", "block", "mean ms", "std ms", "params M", "RSS Δ load MB", "RSS Δ total MB"], rows)
    sums = ", ".join(f"{m} {_f(v)} ms" for m, v in d["offline_sum_ms"].items())
    full = ", ".join(f"{m} {_f(v)} ms" for m, v in d["full_model_ms"].items())
    return f"{t}\n\nOffline sum of block means: {sums} (thesis, GV100: 11.703 ms). Monolithic: {full}."


def rtt(d: dict) -> str:
    rows = [[s["kind"], _f(s["zeromq_mean_ms"], 3), _f(s["http_mean_ms"], 3), _f(s["ratio_mean"], 1),
             _f(s["thesis_zeromq_ms"], 3), _f(s["thesis_http_ms"], 3), _f(s["thesis_ratio"], 1)]
            for s in d["table_4_3"]]
    return _table(["message", "ZeroMQ ms", "HTTP ms", "HTTP/ZeroMQ", "thesis ZeroMQ ms", "thesis HTTP ms",
                   "thesis ratio"], rows)


def pipeline_latency(d: dict) -> str:
    s, th = d["summary"], d["thesis_gv100"]
    rows = [["HTTP* (full.pt behind CherryPy)", _f(s["http"]["rtt_ms"]["p50"]), _f(s["http"]["rtt_ms"]["mean"]),
             "–", f"~{th['http_full_ms']:.0f}", "–"]]
    for t, ts in s["transports"].items():
        rows.append([f"{t} pipeline, 5 blocks", _f(ts["rtt_ms"]["p50"]), _f(ts["rtt_ms"]["mean"]),
                     _f(ts["overhead_ms"]["mean"]), _f(th[f"{t}_ms"]), _f(th[f"{t}_overhead_ms"])])
    rows.append(["offline sum of blocks", _f(s["offline"]["sum_ms"]["p50"]), _f(s["offline"]["sum_ms"]["mean"]),
                 "–", _f(th["offline_ms"], 3), "–"])
    rows.append(["monolithic full.pt, one process", _f(s["offline"]["monolithic_ms"]["p50"]),
                 _f(s["offline"]["monolithic_ms"]["mean"]), "–", "–", "–"])
    t = _table(["series", "p50 ms", "mean ms", "overhead mean ms", "thesis ms", "thesis overhead ms"], rows)
    ratios = "; ".join(f"{k}: pipeline p50 / monolithic p50 = {_f(r['ratio'])} (goal ≤ {r['goal']})"
                       for k, r in d["ratio_pipeline_vs_monolithic"].items())
    comp = []
    for tname, ts in s["transports"].items():
        for b, c in ts["blocks"].items():
            cm = c["components_ms"]
            comp.append([tname, b, *(_f(cm[k]["p50"], 3) for k in ("wait", "deser", "dev", "inf", "share"))])
    return (f"{t}\n\n{ratios}.\n\nPer-block components, p50 ms (Fig. 4.4):\n\n"
            + _table(["transport", "block", "wait", "deser", "dev", "inf", "share"], comp))


def hop_overhead(d: dict) -> str:
    rows = [[r.get("block", "identity"), r["transport"], r.get("device", "cpu"), "x".join(str(v) for v in r["shape"]),
             _f(r["mbytes"], 2), _f(r["per_hop_paired_median_ms"], 3), _f(r["per_hop_p99_ms"], 3),
             _f(r.get("hop_inf_ms"), 3), _f(r.get("transport_ms"), 3)] for r in d["rows"]]
    return _table(["block", "transport", "device", "shape", "MB", "per-hop median ms", "per-hop p99 ms",
                   "block compute ms", "transport ms (median minus compute)"], rows)


def batch_scaling(d: dict) -> str:
    rows = [[r["series"], r["batch"], _f(r["rtt_ms"]["p50"]), _f(r["rtt_ms"]["p50"] / r["batch"]),
             _f(r.get("overhead_ms", {}).get("p50") if isinstance(r.get("overhead_ms"), dict) else None)]
            for r in d["rows"]]
    return _table(["series", "batch", "round trip p50 ms", "per image ms", "overhead p50 ms"], rows)


def multiclient(d: dict) -> str:
    rows = [[r["transport"], r["clients"], _f(r["mean_rtt_per_client_ms"]), _f(r["rtt_ms"]["p99"]),
             _f(r["throughput_rps"]), r["errors"]] for r in d["rows"]]
    th = d["thesis_gv100"]
    return (_table(["transport", "clients", "mean RTT ms", "p99 ms", "req/s", "errors"], rows)
            + f"\n\nThesis (GV100): TensorMQ ~{th['tensormq_1_to_4_clients_ms']:.0f} ms for 1-4 clients; "
              f"ZeroMQ ~{th['zeromq_1_client_ms']:.0f} ms at 1 client, ~{th['zeromq_4_clients_ms']:.0f} ms at 4.")


def throughput(d: dict) -> str:
    rows = []
    for t, rs in d["rows"].items():
        for r in rs:
            lat = r["latency_ms"] or {}
            rows.append([t, _f(r["offered_rps"], 0), _f(r["delivered_rps"]), _f(lat.get("p50")), _f(lat.get("p99")),
                         _f(r["ram_mb_mean"], 0)])
    sat = "; ".join(f"{t}: {_f(s['saturation_rps'])} req/s" for t, s in d["saturation"].items())
    th = d["thesis_gv100"]
    return (_table(["transport", "offered req/s", "delivered req/s", "p50 ms", "p99 ms", "RAM MB"], rows)
            + f"\n\nSaturation here: {sat}. Thesis (GV100): ZeroMQ {th['zeromq_saturation_rps']:.0f}, "
              f"TensorMQ {th['tensormq_saturation_rps']:.0f} tensors/s.")


def utilization(d: dict) -> str:
    rows = [[t, _f(s["rtt_ms"]["p50"]), _f(s["inferences_per_s"]), _f(s["cpu_per_block_pct"]["mean"], 1),
             _f(s["cpu_blocks_total_pct"]["mean"], 1), _f(s["cpu_dispatcher_pct"]["mean"], 1),
             _f(s["gpu"].get("util_pct"), 1)] for t, s in d["summary"].items()]
    return _table(["transport", "RTT p50 ms", "inferences/s", "CPU % per block", "CPU % all blocks",
                   "CPU % dispatcher", "GPU %"], rows)


def _thesis_savings(t) -> str:
    """Tables 4.5/4.6 give MB (MOD, B12, B12&B34, TRAD); savings = (TRAD - X) / TRAD."""
    if not t or len(t) < 4:
        return "–"
    return " / ".join(_f(100 * (t[3] - x) / t[3]) for x in t[:3])


def memory_model(d: dict) -> str:
    out = []
    results = dict(d["results"])
    if d.get("thesis_inputs_through_this_model"):
        results["resnet50/thesis inputs (model check)"] = d["thesis_inputs_through_this_model"]
    for label, res in results.items():
        model = label.split("/")[0]
        thesis = d.get("thesis_tables", {}).get(model, {})
        rows = []
        for r in res["rows"]:
            rows.append([r["scenario"], "/".join(str(c) for c in r["counts"]), _f(r["modular_savings_pct"]),
                         _f(r["b12_fused_savings_pct"]), _f(r["b12_b34_fused_savings_pct"]),
                         _thesis_savings(thesis.get(str(r["scenario"])))])
        out.append(f"**{label}** (per-process context {_f(res['context_mb'], 0)} MB):\n\n"
                   + _table(["scenario", "tasks A/B/C", "modular %", "b1+2 fused %", "b1+2, 3+4 fused %",
                             "thesis % (mod / 12 / 12+34)"], rows))
    return "\n\n".join(out)


def skipped(d: dict) -> str:
    return f"Not run here: {d.get('reason', 'skipped')}"


SECTIONS = [("offline_blocks", offline_blocks), ("rtt", rtt), ("pipeline_latency", pipeline_latency),
            ("hop_overhead", hop_overhead), ("batch_scaling", batch_scaling), ("multiclient", multiclient),
            ("throughput", throughput), ("utilization", utilization), ("energy", None),
            ("memory_model", memory_model), ("multi_gpu", None)]


def peers(d: dict) -> str:
    from .peers import table  # experiments/peers.py owns its table
    return table(d)


SECTIONS.append(("peers", peers))


def section(out: str, name: str) -> str:
    fn = dict(SECTIONS)[name]
    d = _load(out, name)
    if d is None:
        return "not run (no JSON)"
    env = d.get("env", {})
    head = f"_{env.get('machine', '?')}, torch {env.get('torch', '?')}, {env.get('time', '')}; {_settings(d)}_"
    return head + "\n\n" + (skipped(d) if d.get("skipped") or fn is None else fn(d))


def report(out: str) -> str:
    return "\n\n".join(f"### {name}\n\n{section(out, name)}" for name, _ in SECTIONS) + "\n"


def rewrite_readme(path: str, out: str) -> list[str]:
    """Replace every marked table in ``path``; returns the names replaced."""
    with open(path) as f:
        text = f.read()
    done = []

    def sub(m):
        done.append(m.group(1))
        return f"<!-- table:{m.group(1)} -->\n{section(out, m.group(1))}\n<!-- /table:{m.group(1)} -->"
    text = re.sub(r"<!-- table:(\w+) -->.*?<!-- /table:\1 -->", sub, text, flags=re.S)
    with open(path, "w") as f:
        f.write(text)
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.report", description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?", help="results directory (default experiments/results/<machine>)")
    ap.add_argument("--readme", action="store_true", help="rewrite the marked tables in experiments/README.md")
    args = ap.parse_args(argv)
    out = args.out or os.path.join(common.RESULTS_ROOT, common.machine_label())
    if not os.path.isdir(out):
        print(f"no results directory {out}; run `blockflow bench all` first", file=sys.stderr)
        return 2
    if args.readme:
        names = rewrite_readme(os.path.join(common.HERE, "README.md"), out)
        print(f"rewrote {len(names)} tables in experiments/README.md from {out}: {', '.join(names)}")
        return 0
    print(report(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
