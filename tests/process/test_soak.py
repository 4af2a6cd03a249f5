"""The soak run in its short form (``python -m experiments.soak --quick --minutes 0.35
--update-every 5``: 5 s of saturation measurement, then 21 s of load).

A real ``blockflow serve`` under Poisson load at 80% of the saturation it measures, with a
topology update every 5 s (four in the run; three asserted, so one late update under a loaded
machine does not fail it) that spawns and retires a block on the path. Checked here: every
request answered, every update applied, clean exit, and no process, socket file or
shared-memory segment left. The leak detector itself is tested on a planted leak below (a
block that keeps 10 KB per request); the committed no-leak figure needs the 10-minute run, whose
figures are in README.md.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import List

import pytest
import torch

# No parallel worker beside them. The short soak's load runs at 80% of a capacity it measures: a
# neighbour test on the other core would move both, so it runs alone, after every other test. The
# planted leak runs at a fixed 80 req/s of identity blocks, and reads memory, not time.
pytestmark = pytest.mark.exclusive

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.alone
def test_short_soak_answers_everything_and_leaves_nothing(model_repo, tmp_path, leak_check):
    out = str(tmp_path)
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "experiments.soak", "--quick", "--minutes", "0.35", "--update-every", "5",
                           "--repo", model_repo, "--out", out],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    with open(os.path.join(out, "soak.json")) as f:
        res = json.load(f)
    counts = res["counts"]
    assert counts["sent"] > 50 and counts["ok"] > 0.9 * counts["sent"], (counts, proc.stderr[-2000:])
    assert counts["timeouts"] == 0 and res["unanswered"] == 0, counts
    assert len(res["updates"]) >= 3 and not [u for u in res["updates"] if "error" in u], res["updates"]
    assert any("b4b" in u["spawned"] for u in res["updates"]), res["updates"]
    assert res["server_exit_code"] == 0
    assert res["left_behind"] == {"processes": [], "sockets": [], "shm": False}, res["left_behind"]
    assert res["samples"] and all(s["rss_mb"] > 0 for s in res["samples"])


# -- the planted leak (Note [Seeing a leak] in experiments/soak.py) ------------------------------

#: float32 values the leaking block keeps per request: 10 KB, i.e. 1 MB per 100 requests.
LEAK_FLOATS = 2621


class _Identity(torch.nn.Module):
    def forward(self, x):
        return x


class _Leak(torch.nn.Module):
    """Keeps ``floats`` float32 values of every request it serves. The attribute's type is
    given as an object: this module's ``from __future__ import annotations`` would make a class
    annotation a string, which TorchScript cannot resolve."""
    __annotations__ = {"kept": List[torch.Tensor]}

    def __init__(self, floats: int):
        super().__init__()
        self.floats = floats
        self.kept = []

    def forward(self, x):
        self.kept.append(torch.full([self.floats], 1.0) + x.flatten()[0])
        return x


def _toy_repo(path) -> str:
    """identity.pt and leak.pt (a _Leak of LEAK_FLOATS values per request), in no manifest."""
    os.makedirs(path / "toy")
    torch.jit.save(torch.jit.script(_Identity()), str(path / "toy" / "identity.pt"))
    torch.jit.save(torch.jit.script(_Leak(LEAK_FLOATS)), str(path / "toy" / "leak.pt"))
    return str(path)


def _toy_soak(repo: str, last: str) -> dict:
    from experiments.soak import run_soak

    def topology(phase: int) -> dict:
        return {"transport": "tensormq",
                "blocks": [{"name": "a", "model": "toy/identity.pt", "threads": 1},
                           {"name": "z", "model": f"toy/{last}.pt", "threads": 1}],
                "tasks": [{"id": "classify", "path": ["a", "z"]}]}

    # 15 s at 80 req/s, two samples a second, the first 4 s left out; no updates (one phase)
    return run_soak(repo, minutes=0.25, rate=80.0, update_every=3600.0, sample_every=0.5, clients=1, load=0.8,
                    saturate_s=0.0, warmup_s=4.0, seed=1, topology=topology, model=f"toy/{last}")


def test_soak_reports_a_planted_leak(tmp_path, leak_check):
    """A block that keeps 10 KB per request (1 MB per 100) must be reported as a leak, with a
    slope near what it keeps; the same chain with an identity block in its place shows a slope
    far below it. (The first soak compared overlapping windows in percent: +0.35% here, a pass.)"""
    repo = _toy_repo(tmp_path)
    leaking = _toy_soak(repo, "leak")
    g = leaking["growth"]["rss_mb"]
    print(f"\nplanted leak: RSS {g}")
    assert leaking["counts"]["ok"] > 700, leaking["counts"]
    assert g["leak"] is True and leaking["passed"] is False, g
    kept = LEAK_FLOATS * 4 / 2**20 * 1000  # MB per 1000 requests: 10.0
    slope, _ = g["mb_per_1000_requests"]
    assert 0.5 * kept < slope < 2 * kept, g

    assert leaking["rss_slope_by_process"]["z"][0] > 0.5 * kept, leaking["rss_slope_by_process"]

    clean = _toy_soak(repo, "identity")
    c = clean["growth"]["rss_mb"]
    by = clean["rss_slope_by_process"]
    print(f"no leak: RSS {c}, by process {by}")
    assert clean["counts"]["ok"] > 700, clean["counts"]
    # The control is the block in the leaker's place, not the total: the dispatcher's and the
    # REST process's RSS still settle for some seconds after warm-up (the total's slope was
    # +0.5-2.7 MB per 1000 requests over 30 s runs on a loaded 2-core CI machine, flat over
    # minutes in probes of the identity chain), which a short run cannot tell from a leak.
    assert by["z"][0] < 0.25 * kept, by
