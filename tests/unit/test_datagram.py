"""Headers by Unix datagram beside ZeroMQ (tensormq/datagram.py): what goes by datagram, and
that everything the datagram refuses goes the ZeroMQ way, once, nothing lost."""
from __future__ import annotations

import os
import socket
import time

import pytest
import zmq

from blockflow.tensormq import datagram
from blockflow.tensormq.datagram import MAX_ADDRESSES, MAX_DATAGRAM, Receiver, Sender, path_of
from blockflow.tensormq.transport import Transport, recv_message


@pytest.fixture
def sock_dir(tmp_path_factory):
    # a short path: a Unix socket's path has at most 107 bytes
    d = tmp_path_factory.mktemp("dg")
    yield str(d)


def drain_all(receiver: Receiver, want: int, timeout: float = 10.0) -> list[bytes]:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        got += receiver.drain(1000)
        if len(got) < want:
            time.sleep(0.001)
    return got


def test_the_datagram_path_is_beside_an_ipc_address_only(sock_dir, monkeypatch):
    assert path_of(f"ipc://{sock_dir}/b1-0.sock") == f"{sock_dir}/b1-0.sock.dg"
    assert path_of("tcp://127.0.0.1:5555") is None
    assert path_of("ipc:///" + "x" * 120) is None  # longer than a Unix socket's path may be
    monkeypatch.setattr(datagram.settings, "DATAGRAMS", False)
    assert path_of(f"ipc://{sock_dir}/b1-0.sock") is None


def test_a_header_goes_by_datagram_and_arrives_once(sock_dir):
    address = f"ipc://{sock_dir}/b.sock"
    receiver, sender = Receiver.beside(address, "test"), Sender()
    try:
        assert receiver.drain(10) == []  # nothing waits: no blocking
        for i in range(5):
            assert sender.send(address, b'{"i": %d}' % i)
        assert drain_all(receiver, 5) == [b'{"i": %d}' % i for i in range(5)]
        assert sender.stats() == {"sent": 5, "refused": 0}
        assert receiver.stats() == {"received": 5, "dropped": 0}
    finally:
        receiver.close()
        sender.close()
    assert not os.path.exists(receiver.path)


def test_no_receiver_means_zeromq_until_it_is_tried_again(sock_dir, monkeypatch):
    address = f"ipc://{sock_dir}/late.sock"
    sender = Sender()
    assert not sender.send(address, b"{}")  # nobody bound: refused, not raised
    assert sender.refused == 1
    assert not sender.send(address, b"{}")  # not even tried within RETRY_S
    assert sender.refused == 1
    receiver = Receiver.beside(address, "test")
    try:
        monkeypatch.setattr(datagram, "RETRY_S", 0.0)
        sender._missing[receiver.path] = time.monotonic()  # the retry time has come
        assert sender.send(address, b"{}")
        assert drain_all(receiver, 1) == [b"{}"]
    finally:
        receiver.close()
        sender.close()


def test_a_full_queue_refuses_at_once_and_what_it_took_is_read(sock_dir):
    address = f"ipc://{sock_dir}/full.sock"
    receiver, sender = Receiver.beside(address, "test"), Sender()
    try:
        sent, t0 = 0, time.monotonic()
        for i in range(10_000):  # the kernel's queue is bounded (net.unix.max_dgram_qlen)
            if not sender.send(address, b"%d" % i):
                break
            sent += 1
        assert 0 < sent < 10_000 and sender.refused == 1
        assert time.monotonic() - t0 < 5  # never blocked
        assert drain_all(receiver, sent) == [b"%d" % i for i in range(sent)]
        assert sender.send(address, b"again")  # room again
    finally:
        receiver.close()
        sender.close()


def test_a_datagram_larger_than_a_header_is_dropped_and_the_next_one_read(sock_dir):
    address = f"ipc://{sock_dir}/big.sock"
    receiver, sender = Receiver.beside(address, "test"), Sender()
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        assert not sender.send(address, b"x" * (MAX_DATAGRAM + 1))  # the sender never tries
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * MAX_DATAGRAM)
        raw.sendto(b"y" * (MAX_DATAGRAM + 10), receiver.path)  # a forger does
        raw.sendto(b"{}", receiver.path)
        assert drain_all(receiver, 1) == [b"{}"]
        assert receiver.stats() == {"received": 1, "dropped": 1}
    finally:
        raw.close()
        receiver.close()
        sender.close()


def test_forged_addresses_cost_a_bounded_memory(sock_dir):
    sender = Sender()
    try:
        for i in range(3 * MAX_ADDRESSES):
            sender.send(f"ipc://{sock_dir}/forged-{i}.sock", b"{}")
        assert len(sender._paths) <= MAX_ADDRESSES and len(sender._missing) <= MAX_ADDRESSES
    finally:
        sender.close()


def test_after_unlink_what_came_is_still_read_and_senders_go_elsewhere(sock_dir):
    address = f"ipc://{sock_dir}/closing.sock"
    receiver, sender = Receiver.beside(address, "test"), Sender()
    try:
        assert sender.send(address, b"before")
        receiver.unlink()
        assert not sender.send(address, b"after")
        assert drain_all(receiver, 1) == [b"before"]
    finally:
        receiver.close()
        sender.close()


def test_a_transport_sends_headers_by_datagram_and_the_rest_by_zeromq_nothing_lost(sock_dir, tmp_path):
    """One-frame messages go by datagram while the receiver's queue has room, then by ZeroMQ;
    messages with payload frames always by ZeroMQ. Every message arrives once."""
    address = f"ipc://{sock_dir}/recv.sock"
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(address)
    receiver = Receiver.beside(address, "test")
    t = Transport(ctx, "test", "zeromq")
    try:
        n = 200
        for i in range(n):
            t.send(address, {"i": i})
        t.send(address, {"i": n}, payload=b"z" * 100)
        by_datagram = drain_all(receiver, t.datagrams.sent)
        by_zeromq = []
        deadline = time.monotonic() + 10
        while len(by_datagram) + len(by_zeromq) < n + 1 and time.monotonic() < deadline:
            if pull.poll(100):
                by_zeromq.append(recv_message(pull))
        assert 0 < t.datagrams.sent < n  # the queue overflowed into ZeroMQ
        assert t.datagrams.refused >= 1
        assert all(len(m) == 1 for m in by_zeromq[:-1]) and len(by_zeromq[-1]) == 2  # the payload's message
        seen = sorted([int(m.split(b":")[1].strip(b"}")) for m in by_datagram]
                      + [int(bytes(m[0]).split(b":")[1].strip(b"}")) for m in by_zeromq])
        assert seen == list(range(n + 1))
    finally:
        t.close()
        receiver.close()
        pull.close(linger=0)
        ctx.term()
