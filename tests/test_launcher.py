"""The launcher seam (manager/launcher.py, issue 30 item 1): the manager starts, watches and
stops every child through a Launcher and its handles. Here the local launcher with real children
forked from the forkserver; the whole suite runs the manager through it."""
from __future__ import annotations

import os
import signal
import socket
import time

from blockflow.manager.launcher import LocalLauncher


def _wait_exit(handle, timeout: float = 30.0) -> int | None:
    deadline = time.monotonic() + timeout
    while handle.exitcode is None and time.monotonic() < deadline:
        handle.join(0.1)
    return handle.exitcode


def test_a_local_child_reports_its_node_pid_and_exit_code_and_is_stopped_by_its_handle():
    launcher = LocalLauncher()
    children = []
    try:
        exits = launcher.start(os._exit, 3, "blockflow-test-exit")  # the child exits with code 3
        sleeper = launcher.start(time.sleep, 600, "blockflow-test-sleep")
        killed = launcher.start(time.sleep, 600, "blockflow-test-kill")
        children = [exits, sleeper, killed]
        for h in children:
            assert h.node == socket.gethostname() and isinstance(h.pid, int) and h.pid != os.getpid()
        assert _wait_exit(exits) == 3 and not exits.is_alive()
        assert sleeper.is_alive() and sleeper.exitcode is None
        sleeper.terminate()
        assert _wait_exit(sleeper) == -signal.SIGTERM
        killed.kill()
        assert _wait_exit(killed) == -signal.SIGKILL
        killed.kill()  # a child already gone: nothing happens, nothing raises
    finally:
        for h in children:
            if h.is_alive():
                h.kill()
                h.join(10)
        launcher.close()
