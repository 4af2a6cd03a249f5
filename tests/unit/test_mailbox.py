"""The mailbox through which a child's control thread hands commands to its main thread
(Note [Commands for the main loop] in blockflow/core/childproc.py): real inproc sockets, a real
second thread, each side waiting on its own end as the dispatcher and a block do."""
import threading
import time

import pytest
import zmq

from blockflow.core.childproc import Mailbox


@pytest.fixture
def mailbox():
    ctx = zmq.Context()
    box = Mailbox(ctx, "the dispatcher", "main loop")
    yield box
    box.loop_end.close(linger=0)
    box.control_end.close(linger=0)
    ctx.term()


def answers_until(box: Mailbox, n: int, timeout: float = 10.0) -> list:
    """Collect answers on the control side, waiting on its end, until ``n`` came."""
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        if box.control_end.poll(100):
            box.collect(lambda rid, result=None, error=None: got.append((rid, result, error)))
    return got


def serve_in_thread(box: Mailbox, stop: threading.Event, ran: list) -> threading.Thread:
    """A main loop that polls its end of the mailbox, as the dispatcher's does."""
    def loop():
        while not stop.is_set():
            if box.loop_end.poll(50):
                box.serve()
        ran.append(threading.get_ident())
    t = threading.Thread(target=loop)
    t.start()
    return t


def test_commands_run_on_the_main_thread_in_their_order_and_each_is_answered_once(mailbox):
    stop, ran, seen = threading.Event(), [], []
    main = serve_in_thread(mailbox, stop, ran)
    try:
        laters = []
        for i in range(50):
            later = mailbox.post("task table", lambda a: seen.append((a, threading.get_ident())) or {"n": a}, i, 10)
            later.rid = 1000 + i
            laters.append(later)
        got = answers_until(mailbox, 50)
    finally:
        stop.set()
        main.join(5)
    assert [a for a, _ in seen] == list(range(50))  # in the order posted
    assert {tid for _, tid in seen} == set(ran) and threading.get_ident() not in set(ran)
    assert got == [(1000 + i, {"n": i}, None) for i in range(50)]
    assert mailbox.due == {}


def test_a_command_that_raises_is_answered_with_its_error_and_the_next_one_still_runs(mailbox):
    stop, ran = threading.Event(), []
    main = serve_in_thread(mailbox, stop, ran)
    try:
        def bad(args):
            raise ValueError("no such block 'x'")
        mailbox.post("failure", bad, None, 10).rid = 1
        mailbox.post("topology", lambda a: {"dropped": a}, 3, 10).rid = 2
        got = answers_until(mailbox, 2)
    finally:
        stop.set()
        main.join(5)
    assert got == [(1, None, "the dispatcher could not apply the failure: ValueError: no such block 'x'"),
                   (2, {"dropped": 3}, None)]


def test_a_command_the_main_thread_does_not_reach_in_time_is_answered_once_with_a_timeout(mailbox):
    errors = []
    answer = lambda rid, result=None, error=None: errors.append((rid, result, error))  # noqa: E731
    mailbox.post("topology", lambda a: {"late": True}, None, 0.05).rid = 7
    assert mailbox.waiting
    deadline = time.monotonic() + 10
    while mailbox.due and time.monotonic() < deadline:
        time.sleep(0.01)
        mailbox.expire(answer)
    assert len(errors) == 1 and errors[0][0] == 7 and errors[0][2].startswith("TimeoutError: the main loop of "
                                                                               "the dispatcher did not apply the topology")
    mailbox.serve()  # the main thread gets round to it after all: its answer is not sent a second time
    assert mailbox.control_end.poll(1000)
    mailbox.collect(answer)
    assert len(errors) == 1
