"""experiments/vram.py: per-process VRAM stages, the recommended configuration, the group figure.

CPU tests check what can be checked without a GPU: the one-line refusal, the pure functions that
pick the recommendation and format the tables, the child plumbing (errors and timeouts become
entries, children never outlive their timeout) and the orchestration with fake children. The
``cuda`` test runs one real configuration."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from experiments import vram

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _no_gpu_env() -> dict:
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore"}


def _entry(mb: dict | float | None, ms: float | None, **extra) -> dict:
    """A made-up child result: process_mb per stage (one number: the same at every stage)."""
    if not isinstance(mb, dict):
        mb = {s: mb for s in vram.STAGES} if mb is not None else {}
    stages = {s: {"process_mb": v, "torch_reserved_mb": 10.0, "source": "nvml_pid"} for s, v in mb.items()}
    return {"stages": stages, "eager_median_ms": ms, **extra}


def test_cli_without_a_gpu_says_so_in_one_line_and_exits_2():
    proc = subprocess.run([sys.executable, "-m", "experiments.vram", "--n", "3"], cwd=ROOT, env=_no_gpu_env(),
                          capture_output=True, text=True, timeout=120)
    out = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, out)
    assert len(out) == 1 and "needs a CUDA GPU" in out[0], out


def test_measure_without_a_gpu_returns_skipped():
    code = "import json; from experiments import vram; print(json.dumps(vram.measure()))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_no_gpu_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"skipped": "no GPU"}


def test_help_explains_every_stage_and_configuration():
    proc = subprocess.run([sys.executable, "-m", "experiments.vram", "--help"], cwd=ROOT, env=_no_gpu_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    for word in [*vram.STAGES[:-1], *vram.CONFIGS, "--budget", "--device", "--out", "ratio"]:
        assert word in proc.stdout, word


def test_recommend_picks_the_smallest_configuration_within_tolerance():
    configs = {
        "default": _entry(520.0, 2.00),
        "small_but_slow": _entry(300.0, 2.20),      # 10 % slower: refused
        "smaller": _entry(480.0, 2.08),             # 4 % slower: allowed
        "smallest_fast": _entry(470.0, 1.90),
        "broken": {**_entry(100.0, 1.0), "error": "load: boom"},
        "skipped": {"skipped": "budget"},
        "untimed": _entry(50.0, None),
    }
    rec = vram.recommend(configs)
    assert rec["name"] == "smallest_fast"
    assert rec["process_mb"] == 470.0 and rec["saved_mb"] == pytest.approx(50.0)
    assert rec["slowdown_pct"] == pytest.approx(-5.0)
    assert set(rec["too_slow_ms"]) == {"small_but_slow"}
    assert set(rec["unusable"]) == {"broken", "skipped", "untimed"}
    # exactly at the tolerance still counts; just above it does not
    assert vram.recommend({"default": _entry(520.0, 2.0), "edge": _entry(400.0, 2.1)})["name"] == "edge"
    assert vram.recommend({"default": _entry(520.0, 2.0), "over": _entry(400.0, 2.1001)})["name"] == "default"


def test_recommend_prefers_the_baseline_on_a_tie_and_uses_the_figure_stage():
    tie = {"a_first": _entry(500.0, 2.0), "default": _entry(500.0, 2.0)}
    assert vram.recommend(tie)["name"] == "default"
    staged = {"default": _entry({"cuda_graph": 600.0, "empty_cache": 500.0}, 2.0),
              "x": _entry({"cuda_graph": 400.0, "empty_cache": 550.0}, 2.0)}
    assert vram.recommend(staged)["name"] == "default"  # compared at empty_cache, not cuda_graph
    assert vram.recommend(staged, stage="cuda_graph")["name"] == "x"


def test_recommend_without_a_usable_baseline_says_why():
    for configs in ({}, {"default": {"error": "context: no driver"}}, {"default": _entry(500.0, None)}):
        rec = vram.recommend(configs)
        assert rec["name"] is None and "baseline" in rec["reason"]
    rec = vram.recommend({"default": {"stages": {}, "eager_median_ms": 2.0}})
    assert rec["name"] is None and "empty_cache" in rec["reason"]


def test_breakdown_from_stages():
    stages = {"context": {"process_mb": 500.0, "torch_reserved_mb": 2.0},
              "load": {"process_mb": 580.0, "torch_reserved_mb": 82.0},
              "first": {"process_mb": 700.0, "torch_reserved_mb": 150.0},
              "cuda_graph": {"process_mb": 760.0, "torch_reserved_mb": 210.0},
              "empty_cache": {"process_mb": 700.0, "torch_reserved_mb": 150.0}}
    b = vram.breakdown(stages)
    assert b == {"context_outside_allocator_mb": 498.0, "weights_mb": 80.0, "first_inference_allocator_mb": 68.0,
                 "first_inference_outside_allocator_mb": 52.0, "cuda_graph_mb": 60.0, "empty_cache_released_mb": 60.0}
    partial = vram.breakdown({"context": stages["context"]})
    assert partial["context_outside_allocator_mb"] == 498.0 and partial["weights_mb"] is None


def test_group_summary_ratio_and_missing_figures():
    five = {s: _entry(400.0 + i, None) for i, s in enumerate(vram.PIPELINE_STEMS)}
    one = _entry(800.0, None)
    g = vram.group_summary(five, one)
    assert g["five_sum_mb"]["first"] == pytest.approx(2010.0)
    assert g["ratio"]["first"] == pytest.approx(800.0 / 2010.0)
    five["head"] = {"error": "child timed out"}
    g = vram.group_summary(five, one)
    assert g["five_sum_mb"]["first"] is None and g["ratio"]["first"] is None and g["one_mb"]["first"] == 800.0


def test_tables_show_error_and_skipped_entries():
    configs = {"default": _entry(520.0, 2.0),
               "cublas_ws_0": {"stages": {"context": {"process_mb": 510.0}}, "error": "load: RuntimeError: boom\nmore"},
               "module_loading_eager": {"skipped": "budget: 70 s spent before it started"},
               "odd": None}
    lines = vram.format_table(configs)
    assert len(lines) == 1 + len(configs)
    assert "error: load: RuntimeError: boom" in lines[2] and "more" not in lines[2] and "510" in lines[2]
    assert "skipped: budget" in lines[3] and "no result" in lines[4]
    assert "2.000" in lines[1] and "520" in lines[1]
    group = {"five": {s: _entry(400.0, None) for s in vram.PIPELINE_STEMS[:-1]}, "one": {"error": "oops"},
             **vram.group_summary({}, {})}
    text = "\n".join(vram.format_group(group))
    assert "head" in text and "no result" in text and "error: oops" in text
    assert vram.format_group({}) == ["group: not measured"]
    assert "skipped" in vram.format_group({"skipped": "budget"})[0]
    summary = "\n".join(vram.summary_lines({"device": "cuda:0", "blocks": ["block4", "head"], "configs": configs,
                                            "group": group, "recommended": vram.recommend(configs)}))
    assert "recommended: default" in summary


def test_a_failing_child_becomes_an_error_entry():
    res = vram.run_child({"name": "cpu", "device": "cpu", "stems": ["head"], "nvml_index": None,
                          "repo": "/nonexistent"}, timeout=60)
    assert "error" in res and res["error"], res
    assert res["wall_s"] < 60


def test_a_child_past_its_timeout_is_killed_and_reported():
    t = time.monotonic()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    res = vram.run_child({"name": "slow", "device": "cpu", "stems": ["head"], "sleep_s": 60}, timeout=3)
    assert time.monotonic() - t < 20
    assert "timed out after 3 s" in res["error"]
    left = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not left, f"children left running: {left}"


def test_measure_orchestrates_children_within_the_budget(monkeypatch, tmp_path):
    """measure() with fake children: run order, group, recommendation, budget cut-off."""
    import torch

    from experiments import common
    calls = []

    def fake_child(spec, env=None, timeout=0):
        calls.append((spec["name"], spec["n"], {k: env.get(k) for k in vram.CONTROLLED_ENV if k in env}))
        mb = {"default": 520.0, "cublas_ws_0": 480.0, "cublas_ws_small": 490.0}.get(spec["name"], 500.0)
        if spec["name"].startswith("group:"):
            mb = 900.0 if spec["name"] == "group:one" else 420.0
        time.sleep(0.01)
        return {**_entry(mb, 2.0 if spec["n"] else None), "wall_s": 0.01}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(vram, "run_child", fake_child)
    monkeypatch.setattr(vram, "_nvml_index", lambda device: (0, "fake"))
    monkeypatch.setattr(common, "ensure_repo", lambda repo=None, model="resnet50": str(tmp_path))
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # inherited: must not reach "default"
    res = vram.measure("cuda:0", n=7, configs=["default", "cublas_ws_0", "cublas_ws_small"])
    names = [c[0] for c in calls]
    assert names[:7] == ["default", *[f"group:{s}" for s in vram.PIPELINE_STEMS], "group:one"]
    assert names[7:] == ["cublas_ws_0", "cublas_ws_small"]
    assert calls[0][1] == 7 and calls[1][1] == 0
    assert calls[0][2] == {} and calls[7][2] == {"CUBLAS_WORKSPACE_CONFIG": ":0:0"}
    assert res["inherited_env"] == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    assert res["recommended"]["name"] == "cublas_ws_0"
    assert res["per_process_mb"]["before"] == 520.0 and res["per_process_mb"]["after"] == 480.0
    assert res["group"]["ratio"]["first"] == pytest.approx(900.0 / 2100.0)
    assert res["configs"]["default"]["breakdown"]["context_outside_allocator_mb"] == 510.0
    json.dumps(res)
    # a budget already spent: nothing runs, everything says skipped
    calls.clear()
    res = vram.measure("cuda:0", n=7, configs=["default"], budget=0)
    assert calls == [] and "budget" in res["configs"]["default"]["skipped"]
    assert "budget" in res["group"]["one"]["skipped"] and res["recommended"]["name"] is None
    with pytest.raises(ValueError):
        vram.measure("cuda:0", configs=["nope"])


@pytest.mark.cuda
def test_one_configuration_on_the_gpu_has_positive_stage_figures(model_repo):
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    res = vram.measure("cuda:0", repo=model_repo, n=5, budget=60, configs=["default"], group=False)
    entry = res["configs"]["default"]
    assert not entry.get("error"), entry
    for stage in vram.STAGES:
        rec = entry["stages"][stage]
        assert rec["torch_reserved_mb"] > 0, (stage, rec)
        assert rec["process_mb"] is not None and rec["process_mb"] > 0, (stage, rec)
    assert entry["stages"]["load"]["torch_reserved_mb"] > entry["stages"]["context"]["torch_reserved_mb"]
    assert entry["eager_median_ms"] > 0 and entry["graph_median_ms"] > 0
    assert res["recommended"]["name"] == "default"


def test_main_writes_the_json_and_prints_the_tables(monkeypatch, tmp_path, capsys):
    """main() end to end with fake children: vram.json with its keys, rewritten as it goes."""
    import torch

    from experiments import common
    written = []

    def fake_child(spec, env=None, timeout=0):
        path = tmp_path / "out" / "vram.json"
        if path.exists():
            written.append(json.loads(path.read_text())["figures"].get("partial"))
        return {**_entry(500.0 if spec["name"] != "group:one" else 800.0, 2.0 if spec["n"] else None), "wall_s": 0.0}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(vram, "run_child", fake_child)
    monkeypatch.setattr(vram, "_nvml_index", lambda device: (0, "fake"))
    monkeypatch.setattr(common, "ensure_repo", lambda repo=None, model="resnet50": str(tmp_path))
    monkeypatch.setattr(common, "env_info", lambda settings=None: {"machine": "fake", "settings": settings})
    rc = vram.main(["--out", str(tmp_path / "out"), "--configs", "default,cublas_ws_0", "--n", "3"])
    assert rc == 0
    data = json.loads((tmp_path / "out" / "vram.json").read_text())
    assert {"commit", "env", "settings", "config_definitions", "figures"} <= set(data)
    fig = data["figures"]
    assert "partial" not in fig and written and all(written)
    assert set(fig["configs"]) == {"default", "cublas_ws_0"}
    assert {"group", "recommended", "per_process_mb", "nvml_index", "seconds"} <= set(fig)
    assert fig["group"]["ratio"]["first"] == pytest.approx(800.0 / 2500.0)
    out = capsys.readouterr().out
    assert "recommended: default" in out and "ratio one / five" in out
