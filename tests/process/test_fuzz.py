"""The data plane under garbage: the short version of ``python -m experiments.fuzz``.

A real dispatcher and real blocks (StandalonePipeline) get a few thousand random and mutated
frames on the dispatcher's client socket, a block's data socket and the dispatcher's result
socket, with correct requests interleaved. See experiments/fuzz.py for what is sent.
"""
from __future__ import annotations

import os

import pytest

from experiments.fuzz import fd_budget, run_fuzz

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
          f"({s['rss_growth_pct']:+.2f}%), fds {s['fds']['warm']} -> {s['fds']['end']} (budget {fd_budget(s)}: "
          f"{s['foreign_hops_after_warm']} hops forged after warm-up; "
          f"{s['fds']['kinds_warm']} -> {s['fds']['kinds_end']})")
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
    # Descriptors grow by what the next hops forged after warm-up cost block d: a socket, and a
    # window of 8 slot files (a descriptor per mapping) once a tensor goes there. How many such
    # hops a run forges depends on where the bit flips land, and the frames carry the run's pid
    # and temporary directory: +4 to +21 in runs of one seed here, +33 (4 windows) in the run
    # that failed the fixed bound of 32 (issue 42). fd_budget counts the hops instead.
    assert s["fds"]["end"] - s["fds"]["warm"] <= fd_budget(s), \
        (f"budget {fd_budget(s)} for {s['foreign_hops_after_warm']} hops forged after warm-up", s["fds"])


#: The planted leak: every tensor a block or the dispatcher decodes opens a descriptor it never closes.
PLANTED_LEAK = """\
import os
if os.environ.get("BLOCKFLOW_TEST_PLANTED_LEAK"):
    from blockflow.tensormq import transport

    def _leaky(decode):
        def leaky(self, *args, **kw):
            os.open(os.devnull, os.O_RDONLY)  # never closed: the leak
            return decode(self, *args, **kw)
        return leaky

    transport.Transport.decode = _leaky(transport.Transport.decode)
    transport.Transport.decode_value = _leaky(transport.Transport.decode_value)
"""


def test_a_planted_descriptor_leak_exceeds_the_budget(tmp_path, leak_check):
    """The descriptor check of test_memory_stays_flat still catches a leak: the same run with a
    descriptor leaked per decoded tensor (a sitecustomize in the children's PYTHONPATH) grows past
    fd_budget, and the growth is in what the leak opens (``other``: /dev/null), not in slots."""
    import tempfile
    import shutil
    (tmp_path / "sitecustomize.py").write_text(PLANTED_LEAK)
    env = {"BLOCKFLOW_TEST_PLANTED_LEAK": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)}
    base = tempfile.mkdtemp(prefix="bfz-")
    try:
        s = run_fuzz(600, SEED, every=20, workdir=base, env=env)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert s["correct_ok"] == s["correct_requests"] > 0, s["failures"]  # the leak broke nothing else
    grew = s["fds"]["end"] - s["fds"]["warm"]
    assert grew > fd_budget(s), (grew, fd_budget(s), s["fds"])
    other = s["fds"]["kinds_end"].get("other", 0) - s["fds"]["kinds_warm"].get("other", 0)
    assert other > fd_budget(s), s["fds"]


def test_a_header_that_is_not_utf8_gets_a_clear_error(identity_repo, short_tmp, leak_check):
    """Found by the 10,000-frame fuzz run: msgspec raises UnicodeDecodeError, not DecodeError,
    for invalid UTF-8 inside a JSON string. The dispatcher took it for a bad input value and
    failed in its own error path (the client got "bad request: UnboundLocalError"); a block
    logged a traceback. Both now answer a WireError that says what is wrong, and a block answers
    exactly the messages ``_return_address`` says it answers (the fuzzer's oracle)."""
    import json

    import torch
    import zmq

    from blockflow.blocks.process import _return_address
    from blockflow.core.protocol import RETURN_HOP
    from blockflow.standalone import StandalonePipeline
    from blockflow.tensormq.transport import encode_bytes
    from blockflow.tensormq.wire import WireError, loads_data_header, loads_header

    bad = b"\xe8ab"  # a lead byte with no continuation: not UTF-8
    with pytest.raises(WireError, match="not UTF-8"):
        loads_header(b'{"id": 1, "task": "' + bad + b'"}')

    pipe = StandalonePipeline(identity_repo, {"a": "toy/identity.pt"}, {"t": ["a"]}, transport="zeromq",
                              workdir=os.path.join(short_tmp, "p"))
    ctx = zmq.Context()
    try:
        front = ctx.socket(zmq.DEALER)
        front.connect(pipe.address)
        front.send_multipart([b'{"id": 7, "op": "infer", "task": "' + bad + b'"}', b""])
        assert front.poll(30_000), "the dispatcher did not answer"
        reply = json.loads(front.recv_multipart()[0])
        assert reply["status"] == "error" and reply["code"] == "bad_request", reply
        assert "not UTF-8" in reply["error"], reply

        ret = f"ipc://{os.path.join(pipe.workdir, 'ret.sock')}"
        pull = ctx.socket(zmq.PULL)
        pull.bind(ret)
        push = ctx.socket(zmq.PUSH)
        push.connect(pipe.endpoints["a"])
        desc, payload = encode_bytes(torch.ones(4))
        header = json.dumps({"v": 1, "t": "data", "rid": 11, "task": "PLACEHOLDER", "path": [[RETURN_HOP, ret]],
                             "hops": [], "unknown": "PLACEHOLDER", "x": desc.to_json()}).encode()
        in_task = header.replace(b'"task": "PLACEHOLDER"', b'"task": "' + bad + b'"')
        in_unknown = header.replace(b'"task": "PLACEHOLDER"', b'"task": "t"').replace(b"PLACEHOLDER", bad)
        with pytest.raises(WireError, match="not UTF-8"):
            loads_data_header(in_task)
        assert _return_address(in_task) is None            # nothing readable names a requester
        assert _return_address(in_unknown) == (11, ret)     # a field DataHeader skips, unread
        push.send_multipart([in_task, bytes(payload)])
        push.send_multipart([in_unknown, bytes(payload)])
        # in order: an answer to the first message would be sent by admit(), before the second's
        # inference, so the first answer to arrive is the result only when the first got none
        assert pull.poll(30_000), "the block did not answer"
        answer = json.loads(pull.recv_multipart()[0])
        assert answer["rid"] == 11 and answer["t"] == "result", answer
    finally:
        ctx.destroy(linger=0)
        result = pipe.stop()
    assert result["left"] == {"slots": [], "sockets": []}, result
