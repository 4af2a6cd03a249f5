"""``blockflow serve`` as an operator meets it (issue 42): what it prints, how it refuses, what a
restart keeps. One server on one state directory, restarted once, covers:

4. a second server on the same state directory is refused in one line, with an exit code of
   its own (not a CherryPy traceback and 70), even one started at the same moment;
9. every CherryPy ENGINE line is printed once (not by CherryPy's screen log and again through
   Python logging);
10. a server that stops leaves nothing in the temporary directory (multiprocessing's pymp-*,
    where its forkserver's socket was, stayed behind after every run);
12. the update version goes on from where it was after a restart, ``--fresh`` too: versions an
    optimiser reads only grow.
"""
from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import sys

import psutil

import pytest

from blockflow.demo import stop_server, wait_ready_file
from blockflow.manager.state import StateDir, StateDirInUse
from blockflow.restclient import call
from conftest import kill_tree, reap, wait_for

TOY = {"blocks": [{"name": "a", "model": "toy/identity.pt"}], "tasks": [{"id": "t", "path": ["a"]}]}


def serve_cmd(repo: str, state_dir: str, *extra: str) -> list[str]:
    """``blockflow serve`` as an operator types it: no --quiet, so the log is what they see."""
    return [sys.executable, "-m", "blockflow.cli", "serve", "--port", "0", "--dispatcher-port", "0",
            "--repo", repo, "--state-dir", state_dir, *extra]


def start(repo: str, state_dir: str, log_path: str, *extra: str, tmpdir: str | None = None):
    """A server whose stdout and stderr both go to ``log_path``; returns it and its ready info."""
    ready = os.path.join(state_dir, "ready.json")
    env = dict(os.environ, BLOCKFLOW_LOG="INFO", **({"TMPDIR": tmpdir} if tmpdir else {}))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(serve_cmd(repo, state_dir, "--ready-file", ready, *extra), start_new_session=True,
                                stdout=log, stderr=log, env=env)
    try:
        return proc, wait_ready_file(proc, ready, 120)
    except (RuntimeError, TimeoutError) as exc:
        kill_tree(proc.pid)
        raise AssertionError(f"{exc}: {open(log_path).read()[-2000:]}") from None


def test_one_state_directory_one_server_whose_log_lines_and_versions_an_operator_can_trust(
        identity_repo, short_tmp, leak_check):
    state_dir = os.path.join(short_tmp, "st")
    os.makedirs(state_dir)
    log_path = os.path.join(short_tmp, "serve.log")
    tmpdir = os.path.join(short_tmp, "tmp")  # the servers' own temporary directory (10.)
    os.makedirs(tmpdir)
    procs = []
    try:
        proc, info = start(identity_repo, state_dir, log_path, tmpdir=tmpdir)
        procs.append(proc)
        url = info["rest"]
        call("POST", url + "/system/update", TOY, timeout=60)
        call("POST", url + "/system/update", {**TOY, "tasks": TOY["tasks"] + [{"id": "u", "path": ["a"]}]},
             timeout=60)
        version = call("GET", url + "/system")["version"]
        assert version == 2

        # 4. a second server on the same state directory: one line naming the other server
        second = subprocess.run(serve_cmd(identity_repo, state_dir), capture_output=True, text=True, timeout=120,
                                env=dict(os.environ, BLOCKFLOW_LOG="WARNING"))
        lines = second.stderr.strip().splitlines()
        assert second.returncode not in (0, 70), (second.returncode, second.stderr[-2000:])
        assert len(lines) == 1 and "Traceback" not in second.stderr, second.stderr[-2000:]
        assert lines[0].startswith(f"blockflow serve: another BlockFlow server (pid {proc.pid}) is using the state "
                                   f"directory {state_dir}; stop it, or choose another --state-dir"), lines
        assert call("GET", url + "/system")["version"] == version  # the first one serves on, untouched

        # 12. a restart goes on from the last version: --fresh starts without blocks, not from 0
        assert stop_server(proc) == 0
        proc, info = start(identity_repo, state_dir, log_path, "--fresh", tmpdir=tmpdir)
        procs.append(proc)
        system = call("GET", info["rest"] + "/system")
        assert system["blocks"] == [] and system["version"] == version, system["version"]
        assert call("POST", info["rest"] + "/system/update", TOY, timeout=60)["version"] == version + 1

        # 9. each ENGINE line once (the log of this second server, from its start to here)
        wait_for(lambda: "ENGINE Bus STARTED" in open(log_path).read(), 10, "the engine's start is logged")
        engine = [re.sub(r"^.*?ENGINE ", "", line) for line in open(log_path).read().splitlines()
                  if "ENGINE " in line]
        twice = {line: n for line, n in collections.Counter(engine).items() if n > 1}
        assert engine and not twice, f"ENGINE lines printed more than once: {twice}"
        assert all(not re.search(r"\[\d+/\w+/\d+:[\d:]+\] ENGINE", line) for line in open(log_path)), \
            "CherryPy's own time stamp beside the log's"
        assert stop_server(proc) == 0

        # 10. two servers started and stopped: nothing of theirs is left in the temporary directory
        assert os.listdir(tmpdir) == [], f"left in the servers' temporary directory: {os.listdir(tmpdir)}"
    finally:
        reap(procs, [])


def test_a_state_directory_is_claimed_by_one_server_at_a_time(short_tmp):
    """The lock, not state.json (written only once the dispatcher is up), decides: two servers
    started at the same moment cannot both pass, and a dead holder keeps nobody out."""
    root = os.path.join(short_tmp, "st")
    first, second = StateDir(root), StateDir(root)
    first.claim()
    try:
        with pytest.raises(StateDirInUse, match=rf"another BlockFlow server \(pid {os.getpid()}\) is using the "
                                                rf"state directory {re.escape(first.root)}; stop it"):
            second.claim()
    finally:
        first.release()
    second.claim()  # the holder let go (as a dead one does): the next one may use it
    second.release()


@pytest.mark.parametrize("when", ["starting", "serving"])
def test_a_demo_ended_by_sigterm_stops_its_server_and_removes_its_state_directory(
        identity_repo, short_tmp, leak_check, when):
    """``blockflow demo`` stopped by SIGTERM (``kill``, ``timeout``, a cancelled CI job) cleans up
    as Ctrl-C does: its server and blocks are stopped and its /tmp/blockflow-demo-* state
    directory is gone. Python's default SIGTERM ended it at once, leaving the directory behind.
    ``starting``: while the server starts; ``serving``: while requests go through a deployed block."""
    from blockflow.cli import Exit
    tmpdir = os.path.join(short_tmp, "tmp")  # the demo's own temporary directory: its state directory goes there
    os.makedirs(tmpdir)
    config = os.path.join(short_tmp, "toy.json")
    with open(config, "w") as f:
        json.dump(TOY, f)
    log_path = os.path.join(short_tmp, "demo.log")
    env = dict(os.environ, TMPDIR=tmpdir)
    with open(log_path, "wb") as log:
        demo = subprocess.Popen([sys.executable, "-m", "blockflow.cli", "demo", "--repo", identity_repo,
                                 "--config", config, "--requests", "1000000"], stdout=log, stderr=log, env=env)
    me, children = psutil.Process(demo.pid), []
    try:
        state = wait_for(lambda: [os.path.join(tmpdir, d) for d in os.listdir(tmpdir) if d.startswith("blockflow-demo-")],
                         60, "the demo's state directory")[0]
        if when == "serving":
            info = wait_for(lambda: _read_json(os.path.join(state, "ready.json")), 120, "the demo's server ready")
            wait_for(lambda: any(b.get("status") == "ready" for b in call("GET", info["rest"] + "/system")["blocks"]),
                     120, "the demo's block ready")
        children = me.children(recursive=True)
        demo.send_signal(signal.SIGTERM)
        code = demo.wait(90)
        out = open(log_path).read()
        assert code == Exit.INTERRUPTED, f"exit {code}:\n{out[-2000:]}"
        assert "interrupted" in out, out[-2000:]
        assert os.listdir(tmpdir) == [], (os.listdir(tmpdir), out[-2000:])  # its state directory, no pymp-* either
        wait_for(lambda: not [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], 30,
                 "the demo's server and blocks gone")
    finally:
        reap([demo], [p.pid for p in children])  # without the fix the server outlived the demo


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
