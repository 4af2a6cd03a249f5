"""Read the per-block KPI logs (JSON lines) and summarise them: ``blockflow kpi RUN_DIR``."""
from __future__ import annotations

import glob
import json
import os
import statistics

from blockflow.blocks.kpilog import LATENCY_FIELDS


def _read(path: str, skip: int = 0) -> list[dict]:
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line cut by a crash
    return out[skip:]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    return {"mean": statistics.fmean(values), "p50": percentile(values, 0.5), "p99": percentile(values, 0.99)}


def summarize_block(run_dir: str, name: str, skip: int = 0) -> dict:
    lat = _read(os.path.join(run_dir, f"{name}.latency.jsonl"), skip)
    res = _read(os.path.join(run_dir, f"{name}.resources.jsonl"))
    out = {"name": name, "count": len(lat), "latency_ms": {}, "queue": stats([r.get("queue", 0) for r in lat])}
    for key in LATENCY_FIELDS:
        out["latency_ms"][key] = stats([r[key] for r in lat if key in r])
    out["latency_ms"]["overhead"] = stats([r["total"] - r["inf"] for r in lat if "total" in r and "inf" in r])
    resources = {}
    for key in ("cpu_percent", "rss_mb", "vram_mb", "gpu_util", "torch_allocated_mb", "power_w"):
        vals = [r[key] for r in res if key in r]
        if vals:
            resources[key] = statistics.fmean(vals)
    why = next((r["vram_unavailable"] for r in res if "vram_unavailable" in r), None)
    if "vram_mb" not in resources and why:  # say why per-process VRAM is missing (PID namespace)
        resources["vram_unavailable"] = why
    out["resources"] = resources
    out["samples"] = len(res)
    return out


def without_records(summaries: list[dict]) -> list[str]:
    """Blocks whose log exists (they started) but holds no inference yet."""
    return [s["name"] for s in summaries if not s["count"]]


def blocks_in(run_dir: str) -> list[str]:
    names = {os.path.basename(p).split(".")[0] for p in glob.glob(os.path.join(run_dir, "*.jsonl"))}
    return sorted(names)


def format_table(summaries: list[dict]) -> str:
    cols = ["block", "count", "wait", "deser", "dev", "inf", "share", "fwd", "total", "p99 total", "queue", "cpu%",
            "rss MB", "vram MB"]
    rows = []
    for s in summaries:
        lat = s["latency_ms"]
        fmt = lambda v: "-" if v is None else f"{v:.3f}"
        r = s["resources"]
        rows.append([s["name"], str(s["count"])] + [fmt(lat[k]["mean"]) for k in LATENCY_FIELDS]
                    + [fmt(lat["total"]["p99"]), fmt(s["queue"]["mean"]),
                       f"{r['cpu_percent']:.0f}" if "cpu_percent" in r else "-",
                       f"{r['rss_mb']:.0f}" if "rss_mb" in r else "-",
                       f"{r['vram_mb']:.0f}" if "vram_mb" in r else ("n/a" if "vram_unavailable" in r else "-")])
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
    lines.append("(latency columns: mean milliseconds per inference; thesis eq. 4.1)")
    why = next((s["resources"]["vram_unavailable"] for s in summaries if "vram_unavailable" in s["resources"]), None)
    if why:
        lines.append(f"(vram n/a: {why})")
    return "\n".join(lines)
