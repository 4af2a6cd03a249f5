"""experiments/gpu_floor.py (issue 27): the monolithic model eager and as a CUDA graph, the five
blocks as CUDA graphs back to back, and the floor of five torch-only processes; and how
experiments/pipeline_latency.py reports the served pipeline against them.

Without a GPU (the CPU tests hide any GPU with CUDA_VISIBLE_DEVICES= or a patched
``torch.cuda.is_available``): the command line says so in one line and exits 2, ``measure``
returns ``skipped``, and pipeline_latency's lines and ratios are computed from made-up figures.
The one test marked ``cuda`` measures every row for real.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from experiments import gpu_floor, pipeline_latency

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_cli(*args: str, hide_gpu: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + (os.pathsep + os.environ["PYTHONPATH"]
                                              if os.environ.get("PYTHONPATH") else ""))
    if hide_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run([sys.executable, "-m", "experiments.gpu_floor", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_without_a_gpu_says_so_in_one_line_and_exits_2(tmp_path):
    out = tmp_path / "out"
    proc = run_cli("--n", "5", "--out", str(out))
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "needs a CUDA GPU" in lines[0] and "Traceback" not in proc.stderr
    assert not out.exists() or not os.listdir(out), "nothing is written without a GPU"


def test_cli_refuses_a_cpu_device():
    proc = run_cli("--device", "cpu", hide_gpu=False)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and "needs a CUDA" in lines[0], lines
    assert "Traceback" not in proc.stderr


def test_cli_help_describes_the_rows():
    proc = run_cli("--help")
    assert proc.returncode == 0, proc.stderr
    for word in ("mono_eager", "mono_graph", "chain_graph", "floor", "--device", "--n", "--out", "--timeout",
                 "inter-process CUDA event"):
        assert word in proc.stdout, word


def test_measure_without_a_gpu_is_skipped(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_floor.measure("/nonexistent", "cuda", n=5) == {"skipped": "no GPU"}


def test_measure_refuses_a_cpu_device(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    res = gpu_floor.measure("/nonexistent", "cpu", n=5)
    assert set(res) == {"skipped"} and "cpu" in res["skipped"]


#: made-up figures in the shape measure() returns (ms)
FIGURES = {"n": 300, "warmup": 20, "gpu": "Made-up GPU", "device": "cuda:0",
           "mono_eager_p50_ms": 5.0, "mono_eager_p90_ms": 5.5,
           "mono_graph_p50_ms": 2.0, "mono_graph_p90_ms": 2.2,
           "chain_graph_p50_ms": 2.5, "chain_graph_p90_ms": 2.6,
           "floor_p50_ms": 3.0, "floor_p90_ms": 3.3, "floor_processes": 5,
           "floor_check_max_abs_diff": 1e-5, "floor_check_inputs_max_abs_diff": 2.0}


def stats(p50: float) -> dict:
    return {"n": 10, "mean": p50, "std": 0.1, "min": p50, "p50": p50, "p90": p50, "p99": p50, "max": p50}


def summary_with(floor: dict | None, pipeline: dict[str, float]) -> dict:
    """A pipeline_latency summary with the keys report() reads and ``floor`` as gpu_floor."""
    blocks = {b: {"inference_ms": stats(1.0), "overhead_ms": stats(0.1)} for b in pipeline_latency.BLOCK_NAMES}
    s = {"offline": {"sum_ms": stats(4.0), "monolithic_ms": stats(5.0)},
         "transports": {t: {"rtt_ms": stats(p50), "inference_ms": stats(4.0), "overhead_ms": stats(0.5),
                            "wait_ms": stats(0.1), "blocks": blocks} for t, p50 in pipeline.items()}}
    if floor is not None:
        s["gpu_floor"] = floor
    return s


def test_floor_ratios_and_lines():
    s = summary_with(FIGURES, {"zeromq": 6.0, "tensormq": 4.0})
    r = pipeline_latency.floor_ratios(s)
    assert set(r) == {"zeromq", "tensormq"}
    assert r["zeromq"]["ratio_vs_mono_eager"] == pytest.approx(1.2)
    assert r["zeromq"]["ratio_vs_floor"] == pytest.approx(2.0)
    assert r["zeromq"]["ratio_vs_mono_graph"] == pytest.approx(3.0)
    assert (r["zeromq"]["meets_goal"], r["zeromq"]["meets_stretch"]) == (False, False)
    assert r["tensormq"]["ratio_vs_mono_eager"] == pytest.approx(0.8)
    assert r["tensormq"]["ratio_vs_floor"] == pytest.approx(4 / 3)
    assert (r["tensormq"]["meets_goal"], r["tensormq"]["meets_stretch"]) == (True, True)
    lines = pipeline_latency.floor_lines(s)
    text = "\n".join(lines)
    for row in ("mono_eager", "mono_graph", "chain_graph", "floor"):
        assert any(line.strip().startswith(row + " ") and "p50" in line for line in lines), (row, text)
    zeromq = next(line for line in lines if line.startswith("FLOOR zeromq:"))
    assert "median pipeline 6.00 ms" in zeromq and "monolithic eager 5.00 ms" in zeromq
    assert "monolithic CUDA graph 2.00 ms" in zeromq and "floor (5 processes) 3.00 ms" in zeromq
    assert "1.200x monolithic eager (goal <= 1.00x: NOT met)" in zeromq, zeromq
    assert "2.000x the floor (stretch <= 1.50x: NOT met)" in zeromq, zeromq
    tensormq = next(line for line in lines if line.startswith("FLOOR tensormq:"))
    assert "0.800x monolithic eager (goal <= 1.00x: met)" in tensormq, tensormq
    assert "1.333x the floor (stretch <= 1.50x: met)" in tensormq, tensormq


def test_a_failed_row_is_reported_and_the_others_kept():
    figures = {k: v for k, v in FIGURES.items() if not k.startswith("floor")}
    figures["floor_error"] = "TimeoutError: floor: loading the blocks took more than 60 s"
    s = summary_with(figures, {"tensormq": 4.0})
    r = pipeline_latency.floor_ratios(s)["tensormq"]
    assert r["ratio_vs_floor"] is None and r["meets_stretch"] is None
    assert r["ratio_vs_mono_eager"] == pytest.approx(0.8)
    lines = pipeline_latency.floor_lines(s)
    assert any("floor" in line and "failed: TimeoutError" in line for line in lines), lines
    line = next(line for line in lines if line.startswith("FLOOR tensormq:"))
    assert "floor (5 processes) n/a" in line and "0.800x monolithic eager" in line, line


def test_no_floor_and_cpu():
    skipped = summary_with({"skipped": "--no-floor"}, {"tensormq": 4.0})
    assert pipeline_latency.floor_ratios(skipped) == {}
    assert pipeline_latency.floor_lines(skipped) == ["GPU floor: skipped (--no-floor)"]
    failed = summary_with({"error": "RuntimeError: boom"}, {"tensormq": 4.0})
    assert pipeline_latency.floor_lines(failed)[0] == "GPU floor: failed (RuntimeError: boom)"
    cpu = summary_with(None, {"tensormq": 4.0})  # on a CPU the summary has no gpu_floor
    assert pipeline_latency.floor_ratios(cpu) == {} and pipeline_latency.floor_lines(cpu) == []


def test_report_prints_the_floor_beside_the_pipeline(capsys):
    s = summary_with(FIGURES, {"tensormq": 6.0})
    ratios = {"tensormq": {"pipeline_p50_ms": 6.0, "monolithic_p50_ms": 5.0, "ratio": 1.2, "ratio_vs_alone": 1.2,
                           "meets_goal": True}}
    pipeline_latency.report(s, ratios, {"machine": "test"}, {"device": "cuda", "threads": 1, "series": "10 samples"})
    out = capsys.readouterr().out
    assert "RATIO tensormq:" in out
    assert "FLOOR tensormq: median pipeline 6.00 ms" in out and "1.200x monolithic eager" in out, out
    assert "2.000x the floor" in out and "GPU floor on Made-up GPU" in out, out
    pipeline_latency.report(summary_with(None, {"tensormq": 6.0}), ratios, {"machine": "test"},
                            {"device": "cpu", "threads": 1, "series": "10 samples"})
    assert "FLOOR" not in capsys.readouterr().out


@pytest.mark.cuda
def test_measure_on_a_gpu(model_repo):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    res = gpu_floor.measure(model_repo, "cuda", n=20)
    errors = {k: v for k, v in res.items() if k.endswith("_error")}
    assert not errors, errors
    for row in gpu_floor.ROWS:
        for q in ("p50", "p90"):
            v = res[f"{row}_{q}_ms"]
            assert isinstance(v, float) and math.isfinite(v) and v > 0, (row, q, v)
    assert res["n"] == 20 and res["floor_processes"] == 5
