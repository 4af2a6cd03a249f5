"""The data plane under garbage: the short version of ``python -m experiments.fuzz``.

A real dispatcher and real blocks (StandalonePipeline) get a few thousand random and mutated
frames on the dispatcher's client socket, a block's data socket and the dispatcher's result
socket, with correct requests interleaved. See experiments/fuzz.py for what is sent.
"""
from __future__ import annotations

import os

import pytest

from experiments.fuzz import run_fuzz

#: Seeded so a failure can be replayed; printed with the summary.
SEED = int(os.environ.get("BLOCKFLOW_FUZZ_SEED", 7))
FRAMES = int(os.environ.get("BLOCKFLOW_FUZZ_FRAMES", 3000))


@pytest.fixture(scope="module")
def fuzz_summary(tmp_path_factory):
    import tempfile
    import shutil
    base = tempfile.mkdtemp(prefix="bfz-")  # short: ipc socket paths are limited to ~107 characters
    try:
        s = run_fuzz(FRAMES, SEED, every=20, workdir=base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"\nfuzz seed {SEED}: {s['frames']} frames in {s['seconds']}s, dispatcher {s['dispatcher_frames']} -> "
          f"{s['dispatcher_replies']} replies, block answers {s['block_replies']}/{s['block_expected_replies']}, "
          f"correct {s['correct_ok']}/{s['correct_requests']}, RSS {s['rss_mb']['warm']} -> {s['rss_mb']['end']} MB "
          f"({s['rss_growth_pct']:+.2f}%), fds {s['fds']}")
    return s


def test_fuzz_crashes_nothing(fuzz_summary, leak_check):
    s = fuzz_summary
    assert s["frames"] >= FRAMES
    assert s["crashes"] == 0, s["crash_details"]
    assert all(code == 0 for code in s["exit_codes"].values()), s["exit_codes"]
    assert s["left_behind"] == {"slots": [], "sockets": []}, s["left_behind"]
    assert not s["pickle_executed"], "a pickle sent as a frame was executed"


def test_every_frame_that_names_a_requester_is_answered(fuzz_summary):
    s = fuzz_summary
    # every message on the dispatcher's ROUTER names its sender: exactly one reply each
    assert s["dispatcher_frames"] > FRAMES // 3
    assert s["dispatcher_replies"] == s["dispatcher_frames"], s["failures"]
    assert s["dispatcher_missing_replies"] == 0
    assert s["dispatcher_error_replies"] > s["dispatcher_frames"] // 2  # garbage really was refused
    # a block answers every message naming a request id and a return address, and nothing else
    assert s["block_expected_replies"] > FRAMES // 10
    assert s["block_replies"] == s["block_expected_replies"], s["failures"]
    assert s["block_error_replies"] > 0
    assert s["block_unexpected_replies"] == 0, s["failures"]
    assert s["shm_handles_sent"] > 0  # real, stale and forged handles were part of it
    assert s["failure_count"] == 0, s["failures"]


def test_correct_requests_interleaved_with_garbage_succeed(fuzz_summary):
    s = fuzz_summary
    assert s["correct_requests"] >= FRAMES // 20
    assert s["correct_ok"] == s["correct_requests"], s["failures"]
    assert s["dispatcher_stats"]["outstanding"] == 0 and s["dispatcher_stats"]["pending"] == 0


def test_memory_stays_flat(fuzz_summary):
    s = fuzz_summary
    # RSS of dispatcher + blocks from the end of warm-up to the end; a leak per frame (a socket,
    # a mapping, a queued request) would show as megabytes over thousands of frames
    assert s["rss_growth_pct"] < 5.0, s["rss_mb"]
    assert s["rss_mb"]["end"] - s["rss_mb"]["warm"] < 40, s["rss_mb"]
    assert s["fds"]["end"] - s["fds"]["warm"] < 32, s["fds"]
