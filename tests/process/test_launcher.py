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


def test_a_block_on_a_node_needs_a_server_with_ray():
    """Without --ray an update may not place a block on a node, and the local launcher refuses
    one, each naming what to do; the answers of an update in Ray mode are in test_cluster.py."""
    import pytest
    from blockflow.core.schema import UpdateError, validate_update
    body = {"blocks": [{"name": "a", "model": "m.pt", "node": "edge-a"}], "tasks": [{"id": "t", "path": ["a"]}]}
    with pytest.raises(UpdateError, match=r"--ray ADDRESS") as info:
        validate_update(body)
    assert info.value.field == "blocks[0].node"
    with pytest.raises(UpdateError, match=r"advertises the resource 'edge-a'.*ray start --resources"):
        validate_update(body, nodes={"edge-b"})
    assert validate_update(body, nodes={"edge-a"}).blocks["a"].node == "edge-a"
    with pytest.raises(ValueError, match="start it with --ray"):
        LocalLauncher().start(time.sleep, 1, "blockflow-test-node", node="edge-a")


def test_a_block_on_another_node_stops_when_the_manager_goes_silent(identity_repo, short_tmp):
    """A block whose controller is over CURVE TCP (another node, Ray mode) cannot watch the
    manager's pid; once the manager stops pinging it (it gave the node up: a partition) it stops
    by itself after BLOCKFLOW_CONTROL_LEASE, with the orphan's exit code. Real block process,
    real CURVE controller, the cluster's keys in its spec (on its standard input)."""
    import json
    import subprocess
    import sys
    import zmq
    from blockflow.manager.controller import Controller
    from blockflow.core.protocol import EXIT_ORPHANED, identity
    from blockflow.core.curve import ClusterKeys
    keys = ClusterKeys.generate()
    ctx = zmq.Context()
    controller = Controller(ctx, f"ipc://{short_tmp}/ctl.sock")
    endpoint = controller.listen_between_nodes("127.0.0.1", keys)
    controller.start()
    spec = {"name": "far", "model": "toy/identity.pt", "repo": identity_repo, "run_dir": short_tmp,
            "sock_dir": short_tmp, "shm_dir": short_tmp, "controller": endpoint, "curve": keys.to_json(),
            "bind_host": "127.0.0.1", "threads": 1}
    proc = subprocess.Popen([sys.executable, "-m", "blockflow.blocks.process", "--spec", "-"], stdin=subprocess.PIPE,
                            env=dict(os.environ, BLOCKFLOW_CONTROL_LEASE="1"))
    try:
        proc.stdin.write(json.dumps(spec).encode())
        proc.stdin.close()
        info = controller.wait_ready(identity("far", 0), 120)  # over CURVE TCP
        assert info["endpoint"].startswith("tcp://127.0.0.1:") and info["near"].startswith("ipc://")
        assert controller.request(identity("far", 0), "ping", timeout=10)["pid"] == proc.pid
        assert proc.wait(30) == EXIT_ORPHANED  # no ping since: the lease ran out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        controller.stop()
        ctx.term()


def test_a_block_whose_parent_has_exited_but_is_not_reaped_stops(identity_repo, short_tmp):
    """The parent a block watches (on a Ray node: its agent) exits and stays a zombie, as under an
    init that does not reap orphans: the block still sees it gone and stops, with the orphan's
    exit code. A zombie answers ``kill(pid, 0)``, so a block that asked only that ran on forever,
    which a healed partition's old blocks once did (tests/cluster/test_cluster.py)."""
    import json
    import subprocess
    import sys
    from blockflow.core.protocol import EXIT_ORPHANED
    from conftest import gone, wait_for
    parent = subprocess.Popen(["true"])  # never waited for until the end: a zombie once it exits
    wait_for(lambda: gone(parent.pid), 30, "`true` exiting")
    spec = {"name": "kid", "model": "toy/identity.pt", "repo": identity_repo, "run_dir": short_tmp,
            "sock_dir": short_tmp, "shm_dir": short_tmp, "parent_pid": parent.pid, "threads": 1}
    proc = subprocess.Popen([sys.executable, "-m", "blockflow.blocks.process", "--spec", "-"], stdin=subprocess.PIPE)
    try:
        proc.stdin.write(json.dumps(spec).encode())
        proc.stdin.close()
        assert proc.wait(120) == EXIT_ORPHANED
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        parent.wait()


def test_serve_with_ray_but_without_the_cluster_extra_says_what_to_install(tmp_path):
    """`blockflow serve --ray` where Ray cannot be imported: exit 2 before anything starts, with
    the pip line. Ray is hidden by a package of that name that fails to import (the cluster
    extra is installed by `make install`)."""
    import subprocess
    import sys
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text("raise ImportError('No module named ray (hidden by the test)')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "blockflow.cli", "serve", "--ray", "auto", "--port", "0",
                           "--dispatcher-port", "0", "--state-dir", str(tmp_path / "state")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--ray needs Ray" in proc.stderr and "pip install -e '.[cluster]'" in proc.stderr, proc.stderr
    assert not (tmp_path / "state").exists()  # nothing was started


def test_visible_gpus_reads_cuda_visible_devices_as_cuda_does():
    """The control plane counts GPUs without torch (manager.visible_gpus): NVML's count, narrowed
    by CUDA_VISIBLE_DEVICES up to its first entry CUDA would stop at."""
    from blockflow.manager.manager import visible_gpus
    assert visible_gpus("", physical=2) == 0                  # set but empty: none
    assert visible_gpus("1,0", physical=2) == 2
    assert visible_gpus("0,0", physical=2) == 1               # a repeat ends the list
    assert visible_gpus("0,-1,1", physical=2) == 1            # so does a negative index
    assert visible_gpus("2", physical=2) == 0                 # out of range
    assert visible_gpus("GPU-8f2c, MIG-1a", physical=4) == 2  # UUIDs count as given
    assert visible_gpus("0", physical=0) == 0                 # no device at all
