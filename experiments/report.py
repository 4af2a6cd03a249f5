"""Markdown tables and the sentences that carry numbers, from a results directory: the measured
figures beside the thesis's.

    python -m experiments.report [DIR]            # print them; DIR defaults to results/<machine>
    python -m experiments.report --readme [DIR]   # rewrite them in experiments/README.md

experiments/README.md holds each table between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->``
and each experiment's numbers in prose between ``<!-- text:NAME -->`` and ``<!-- /text:NAME -->``;
``--readme`` replaces what is between the markers, so the README says what the JSON files say. The
hand-written prose around them holds no numbers, only the method and what the figures mean. The
thesis's figures are quoted as it states them; a figure computed from them is marked "derived". A
missing JSON is reported as not run; a JSON of an older shape gets "–" where a field is missing.
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


def _rng(values, digits: int = 2, unit: str = "") -> str:
    """'a-b unit' (or one value) of the numbers in ``values``; '–' when there are none."""
    v = [x for x in values if isinstance(x, (int, float))]
    if not v:
        return "–"
    lo, hi = min(v), max(v)
    sep = " to " if lo < 0 else "-"
    text = _f(lo, digits) if round(lo, digits) == round(hi, digits) else f"{_f(lo, digits)}{sep}{_f(hi, digits)}"
    return text + (f" {unit}" if unit else "")


def _pct(a, b) -> float | None:
    """(a / b - 1) in %, or None."""
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or not b:
        return None
    return 100.0 * (a / b - 1.0)


def _signed(v, digits: int = 0) -> str:
    return "–" if v is None else f"{v:+.{digits}f}%"


# -- offline_blocks (Table 4.2, Fig 4.2) ----------------------------------------------------
def offline_blocks(d: dict) -> str:
    gpu = any("torch_allocated_mb" in r for r in d["rows"])  # Table 4.2's GPU columns, when measured
    rows = []
    for r in d["rows"]:
        lat = r["latency_ms"]
        rows.append([r["method"], r["block"], _f(lat.get("mean")), _f(lat.get("std")), _f(r.get("params", 0) / 1e6, 2),
                     _f(r.get("rss_load_delta_mb"), 1), _f(r.get("rss_total_delta_mb"), 1)]
                    + ([_f((r.get("torch_allocated_mb") or {}).get("mean"), 1),
                        _f((r.get("torch_reserved_mb") or {}).get("mean"), 0), _f(r.get("process_vram_mb"), 0)]
                       if gpu else []))
    return _table(["method", "block", "mean ms", "std ms", "params M", "RSS Δ load MB", "RSS Δ total MB"]
                  + (["torch allocated MB", "torch reserved MB", "process VRAM MB"] if gpu else []), rows)


def offline_blocks_text(d: dict) -> str:
    sums, full = d.get("offline_sum_ms", {}), d.get("full_model_ms", {})
    parts = [f"{m}: sum of the block means {_f(sums[m])} ms, {_f(sums[m] / full[m])}x the monolithic model's "
             f"{_f(full[m])} ms" for m in sums if sums[m] is not None and full.get(m)]
    script = [r for r in d["rows"] if r["method"] == "script" and r["block"] != "full"]
    big = max(script, key=lambda r: r.get("params", 0)) if script else None
    total = next((r.get("params") for r in d["rows"] if r["method"] == "script" and r["block"] == "full"), None)
    slow = sorted(script, key=lambda r: -r["latency_ms"].get("mean", 0))[:2]
    text = ("; ".join(parts) + " (the thesis's offline sum: 11.703 ms, on a GPU)." if parts else "")
    if big and total:
        text += (f" {big['block']} holds the most parameters ({_f(big['params'] / 1e6, 1)} of "
                 f"{_f(total / 1e6, 1)} M); the slowest blocks here are {' and '.join(r['block'] for r in slow)}.")
    text += (f" A block process's RSS is {_rng([r.get('rss_total_delta_mb') for r in script], 0, 'MB')} above the "
             "interpreter's own after its inferences; the thesis gives 394-478 MB of process VRAM per block "
             "(Table 4.2), about 370 MB of it the CUDA context.")
    return text + _export_time_text(d)


def _into(blocks: int) -> str:
    return f"into {blocks} blocks and full" if blocks > 1 else "as one file (full)"


def _export_time_text(d: dict) -> str:
    """The time to export the whole model in each format (where --export measured it)."""
    e = d.get("export_time")
    if not e:
        return ""
    med = e["median_s"]
    return (f" Exporting {e['model']} {_into(e['blocks'])} (`blockflow export`, median of "
            f"{e['rounds']} interleaved round(s)) takes {_f(med['torchscript'], 1)} s as TorchScript and "
            f"{_f(med['export'], 1)} s as torch.export programs ({_f(e['export_over_torchscript'])}x).")


# -- rtt (Table 4.3) ---------------------------------------------------------------------
#: Table 4.3 states the ratios as "~24x", "~21x", "~10x" (Awenode).
RTT_THESIS_RATIO = {"string": 24, "json": 21, "tensor": 10}


def rtt(d: dict) -> str:
    rows = [[s["kind"], _f(s["zeromq_mean_ms"], 3), _f(s["http_mean_ms"], 3), _f(s["ratio_mean"], 1),
             _f(s.get("http_newconn_mean_ms"), 3), _f(s["thesis_zeromq_ms"], 3), _f(s["thesis_http_ms"], 3),
             f"~{RTT_THESIS_RATIO.get(s['kind'], '–')}"]
            for s in d["table_4_3"]]
    return _table(["message", "ZeroMQ mean ms", "HTTP mean ms", "HTTP/ZeroMQ", "HTTP new connection mean ms",
                   "thesis ZeroMQ ms (Awenode)", "thesis HTTP ms", "thesis ratio"], rows)


def rtt_text(d: dict) -> str:
    t = d["table_4_3"]
    text = (f"Means, as in the thesis. ZeroMQ's round trip is {_rng([s['ratio_mean'] for s in t], 1)}x shorter "
            f"than HTTP's here; the thesis measured up to ~24x (Table 4.3, Awenode).")
    extra = [(s["kind"], s["http_newconn_mean_ms"] - s["http_mean_ms"]) for s in t if "http_newconn_mean_ms" in s]
    if extra:
        text += (" A new TCP connection per HTTP request adds "
                 + ", ".join(f"{_f(v, 2)} ms ({k})" for k, v in extra) + " to HTTP's mean.")
    z = [s["zeromq_mean_ms"] / s["thesis_zeromq_ms"] for s in t]
    h = [s["http_mean_ms"] / s["thesis_http_ms"] for s in t]
    text += (f" Against the thesis's figures ZeroMQ is {_rng(z, 1)}x and HTTP {_rng(h, 2)}x the thesis's times "
             "on this machine.")
    return text


# -- pipeline_latency (Figs 4.3-4.5, 4.9, 4.14, Appendix B) ---------------------------------
OVERHEAD_PARTS = ("deser", "dev", "share", "fwd")


def _block_overhead(c: dict) -> tuple[float | None, bool]:
    """Mean o_b of one block (eq. 4.1) from its components; False when ``fwd`` was not recorded."""
    comp = c.get("components_ms", {})
    if not comp:
        return None, False
    return sum((comp.get(k) or {}).get("mean") or 0.0 for k in OVERHEAD_PARTS), "fwd" in comp


def _pipeline_eq41(ts: dict) -> dict:
    """Pipeline sums of eq. 4.1 (means) for one transport, from either JSON shape."""
    defined = "overhead_definition" in ts
    blocks = ts.get("blocks", {})
    per = {b: _block_overhead(c) for b, c in blocks.items()}
    over = ts["overhead_ms"].get("mean") if defined else sum(v or 0.0 for v, _ in per.values())
    wait = (ts.get("wait_ms") or {}).get("mean") if defined else \
        sum(((c.get("components_ms", {}).get("wait") or {}).get("mean") or 0.0) for c in blocks.values())
    inf = ts["inference_ms"].get("mean")
    return {"overhead": over, "wait": wait, "inf": inf, "fwd": all(f for _, f in per.values()),
            "per_block": {b: v for b, (v, _) in per.items()}}


def pipeline_latency(d: dict) -> str:
    s, th = d["summary"], d.get("thesis_gv100", {})
    der = d.get("thesis_gv100_derived", {"tensormq_ms": 44.9 / 2.8})
    rows = []
    if s.get("http_split"):
        rows.append(["HTTP split (5 block servers)", _f(s["http_split"]["rtt_ms"]["p50"]),
                     _f(s["http_split"]["rtt_ms"]["mean"]), "–", "–", f"{_f(der.get('http_split_ms'), 0)} (derived)",
                     "–"])
    else:
        rows.append(["HTTP split (5 block servers)", "not run", "–", "–", "–", "–", "–"])
    if s.get("http"):
        rows.append(["HTTP* (full.pt behind CherryPy)", _f(s["http"]["rtt_ms"]["p50"]), _f(s["http"]["rtt_ms"]["mean"]),
                     "–", "–", f"~{th.get('http_full_ms', 200):.0f}", "–"])
    for t, ts in s["transports"].items():
        e = _pipeline_eq41(ts)
        # the thesis states TensorMQ's time only as "~2.8x" less than ZeroMQ's: always derived
        thesis_t = f"{_f(der.get(f'{t}_ms', th.get(f'{t}_ms')))} (derived)" if f"{t}_ms" in der or \
            t == "tensormq" else _f(th.get(f"{t}_ms"))
        rows.append([f"{t} pipeline, 5 blocks", _f(ts["rtt_ms"]["p50"]), _f(ts["rtt_ms"]["mean"]),
                     _f(e["overhead"]) + ("" if e["fwd"] else " (no fwd)"), _f(e["wait"]), thesis_t,
                     _f(th.get(f"{t}_overhead_ms"))])
    rows.append(["offline sum of blocks", _f(s["offline"]["sum_ms"]["p50"]), _f(s["offline"]["sum_ms"]["mean"]),
                 "–", "–", _f(th.get("offline_ms", 11.703), 3), "–"])
    rows.append(["monolithic full.pt, one process", _f(s["offline"]["monolithic_ms"]["p50"]),
                 _f(s["offline"]["monolithic_ms"]["mean"]), "–", "–", "–", "–"])
    out = _table(["series", "p50 ms", "mean ms", "overhead Σo_b mean ms (eq. 4.1)", "queue wait Σw_b mean ms",
                  "thesis mean ms (GV100)", "thesis overhead ms"], rows)
    comp = []
    keys = ("wait", "deser", "dev", "inf", "share", "fwd")
    for tname, ts in s["transports"].items():
        for b, c in ts["blocks"].items():
            cm = c.get("components_ms", {})
            comp.append([tname, b, *(_f((cm.get(k) or {}).get("mean"), 3) for k in keys),
                         _f(_block_overhead(c)[0], 3)])
    out += ("\n\nPer block, mean ms (Fig. 4.4; o_b = deser + dev + share + fwd, eq. 4.1):\n\n"
            + _table(["transport", "block", "wait w_b", "deser", "dev", "inf m_b", "share", "fwd", "o_b"], comp))
    mem = [(t, b, m) for t, ts in s["transports"].items() for b, m in (ts.get("block_memory_mb") or {}).items()]
    if mem:
        gpu = any(m.get("vram_mb") is not None for _, _, m in mem)
        head = ["transport", "block", "RSS MB", "USS MB"] + (["VRAM MB", "torch allocated MB"] if gpu else [])
        out += "\n\nMemory per block process (Fig. 4.14):\n\n" + _table(head, [
            [t, b, _f(m.get("rss_mb"), 0), _f(m.get("uss_mb"), 0)]
            + ([_f(m.get("vram_mb"), 0), _f(m.get("torch_allocated_mb"), 0)] if gpu else []) for t, b, m in mem])
    else:
        out += "\n\nMemory per block process (Fig. 4.14): not run (this JSON predates it)."
    moved = s.get("data_moved")
    if moved:
        out += "\n\nBytes copied per inference on the CPU (Fig. 4.9; copies per hop: " + ", ".join(
            f"{k} {v}" for k, v in moved["copies_per_hop"].items()) + "):\n\n" + _table(
            ["hop", "tensor", "MB", "zeromq MB copied", "tensormq MB copied", "tensormq outputs made in slot"],
            [[h["hop"], "x".join(map(str, h["shape"])), _f(h["nbytes"] / 1e6, 3), _f(h["zeromq_bytes_copied"] / 1e6, 3),
              _f(h["tensormq_bytes_copied"] / 1e6, 3),
              "–" if h.get("tensormq_made_in_slot") is None else f"{h['tensormq_made_in_slot']:.0%}"]
             for h in moved["hops"]])
        g = moved.get("gpu_copies", {})
        out += ("\n\nHost<->device copies (torch.profiler): " + (f"skipped: {g['skipped']}" if "skipped" in g else
                f"zeromq memcpy events {g.get('zeromq_memcpy_events')} over {g.get('hops_profiled')} hops, "
                f"{_f(g.get('zeromq_bytes_per_direction', 0) / 1e6, 2)} MB each way; tensormq: {g.get('tensormq')}"))
    else:
        out += "\n\nBytes copied per inference (Fig. 4.9): not run (this JSON predates it)."
    if s.get("variants"):
        out += "\n\n" + _pipeline_variants(s["variants"])
    return out


_VARIANT_BLOCKS = ("b1", "b2", "b3", "b4", "h")


def _pipeline_variants(v: dict) -> str:
    """Issue 11's question, from ``--variants``: why is a block slower inside the pipeline than alone?"""
    rows = []
    for name, r in v["variants"].items():
        inf, slow, flt = r["block_inference_ms"], r["block_slowdown_pct"], r["minor_faults_per_request"]
        rows.append([name, r["what"], _f(r["rtt_ms"]["p50"]), _f(r["monolithic_interleaved_ms"]["p50"]),
                     f"{_f(r['ratio_p50'], 3)}x",
                     *(f"{_signed(slow.get(b))} ({_f(inf[b].get('p50'))})" for b in _VARIANT_BLOCKS),
                     " / ".join(_f(flt[b], 0) for b in _VARIANT_BLOCKS)])
    out = (f"Why a block is slower inside the pipeline (`--variants`, {v['transport']}, {v['n_per_round']} requests "
           f"x {v['rounds']} round(s) per variant, {v['order']}; each block's inference p50 inside the pipeline "
           "against the same block alone, back to back, in the offline series):\n\n"
           + _table(["variant", "what it changes", "pipeline p50 ms", "monolithic p50 ms (interleaved)", "ratio",
                     "block1 % (ms)", "block2 % (ms)", "block3 % (ms)", "block4 % (ms)", "head % (ms)",
                     "minor page faults per request b1 / b2 / b3 / b4 / h"], rows))
    alone = v.get("alone")
    if alone:
        out += (f"\n\nEach block alone in the client's process, p50 ms (minor page faults per call), the modes "
                f"interleaved in every sample: heap trimmed = malloc_trim before the call, idle gap = "
                f"{_f(alone['idle_gap_s'], 2)} s of sleep before it, busy gap = the same time spinning, cache flushed = "
                f"{_f(alone['flush_bytes'] / 2**20, 0)} MB written before it, idle gap weights read = the idle gap, then "
                "every weight and buffer of the block read once, own thread = back to back, but each block called on a "
                "thread of its own in this process, handed its input by a queue (as a shared process's members run):\n\n"
                + _table(
                    ["mode", "block1", "block2", "block3", "block4", "head"],
                    [[mode, *(f"{_f(m['block_ms'][b].get('p50'))} ({_f(m['minor_faults_per_call'][b], 0)})"
                              for b in _VARIANT_BLOCKS)] for mode, m in alone["modes"].items()]))
    return out


def _pipeline_variants_text(v: dict) -> str:
    var = v["variants"]
    text = (f" Variants (`--variants`, {v['transport']}, {v['n_per_round'] * v['rounds']} requests each): pipeline p50 / "
            "monolithic p50 " + "; ".join(f"{k} {_f(r['ratio_p50'])}x" for k, r in var.items()) + ".")
    if "default" in var and "no-trim" in var:
        d, n = var["default"], var["no-trim"]
        text += (f" With glibc's own heap trimming (no-trim) block1 takes {_f(n['minor_faults_per_request']['b1'], 0)} "
                 f"minor page faults per request and its inference is {_signed(n['block_slowdown_pct'].get('b1'))} "
                 f"over alone; as served (BLOCKFLOW_MALLOC_TRIM) {_f(d['minor_faults_per_request']['b1'], 0)} and "
                 f"{_signed(d['block_slowdown_pct'].get('b1'))}.")
    modes = (v.get("alone") or {}).get("modes")
    if modes and "back_to_back" in modes:
        base = modes["back_to_back"]["block_ms"]

        def delta(mode):
            vals = [100 * (modes[mode]["block_ms"][b]["p50"] / base[b]["p50"] - 1) for b in ("b1", "b2", "b3", "b4")]
            return f"{_signed(min(vals))} to {_signed(max(vals))}"
        labels = {"heap_trimmed": "after malloc_trim", "idle_gap": "after an idle gap",
                  "busy_gap": "after the same gap spinning", "cache_flushed": "after a cache flush",
                  "idle_gap_weights_read": "after the idle gap with the block's weights read just before",
                  "own_thread": "back to back but each on a thread of its own"}
        text += (" Alone in one process, block1-block4 take " + ", ".join(
            f"{delta(m)} {labels[m]}" for m in labels if m in modes) + " against back to back.")
    return text


def pipeline_latency_text(d: dict) -> str:
    s, th = d["summary"], d.get("thesis_gv100", {})
    parts = []
    eqs = {t: _pipeline_eq41(ts) for t, ts in s["transports"].items()}
    for t, ts in s["transports"].items():
        e, rtt_mean = eqs[t], ts["rtt_ms"]["mean"]
        parts.append(f"{t}: mean round trip {_f(rtt_mean)} ms, pipeline inference Σm_b {_f(e['inf'])} ms, "
                     f"overhead Σo_b {_f(e['overhead'])} ms ({_f(100 * e['overhead'] / rtt_mean, 1)}% of the round "
                     f"trip), queue wait Σw_b {_f(e['wait'])} ms")
    text = "Eq. 4.1 on this machine: " + "; ".join(parts) + "."
    if not all(e["fwd"] for e in eqs.values()):
        text += " (This JSON predates the `fwd` component: its Σo_b is deser + dev + share only.)"
    z, tm = eqs.get("zeromq"), eqs.get("tensormq")
    if z and tm and z["overhead"]:
        text += (f" TensorMQ's overhead is {_f(tm['overhead'] / z['overhead'])}x ZeroMQ's here; on the GV100 the "
                 f"thesis measured {_f(th.get('tensormq_overhead_ms', 2.55))} ms against "
                 f"{_f(th.get('zeromq_overhead_ms', 21.18))} ms (0.12x, derived), of round trips of "
                 f"{_f(th.get('zeromq_ms', 44.9), 1)} ms (ZeroMQ) and ~2.8x less (TensorMQ).")
    ratios = d.get("ratio_pipeline_vs_monolithic", {})
    if ratios:
        from .pipeline_latency import RATIO_GOAL  # the goal now, also for a JSON of an older goal
        text += " Pipeline p50 / monolithic p50 (interleaved): " + "; ".join(
            f"{k} {_f(r['ratio'])}x ({'met' if r['ratio'] <= RATIO_GOAL else '**not met**'})"
            for k, r in ratios.items()) + f" against the goal of ≤ {RATIO_GOAL:.2f}x."
    off = s["offline"].get("blocks_ms", {})
    slow = [100 * (c["inference_ms"]["mean"] / off[b]["mean"] - 1) for ts in s["transports"].values()
            for b, c in ts["blocks"].items() if b in off and off[b].get("mean")]
    if slow:
        text += (f" Each block's mean inference inside the pipeline differs by {_signed(min(slow))} to "
                 f"{_signed(max(slow))} from its time run back to back in the client's process (the offline series "
                 "of the same run).")
    if s.get("variants"):
        text += _pipeline_variants_text(s["variants"])
    for key, label in (("http", "HTTP*"), ("http_split", "HTTP split")):
        if s.get(key) and "zeromq" in s["transports"]:
            text += (f" {label} takes {_f(s[key]['rtt_ms']['mean'] / s['transports']['zeromq']['rtt_ms']['mean'])}x "
                     "ZeroMQ's mean round trip.")
    return text


def hop_overhead(d: dict) -> str:
    if not any("hop_median_ms" in r for r in d["rows"]):  # older JSON: round-trip differences only
        rows = [[r.get("block", "identity"), r["transport"], r.get("device", "cpu"), "x".join(str(v) for v in r["shape"]),
                 _f(r["mbytes"], 2), _f(r["per_hop_paired_median_ms"], 3), _f(r["per_hop_p99_ms"], 3),
                 _f(r.get("hop_inf_ms"), 3), _f(r.get("transport_ms"), 3)] for r in d["rows"]]
        return _table(["block", "transport", "device", "shape", "MB", "per-hop median ms", "per-hop p99 ms",
                       "block compute ms", "transport ms (median minus compute)"], rows)
    rows = [[r.get("block", "identity"), r["transport"], r.get("device", "cpu"), "x".join(str(v) for v in r["shape"]),
             _f(r["mbytes"], 2), _hop_fig(r, "hop_median_ms"), _hop_fig(r, "hop_p99_ms"),
             _f(r.get("hop_transit_ms"), 3), _f(r.get("hop_share_ms"), 3), _f(r.get("hop_inf_ms"), 3),
             _f(r.get("hops_measured"), 0), _hop_fig(r, "per_hop_paired_median_ms")] for r in d["rows"]]
    return _table(["block", "transport", "device", "shape", "MB", "hop median ms", "hop p99 ms", "transit ms",
                   "share ms", "block compute ms", "hops measured", "round trips: per-hop median ms"], rows)


def _hop_fig(r: dict, key: str) -> str:
    """A hop figure of experiments/hop_overhead.py, or "not measured" (its Note [Not measured])."""
    if key in r.get("not_measured", {}) or (key == "hop_p99_ms" and "hop_median_ms" in r.get("not_measured", {})):
        return "not measured"
    return _f(r.get(key), 3)


def _hop_pick(d: dict, kind: str, transport: str, batch: int, stage_mb: float = 3.21) -> dict | None:
    """The row of ``kind`` and ``transport`` at ``batch`` for the stage of ``stage_mb`` MB per image."""
    return next((r for r in d["rows"] if r.get("block", "identity") == kind and r["transport"] == transport
                 and r["shape"][0] == batch and abs(r["mbytes"] / batch - stage_mb) < 0.05
                 and r.get("device", "cpu") == "cpu"), None)


def hop_overhead_text(d: dict) -> str:
    if not any("hop_median_ms" in r for r in d["rows"]):
        return _hop_overhead_text_round_trips(d)
    text = []
    for b in sorted({r["shape"][0] for r in d["rows"]}):
        ident = {t: [r for r in d["rows"] if r.get("block") == "identity" and r["transport"] == t and r["shape"][0] == b
                     and r.get("hop_median_ms") is not None] for t in ("tensormq", "zeromq")}
        if not ident["tensormq"]:
            continue
        tm = ident["tensormq"]
        part = (f"at batch {b} an identity TensorMQ hop costs {_rng([r['hop_median_ms'] for r in tm], 3, 'ms')} "
                f"(median over the stages; p99 {_rng([r['hop_p99_ms'] for r in tm], 3, 'ms')})")
        if ident["zeromq"]:
            part += f", ZeroMQ {_rng([r['hop_median_ms'] for r in ident['zeromq']], 3, 'ms')}"
        def floor_rows(kind, b=b):
            return [r for r in d["rows"] if r.get("block") == kind and r["transport"] == "tensormq"
                    and r["shape"][0] == b and r.get("hop_median_ms") is not None]
        floor, cold = floor_rows("floor"), floor_rows("floor-cold")
        if floor:
            part += f" (two bare pyzmq relays passing the same header: {_rng([r['hop_median_ms'] for r in floor], 3, 'ms')}"
            if cold:
                part += (f"; {_rng([r['hop_median_ms'] for r in cold], 3, 'ms')} when each round trip is preceded"
                         f" by two copies of the tensor, as BlockFlow's client and dispatcher make them")
            part += ")"
        text.append(part)
    if not text:
        return ""
    out = "Measured inside the blocks, " + "; ".join(text) + ". The issue's goal is 0.10 ms per hop"
    tm = [r["hop_median_ms"] for r in d["rows"] if r.get("block") == "identity" and r["transport"] == "tensormq"
          and r.get("hop_median_ms") is not None]
    out += f": {'met' if max(tm) <= 0.10 else 'not met'}."
    ratios = []
    for b in (1, 32):
        ct, cz = _hop_pick(d, "copy", "tensormq", b), _hop_pick(d, "copy", "zeromq", b)
        if ct and cz and cz.get("transport_ms") and ct.get("transport_ms") is not None:
            made = ct.get("made_in_slot")
            how = ("copying the output into its slot" if made is None or made < 0.5
                   else f"lending slots and sending the output made in one ({made:.0%} of them)")
            ratios.append(f"{_f(ct['mbytes'], 1)} MB {_f(ct['transport_ms'] / cz['transport_ms'])}x "
                          f"({_f(ct['transport_ms'], 3)} against {_f(cz['transport_ms'], 3)} ms, of which "
                          f"TensorMQ's {how} {_f(ct.get('hop_share_ms'), 3)} ms)")
    if ratios:
        out += (" A copying hop's transport cost (per request, its compute taken off), TensorMQ against ZeroMQ: "
                + "; ".join(ratios) + "; the goal is at most 0.5x.")
    return out + _hop_bundle_text(d) + _hop_cross_node_text(d)


def _hop_cross_node_text(d: dict) -> str:
    """Issue 30's rows: an identity hop to another node (bytes over CURVE TCP, on this machine)
    against the TensorMQ hop on one node, same stage and batch."""
    parts = []
    for r in sorted((r for r in d["rows"] if r.get("block") == "identity" and r["transport"] == "cross-node"
                     and r.get("hop_median_ms") is not None), key=lambda r: (r["shape"][0], r["mbytes"])):
        local = next((q for q in d["rows"] if q.get("block") == "identity" and q["transport"] == "tensormq"
                      and q["shape"] == r["shape"] and q.get("hop_median_ms")), None)
        parts.append(f"{_f(r['mbytes'], 1)} MB {_f(r['hop_median_ms'], 3)} ms"
                     + (f" ({_f(r['hop_median_ms'] / local['hop_median_ms'], 1)}x the hop on one node)" if local else ""))
    if not parts:
        return ""
    return (" A hop to another node (Ray mode: bytes over CURVE TCP; both nodes on this machine, so no network in "
            "it), identity blocks: " + "; ".join(parts) + ".")


def _hop_bundle_text(d: dict) -> str:
    """Issue 29's rows: three tensors in one message against one tensor of the same bytes."""
    parts = []
    for kind in ("bundle-identity", "bundle-copy"):
        for t in ("tensormq", "zeromq"):
            rows = sorted((r for r in d["rows"] if r.get("block") == kind and r["transport"] == t
                           and r.get("vs_single") is not None), key=lambda r: r["shape"][0])
            if rows:
                parts.append(f"{kind.split('-')[1]} over {t} " + ", ".join(
                    f"{_f(r['vs_single'])}x at {_f(r['mbytes'], 1)} MB ({_f(r['hop_median_ms'], 3)} ms)" for r in rows))
    if not parts:
        return ""
    return (" Three tensors in one message (the bundle rows) against one tensor of the same bytes, hop medians: "
            + "; ".join(parts) + ".")


def _hop_overhead_text_round_trips(d: dict) -> str:
    """The sentence of a JSON from before the blocks stamped their hops (round-trip differences)."""
    def pairs(batch1: bool):
        out = []
        for r in d["rows"]:
            if r["transport"] != "tensormq" or r.get("block", "identity") != "identity" or (r["shape"][0] == 1) != batch1:
                continue
            z = next((q for q in d["rows"] if q["transport"] == "zeromq" and q["shape"] == r["shape"]
                      and q.get("block", "identity") == "identity" and q.get("device") == r.get("device")), None)
            if z:
                out.append((r["per_hop_paired_median_ms"], z["per_hop_paired_median_ms"]))
        return out
    text = []
    for b1, label in ((True, "batch 1"), (False, "larger batches")):
        p = pairs(b1)
        if p:
            ratio = (f": ZeroMQ / TensorMQ = {_rng([b / a for a, b in p], 2)}x" if all(a > 0 for a, _ in p) else "")
            text.append(f"{'At' if not text else 'at'} {label} an identity TensorMQ hop costs {_rng([a for a, _ in p], 3, 'ms')} (median), "
                        f"ZeroMQ {_rng([b for _, b in p], 3, 'ms')}{ratio}")
    noise = any(a <= 0 for b1 in (True, False) for a, _ in pairs(b1))
    return ("; ".join(text) + ". The issue's goal is 0.10 ms per hop."
            + (" A negative median means the difference of two client round trips is noise larger than the"
               " hop itself (the client-to-dispatcher transfer varies by more than a hop costs): this method"
               " cannot resolve a TensorMQ hop here, and no ratio is given; the floor rows (bare pyzmq) bound"
               " it from below." if noise else "")) if text else ""


# -- batch_scaling (Figs 4.7-4.8) -----------------------------------------------------------
def batch_scaling(d: dict) -> str:
    eq = "eq. 4.1" in str(d.get("settings", {}).get("overhead", ""))
    rows = [[r["series"], r["batch"], r.get("n", "–"), _f(r["rtt_ms"].get("p50")),
             _f((r["rtt_ms"].get("p50") or 0) / r["batch"]),
             _f((r.get("overhead_ms") or {}).get("p50") if isinstance(r.get("overhead_ms"), dict) else None),
             _f((r.get("wait_ms") or {}).get("p50") if isinstance(r.get("wait_ms"), dict) else None)]
            for r in d["rows"]]
    return _table(["series", "batch", "samples", "round trip p50 ms", "per image ms",
                   "overhead p50 ms (" + ("Σo_b, eq. 4.1" if eq else "round trip - inference: older JSON") + ")",
                   "queue wait p50 ms"], rows)


def batch_scaling_text(d: dict) -> str:
    eq = "eq. 4.1" in str(d.get("settings", {}).get("overhead", ""))
    what = "Σo_b (eq. 4.1)" if eq else "round trip - inference (this JSON predates eq. 4.1)"
    by = {(r["series"], r["batch"]): r for r in d["rows"]}
    batches = sorted({r["batch"] for r in d["rows"]})
    lo, hi = batches[0], batches[-1]
    parts = []
    for t in ("zeromq", "tensormq"):
        a, b = by.get((t, lo)), by.get((t, hi))
        if a and b and isinstance(a.get("overhead_ms"), dict):
            o1, o2 = a["overhead_ms"].get("p50"), b["overhead_ms"].get("p50")
            if o1 and o2:
                parts.append(f"{t} {_f(o1)} -> {_f(o2)} ms ({_f(o2 / o1, 1)}x)")
    text = f"Overhead p50, {what}, from batch {lo} to {hi}: " + "; ".join(parts) + "." if parts else ""
    text += " The thesis found TensorMQ's overhead constant over the batch size (the handle has a fixed size)."
    diffs = [_pct(by[("tensormq", b)]["rtt_ms"]["p50"], by[("zeromq", b)]["rtt_ms"]["p50"]) for b in batches
             if ("tensormq", b) in by and ("zeromq", b) in by]
    if diffs:
        text += f" TensorMQ's round trip p50 differs from ZeroMQ's by {_rng(diffs, 0)}% across the batch sizes"
    mono = [_pct(by[(t, b)]["rtt_ms"]["p50"], by[("monolithic", b)]["rtt_ms"]["p50"]) for t in ("zeromq", "tensormq")
            for b in batches if b >= 8 and (t, b) in by and ("monolithic", b) in by]
    if mono:
        text += f", and from batch 8 on the pipeline's from the monolithic model's by {_rng(mono, 0)}%"
    text = text + "." if diffs else text
    sizing = [(t, by[(t, hi)]["sizing_overhead_ms"]) for t in ("zeromq", "tensormq")
              if (t, hi) in by and by[(t, hi)].get("sizing_overhead_ms")]
    if sizing:
        text += (f" A new batch size costs its first requests more (untimed, before the samples): overhead Σo_b "
                 f"of the first {len(sizing[0][1])} requests at batch {hi}: "
                 + "; ".join(f"{t} " + ", ".join(_f(v) for v in vals) + " ms" for t, vals in sizing)
                 + " (TensorMQ grows the slots of the new size: files of shared memory allocated whole).")
    return text


# -- multiclient (Fig 4.11) -----------------------------------------------------------------
def multiclient(d: dict) -> str:
    rows = [[r["transport"], r["clients"], _f(r["mean_rtt_per_client_ms"]), _f(r["rtt_ms"].get("p99")),
             _f(r["throughput_rps"]), r["errors"]] for r in d["rows"]]
    return _table(["transport", "clients", "mean RTT per client ms", "p99 ms", "req/s", "errors"], rows)


def multiclient_text(d: dict) -> str:
    rows, th = d["rows"], d.get("thesis_gv100", {})
    by = {(r["transport"], r["clients"]): r for r in rows}
    ks = sorted({r["clients"] for r in rows})
    top = max((r["throughput_rps"] or 0) for r in rows)
    k_sat = min((r["clients"] for r in rows if (r["throughput_rps"] or 0) >= 0.9 * top), default=None)
    diffs = [(k, _pct(by[("tensormq", k)]["mean_rtt_per_client_ms"], by[("zeromq", k)]["mean_rtt_per_client_ms"]))
             for k in ks if ("tensormq", k) in by and ("zeromq", k) in by]
    text = (f"Throughput reaches {_f(top)} req/s (90% of it from {k_sat} clients on); past that the mean round "
            "trip grows with the number of clients.")
    if diffs:
        text += (" TensorMQ's mean round trip per client against ZeroMQ's: "
                 + ", ".join(f"{k} client{'s' if k > 1 else ''} {_signed(v)}" for k, v in diffs) + ".")
    text += (f" Errors: {sum(r['errors'] for r in rows)}. The thesis (GV100) saw TensorMQ at approximately "
             f"{_f(th.get('tensormq_1_to_4_clients_ms', 18), 0)} ms for 1-4 clients and ZeroMQ going from "
             f"{_f(th.get('zeromq_1_client_ms', 45), 0)} to {_f(th.get('zeromq_4_clients_ms', 35), 0)} ms.")
    return text


# -- throughput (Figs 4.12-4.13) ------------------------------------------------------------
def throughput(d: dict) -> str:
    rows = []
    gpu = any(r.get("vram_mb_mean") is not None for rs in d["rows"].values() for r in rs)
    for t, rs in d["rows"].items():
        for r in rs:
            lat = r["latency_ms"] or {}
            rows.append([t, _f(r["offered_rps"], 0), _f(r["delivered_rps"]), _f(lat.get("p50")), _f(lat.get("p99")),
                         _f(r["ram_mb_mean"], 0)] + ([_f(r.get("vram_mb_mean"), 0)] if gpu else []))
    return _table(["transport", "offered req/s", "delivered req/s", "p50 ms", "p99 ms", "RAM MB"]
                  + (["VRAM MB"] if gpu else []), rows)


def throughput_text(d: dict) -> str:
    sat, th = d["saturation"], d.get("thesis_gv100", {})
    text = "Saturation (largest delivered throughput): " + "; ".join(
        f"{t} {_f(v['saturation_rps'])} req/s" for t, v in sat.items()) + "."
    if "zeromq" in sat and "tensormq" in sat and sat["zeromq"]["saturation_rps"]:
        text += f" TensorMQ / ZeroMQ = {_f(sat['tensormq']['saturation_rps'] / sat['zeromq']['saturation_rps'])}x."
    z, tz = th.get("zeromq_saturation_rps", 160), th.get("tensormq_saturation_rps", 217)
    text += (f" The thesis (GV100): ZeroMQ around {z:.0f}, TensorMQ {tz:.0f} tensors/s, which it calls an increase "
             f"of ~42%; {tz:.0f}/{z:.0f} is +{100 * (tz / z - 1):.0f}% (derived).")
    rows = d["rows"]
    if "zeromq" in rows and "tensormq" in rows:
        zb = {r["offered_rps"]: r for r in rows["zeromq"]}
        below = [_pct((r["latency_ms"] or {}).get("p50"), (zb[r["offered_rps"]]["latency_ms"] or {}).get("p50"))
                 for r in rows["tensormq"] if r["offered_rps"] in zb
                 and r["delivered_rps"] >= 0.9 * r.get("sent_rps", r["offered_rps"])
                 and zb[r["offered_rps"]]["delivered_rps"] >= 0.9 * zb[r["offered_rps"]].get("sent_rps", r["offered_rps"])]
        if below:
            text += f" Below saturation TensorMQ's p50 differs from ZeroMQ's by {_rng(below, 0)}%."
    ram = [r["ram_mb_mean"] for rs in rows.values() for r in rs]
    text += f" RAM of the server's processes: {_rng(ram, 0, 'MB')}."
    return text


# -- utilization (Fig 4.6) ------------------------------------------------------------------
def utilization(d: dict) -> str:
    rows = [[t, _f(s["rtt_ms"].get("p50")), _f(s["inferences_per_s"]), _f(s["cpu_per_block_pct"].get("mean"), 1),
             _f(s["cpu_blocks_total_pct"].get("mean"), 1), _f(s["cpu_dispatcher_pct"].get("mean"), 1)]
            + ([_f((s["gpu"].get("util_pct") or {}).get("mean") if isinstance(s["gpu"].get("util_pct"), dict)
                   else s["gpu"].get("util_pct"), 1)] if s.get("gpu", {}).get("available") else [])
            for t, s in d["summary"].items()]
    gpu = any(s.get("gpu", {}).get("available") for s in d["summary"].values())
    return _table(["transport", "RTT p50 ms", "inferences/s", "CPU % per block", "CPU % all blocks",
                   "CPU % dispatcher"] + (["GPU %"] if gpu else []), rows)


def utilization_text(d: dict) -> str:
    s = d["summary"]
    text = "With one synchronous client: " + "; ".join(
        f"{t}: the blocks together use {_f(v['cpu_blocks_total_pct'].get('mean'), 0)}% of one core "
        f"({_f(v['cpu_per_block_pct'].get('mean'), 1)}% per block, the thesis's measure), the dispatcher "
        f"{_f(v['cpu_dispatcher_pct'].get('mean'), 1)}%" for t, v in s.items()) + "."
    if "zeromq" in s and "tensormq" in s:
        diff = (s["tensormq"]["cpu_per_block_pct"].get("mean") or 0) - (s["zeromq"]["cpu_per_block_pct"].get("mean") or 0)
        text += f" TensorMQ - ZeroMQ, CPU per block: {diff:+.1f} points."
    text += " The thesis saw TensorMQ's GPU utilisation almost double ZeroMQ's (about 2.0x)."
    return text


# -- memory_model (4.3, Tables 4.4-4.6) -----------------------------------------------------
def _thesis_savings(d: dict, model: str, scenario) -> tuple[list | None, bool]:
    """The thesis's savings (%) for a scenario: as Tables 4.5/4.6 state them when the JSON has
    them (quoted), else recomputed from their MB columns (derived). (values, quoted)"""
    stated = (d.get("thesis_savings_pct") or {}).get(model, {}).get(str(scenario))
    if stated:
        return list(stated), True
    t = (d.get("thesis_tables") or {}).get(model, {}).get(str(scenario))
    if not t or len(t) < 4:
        return None, False
    return [100 * (t[3] - x) / t[3] for x in t[:3]], False


def memory_model(d: dict) -> str:
    out = []
    results = dict(d["results"])
    if d.get("thesis_inputs_through_this_model"):
        results["resnet50/thesis inputs (model check)"] = d["thesis_inputs_through_this_model"]
    for label, res in results.items():
        model = label.split("/")[0]
        rows, quoted = [], True
        for r in res["rows"]:
            th, q = _thesis_savings(d, model, r["scenario"])
            quoted = quoted and q
            rows.append([r["scenario"], "/".join(str(c) for c in r["counts"]), _f(r["modular_savings_pct"]),
                         _f(r["b12_fused_savings_pct"]), _f(r["b12_b34_fused_savings_pct"]),
                         _f(r.get("shared_process_savings_pct")), _f(r.get("one_process_savings_pct")),
                         " / ".join(_f(v) for v in th) if th else "–"])
        col = "thesis % (mod / 12 / 12+34)" + ("" if quoted else ", derived from its MB")
        out.append(f"**{label}** (per-process context {_f(res['context_mb'], 0)} MB):\n\n"
                   + _table(["scenario", "tasks A/B/C", "modular %", "b1+2 fused %", "b1+2, 3+4 fused %",
                             "shared blocks in one process %", "one process %", col], rows))
    groups = [[m, g["processes"], _f(g["separate_5_processes"]["pss_mb"], 0), _f(g["pss_mb"], 0),
               f"{g['ratio']['pss_mb']:.2f}x", _f(g["separate_5_processes"]["uss_mb"], 0), _f(g["uss_mb"], 0),
               _f(g["separate_5_processes"]["rss_mb"], 0), _f(g["rss_mb"], 0), g["same_results"]]
              for m, meas in d["measured"].items() for g in [meas.get("group")] if g]
    if groups:
        out.append("**4 blocks + head in one shared process** (measured, beside the five block processes):\n\n"
                   + _table(["model", "processes", "PSS MB, 5 processes", "PSS MB, shared", "PSS ratio",
                             "USS MB, 5", "USS MB, shared", "RSS MB, 5", "RSS MB, shared", "same results"], groups))
    return "\n\n".join(out)


def memory_model_text(d: dict) -> str:
    text = []
    check = d.get("thesis_inputs_through_this_model")
    if check:
        diffs = []
        for r in check["rows"]:
            th, _ = _thesis_savings(d, "resnet50", r["scenario"])
            if th:
                diffs += [abs(a - b) for a, b in zip((r["modular_savings_pct"], r["b12_fused_savings_pct"],
                                                      r["b12_b34_fused_savings_pct"]), th)]
        if diffs:
            text.append(f"Fed with the thesis's own inputs ({_f(check['context_mb'], 0)} MB per CUDA context, Table "
                        f"4.2's VRAM per block), the model gives Table 4.5's savings within {_f(max(diffs), 2)} "
                        f"points (median {_f(sorted(diffs)[len(diffs) // 2], 2)}).")
    for label, res in d["results"].items():
        rows = res["rows"]
        neg = sum(1 for r in rows if r["b12_b34_fused_savings_pct"] < 0)
        text.append(f"{label} (context {_f(res['context_mb'], 0)} MB): modular savings "
                    f"{_rng([r['modular_savings_pct'] for r in rows], 1)}%, with blocks 1+2 and 3+4 fused "
                    f"{_rng([r['b12_b34_fused_savings_pct'] for r in rows], 1)}% (negative in {neg} of {len(rows)} "
                    "scenarios)" + (f", with the shared blocks in one process "
                                    f"{_rng([r['shared_process_savings_pct'] for r in rows], 1)}%, all in one process "
                                    f"{_rng([r['one_process_savings_pct'] for r in rows], 1)}%"
                                    if "one_process_savings_pct" in rows[0] else "") + ".")
    for m, meas in d["measured"].items():
        g = meas.get("group")
        if g:
            text.append(f"{m}'s 4 blocks + head in one shared process: PSS {_f(g['pss_mb'], 0)} MB against "
                        f"{_f(g['separate_5_processes']['pss_mb'], 0)} MB summed over five block processes "
                        f"({g['ratio']['pss_mb']:.2f}x; USS {g['ratio']['uss_mb']:.2f}x, RSS "
                        f"{g['ratio']['rss_mb']:.2f}x), same results: {g['same_results']}.")
    return " ".join(text)


# -- GPU-only ones ----------------------------------------------------------------------------
def energy(d: dict) -> str:
    rows = [[r["transport"], r["batch"], r["n"], _f(r["mj_per_request"], 0), _f(r["mj_per_image"], 0),
             _f(r.get("mj_per_request_above_idle"), 0), _f(r.get("requests_per_s"))] for r in d.get("rows", [])]
    return _table(["transport", "batch", "requests", "mJ per request", "mJ per image", "mJ per request above idle",
                   "req/s"], rows)


def multi_gpu(d: dict) -> str:
    rows = [[r["pdi"], r["transport"], _f(r["total_compute_ms"]), _f(r["total_overhead_ms"]),
             _f(r.get("total_wait_ms")), r["ok"], r["errors"]] for r in d.get("rows", [])]
    return _table(["PDI %", "transport", "Σ compute ms", "Σ overhead ms (eq. 4.1)", "Σ wait ms", "ok", "errors"], rows)


def multi_gpu_text(d: dict) -> str:
    th = (d.get("thesis") or {}).get("overhead_ratio_zeromq_over_tensormq", {})
    r = d.get("overhead_ratio_zeromq_over_tensormq", {})
    return "ZeroMQ / TensorMQ overhead (eq. 4.1) by PDI: " + "; ".join(
        f"PDI {p}: {_f(v)}x (thesis ~{th.get(str(p), th.get(p, '–'))}x)" for p, v in sorted(r.items())) + "."


def batching(d: dict) -> str:
    (lu, ru), (lb, rb) = list(d["rows"].items())
    rows = [[_f(u["offered_rps"], 0), _f(u["delivered_rps"]), _f(u["latency_ms"].get("p99"), 0),
             _f(u.get("block_cpu_ms_per_reply"), 0), _f(b["delivered_rps"]), _f(b["latency_ms"].get("p99"), 0),
             _f(b.get("block_cpu_ms_per_reply"), 0)] for u, b in zip(ru, rb)]
    s, c = d["summary"], d.get("compute", {}).get("rows", [])
    bound = "; ".join(f"batch {r['batch']}: {_f(r['ms_per_image'], 1)} ms/image "
                      f"({_f(r.get('speedup_per_image'))}x batch 1), bound {_f(r['bound_rps'], 1)} req/s" for r in c)
    out = (_table(["offered req/s", f"{lu} req/s", "p99 ms", "CPU ms/reply", f"{lb} req/s", "p99 ms",
                   "CPU ms/reply"], rows)
           + f"\n\nSaturation gain {_f(s['saturation_gain'])}x (goal 1.3x CPU, 3x GPU)."
           + (f" Path alone ({d['compute']['cores']} cores): {bound}." if c else ""))
    half = d.get("half_load")
    if not half:
        return out + f" p99 ratio at {_f(s.get('half_load_rate'), 0)} req/s {_f(s.get('p99_ratio_at_half_load'))}."
    hrows = [[r["round"], " then ".join(r["order"]), r["plain"]["n"], _f(r["plain"]["p99"], 0), r["batched"]["n"],
              _f(r["batched"]["p99"], 0), _f(r["p99_ratio"])] for r in half["per_round"]]
    pu, pb = half["pooled"]["plain"], half["pooled"]["batched"]
    hrows.append(["all (pooled)", "", pu["n"], _f(pu.get("p99"), 0), pb["n"], _f(pb.get("p99"), 0),
                  _f(half["pooled_p99_ratio"])])
    ci = half.get("pooled_p99_ratio_ci95")
    return (out + f"\n\nHalf load ({_f(half['rate'])} req/s, half the unbatched saturation), "
            f"{half['rounds']} rounds of {half['window_s']:g} s per mode:\n\n"
            + _table(["round", "order", "unbatched n", "p99 ms", "batched n", "p99 ms", "p99 ratio"], hrows)
            + f"\n\np99 batched / unbatched at half load: median of the rounds {_f(half['p99_ratio_median'])} "
            f"(min {_f(half['p99_ratio_min'])}, max {_f(half['p99_ratio_max'])}; goal <= 1.1), pooled "
            f"{_f(half['pooled_p99_ratio'])}" + (f" (bootstrap 95% {_f(ci[0])}-{_f(ci[1])})" if ci else "") + ".")


def batching_text(d: dict) -> str:
    """What the batched blocks did at half load and at the top rate (KPI logs), in numbers."""
    half = d.get("half_load") or {}
    text = []
    hb = (half.get("blocks") or {}).get("batched") or {}
    if hb:
        waits = [v["batch_wait_ms_p99"] for v in hb.values() if v.get("batch_wait_ms_p99") is not None]
        text.append(f"At half load the batched blocks ran {_rng([v['mean_requests_in_batch'] for v in hb.values()])}"
                    f" requests per inference on average, and the p99 of the time a request waited in the batcher "
                    f"(`batch_wait`) was at most {_f(max(waits, default=None), 2)} ms per block.")
    (lu, ru), (lb, rb) = list(d["rows"].items())
    top_u, top_b = ru[-1].get("blocks") or {}, rb[-1].get("blocks") or {}
    if top_b and d.get("path_blocks"):
        shared = [b for b in d.get("path_blocks", []) if b in top_b and b in top_u]

        def per(view, key):
            v = [view[b].get(key) for b in shared]
            return sum(v) if v and None not in v else None
        text.append(f"At {_f(rb[-1]['offered_rps'], 0)} req/s, summed over the blocks of one task's path "
                    f"({', '.join(shared)}), per request: inference "
                    f"{_f(per(top_u, 'inf_ms_per_request'), 0)} ms unbatched vs "
                    f"{_f(per(top_b, 'inf_ms_per_request'), 0)} ms batched ({_rng([top_b[b]['mean_requests_in_batch'] for b in shared])} requests per "
                    f"batch), handing the output to the next slot (`share`: made there unbatched, copied there batched) "
                    f"{_f(per(top_u, 'share_ms_mean'), 1)} vs "
                    f"{_f(per(top_b, 'share_ms_mean'), 1)} ms, send {_f(per(top_u, 'fwd_ms_mean'), 1)} vs "
                    f"{_f(per(top_b, 'fwd_ms_mean'), 1)} ms.")
    best = max((d.get("compute") or {}).get("rows") or [], key=lambda r: r.get("speedup_per_image") or 0,
               default=None)
    if best and best.get("speedup_per_image"):
        text.append(f"The path alone is at best {_f(best['speedup_per_image'])}x cheaper per image (batch "
                    f"{best['batch']}): that bounds what batching can gain on this machine"
                    + (f"; building that batch (torch.cat at every block of the path) costs "
                       f"{_f(best['cat_ms_per_image'], 2)} ms per image of its {_f(best['ms_per_image'], 0)} ms"
                       if best.get("cat_ms_per_image") is not None else "") + ".")
    return " ".join(text) or "–"


def fused(d: dict) -> str:
    rows = []
    for label, s in d["series"].items():
        mem = [m for m in (s.get("block_memory") or {}).values() if m]
        rows.append([label, _f(s["rtt_ms"]["p50"]), _f(s["monolithic_interleaved_ms"]["p50"]),
                     f"{s['ratio_p50']:.3f}x", f"≤ {s['goal_ratio']:.2f}x",
                     _f(s["inference_ms"]["p50"]), f"{s['inference_ratio_p50']:.3f}x", _f(s["rest_ms"]["p50"]),
                     _f(s["way_in_ms"]["p50"]), _f(s["way_out_ms"]["p50"]),
                     _f(sum(m["rss_mb"] for m in mem), 0), _f(sum(m["uss_mb"] for m in mem), 0)])
    return _table(["deployment", "round trip p50 ms", "monolithic p50 ms (interleaved)", "ratio", "goal",
                   "blocks' inference p50 ms", "inference / monolithic", "rest p50 ms", "way in p50 ms",
                   "way out p50 ms", "RSS MB (blocks)", "USS MB (blocks)"], rows)


def fused_text(d: dict) -> str:
    parts = []
    for label, s in d["series"].items():
        parts.append(f"{label} {s['ratio_p50']:.3f}x ({'met' if s['meets_goal'] else 'not met'} against "
                     f"≤ {s['goal_ratio']:.2f}x), of which inference {s['inference_ratio_p50']:.3f}x and the rest "
                     f"{_f(s['rest_ms']['p50'])} ms ({_f(s['rest_ms']['p50'] / s['monolithic_interleaved_ms']['p50'] * 100, 1)}% "
                     f"of the monolithic model's p50; p99 {_f(s['rest_ms']['p99'])} ms)")
    return ("Round trip p50 / monolithic p50, interleaved: " + "; ".join(parts) + ". The rest is everything "
            "that is not a block's model: the client's send and the dispatcher's copy on the way in, every hop "
            "between blocks, and the result's way back.")


def replicas(d: dict) -> str:
    rows = []
    for name, s in d["layouts"].items():
        spread = ", ".join(f"{p} {n}" for p, n in sorted(s["inferences_by_process"].items()))
        rows.append([name, s["replicas"], s["threads"], _f(s["throughput_rps"]), _f(s["rtt_ms"].get("p50"), 1),
                     _f(s["rtt_ms"].get("p99"), 1), s["errors"], spread])
    return _table(["layout", "replicas", "threads each", "req/s", "round trip p50 ms", "p99 ms", "errors",
                   "inferences per process (KPI logs)"], rows)


def replicas_text(d: dict) -> str:
    return (f"With {d['settings']['clients']} closed-loop clients, two replicas of the fused block deliver "
            f"{_f(d['ratio_r2_r1'])}x the requests/s of one (goal ≥ {d['goal_ratio']:.1f}x: "
            f"{'met' if d['meets_goal'] else 'not met'}) and {_f(d['ratio_r2_r1_threads2'])}x those of one "
            f"process with two torch threads; two replicas answer the very tensor one does: {d['same_results']}"
            + (f" (two threads: max abs difference {d['max_abs_diff_threads2']:.1e}, float summation order)"
               if "max_abs_diff_threads2" in d else "") + ".")


def validation_cost(d: dict) -> str:
    """Issue 29's question (``typed_header``): header checks after a typed decode or on dicts."""
    t = d["typed_header"]
    rows = [[r["variant"], r["what"], _f(r["single_us"]), _f(r["single_slept_us"]), _f(r["bundle_us"]),
             _f(r["bundle_slept_us"])] for r in t["rows"]]
    b = t["header_bytes"]
    return _table(["variant", "work", f"one tensor ({b['single']} B) µs", "after a sleep µs",
                   f"bundle of 3 ({b['bundle']} B) µs", "after a sleep µs"], rows)


def validation_cost_text(d: dict) -> str:
    t = d["typed_header"]
    p, h = t["struct_over_today_parse"], t["struct_over_today_hop"]
    diff = sum(1 for c in t["differences"] if not c["same"])
    return (f"Typed and checked (Structs + memos), a header costs {_f(p['single_us'])}x the dicts' for one tensor "
            f"({_f(p['single_slept_us'])}x after a sleep) and {_f(p['bundle_us'])}x ({_f(p['bundle_slept_us'])}x) "
            f"for a bundle of three; a hop's whole header work {_f(h['single_us'])}x ({_f(h['single_slept_us'])}x) "
            f"and {_f(h['bundle_us'])}x ({_f(h['bundle_slept_us'])}x). Of {len(t['differences'])} crafted headers, "
            f"{diff} are answered differently by the two ways." + _blocks_now(t))


def _blocks_now(t: dict) -> str:
    """What the blocks' own typed header (DataHeader, descriptors as dicts) costs against the dicts."""
    by = {r["variant"]: r for r in t["rows"]}
    now = next((r for n, r in by.items() if n.startswith("blocks now: DataHeader")), None)
    hop = by.get("blocks now: hop (DataHeader)")
    dicts = next((r for n, r in by.items() if n.startswith(("dicts: msgspec", "today: msgspec"))), None)
    dicts_hop = next((r for n, r in by.items() if n.startswith(("dicts: hop", "today: hop"))), None)
    if not (now and hop and dicts and dicts_hop):
        return ""
    r = {c: now[c] / dicts[c] for c in ("single_us", "single_slept_us", "bundle_us", "bundle_slept_us")}
    rh = {c: hop[c] / dicts_hop[c] for c in r}
    return (f" What blocks do now (DataHeader, descriptors still dicts through their memo) costs "
            f"{_f(r['single_us'])}x the dicts' parse for one tensor ({_f(r['single_slept_us'])}x after a sleep) and "
            f"{_f(r['bundle_us'])}x ({_f(r['bundle_slept_us'])}x) for a bundle; its hop {_f(rh['single_us'])}x "
            f"({_f(rh['single_slept_us'])}x) and {_f(rh['bundle_us'])}x ({_f(rh['bundle_slept_us'])}x).")


def block_cache(d: dict) -> str:
    rows = []
    for r in d["grid"]:
        if r["head"] != "small" or r["concurrency"] != min(d["settings"]["concurrency"]):
            continue
        dep = r["deployments"]
        c, w = r["cache_vs_resident"], r.get("whole_vs_resident") or {}
        rows.append([r["heads"], r["pattern"], _f(dep["resident"]["p50"]), _f(dep["resident"]["p99"]),
                     _f(dep["resident"]["throughput_rps"], 1), _f(dep["cache"]["p50"]), _f(dep["cache"]["p99"]),
                     _f(dep["cache"]["throughput_rps"], 1), _f(dep["cache"].get("swaps_per_request")),
                     f"{c['throughput']:.2f}x / {c['p99']:.2f}x",
                     f"{w['throughput']:.2f}x / {w['p99']:.2f}x" if w else "–"])
    table = _table(["N", "pattern", "resident p50 ms", "resident p99 ms", "resident req/s", "cache p50 ms",
                    "cache p99 ms", "cache req/s", "swaps/request", "cache / resident: req/s, p99",
                    "whole model / resident: req/s, p99"], rows)
    goals = _table(["goal", "measured", "met"], [[g["goal"], f"{g['measured']:.3f}", "met" if g["pass"] else "**not met**"]
                                                  for g in d["goals"]])
    sizes = _table(["block", "MB", "swap-in p50 ms", "p90 ms", "n", "GB/s at p50"],
                   [[_f(r["mb"], 1) + " MB", _f(r["mb"], 1), _f(r["swap_in_ms"]["p50"]), _f(r["swap_in_ms"]["p90"]),
                     r["swap_in_ms"]["n"], _f(r["gb_per_s_p50"])] for r in d.get("swap_in", {}).get("by_size", [])])
    return table + "\n\n" + goals + "\n\n" + sizes


def block_cache_text(d: dict) -> str:
    parts = []
    pol = d.get("policy")
    if pol:
        sh, lru = pol["policies"]["sharing"], pol["policies"]["lru"]
        parts.append(f"Policy, two backbones under Zipf {pol['zipf_alpha']}: sharing mean {_f(sh['mean'])} ms, p99 "
                     f"{_f(sh['p99'])} ms ({sh['backbone_misses']} backbone and {sh['head_misses']} head swaps); plain "
                     f"LRU mean {_f(lru['mean'])} ms, p99 {_f(lru['p99'])} ms ({lru['backbone_misses']} backbone and "
                     f"{lru['head_misses']} head swaps).")
    hit = d.get("hit")
    if hit:
        paired = ""
        if "p50_ratio_paired" in hit:  # results from before 2026-11-28 have the pooled ratio only
            lo, hi = hit["p50_ratio_paired_ci95"]
            paired = (f"; each request against its neighbour without a budget, median of the ratios "
                      f"{hit['p50_ratio_paired']:.3f}x (95% interval {lo:.3f}-{hi:.3f})")
        parts.append(f"A hit: p50 {_f(hit['cache']['p50'])} ms with a budget against {_f(hit['resident']['p50'])} ms "
                     f"without, {hit['p50_ratio']:.3f}x (median of per-round ratios {hit['p50_ratio_median_of_rounds']:.3f}x"
                     f"{paired}).")
    return " ".join(parts) or "–"


def skipped(d: dict) -> str:
    return f"Not run here: {d.get('reason', 'skipped')}"


SECTIONS = [("offline_blocks", offline_blocks), ("rtt", rtt), ("pipeline_latency", pipeline_latency),
            ("hop_overhead", hop_overhead), ("batch_scaling", batch_scaling), ("multiclient", multiclient),
            ("throughput", throughput), ("utilization", utilization), ("energy", energy),
            ("memory_model", memory_model), ("multi_gpu", multi_gpu), ("batching", batching), ("fused", fused),
            ("replicas", replicas), ("block_cache", block_cache), ("validation_cost", validation_cost)]
#: The sentences with numbers in them, per experiment (between ``<!-- text:NAME -->`` markers).
TEXTS = {"offline_blocks": offline_blocks_text, "rtt": rtt_text, "pipeline_latency": pipeline_latency_text,
         "hop_overhead": hop_overhead_text, "batch_scaling": batch_scaling_text, "multiclient": multiclient_text,
         "throughput": throughput_text, "utilization": utilization_text, "memory_model": memory_model_text,
         "multi_gpu": multi_gpu_text, "batching": batching_text,
         "fused": fused_text, "replicas": replicas_text, "block_cache": block_cache_text,
         "validation_cost": validation_cost_text}


def _safe(fn, d: dict, name: str) -> str:
    """``fn(d)``, or a line saying which field an older JSON lacks: a report never crashes."""
    try:
        return fn(d)
    except (KeyError, TypeError, ValueError, ZeroDivisionError, StopIteration, AttributeError) as exc:
        return f"– ({name}.json lacks what this report reads: {type(exc).__name__} {exc}; rerun the experiment)"


def peers(d: dict) -> str:
    from .peers import table  # experiments/peers.py owns its table
    return table(d)


SECTIONS.append(("peers", peers))


def section(out: str, name: str) -> str:
    fn = dict(SECTIONS).get(name)
    d = _load(out, name)
    if d is None:
        return "not run (no JSON)"
    env = d.get("env", {})
    head = f"_{env.get('machine', '?')}, torch {env.get('torch', '?')}, {env.get('time', '')}; {_settings(d)}_"
    if d.get("skipped"):
        return head + "\n\n" + skipped(d)
    return head + "\n\n" + (_safe(fn, d, name) if fn else "not run (no table for this experiment)")


def text(out: str, name: str) -> str:
    """The sentences with numbers for ``name``, from its JSON."""
    fn = TEXTS.get(name)
    d = _load(out, name)
    if d is None:
        return "Not run (no JSON)."
    if d.get("skipped"):
        return "Not run on this machine (the table says why)."
    return _safe(fn, d, name) if fn else "–"


def report(out: str) -> str:
    return "\n\n".join(f"### {name}\n\n{section(out, name)}\n\n{text(out, name)}" for name, _ in SECTIONS) + "\n"


def rewrite_readme(path: str, out: str) -> list[str]:
    """Replace every marked table and text in ``path``; returns the names replaced."""
    with open(path) as f:
        doc = f.read()
    done = []

    def sub(m):
        kind, name = m.group(1), m.group(2)
        done.append(f"{kind}:{name}")
        body = section(out, name) if kind == "table" else text(out, name)
        return f"<!-- {kind}:{name} -->\n{body}\n<!-- /{kind}:{name} -->"
    doc = re.sub(r"<!-- (table|text):(\w+) -->.*?<!-- /\1:\2 -->", sub, doc, flags=re.S)
    with open(path, "w") as f:
        f.write(doc)
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.report", description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?", help="results directory (default experiments/results/<machine>)")
    ap.add_argument("--readme", action="store_true", help="rewrite the marked tables and texts in experiments/README.md")
    args = ap.parse_args(argv)
    out = args.out or os.path.join(common.RESULTS_ROOT, common.machine_label())
    if not os.path.isdir(out):
        print(f"no results directory {out}; run `blockflow bench all` first", file=sys.stderr)
        return 2
    if args.readme:
        names = rewrite_readme(os.path.join(common.HERE, "README.md"), out)
        print(f"rewrote {len(names)} tables and texts in experiments/README.md from {out}: {', '.join(names)}")
        return 0
    print(report(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
