"""Nobody gets in, nothing leaks: pickles refused on every socket, loopback by default, private
directories, the token from the environment, limits and ``overloaded``, and clean-up after a
``kill -9`` of the whole server.

(The token's 401 / ``unauthorized`` with ``--token`` is covered in test_control_plane.py; here
it comes from ``BLOCKFLOW_TOKEN``.)
"""
from __future__ import annotations

import json
import os
import pickle
import signal
import stat
import subprocess
import sys

import psutil
import pytest
import torch
import zmq

from blockflow.client import BlockFlowError, Client
from blockflow.core.protocol import DISPATCHER, RETURN_HOP
from blockflow.standalone import StandalonePipeline
from experiments.fuzz import pickle_bomb
from blockflow.manager.state import StateDir
from blockflow.tensormq.shm import SlotMapper
from blockflow.tensormq.wire import TensorDesc

from blockflow.demo import wait_ready_file
from conftest import gone, reap, wait_for

TOY = {"a": "toy/identity.pt", "d": "toy/double.pt"}
SIMPLE = {"blocks": [{"name": "a", "model": "toy/identity.pt", "protocol": "tcp"},
                     {"name": "d", "model": "toy/double.pt"}],
          "tasks": [{"id": "t", "path": ["a", "d"]}]}


def mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


class Sockets:
    """Raw ZeroMQ sockets with linger 0 and receive deadlines, closed together."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.socks = []

    def open(self, kind, address: str, bind: bool = False, timeout_ms: int = 10000):
        s = self.ctx.socket(kind)
        s.linger = 0
        s.rcvtimeo = timeout_ms
        (s.bind if bind else s.connect)(address)
        self.socks.append(s)
        return s

    def close(self):
        for s in self.socks:
            s.close(linger=0)
        self.ctx.term()


# -- 1. no pickle, ever ------------------------------------------------------------------------

def test_pickle_payload_is_refused_everywhere(identity_repo, short_tmp, leak_check):
    marker = os.path.join(short_tmp, "PWNED")
    # the payload is live: unpickling it here creates the file
    control = os.path.join(short_tmp, "control")
    pickle.loads(pickle_bomb(control))
    assert os.path.exists(control)
    bomb = pickle_bomb(marker)

    pipe = StandalonePipeline(identity_repo, TOY, {"t": ["a", "d"]}, workdir=os.path.join(short_tmp, "p"))
    socks = Sockets()
    try:
        # the dispatcher's client socket: an error reply that says why
        front = socks.open(zmq.DEALER, pipe.address)
        front.send_multipart([bomb])
        reply = json.loads(front.recv_multipart()[0])
        assert reply["status"] == "error" and reply["code"] == "bad_request", reply
        assert "not JSON" in reply["error"] and "pickle" in reply["error"]
        # a pickle as the tensor bytes is only ever bytes: it travels as uint8 data and is doubled
        header = {"v": 1, "op": "infer", "id": 2, "task": "t",
                  "x": {"dtype": "uint8", "shape": [len(bomb)], "stride": [1], "loc": "bytes"}}
        front.send_multipart([json.dumps(header).encode(), bomb])
        frames = front.recv_multipart()
        reply = json.loads(frames[0])
        assert reply["status"] == "ok", reply
        expected = (torch.frombuffer(bytearray(bomb), dtype=torch.uint8) * 2).numpy().tobytes()
        assert frames[1] == expected

        # a block's data socket: dropped when it names no requester, an error reply when it does
        ret = f"ipc://{os.path.join(short_tmp, 'ret.sock')}"
        back = socks.open(zmq.PULL, ret, bind=True, timeout_ms=3000)
        push = socks.open(zmq.PUSH, pipe.endpoints["d"])
        push.send_multipart([bomb])
        header = {"v": 1, "t": "data", "rid": 5, "task": "t", "path": [[RETURN_HOP, ret]], "hops": [],
                  "x": {"dtype": "uint8", "shape": [len(bomb)], "stride": [1], "loc": "pickle"}}
        push.send_multipart([json.dumps(header).encode(), bomb])
        answer = json.loads(back.recv_multipart()[0])
        assert answer["t"] == "error" and answer["rid"] == 5, answer  # the first frame got no answer
        assert "x.loc" in answer["err"], answer
        with pytest.raises(zmq.Again):
            back.recv_multipart()

        # the dispatcher's result socket: dropped
        results = socks.open(zmq.PUSH, f"ipc://{os.path.join(pipe.sock, 'dispatcher-0.sock')}")
        results.send_multipart([bomb])

        # everyone still serves, and nothing was executed
        with Client(pipe.address, timeout=20) as c:
            assert torch.equal(c.infer("t", torch.ones(3)), torch.full((3,), 2.0))
        for name in ("a", "d", DISPATCHER):
            assert pipe.command(name, "ping")["pid"] == pipe.procs[name].pid
        assert not os.path.exists(marker), "a pickle received on a socket was executed"
    finally:
        socks.close()
        result = pipe.stop()
    assert all(code == 0 for code in result["codes"].values()), result
    assert result["left"] == {"slots": [], "sockets": []}, result
    assert not os.path.exists(marker)


# -- 2. loopback by default, private directories, the token from the environment ---------------

def test_serve_defaults_to_loopback():
    from blockflow.cli import build_parser
    args = build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1" and args.dispatcher_host == "127.0.0.1"


def listening(pids) -> list[tuple[str, int]]:
    found = []
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        found += [(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return found


def test_loopback_private_dirs_and_env_token(server_factory, identity_repo, monkeypatch):
    from blockflow.core import settings
    monkeypatch.setenv("BLOCKFLOW_TOKEN", "env-t0ken")
    monkeypatch.setattr(settings, "TOKEN", "env-t0ken")  # settings were read at import, before the setenv
    srv = server_factory(identity_repo, env={"BLOCKFLOW_TOKEN": "env-t0ken"})
    from blockflow.restclient import RestError
    with pytest.raises(RestError) as info:
        srv.call("POST", "/system/update", SIMPLE, timeout=60)
    assert info.value.status == 401
    srv.call("POST", "/system/update", SIMPLE, token="env-t0ken", timeout=60)
    with Client(srv.dispatcher, timeout=20) as c:  # token from BLOCKFLOW_TOKEN
        assert torch.equal(c.infer("t", torch.ones(4)), torch.full((4,), 2.0))
    with Client(srv.dispatcher, timeout=20, token="wrong") as c:
        with pytest.raises(BlockFlowError) as e:
            c.infer("t", torch.ones(4))
        assert e.value.code == "unauthorized"

    # every listening TCP socket of the server and its children is on loopback
    pids = [srv.proc.pid] + [p.pid for p in psutil.Process(srv.proc.pid).children(recursive=True)]
    socks = listening(pids)
    rest_port = int(srv.url.rsplit(":", 1)[1])
    disp_port = int(srv.dispatcher.rsplit(":", 1)[1])
    ports = {port for _, port in socks}
    assert rest_port in ports and disp_port in ports
    assert len(socks) >= 4, socks  # REST, dispatcher front + results, block a (tcp)
    assert all(ip in ("127.0.0.1", "::1") for ip, _ in socks), socks
    assert srv.call("GET", "/blocks/a", token="env-t0ken")["endpoint"].startswith("tcp://127.0.0.1:")

    # sockets and slots live in directories only the owner can enter
    state = StateDir(srv.state_dir)
    system = srv.call("GET", "/system", token="env-t0ken")
    for path in (state.root, state.sock, state.runs, state.shm, system["run_dir"]):
        assert mode(path) == 0o700, (path, oct(mode(path)))
    sock_files = os.listdir(state.sock)
    assert "controller.sock" in sock_files and any(f.startswith("d-") for f in sock_files), sock_files
    slots = os.listdir(state.shm)
    assert slots, "the requests above went through shared-memory slots"
    assert all(mode(os.path.join(state.shm, f)) == 0o600 for f in slots)

    # and everything is removed at shutdown
    assert srv.stop() == 0
    assert os.listdir(state.sock) == []
    assert not os.path.exists(state.shm)


# -- 3. after kill -9 of the whole server, the next serve removes what it left -------------------

def start_detached(repo: str, state_dir: str, timeout: float = 120.0, extra: list[str] | None = None):
    """``blockflow serve`` in a session of its own, so its process group can be killed whole."""
    ready = os.path.join(state_dir, "ready.json")
    if os.path.exists(ready):
        os.unlink(ready)
    cmd = [sys.executable, "-m", "blockflow.cli", "serve", "--port", "0", "--dispatcher-port", "0",
           "--repo", repo, "--state-dir", state_dir, "--ready-file", ready, "--quiet", *(extra or [])]
    proc = subprocess.Popen(cmd, start_new_session=True, env=dict(os.environ, BLOCKFLOW_LOG="WARNING"))
    try:
        return proc, wait_ready_file(proc, ready, timeout)
    except TimeoutError:
        proc.kill()
        raise


def tree(pid: int) -> list[int]:
    try:
        return [pid] + [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def test_slot_directories_of_dead_runs_are_swept(short_tmp):
    """A run killed together with its temporary state directory cannot be found through
    state.json: the next server removes its slot directory by looking at who is still alive,
    and leaves alone every directory a live process may still use."""
    import shutil
    from blockflow.manager.state import OWNER_SUFFIX, process_record
    me = StateDir(os.path.join(short_tmp, "me"))
    parent = me.shm_parent
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    dead, alive, uid = ended.pid, os.getpid(), os.getuid()
    # a producer that has exited but is not reaped yet (its parent, here this test, has not
    # waited for it) maps nothing any more: its slots are as dead as those of a reaped one
    unreaped = subprocess.Popen([sys.executable, "-c", "pass"])
    wait_for(lambda: gone(unreaped.pid), 60, "the unreaped child to exit")  # never waited for: a zombie
    zombie = unreaped.pid
    tag = os.urandom(4).hex()

    def slot_dir(name, slot_pid=None, owner=None):
        path = os.path.join(parent, name)
        os.makedirs(path, mode=0o700)
        if slot_pid is not None:
            open(os.path.join(path, f"b1-0.{slot_pid}.1"), "wb").close()
        if owner is not None:
            with open(path + OWNER_SUFFIX, "w") as f:
                json.dump({"root": "/gone", "server": process_record(owner)}, f)
        return path

    made = {
        "orphan": slot_dir(f"blockflow-{uid}-{tag}aaaa", dead, owner=dead),
        "standalone_orphan": slot_dir(f"blockflow-sa-{dead}-{tag}"),
        "zombie_producer": slot_dir(f"blockflow-{uid}-{tag}eeee", zombie, owner=dead),
        "standalone_of_a_zombie": slot_dir(f"blockflow-sa-{zombie}-{tag}"),
        "zombie_server": slot_dir(f"blockflow-{uid}-{tag}ffff", dead, owner=zombie),
        "server_alive": slot_dir(f"blockflow-{uid}-{tag}bbbb", dead, owner=alive),
        "producer_alive": slot_dir(f"blockflow-{uid}-{tag}cccc", alive, owner=dead),
        "standalone_alive": slot_dir(f"blockflow-sa-{alive}-{tag}"),
        "unowned_but_young": slot_dir(f"blockflow-{uid}-{tag}dddd", dead),
    }
    try:
        removed = set(me.sweep_orphans())
        assert {made["orphan"], made["standalone_orphan"], made["zombie_producer"],
                made["standalone_of_a_zombie"], made["zombie_server"]} <= removed, removed
        assert not os.path.exists(made["orphan"]) and not os.path.exists(made["orphan"] + OWNER_SUFFIX)
        for key in ("server_alive", "producer_alive", "standalone_alive", "unowned_but_young"):
            assert made[key] not in removed and os.path.isdir(made[key]), key
    finally:
        for path in made.values():
            shutil.rmtree(path, ignore_errors=True)
            if os.path.exists(path + OWNER_SUFFIX):
                os.unlink(path + OWNER_SUFFIX)
        unreaped.wait()


def test_kill_9_leftovers_are_removed_by_the_next_serve(identity_repo, short_tmp, leak_check):
    from blockflow.demo import stop_server
    from blockflow.restclient import call

    state_dir = os.path.join(short_tmp, "st")
    os.makedirs(state_dir)
    state = StateDir(state_dir)
    procs, all_pids = [], set()
    try:
        # server 1: blocks deployed, requests served (slots exist), then kill -9 of its whole group
        proc, info = start_detached(identity_repo, state_dir)
        procs.append(proc)
        call("POST", info["rest"] + "/system/update", SIMPLE, timeout=60)
        with Client(info["dispatcher"], timeout=20) as c:
            for _ in range(3):
                c.infer("t", torch.ones(1024))
        old = tree(proc.pid)
        all_pids.update(old)
        assert len(old) >= 4  # server, forkserver, dispatcher, blocks
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        wait_for(lambda: all(gone(p) for p in old), 10, "the killed group exits")
        left_socks, left_slots = set(os.listdir(state.sock)), set(os.listdir(state.shm))
        assert {"d-0.sock", "controller.sock"} <= left_socks, left_socks  # what a kill -9 leaves behind
        assert left_slots, "a kill -9 leaves its shared-memory slots"

        # server 2 on the same state dir (--fresh: nothing re-applied): the old sockets and slots are gone
        old_shm = state.shm
        proc, info = start_detached(identity_repo, state_dir, extra=["--fresh"])
        procs.append(proc)
        assert "d-0.sock" not in os.listdir(state.sock)  # (block a listens on tcp)
        assert state.shm != old_shm and not os.path.exists(old_shm)  # a fresh random name every start
        assert not (left_slots & set(os.listdir(state.shm)))

        # a block that cannot notice its manager died (stopped) survives a kill -9 of the
        # server alone; the next serve finds it through state.json and kills it
        call("POST", info["rest"] + "/system/update", SIMPLE, timeout=60)
        with Client(info["dispatcher"], timeout=20) as c:
            c.infer("t", torch.ones(1024))
        hung = call("GET", info["rest"] + "/blocks/d")["pid"]
        a = call("GET", info["rest"] + "/blocks/a")["pid"]
        dispatcher = call("GET", info["rest"] + "/system")["dispatcher"]["pid"]
        os.kill(hung, signal.SIGSTOP)
        old = tree(proc.pid)
        all_pids.update(old)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        # the running ones notice their manager is gone (a check every second) and exit by themselves
        wait_for(lambda: gone(a) and gone(dispatcher), 20, "block a and the dispatcher see their manager gone and exit")
        assert not gone(hung), "the stopped block should still be there for the next serve to find"

        proc, info = start_detached(identity_repo, state_dir, extra=["--fresh"])
        procs.append(proc)
        wait_for(lambda: gone(hung), 10, "the next serve kills the stopped block of its predecessor")
        wait_for(lambda: all(gone(p) for p in old), 10, "every process of the killed server is gone")
        assert not ({"d-0.sock", "d-1.sock"} & set(os.listdir(state.sock)))
        assert os.listdir(state.shm) == []
        assert stop_server(proc) == 0
        assert os.listdir(state.sock) == [] and not os.path.exists(state.shm)
    finally:
        reap(procs, all_pids)
        import shutil
        shutil.rmtree(state.shm, ignore_errors=True)


# -- 4. limits are explicit, and overload is an error, not a queue -----------------------------

def test_limits_and_overloaded(identity_repo, short_tmp, leak_check):
    env = {"BLOCKFLOW_MAX_QUEUE": "1", "BLOCKFLOW_MAX_PENDING": "2", "BLOCKFLOW_MAX_TENSOR_BYTES": "65536",
           "BLOCKFLOW_MAX_HEADER_BYTES": "4096"}
    pipe = StandalonePipeline(identity_repo, {"s": "toy/sleepy.pt"}, {"t": ["s"]}, window=1, env=env,
                              workdir=os.path.join(short_tmp, "p"))
    socks = Sockets()
    try:
        x = torch.zeros(1, 256)
        # the dispatcher holds at most 2 requests waiting for its one slot towards s
        with Client(pipe.address, timeout=30) as c:
            futures = [c.submit("t", x) for _ in range(20)]
            codes = []
            for f in futures:
                try:
                    f.result(30)
                    codes.append("ok")
                except BlockFlowError as exc:
                    codes.append(exc.code)
                    if exc.code == "overloaded":
                        assert "dispatcher is overloaded" in str(exc)
            assert "ok" in codes and codes.count("overloaded") >= 10, codes
            assert set(codes) <= {"ok", "overloaded"}, codes
            # the largest tensor is a setting
            with pytest.raises(BlockFlowError, match="larger than the limit of 65536") as e:
                c.infer("t", torch.zeros(2, 16384))
            assert e.value.code == "bad_request"
            assert c.infer("t", x).shape == x.shape  # and it still serves

        # the largest header is a setting
        front = socks.open(zmq.DEALER, pipe.address)
        front.send_multipart([json.dumps({"id": 1, "task": "t", "pad": "x" * 5000}).encode()])
        reply = json.loads(front.recv_multipart()[0])
        assert reply["code"] == "bad_request" and "limit of 4096" in reply["error"], reply
        # a frame over twice the limits is cut off by ZeroMQ before it is buffered: no answer
        # (the sender is disconnected), and the dispatcher goes on serving
        huge = socks.open(zmq.DEALER, pipe.address)
        huge.send_multipart([json.dumps({"id": 2, "task": "t", "x": {
            "dtype": "float32", "shape": [75000], "stride": [1], "loc": "bytes"}}).encode(), bytes(300_000)])
        assert huge.poll(1500) == 0
        with Client(pipe.address, timeout=30) as c:
            assert c.infer("t", x).shape == x.shape

        # a block queues at most BLOCKFLOW_MAX_QUEUE tensors; the rest are answered 'overloaded'
        ret = f"ipc://{os.path.join(short_tmp, 'ret.sock')}"
        back = socks.open(zmq.PULL, ret, bind=True)
        push = socks.open(zmq.PUSH, pipe.endpoints["s"])
        payload = x.numpy().tobytes()
        for rid in range(12):
            header = {"v": 1, "t": "data", "rid": rid, "task": "t", "path": [[RETURN_HOP, ret]], "hops": [],
                      "x": {"dtype": "float32", "shape": [1, 256], "stride": [256, 1], "loc": "bytes"}}
            push.send_multipart([json.dumps(header).encode(), payload])
        # The test is the consumer of s's results: like the dispatcher, it releases each slot
        # (s has one slot towards us, window=1; held, it would stall s for its 10 s deadline).
        mapper = SlotMapper(pipe.shm)
        answers = []
        for _ in range(12):
            a = json.loads(back.recv_multipart()[0])
            if a["t"] == "result" and a["x"].get("loc") == "shm":
                mapper.open(TensorDesc.parse(a["x"]))[1].release()
            answers.append(a)
        mapper.close()
        assert sorted(a["rid"] for a in answers) == list(range(12))  # every one answered once
        overloaded = [a for a in answers if a.get("code") == "overloaded"]
        assert len(overloaded) >= 6, answers
        assert all("block s is overloaded" in a["err"] for a in overloaded)
        assert sum(a["t"] == "result" for a in answers) >= 1
        assert pipe.command("s", "ping")["queue"] == 0
    finally:
        socks.close()
        result = pipe.stop()
    assert all(code == 0 for code in result["codes"].values()), result
    assert result["left"] == {"slots": [], "sockets": []}, result
