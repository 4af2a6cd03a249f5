"""The child-process skeleton that blocks and the dispatcher share (blockflow/core/childproc.py):
commands by name, the parent watchdog and its exit code, a boot error announced and exited
with. Real processes, started the ways the manager and `blockflow block` start them."""
from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import sys
from concurrent.futures import Future

import pytest
import zmq

from blockflow.dispatcher.process import DispatcherSpec, serve_dispatcher
from blockflow.manager.controller import ControlError, Controller
from blockflow.manager.launcher import stop_forkserver
from blockflow.core.protocol import DISPATCHER, Command, ExitCode, identity
from blockflow.standalone import StandalonePipeline
from blockflow.tensormq.transport import RESULT_KEYS


def test_an_unknown_command_is_answered_with_the_known_ones(identity_repo, short_tmp, leak_check):
    pipe = StandalonePipeline(identity_repo, {"a": "toy/identity.pt"}, {"t": ["a"]}, transport="zeromq",
                              workdir=os.path.join(short_tmp, "p"))
    try:
        for name, known in (("a", "block a knows monitor, ping, stop, store, update"),
                            (DISPATCHER, "dispatcher knows fail, outstanding, ping, stop, tasks, update")):
            # the controller sends only the commands of protocol.Cmd; a process answers another one
            # (a newer manager's) with the ones it knows: sent here as it would come on the wire
            with pytest.raises(ControlError) as err:
                fut = Future()
                with pipe.controller._lock:
                    pipe.controller._futures[-1] = fut
                pipe.controller._out.put((identity(name, 0), -1, Command(-1, "reboot")))
                os.write(pipe.controller._wake_w, b"x")
                fut.result(10)
            assert "unknown command 'reboot'" in str(err.value) and known in str(err.value), str(err.value)
            # a bad command does not hurt: the same process still answers, with its own fields
            pong = pipe.command(name, "ping")
            assert pong["pid"] == pipe.procs[name].pid
        assert {"busy_s", "beat_age_s", "queue"} <= set(pipe.command("a", "ping"))
        assert {"outstanding", "pending"} <= set(pipe.command(DISPATCHER, "ping"))
    finally:
        result = pipe.stop()
    assert result["codes"] == {"a": ExitCode.OK, DISPATCHER: ExitCode.OK}, result
    assert result["left"] == {"slots": [], "sockets": []}, result


@pytest.fixture
def controller(short_tmp):
    ctx = zmq.Context()
    ctl = Controller(ctx, f"ipc://{os.path.join(short_tmp, 'ctl.sock')}")
    ctl.start()
    yield ctl
    ctl.stop()
    ctx.term()


def test_a_child_whose_manager_dies_exits_orphaned(identity_repo, short_tmp, controller, leak_check):
    """The dispatcher spawned as the manager spawns it (forkserver, serve_dispatcher) and a block
    run by hand (`python -m blockflow.blocks.process`) both watch a parent; when it dies they
    shut down cleanly (socket files gone) and exit ExitCode.ORPHANED, and the code reaches a
    multiprocessing parent too (a target's return value would not)."""
    sock, run = os.path.join(short_tmp, "sock"), os.path.join(short_tmp, "run")
    os.makedirs(sock, mode=0o700)
    os.makedirs(run)
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    mp = multiprocessing.get_context("forkserver")
    dispatcher = block = None
    try:
        dspec = DispatcherSpec(sock_dir=sock, address="tcp://127.0.0.1:0", transport="zeromq",
                               controller=controller.endpoint, parent_pid=parent.pid)
        dispatcher = mp.Process(target=serve_dispatcher, args=(dspec,), daemon=True)
        dispatcher.start()
        bspec = dict(name="a", model="toy/identity.pt", repo=identity_repo, run_dir=run, sock_dir=sock,
                     transport="zeromq", controller=controller.endpoint, parent_pid=parent.pid, threads=1,
                     monitor=False)
        block = subprocess.Popen([sys.executable, "-m", "blockflow.blocks.process", "--spec", json.dumps(bspec)])
        controller.wait_ready(identity(DISPATCHER, 0), 120, alive=dispatcher.is_alive)
        controller.wait_ready(identity("a", 0), 120, alive=lambda: block.poll() is None)
        assert {"a-0.sock", "dispatcher-0.sock", RESULT_KEYS} <= set(os.listdir(sock)), os.listdir(sock)
        parent.kill()
        parent.wait(10)
        dispatcher.join(15)
        assert dispatcher.exitcode == ExitCode.ORPHANED
        assert block.wait(15) == ExitCode.ORPHANED
        assert os.listdir(sock) == [], "an orphaned child still shuts down in order and removes its files"
    finally:
        for p in (parent, block):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)
        if dispatcher is not None and dispatcher.is_alive():
            dispatcher.kill()
            dispatcher.join(10)
        stop_forkserver()


def test_a_dispatcher_that_cannot_bind_reports_a_boot_error(short_tmp, controller, leak_check):
    """Its port is taken: the controller hears why (naming the address) and the process exits
    ExitCode.BOOT_ERROR, so the manager marks it failed instead of respawning it forever."""
    sock = os.path.join(short_tmp, "sock")
    os.makedirs(sock, mode=0o700)
    mp = multiprocessing.get_context("forkserver")
    dispatcher = None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        try:
            spec = DispatcherSpec(sock_dir=sock, address=address, transport="zeromq", controller=controller.endpoint,
                                  parent_pid=os.getpid())
            dispatcher = mp.Process(target=serve_dispatcher, args=(spec,), daemon=True)
            dispatcher.start()
            with pytest.raises(ControlError, match=f"dispatcher cannot bind {address}"):
                controller.wait_ready(identity(DISPATCHER, 0), 120)
            dispatcher.join(15)
            assert dispatcher.exitcode == ExitCode.BOOT_ERROR
        finally:
            if dispatcher is not None and dispatcher.is_alive():
                dispatcher.kill()
                dispatcher.join(10)
            stop_forkserver()
