"""experiments/peers.py without Ray: the script still exits 0 and says why nothing was measured.

The measured run (Ray Serve and BlockFlow side by side) needs the optional ``[peers]`` extra and
minutes of a machine; the smoke test of every experiment runs it where Ray is installed. Here Ray
is made unimportable in the child interpreter (``sys.modules["ray"] = None`` makes ``import ray``
raise ImportError, as on a machine without the extra), whatever this environment has.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WITHOUT_RAY = ("import runpy, sys; sys.modules['ray'] = None; sys.argv[0] = 'peers'; "
               "runpy.run_module('experiments.peers', run_name='__main__')")


def test_without_ray_it_records_skipped_with_the_reason_and_exits_0(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=ROOT + (os.pathsep + os.environ["PYTHONPATH"]
                                              if os.environ.get("PYTHONPATH") else ""))
    proc = subprocess.run([sys.executable, "-c", WITHOUT_RAY, "--quick", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / "peers.json") as f:
        data = json.load(f)
    assert data["skipped"] is True
    assert "Ray Serve is not installed" in data["reason"] and ".[peers]" in data["reason"]
    assert data["settings"]["quick"] is True and data["env"]["settings"] == data["settings"]
    assert not (out / "peers.png").exists()  # nothing measured, nothing plotted

    from experiments.report import section
    assert section(str(out), "peers").endswith("Not run here: " + data["reason"])


def test_a_per_hop_difference_that_is_noise_is_not_a_figure():
    """hop_overhead's Note [Not measured] in peers' per-hop rows: three runs of three gave a
    negative BlockFlow hop at 103 MB (a few ms inside round trips of 100-200 ms)."""
    import pytest
    from experiments.peers import per_hop_figure
    ok = per_hop_figure([0.2, 0.21, 0.19, 0.25, 0.2, 0.22])
    assert ok["per_hop_median_ms"] == pytest.approx(0.205) and ok["per_hop_p99_ms"] > 0 and "not_measured" not in ok
    below = per_hop_figure([-7.0, 3.0, -10.0, 2.0, -9.0, 1.0])
    assert below["per_hop_median_ms"] is None and below["per_hop_p99_ms"] is None
    assert below["not_measured"].startswith("below zero")
    wide = per_hop_figure([5.0, 80.0, -20.0, 10.0, 7.0, 30.0])  # thirds' medians 42.5, -5, 18.5
    assert wide["per_hop_median_ms"] is None and "spread over" in wide["not_measured"]
    assert per_hop_figure([])["not_measured"] == "no samples"
