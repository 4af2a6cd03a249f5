"""What an operator sees of a running deployment (issue 42 items 2 and 13): ``blockflow status``
rows whose rates and latencies belong to the process the row names, and processes that ``ps``,
``top`` and ``py-spy`` tell apart by role and block. Real server, real processes."""
from __future__ import annotations

import os
import signal

import psutil
import torch

from blockflow.client import Client

from test_control_plane import block_of, update_body, wait_for


def _row(srv, name: str) -> dict:
    return next(r for r in srv.call("GET", "/status")["processes"] if r["process"] == name)


def _send(srv, task: str, n: int) -> None:
    x = torch.ones(1, 4)
    with Client(srv.dispatcher, timeout=30) as c:
        for _ in range(n):
            assert torch.equal(c.infer(task, x), x)


def _ready_again(srv, name: str, old_pid: int) -> dict:
    return wait_for(lambda: (lambda b: b if b and b["status"] == "ready" and b["pid"] != old_pid else None)(
        block_of(srv.call("GET", "/system"), name)), 30, f"block {name} ready in a new process")


def test_status_counts_only_what_the_current_process_served(server_factory, identity_repo):
    """After a respawn (kill -9) or a replacement (moved into a shared process), the row's
    requests, rate and percentiles count the new process's requests only, over the seconds it
    has been sent requests: the old process's were divided by the new one's uptime (60 req/s at
    uptime 0 s)."""
    srv = server_factory(identity_repo)
    srv.call("POST", "/system/update", update_body({"a": "toy/identity.pt"}, {"t": ["a"]}), timeout=60)
    _send(srv, "t", 20)
    before = _row(srv, "a")  # this scrape also flushes the block's KPI log: its records are on disk
    assert before["requests"] == 20 and before["p50_ms"] is not None, before

    os.kill(before["pid"], signal.SIGKILL)
    _ready_again(srv, "a", before["pid"])
    row = _row(srv, "a")
    assert row["requests"] == 0 and row["requests_per_s"] == 0 and row["p50_ms"] is None, row
    _send(srv, "t", 3)
    row = _row(srv, "a")
    assert row["requests"] == 3 and row["errors"] == 0 and row["p50_ms"] is not None, row
    assert row["requests_per_s"] <= 3 / max(row["window_s"], 1.0) + 0.01, row
    assert row["window_s"] <= row["uptime_s"] + 0.5, row  # it covers this process's time, no more

    # replaced: moved into a shared process by an update
    res = srv.call("POST", "/system/update",
                   update_body({"a": {"model": "toy/identity.pt", "process": "g"}}, {"t": ["a"]}), timeout=60)
    assert res["diff"]["replaced"] == ["a"], res
    _send(srv, "t", 2)
    row = _row(srv, "a")
    assert row["group"] == "g" and row["requests"] == 2 and row["errors"] == 0, row
    # the dispatcher was not respawned: its row still counts every answered request of the minute
    wait_for(lambda: _row(srv, "@dispatcher")["requests"] == 25, 10, "the dispatcher's row counts 25 requests")


def _title(pid: int) -> str:
    """The command line as ps shows it (setproctitle pads what it writes over argv)."""
    return " ".join(psutil.Process(pid).cmdline()).strip()


def test_processes_are_named_after_their_role_and_block(server_factory, identity_repo):
    """``ps`` showed every child as ``python -c from multiprocessing.forkserver import main ...``:
    each names its role and block in its command line (ps -f, py-spy) and its short name (comm:
    ps -e, top)."""
    srv = server_factory(identity_repo)
    body = update_body({"a": "toy/identity.pt", "s": {"model": "toy/identity.pt", "replicas": 2},
                        "g1": {"model": "toy/identity.pt", "process": "grp"},
                        "g2": {"model": "toy/identity.pt", "process": "grp"}},
                       {"t": ["a", "s", "g1", "g2"]})
    srv.call("POST", "/system/update", body, timeout=60)
    system = srv.call("GET", "/system")
    pids = {b["name"]: b["pid"] for b in system["blocks"]}
    assert _title(pids["a"]) == "blockflow block a", _title(pids["a"])
    assert _title(pids["s.r1"]) == "blockflow block s.r1", _title(pids["s.r1"])
    assert psutil.Process(pids["a"]).name() == "bf:a"
    assert pids["g1"] == pids["g2"]
    assert _title(pids["g1"]) == "blockflow group grp: g1, g2", _title(pids["g1"])
    assert _title(system["dispatcher"]["pid"]) == "blockflow dispatcher"
    assert psutil.Process(system["dispatcher"]["pid"]).name() == "bf:@dispatcher"
    # a member that leaves the group leaves its title
    srv.call("POST", "/system/update", update_body({"a": "toy/identity.pt", "g1": {"model": "toy/identity.pt",
                                                                                  "process": "grp"}},
                                                   {"t": ["a", "g1"]}), timeout=60)
    wait_for(lambda: _title(pids["g1"]) == "blockflow group grp: g1", 10, "the group's title drops g2")
