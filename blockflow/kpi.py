"""Read the per-block KPI logs (JSON lines) and summarise them: ``blockflow kpi RUN_DIR``."""
from __future__ import annotations

import glob
import json
import math
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


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _numbers(records: list[dict], key: str) -> list[float]:
    """``key``'s values in ``records`` that are numbers: a value the writer could not measure is
    NaN, which JSON lines carry as null (blocks/kpilog.py), and is left out, not averaged."""
    return [r[key] for r in records if _is_number(r.get(key))]


def summarize_block(run_dir: str, name: str, skip: int = 0) -> dict:
    """Latency components of ``name``'s inferences after the first ``skip`` (warm-up), and its
    resource samples taken while those ran (CPU % over the measured window, not the lifetime)."""
    records = _read(os.path.join(run_dir, f"{name}.latency.jsonl"))
    lat = [r for r in records if "error" not in r][skip:]
    errors: dict[str, int] = {}  # failed requests by error code (blocks/process.py ``fail``), none dropped
    for r in records:
        if "error" in r:
            errors[str(r["error"])] = errors.get(str(r["error"]), 0) + 1
    res = _read(os.path.join(run_dir, f"{name}.resources.jsonl"))
    stamps = [r["ts"] for r in lat if isinstance(r.get("ts"), (int, float))]
    if stamps:
        start, end = min(stamps), max(stamps) + 1.0  # a sample covers the interval before it
        res = [r for r in res if isinstance(r.get("ts"), (int, float)) and start <= r["ts"] <= end] or res
    out = {"name": name, "count": len(lat), "errors": errors, "latency_ms": {},
           "queue": stats([r.get("queue", 0) for r in lat])}
    for key in LATENCY_FIELDS:
        out["latency_ms"][key] = stats(_numbers(lat, key))
    out["latency_ms"]["overhead"] = stats([r["total"] - r["inf"] for r in lat
                                           if _is_number(r.get("total")) and _is_number(r.get("inf"))])
    resources = {}
    for key in ("cpu_percent", "rss_mb", "vram_mb", "gpu_util", "torch_allocated_mb", "power_w"):
        vals = _numbers(res, key)
        if vals:
            resources[key] = statistics.fmean(vals)
    why = next((r["vram_unavailable"] for r in res if "vram_unavailable" in r), None)
    if "vram_mb" not in resources and why:  # say why per-process VRAM is missing (PID namespace)
        resources["vram_unavailable"] = why
    out["resources"] = resources
    out["samples"] = len(res)
    return out


def without_records(summaries: list[dict]) -> list[str]:
    """Blocks whose log exists (they started) but holds no inference yet, nor a failed one."""
    return [s["name"] for s in summaries if not s["count"] and not s.get("errors")]


def failing(summaries: list[dict]) -> list[str]:
    """One line per block that answered requests with errors: how many, by error code."""
    out = []
    for s in summaries:
        errors = s.get("errors") or {}
        if errors:
            kinds = ", ".join(f"{code}: {n}" for code, n in sorted(errors.items(), key=lambda kv: -kv[1]))
            out.append(f"block {s['name']}: {sum(errors.values())} request(s) failed ({kinds})"
                       + ("" if s["count"] else ", none succeeded") + "; the server's log says why")
    return out


def blocks_in(run_dir: str) -> list[str]:
    """Blocks with a KPI log in ``run_dir`` (the dispatcher's ``@dispatcher`` log is not a block)."""
    names = set()
    for suffix in (".latency.jsonl", ".resources.jsonl"):
        for p in glob.glob(os.path.join(glob.escape(run_dir), "*" + suffix)):
            name = os.path.basename(p)[:-len(suffix)]
            if not name.startswith("@"):
                names.add(name)
    return sorted(names)


def newest_run(path: str) -> str | None:
    """``path`` if it holds KPI logs; else the newest run under it (a state directory's ``runs/``,
    or a directory of runs); None when there is none."""
    if blocks_in(path):
        return path
    for root in (os.path.join(path, "runs"), path):
        if not os.path.isdir(root):
            continue
        runs = [d for d in (os.path.join(root, e) for e in os.listdir(root)) if os.path.isdir(d) and blocks_in(d)]
        if runs:
            return max(runs, key=os.path.getmtime)
    return None


#: What each column of ``blockflow kpi`` means (printed under the table).
LEGEND = """\
  count       inferences measured (after the warm-up records dropped with --warmup)
  errors      requests the block answered with an error (all of them: none is dropped)
  wait        queued before the inference thread took it           (eq. 4.1: queue wait)
  deser       rebuilding the tensor from its handle or bytes        (reconstruct)
  dev         moving it to the block's device                        (to-device)
  inf         the model's forward pass                               (inference)
  share       putting the output into a slot for the next hop        (share)
  fwd         sending the message on                                 (forward)
  total       arrival to departure: the sum of the six above; p99 total is its 99th percentile
  queue       messages waiting when the inference ended (mean)
  cpu%        the block process's CPU while those inferences ran (100 = one core)
  rss MB      resident memory; vram MB: GPU memory of the process
latency columns are means in milliseconds"""


def plot(summaries: list[dict], path: str) -> None:
    """A stacked bar per block of its mean latency components (matplotlib, the [bench] extra)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [s["name"] for s in summaries]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.0 + 0.8 * len(names)), 3.6))
    bottom = [0.0] * len(names)
    for key in LATENCY_FIELDS[:-1]:
        vals = [s["latency_ms"][key]["mean"] or 0.0 for s in summaries]
        ax.bar(names, vals, bottom=bottom, label=key)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("mean latency per inference (ms)")
    ax.set_title("per-block latency components (thesis eq. 4.1)")
    ax.legend(fontsize=7, ncols=3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def format_table(summaries: list[dict]) -> str:
    cols = ["block", "count", "errors", "wait", "deser", "dev", "inf", "share", "fwd", "total", "p99 total", "queue", "cpu%",
            "rss MB", "vram MB"]
    rows = []
    for s in summaries:
        lat = s["latency_ms"]
        fmt = lambda v: "-" if v is None else f"{v:.3f}"
        r = s["resources"]
        rows.append([s["name"], str(s["count"]), str(sum((s.get("errors") or {}).values()))]
                    + [fmt(lat[k]["mean"]) for k in LATENCY_FIELDS]
                    + [fmt(lat["total"]["p99"]), fmt(s["queue"]["mean"]),
                       f"{r['cpu_percent']:.0f}" if "cpu_percent" in r else "-",
                       f"{r['rss_mb']:.0f}" if "rss_mb" in r else "-",
                       f"{r['vram_mb']:.0f}" if "vram_mb" in r else ("n/a" if "vram_unavailable" in r else "-")])
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
    lines.append(LEGEND)
    why = next((s["resources"]["vram_unavailable"] for s in summaries if "vram_unavailable" in s["resources"]), None)
    if why:
        lines.append(f"(vram n/a: {why})")
    return "\n".join(lines)
