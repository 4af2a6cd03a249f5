"""The client against a dispatcher that is not there (issue 12, item 4): every call ends by its
deadline, and a full send queue refuses at once instead of blocking."""
from __future__ import annotations

import socket
import time
from concurrent.futures import wait

import pytest
import torch

from blockflow.client import BlockFlowError, Client


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_call_ends_by_its_deadline_with_no_dispatcher():
    address = f"tcp://127.0.0.1:{_unused_port()}"  # nothing listens here
    x = torch.zeros(1, 16)
    with Client(address, timeout=1.0, max_queued=5000) as c:
        t0 = time.monotonic()
        futures = [c.submit("t", x, timeout=1.0) for _ in range(3000)]  # past ZeroMQ's 1000-message HWM
        done, not_done = wait(futures, timeout=1.0 + 3.0)
        elapsed = time.monotonic() - t0
        assert not not_done, f"{len(not_done)} calls outlived their deadline by 3 s"
        assert all(isinstance(f.exception(), TimeoutError) for f in done)
        assert elapsed < 1.0 + 3.0
        # the timed-out requests left the queue: the client takes new ones at once
        assert c._io.queued() == 0
        fut = c.submit("t", x, timeout=0.5)
        with pytest.raises(TimeoutError):
            fut.result(0.5 + 3.0)


def test_a_full_send_queue_refuses_at_once():
    address = f"tcp://127.0.0.1:{_unused_port()}"
    x = torch.zeros(1, 16)
    with Client(address, timeout=5.0, max_queued=50) as c:
        # ZeroMQ itself buffers up to its high-water mark before the socket refuses: fill both
        futures, refused = [], None
        t0 = time.monotonic()
        for _ in range(5000):
            try:
                futures.append(c.submit("t", x))
            except BlockFlowError as exc:
                refused = exc
                break
        assert refused is not None, "5000 requests were queued with a queue of 50"
        assert refused.code == "overloaded" and "already waiting to be sent" in str(refused)
        # the owner thread may still be moving queued requests into ZeroMQ (a loaded machine
        # refuses before ZeroMQ's high-water mark is reached): once it cannot, a submit is
        # refused, and at once, not after a deadline
        while True:
            t1 = time.monotonic()
            try:
                futures.append(c.submit("t", x))
            except BlockFlowError as exc:
                assert "already waiting to be sent" in str(exc)
                assert time.monotonic() - t1 < 0.5
                break
            assert t1 - t0 < 4.0, "the send queue kept draining with no peer to take it"
        assert time.monotonic() - t0 < 5.0
        done, not_done = wait(futures, timeout=5.0 + 3.0)
        assert not not_done


def test_a_waiting_call_ends_by_its_deadline_with_no_dispatcher():
    """``infer`` sends on its own thread when it can (Note [A caller that waits holds the
    socket]); with no peer the socket refuses, the owner thread queues it, and the call still
    ends by its deadline, the next one too."""
    address = f"tcp://127.0.0.1:{_unused_port()}"
    with Client(address, timeout=0.5) as c:
        for _ in range(2):
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):
                c.infer("t", torch.zeros(1, 4))
            assert time.monotonic() - t0 < 0.5 + 3.0
        assert c._io.queued() == 0


def test_a_call_holding_the_socket_ends_by_its_deadline_when_no_answer_comes():
    """A peer that takes requests and never answers: the call that holds the socket (Note [A
    caller that waits holds the socket]) is ended by the owner thread's tick at its deadline,
    and the next call holds it again."""
    import zmq
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        with Client(f"tcp://127.0.0.1:{port}", timeout=0.5, shared_memory=False) as c:
            deadline = time.monotonic() + 10
            while c._io.held < 2 and time.monotonic() < deadline:  # the first calls may find no peer yet
                t0 = time.monotonic()
                with pytest.raises(TimeoutError):
                    c.infer("t", torch.zeros(1, 4))
                assert time.monotonic() - t0 < 0.5 + 3.0
            assert c._io.held >= 2 and not c._waiting
            assert router.poll(1000)  # the requests did reach the peer
    finally:
        router.close(0)
        ctx.term()


@pytest.mark.parametrize("address, words", [
    ("localhost:5580", ["names no transport", "write tcp://localhost:5580"]),
    ("http://127.0.0.1:8080", ["is a REST URL", "tcp://127.0.0.1:5580", "dispatcher.endpoint"]),
    ("127.0.0.1", ["is not a ZeroMQ address", "tcp://127.0.0.1:5580"]),
])
def test_an_address_that_is_no_zeromq_endpoint_is_refused_saying_what_to_write(address, words):
    """ZeroMQ's own answer was a bare 'Invalid argument' or 'Protocol not supported'."""
    with pytest.raises(ValueError) as info:
        Client(address)
    for w in words:
        assert w in str(info.value), str(info.value)
