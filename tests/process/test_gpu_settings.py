"""The GPU hand-over's settings (issue 27): read once per process, so each case starts one."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _settings_in_a_fresh_process(**env):
    return subprocess.run([sys.executable, "-c", "from blockflow.core import settings; "
                           "print(settings.CUDA_HANDOVER, settings.CUDA_STACK_BYTES)"],
                          cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=60)


def test_the_hand_over_mode_and_the_stack_limit_are_settings_and_bad_values_are_named():
    ok = _settings_in_a_fresh_process(BLOCKFLOW_CUDA_HANDOVER="Sync", BLOCKFLOW_CUDA_STACK_BYTES="0")
    assert ok.returncode == 0 and ok.stdout.split() == ["sync", "0"], ok.stderr
    for var, bad in (("BLOCKFLOW_CUDA_HANDOVER", "lazy"), ("BLOCKFLOW_CUDA_STACK_BYTES", "small")):
        res = _settings_in_a_fresh_process(**{var: bad})
        assert res.returncode != 0 and f"{var}={bad!r}" in res.stderr, res.stderr
