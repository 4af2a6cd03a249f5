"""The manager split in two: the pure reconciler, the model catalog, and a supervisor loop that
goes on supervising while an update waits, kills stuck blocks, and answers the requests a dead
block held at once."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time

import psutil
import pytest
import torch

from blockflow.client import BlockFlowError, Client
from blockflow.core.protocol import ErrorCode
from blockflow.core.schema import BlockDecl, UpdateError, validate_update
from blockflow.manager.models import ModelCatalog
from blockflow.manager.reconcile import Running, diff_tasks, plan, without_block

from conftest import slot_files_of
from test_control_plane import SIMPLE, block_of, rest_error, update_body, wait_for


# -- the reconciler, without a process -----------------------------------------------------------

def decl(name, model="toy/identity.pt", **kw):
    return BlockDecl(name=name, model=model, **kw)


def test_plan_spawns_keeps_replaces_and_drains():
    current = {"a": Running(decl("a")), "b": Running(decl("b")), "c": Running(decl("c")),
               "f": Running(decl("f"), failed=True)}
    desired = {"a": decl("a"), "b": decl("b", threads=2), "f": decl("f"), "n": decl("n")}
    p = plan(current, desired)
    assert p.keep == ("a",)
    assert p.replace == ("b", "f")       # changed declaration; failed block
    assert p.spawn == ("n",)
    assert p.drain == ("c",)
    assert p.starts == ("n", "b", "f") and set(p.retires) == {"c", "b", "f"}
    assert plan(current, {}).drain == ("a", "b", "c", "f") and plan({}, desired).spawn == tuple(desired)
    same = {n: r.decl for n, r in current.items() if not r.failed}
    assert plan({n: Running(d) for n, d in same.items()}, same).keep == tuple(same)
    # max_inference_s is part of a block's declaration: changing it replaces the block
    assert plan({"a": Running(decl("a"))}, {"a": decl("a", max_inference_s=5.0)}).replace == ("a",)


def test_task_diff_and_block_deletion_rules():
    d = diff_tasks({"t1": ["a"], "t2": ["a", "b"]}, {"t2": ["b"], "t3": ["a"]})
    assert d.as_dict() == {"added": ["t3"], "removed": ["t1"], "changed": ["t2"]}
    blocks = {"a": decl("a"), "b": decl("b")}
    with pytest.raises(ValueError, match="task.*t1"):
        without_block(blocks, {"t1": ["a", "b"]}, "b")
    assert list(without_block(blocks, {"t1": ["a"]}, "b").blocks) == ["a"]


def test_max_inference_s_is_checked_field_by_field():
    body = {"blocks": [{"name": "a", "model": "toy/identity.pt", "max_inference_s": 2.5}], "tasks": []}
    assert validate_update(body).blocks["a"].max_inference_s == 2.5
    assert validate_update({"blocks": [{"name": "a", "model": "m.pt"}]}).blocks["a"].max_inference_s == 60.0
    for bad in (0, -1, "10", True, None, float("nan"), 1e9):
        body["blocks"][0]["max_inference_s"] = bad
        with pytest.raises(UpdateError) as e:
            validate_update(body)
        assert e.value.field == "blocks[0].max_inference_s", (bad, e.value)


def test_schema_reads_no_file():
    """The schema checks shape only: a model path that does not exist is the catalog's to refuse."""
    upd = validate_update({"blocks": [{"name": "a", "model": "no/such.pt"}], "tasks": []})
    assert upd.blocks["a"].model == "no/such.pt"


def test_each_model_file_is_hashed_once_per_change(model_repo):
    catalog = ModelCatalog(model_repo)
    body = {"blocks": [{"name": f"b{i}", "model": "resnet18/block1.pt"} for i in range(3)]
            + [{"name": "h", "model": "resnet18/head.pt"}], "tasks": []}
    for _ in range(3):  # three updates naming the same files, and three blocks sharing one
        catalog.check_update(validate_update(body))
    assert catalog.hashes == 2
    first = catalog.check("resnet18/head.pt")
    verified = first.verified()
    assert verified["sha256"] == first.entry["sha256"] and len(verified["signature"]) == 4
    path = os.path.join(model_repo, "resnet18", "head.pt")
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # "changed" (same bytes)
    try:
        assert catalog.check("resnet18/head.pt").signature != first.signature
        assert catalog.hashes == 3
    finally:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    bad = {"blocks": [{"name": "a", "model": "resnet18/block1.pt"}, {"name": "z", "model": "resnet18/nope.pt"}]}
    with pytest.raises(UpdateError) as e:
        catalog.check_update(validate_update(bad))
    assert e.value.field == "blocks[1].model" and "not found" in str(e.value)


def test_open_block_loads_the_bytes_it_checked(model_repo, tmp_path):
    from blockflow.blocks.repository import BlockFileError, open_block
    catalog = ModelCatalog(model_repo)
    verified = catalog.check("resnet18/head.pt").verified()
    mod, entry = open_block(model_repo, "resnet18/head.pt", verified={"resnet18/head.pt": verified})
    assert entry["sha256"] == verified["sha256"]
    x = torch.randn(1, 512, 7, 7)
    assert mod(x).shape == (1, 1000)
    # a stale 'verified' (another signature) is not trusted: the bytes are hashed and must match
    import shutil
    repo = tmp_path / "repo"
    shutil.copytree(os.path.join(model_repo, "resnet18"), repo / "resnet18")
    with open(repo / "resnet18" / "head.pt", "r+b") as f:
        f.seek(-8, os.SEEK_END)
        f.write(b"\0" * 8)
    with pytest.raises(BlockFileError, match="does not match"):
        open_block(str(repo), "resnet18/head.pt", verified={"resnet18/head.pt": {**verified, "signature": [0] * 4}})


# -- a repository with slow models -----------------------------------------------------------------

class Spin(torch.nn.Module):
    """Real work in a loop: ``n`` steps of tanh (about 17 us each here), so a block is busy for a
    known while without sleeping."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def forward(self, x):
        y = x
        for _ in range(self.n):
            y = torch.tanh(y + 0.001)
        return y


class SpinOnPositive(Spin):
    """Doubles an input that sums to zero or less (a new tensor: made in a slot of the block's
    next hop); spins its ``n`` steps on any other."""

    def forward(self, x):
        if bool(x.sum() <= 0):
            return x * 2
        y = x
        for _ in range(self.n):
            y = torch.tanh(y + 0.001)
        return y


def _steps_for(seconds: float) -> int:
    m = torch.jit.script(Spin(20000))
    x = torch.ones(1, 4)
    t0 = time.perf_counter()
    m(x)
    return max(1000, int(20000 * seconds / (time.perf_counter() - t0)))


@pytest.fixture(scope="module")
def slow_repo(tmp_path_factory, identity_repo):
    """toy/identity.pt and toy/double.pt, plus models listed in a manifest with an input shape,
    so that a block warms up (runs them once) before it reports READY:
    ``slowload.pt`` takes about 8 s to load; ``slow.pt`` about 2 s to load and per request;
    ``stuck.pt`` is never finished within a test (about 120 s per call), and ``stuck_later.pt``
    is on any input that does not sum to zero or less."""
    import shutil
    repo = tmp_path_factory.mktemp("slow_repo")
    shutil.copytree(os.path.join(identity_repo, "toy"), repo / "toy")
    step = _steps_for(1.0)
    manifest = {"blocks": {}}
    for name, seconds in (("slowload.pt", 8.0), ("slow.pt", 2.0), ("stuck.pt", 120.0)):
        path = repo / "toy" / name
        torch.jit.save(torch.jit.script(Spin(int(step * seconds))), str(path))
        if name != "stuck.pt":
            manifest["blocks"][name] = {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                                        "input_shape": [1, 4], "dtype": "float32"}
    torch.jit.save(torch.jit.script(SpinOnPositive(int(step * 120.0))), str(repo / "toy" / "stuck_later.pt"))
    (repo / "toy" / "manifest.json").write_text(json.dumps(manifest))
    return str(repo)


# -- the supervisor goes on while an update waits --------------------------------------------------

def test_a_killed_block_is_respawned_while_an_update_waits(server_factory, slow_repo):
    srv = server_factory(slow_repo)
    srv.call("POST", "/system/update", SIMPLE, timeout=60)
    old = srv.call("GET", "/blocks/d")
    slow = update_body({"a": "toy/identity.pt", "d": "toy/double.pt", "w": "toy/slowload.pt"},
                       {"t": ["a", "d"], "w": ["w"]})
    result = {}
    server = psutil.Process(srv.proc.pid)
    before = len(server.children(recursive=True))
    poster = threading.Thread(target=lambda: result.update(srv.call("POST", "/system/update", slow, timeout=120)))
    poster.start()
    try:
        wait_for(lambda: len(server.children(recursive=True)) > before, 10, "the slow block is spawned")
        t0 = time.monotonic()
        os.kill(old["pid"], signal.SIGKILL)
        new = wait_for(lambda: (lambda b: b if b["pid"] != old["pid"] and b["status"] == "ready" else None)(
            block_of(srv.call("GET", "/system"), "d")), 10, "d is respawned while the update waits")
        took = time.monotonic() - t0
        assert poster.is_alive(), "the update finished before the test could see the supervisor at work"
        print(f"\nkilled block respawned in {took:.2f}s while an update waited for a slow block")
        # the pipeline serves again during the update
        with Client(srv.dispatcher, timeout=10) as c:
            x = torch.ones(3)
            y = wait_for(lambda: _infer_or_none(c, "t", x), 10, "t serves again")
            assert torch.equal(y[0], x * 2)
    finally:
        poster.join(120)
    assert result.get("version") == 2 and result["diff"]["spawned"] == ["w"], result
    assert srv.call("GET", "/blocks/d")["restarts"] == 1


def test_a_block_hung_during_an_update_is_killed_and_the_update_goes_on(server_factory, identity_repo):
    """Issue 28 item 4. A block stopped (SIGSTOP) just before an update cannot acknowledge it.
    The manager used to spare a block from the hang check while its acknowledgement was due, and
    that future never resolved: the block stayed stopped for ever, and the update waited its
    whole ack timeout. Now the block has the hang timeout for the update, like any silence; it is
    killed and respawned, and the update ends."""
    srv = server_factory(identity_repo)
    srv.call("POST", "/system/update", SIMPLE, timeout=60)
    old = srv.call("GET", "/blocks/d")
    os.kill(old["pid"], signal.SIGSTOP)
    try:
        bigger = update_body({"a": "toy/identity.pt", "d": "toy/double.pt", "e": "toy/identity.pt"},
                             {"t": ["a", "d"], "u": ["e"]})
        t0 = time.monotonic()
        result = srv.call("POST", "/system/update", bigger, timeout=60)
        took = time.monotonic() - t0
        assert result["diff"]["spawned"] == ["e"], result
        new = wait_for(lambda: (lambda b: b if b["pid"] != old["pid"] and b["status"] == "ready" else None)(
            block_of(srv.call("GET", "/system"), "d")), 30, "the block stopped during the update is replaced")
    finally:
        try:
            os.kill(old["pid"], signal.SIGCONT)
        except ProcessLookupError:
            pass
    print(f"\nupdate with a stopped block took {took:.2f}s; it was replaced ({new['last_exit']})")
    assert new["restarts"] == 1 and "hung" in (new.get("last_exit") or ""), new
    with Client(srv.dispatcher, timeout=10) as c:
        x = torch.ones(3)
        assert torch.equal(wait_for(lambda: _infer_or_none(c, "t", x), 10, "t serves again")[0], x * 2)


def test_a_dispatcher_stuck_in_its_loop_answers_its_pings_and_is_killed_for_the_stall(server_factory, identity_repo):
    """The dispatcher's pings are answered by its control thread, so a main loop busy for seconds
    (a 100 MB tensor copied and its slots made on a loaded machine) is not taken for hung: it
    used to be, with the requests it held. A loop that is stuck for good is still found, by the
    ping's beat_age_s (BLOCKFLOW_LOOP_STALL). Stuck here for real: its request log is a FIFO
    that nobody reads, so the loop's once-a-second flush blocks in open(), as on a hung disk."""
    srv = server_factory(identity_repo, env={"BLOCKFLOW_LOOP_STALL": "4"})
    srv.call("POST", "/system/update", SIMPLE, timeout=60)
    system = srv.call("GET", "/system")
    old = system["dispatcher"]
    fifo = os.path.join(system["run_dir"], "@dispatcher.requests.jsonl")
    if os.path.exists(fifo):
        os.unlink(fifo)  # the warm-up's records: the next flush opens the FIFO
    os.mkfifo(fifo)
    try:
        with Client(srv.dispatcher, timeout=10) as c:
            x = torch.ones(3)
            assert torch.equal(c.infer("t", x), x * 2)  # answered; its record waits for the flush
            new = wait_for(lambda: (lambda d: d if d and d["pid"] != old["pid"] and d["status"] == "ready" else None)(
                srv.call("GET", "/system")["dispatcher"]), 30, "the stalled dispatcher replaced")
    finally:
        os.unlink(fifo)
    print(f"\nthe stalled dispatcher: {new['last_exit']}")
    # killed for what its pings said (they were answered all along), not for silence
    assert "main loop has not come round" in (new.get("last_exit") or ""), new
    assert "without answering" not in new["last_exit"], new
    with Client(srv.dispatcher, timeout=10) as c:
        x = torch.ones(3)
        assert torch.equal(wait_for(lambda: _infer_or_none(c, "t", x), 10, "t served again")[0], x * 2)


def _infer_or_none(c, task, x):
    try:
        return [c.infer(task, x, timeout=5)]
    except BlockFlowError:
        return None


# -- a dead block's requests are answered at once ------------------------------------------------

def test_requests_of_a_killed_block_are_answered_at_once(server_factory, slow_repo):
    """Issue 12 item 8. The request inside the killed block gets block_failed at once; a request
    sent while its replacement loads (2 s here) is answered at once too (it used to go to the
    dead block's socket and wait for its whole deadline: 'timeout')."""
    srv = server_factory(slow_repo)
    srv.call("POST", "/system/update", update_body({"s": "toy/slow.pt"}, {"t": ["s"]}), timeout=60)
    pid = srv.call("GET", "/blocks/s")["pid"]
    x = torch.ones(1, 4)
    deadline = 8.0
    with Client(srv.dispatcher, timeout=deadline) as c:
        inside = c.submit("t", x)
        # kill s while the request is inside its model (the ping's busy_s says so), however
        # slow the machine: a kill before the request arrived would test something else
        wait_for(lambda: (srv.call("GET", "/blocks/s/ping").get("busy_s") or 0) > 0, 20,
                 "the request reaching the model of s", interval=0.01)
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(BlockFlowError) as e:
            inside.result(deadline + 2)
        first = time.monotonic() - t0
        assert e.value.code == ErrorCode.BLOCK_FAILED, e.value
        codes, took = [], []
        for _ in range(3):  # sent while s is dead or loading again
            t1 = time.monotonic()
            try:
                c.infer("t", x)
                codes.append("ok")
            except BlockFlowError as exc:
                codes.append(exc.code)
            took.append(time.monotonic() - t1)
    print(f"\nheld request answered {first:.2f}s after the kill; next ones {codes} in "
          f"{', '.join(f'{t:.2f}' for t in took)}s")
    assert first < 2.0, first
    assert ErrorCode.TIMEOUT not in codes and max(took[:1]) < deadline / 2, (codes, took)


# -- a model stuck in one inference ----------------------------------------------------------------

def test_a_stuck_model_is_answered_and_replaced(server_factory, slow_repo):
    """Acceptance of issue 11: answered block_failed and a new incarnation READY within
    max_inference_s + 2 s. Needs the block's ping to report busy_s (the data-plane branch)."""
    srv = server_factory(slow_repo)
    limit = 2.0
    srv.call("POST", "/system/update", update_body(
        {"s": {"model": "toy/stuck.pt", "max_inference_s": limit}}, {"t": ["s"]}), timeout=60)
    ping = srv.call("GET", "/blocks/s/ping")
    assert isinstance(ping.get("busy_s"), (int, float)), f"the block's ping lacks busy_s, which liveness needs: {ping}"
    old = srv.call("GET", "/blocks/s")
    with Client(srv.dispatcher, timeout=30) as c:
        t0 = time.monotonic()
        with pytest.raises(BlockFlowError) as e:
            c.infer("t", torch.ones(1, 4))
        answered = time.monotonic() - t0
        assert e.value.code == ErrorCode.BLOCK_FAILED, e.value
        new = wait_for(lambda: (lambda b: b if b["incarnation"] > old["incarnation"] and b["status"] == "ready"
                                else None)(block_of(srv.call("GET", "/system"), "s")), 10, "s is replaced")
        replaced = time.monotonic() - t0
    print(f"\nstuck model (max_inference_s {limit}) answered in {answered:.2f}s, replaced in {replaced:.2f}s")
    assert new["restarts"] == 1, new
    assert answered < limit + 2 and replaced < limit + 2 + 1, (answered, replaced)


def test_bad_max_inference_s_is_a_field_named_400(server_factory, identity_repo):
    srv = server_factory(identity_repo)
    err = rest_error(srv, "POST", "/system/update", update_body(
        {"a": {"model": "toy/identity.pt", "max_inference_s": -3}}, {"t": ["a"]}))
    assert err.status == 400 and err.body["field"] == "blocks[0].max_inference_s", err.body


# -- settings reach the processes ----------------------------------------------------------------

@pytest.mark.parametrize("how", ["env", "flag"])
def test_window_setting_reaches_the_blocks(server_factory, identity_repo, how):
    """An edge commits its whole window of slots on first use: the slot files a block made
    towards its one consumer are the window it was given."""
    srv = (server_factory(identity_repo, env={"BLOCKFLOW_WINDOW": "3"}) if how == "env"
           else server_factory(identity_repo, extra=["--window", "2"]))
    srv.call("POST", "/system/update", SIMPLE, timeout=60)
    # bytes, not slots the dispatcher lends: the dispatcher makes its own slots for them (a request
    # sent after the lending arrived would travel in a lent slot, seen once on a loaded machine)
    with Client(srv.dispatcher, timeout=15, shared_memory=False) as c:
        x = torch.ones(4)
        assert torch.equal(c.infer("t", x), x * 2)
    window = 3 if how == "env" else 2
    # (a, the identity, forwards the dispatcher's slot; d makes a new tensor, in its own slots)
    assert len(slot_files_of(srv.call("GET", "/blocks/d")["pid"])) == window
    assert len(slot_files_of(srv.call("GET", "/system")["dispatcher"]["pid"])) == window


def test_a_path_of_large_tensors_keeps_its_dispatcher(server_factory, identity_repo):
    """Note [A window made at once, up to a budget] in tensormq/shm.py: 103 MB tensors (ResNet50's
    block1 output at batch 32) through one and four identity blocks. When every edge made its
    whole window at its first use (8 slots of 128 MiB), the dispatcher, making a client's window
    of lent slots, went more than 3 s without answering its pings on the 2-core VM and was killed
    as hung, a request lost each time (three times in 24 requests). Now the same dispatcher
    answers every request, and the slots it made are the budget's, not a whole window. Even
    with the budget, a dispatcher that answered its pings from the thread that copies went
    silent for 3 s when two test workers shared the two cores: its control thread answers now
    (Note [Commands for the main loop] in blockflow/core/childproc.py)."""
    srv = server_factory(identity_repo)
    names = [f"i{k}" for k in range(4)]
    srv.call("POST", "/system/update", {
        "transport": "tensormq", "blocks": [{"name": n, "model": "toy/identity.pt"} for n in names],
        "tasks": [{"id": "one", "path": names[:1]}, {"id": "four", "path": names}]}, timeout=60)
    x = torch.randn(32, 256, 56, 56)
    with Client(srv.dispatcher, timeout=60) as c:
        for _ in range(4):
            for task in ("one", "four"):
                assert torch.equal(c.infer(task, x), x)
    dispatcher = srv.call("GET", "/system")["dispatcher"]
    assert dispatcher["restarts"] == 0 and dispatcher["last_exit"] is None, dispatcher
    made = sum(os.path.getsize(f) for f in slot_files_of(dispatcher["pid"]))
    assert 0 < made <= (256 << 20) + (1 << 20) * 8, made  # 2 of 128 MiB (+ the warm-up's small window)


def test_update_transport_reaches_the_dispatcher(server_factory, identity_repo):
    """With "transport": "zeromq" every hop carries bytes, the dispatcher's first hop too:
    no process makes a slot. Back to tensormq, the dispatcher does again."""
    srv = server_factory(identity_repo)
    x = torch.ones(4)
    srv.call("POST", "/system/update", {**SIMPLE, "transport": "zeromq"}, timeout=60)
    assert srv.call("GET", "/system")["transport"] == "zeromq"
    dispatcher = srv.call("GET", "/system")["dispatcher"]["pid"]
    with Client(srv.dispatcher, timeout=15) as c:
        assert torch.equal(c.infer("t", x), x * 2)
        assert slot_files_of(dispatcher) == []
        srv.call("POST", "/system/update", SIMPLE, timeout=60)  # tensormq again
        assert torch.equal(c.infer("t", x), x * 2)
        assert len(slot_files_of(dispatcher)) > 0


# -- a clean exit leaves nothing -----------------------------------------------------------------

def test_nothing_outlives_a_clean_exit(server_factory, identity_repo):
    """Everything `serve` started (forkserver, resource tracker, blocks, dispatcher) is gone when
    it returns, not a moment later: the forkserver used to linger up to a second."""
    from test_control_plane import pid_gone
    srv = server_factory(identity_repo)
    srv.call("POST", "/system/update", SIMPLE, timeout=60)
    started = psutil.Process(srv.proc.pid).children(recursive=True)
    names = {p.pid: " ".join(p.cmdline())[:80] for p in started}
    assert any("forkserver" in n for n in names.values()), names
    assert srv.stop() == 0
    left = {pid: name for pid, name in names.items() if not pid_gone(pid)}
    assert not left, f"still running after serve exited: {left}"


# -- an orphan's stop has a deadline -------------------------------------------------------------

@pytest.mark.parametrize("alone", [True, False], ids=["own-process", "shared-process"])
def test_an_orphan_stuck_in_an_inference_ends_at_its_stop_deadline(server_factory, slow_repo, capfd, alone):
    """The server is killed while a block is stuck in an inference: the block sees its manager
    gone and begins to stop, but its main thread never comes back (the model spins ~120 s) and
    nobody is left to kill it. BLOCKFLOW_STOP_DEADLINE (2 s here) later it writes every thread's
    stack to its log, removes its files and exits; the next server's sweep finds the old slot
    directory with no live producer and removes it. In a shared process the deadline is the
    process's, not the stuck member's: it says so once, and removes the slots of every member."""
    from blockflow.manager.state import StateDir
    srv = server_factory(slow_repo, env={"BLOCKFLOW_STOP_DEADLINE": "2"})
    group = {} if alone else {"process": "g"}
    srv.call("POST", "/system/update", update_body({"s": {"model": "toy/stuck_later.pt", **group},
                                                    **({} if alone else {"a": {"model": "toy/double.pt", **group}})},
                                                   {"t": ["s"], **({} if alone else {"u": ["a"]})}), timeout=60)
    pid = block_of(srv.call("GET", "/system"), "s")["pid"]
    with Client(srv.dispatcher, timeout=30) as c:  # s's output (and a's) goes into slots of its process
        assert torch.equal(c.infer("t", -torch.ones(1, 4)), torch.full((1, 4), -2.0))
        if not alone:
            assert torch.equal(c.infer("u", torch.ones(1, 4)), torch.full((1, 4), 2.0))
    assert slot_files_of(pid), "the block's process made no slot: nothing for its deadline to remove"

    def ask():
        try:
            with Client(srv.dispatcher, timeout=15) as c:
                c.infer("t", torch.ones(1, 4))
        except (BlockFlowError, OSError):
            pass  # its dispatcher goes with the server: this request has no one to answer it
    t = threading.Thread(target=ask, daemon=True)
    t.start()
    wait_for(lambda: (srv.call("GET", "/blocks/s/ping").get("busy_s") or 0) > 0, 30, "s busy with the request")
    shm = StateDir(srv.state_dir).shm
    srv.proc.kill()
    srv.proc.wait(10)
    killed = time.monotonic()

    def running():
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
    wait_for(lambda: not running(), 60, "the stuck orphan s ending")  # its model alone would take ~120 s
    print(f"\nthe stuck orphan ended {time.monotonic() - killed:.1f}s after its server was killed")
    t.join(30)
    err = capfd.readouterr().err
    assert err.count("still running 2 s after it began to stop (BLOCKFLOW_STOP_DEADLINE)") == 1, err[-3000:]
    assert ("block s:" if alone else "shared process @g:") in err.split("still running 2 s")[0][-200:], err[-3000:]
    assert "most recent call first" in err, err[-3000:]  # the threads' stacks
    assert not slot_files_of(pid)
    other = StateDir(os.path.join(srv.state_dir, "next"))  # another server of this user: it sweeps
    wait_for(lambda: shm in other.sweep_orphans() or not os.path.exists(shm), 30,
             "the killed server's slot directory swept as orphaned")
