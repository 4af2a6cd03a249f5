"""Hostile-input and fault holes of issue 12, one test (or two) per item, each failing before its fix:

2. links planted in /dev/shm or /tmp are never followed;
3. a shared-memory filesystem too small for the slot window fails one request, not the dispatcher;
5. no unauthenticated server on a non-loopback address; with a token, every read is guarded too;
6. a server restarted on the same state directory serves the last update again;
7. KPI records reach the disk within a second, and ``blockflow kpi`` names blocks without records;
9. a model file that resolves outside the repository is served only with a manifest sha256.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

import psutil
import pytest
import torch

from blockflow.client import BlockFlowError, Client
from blockflow.manager.state import OWNER_SUFFIX, StateDir, UnsafePath, process_record
from blockflow.restclient import RestError

from blockflow.demo import wait_ready_file
from conftest import gone, kill_tree, reap, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IPC = {"blocks": [{"name": "a", "model": "toy/identity.pt"}, {"name": "d", "model": "toy/double.pt"}],
       "tasks": [{"id": "t", "path": ["a", "d"]}]}


def tree(pid: int) -> list[int]:
    try:
        return [pid] + [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def rest_error(srv, method, path, body=None, **kw) -> RestError:
    with pytest.raises(RestError) as info:
        srv.call(method, path, body, **kw)
    return info.value


def serve_cmd(repo: str, state_dir: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "blockflow.cli", "serve", "--port", "0", "--dispatcher-port", "0",
            "--repo", repo, "--state-dir", state_dir, "--ready-file", os.path.join(state_dir, "ready.json"),
            "--quiet", *extra]


class Victim:
    """A directory and a file that a planted link points at; ``untouched()`` says whether they
    are exactly as made (mode, contents, no file added or removed)."""

    def __init__(self, base: str):
        self.dir = os.path.join(base, "victim-dir")
        os.makedirs(self.dir)
        os.chmod(self.dir, 0o755)
        self.file = os.path.join(base, "victim-file")
        for path in (self.file, os.path.join(self.dir, "precious"), os.path.join(self.dir, "b.999999.1")):
            with open(path, "w") as f:
                f.write("do not touch")
            os.chmod(path, 0o644)
        self.before = self.snapshot()

    def snapshot(self):
        files = sorted(os.listdir(self.dir))
        return (stat.S_IMODE(os.stat(self.dir).st_mode), files,
                [(stat.S_IMODE(os.stat(os.path.join(self.dir, f)).st_mode), open(os.path.join(self.dir, f)).read())
                 for f in files],
                stat.S_IMODE(os.stat(self.file).st_mode), open(self.file).read())

    def untouched(self) -> bool:
        return self.snapshot() == self.before


# -- 2. links planted in /dev/shm and /tmp are never followed -----------------------------------

def test_planted_links_are_never_followed(short_tmp):
    victim = Victim(short_tmp)
    planted = []

    def plant(path, target):
        os.symlink(target, path)
        planted.append(path)

    try:
        # the state directory (predictable in world-writable /tmp) is a link: refuse, touch nothing
        root = os.path.join(short_tmp, "state-link")
        plant(root, victim.dir)
        with pytest.raises(UnsafePath, match="symbolic link"):
            StateDir(root).prepare()
        assert victim.untouched()

        # ... or a directory of someone else: refuse
        other = os.path.join(short_tmp, "state-other")
        os.mkdir(other, 0o777)
        os.chown(other, 65534, 65534)
        with pytest.raises(UnsafePath, match="uid 65534"):
            StateDir(other).prepare()

        # the slot directory a predecessor used (recorded in state.json) and the name older
        # versions derived from the state dir are links to the victim by now: the next server
        # neither empties, chmods nor writes through them, and picks a fresh random name
        root = os.path.join(short_tmp, "state")
        state = StateDir(root)
        uid = os.getuid()
        predictable = os.path.join(state.shm_parent, f"blockflow-{uid}-{hashlib.sha1(root.encode()).hexdigest()[:12]}")
        recorded = os.path.join(state.shm_parent, f"blockflow-{uid}-{os.urandom(6).hex()}")
        for name in (predictable, recorded):
            plant(name, victim.dir)
            plant(name + OWNER_SUFFIX, victim.file)
        os.makedirs(root, mode=0o700)
        with open(os.path.join(root, "state.json"), "w") as f:
            json.dump({"shm_dir": recorded, "server": None}, f)
        state.prepare()
        planted.append(state.shm)
        state.clean_leftovers()
        state.sweep_orphans()
        assert victim.untouched()
        assert state.shm not in (predictable, recorded)
        st = os.lstat(state.shm)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == uid
        assert json.load(open(state.shm + OWNER_SUFFIX))["root"] == os.path.abspath(root)
        # a second start never reuses a name
        again = StateDir(os.path.join(short_tmp, "state2"))
        again.prepare()
        planted.append(again.shm)
        assert again.shm != state.shm

        # a link inside the slot directory is neither a slot to create nor one to map
        from blockflow.tensormq.shm import SlotMapper, SlotPool
        from blockflow.tensormq.wire import TensorDesc, WireError
        plant(os.path.join(state.shm, "p.1.1"), victim.file)
        mapper = SlotMapper(state.shm)
        with pytest.raises(WireError):
            mapper.open(TensorDesc.parse({"loc": "shm", "dtype": "uint8", "shape": [4], "stride": [1],
                                          "seg": "p.1.1", "gen": 1, "off": 0, "nbytes": 4}))
        mapper.close()
        pool = SlotPool(state.shm, "p", window=1)
        pool._seq = 0
        os.rename(os.path.join(state.shm, "p.1.1"), os.path.join(state.shm, f"p.{os.getpid()}.1"))
        with pytest.raises(FileExistsError):
            pool.put("edge", torch.ones(4), timeout=1)
        pool.close()
        assert victim.untouched()

        # removing the runtime unlinks the links, never their targets
        state.remove_runtime()
        again.remove_runtime()
        assert not os.path.exists(state.shm) and not os.path.lexists(state.shm + OWNER_SUFFIX)
        assert victim.untouched()
    finally:
        for path in planted:
            if os.path.islink(path):
                os.unlink(path)
            elif os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            if os.path.lexists(path + OWNER_SUFFIX):
                os.unlink(path + OWNER_SUFFIX)


def test_serve_refuses_a_state_dir_that_is_a_link(short_tmp, identity_repo):
    victim = Victim(short_tmp)
    link = os.path.join(short_tmp, "st")
    os.symlink(victim.dir, link)
    proc = subprocess.run(serve_cmd(identity_repo, link), capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, BLOCKFLOW_LOG="WARNING"))
    assert proc.returncode != 0
    assert "is a symbolic link" in proc.stderr and link in proc.stderr, proc.stderr[-2000:]
    assert victim.untouched()


# -- 3. a small shared-memory filesystem: an error for one request, not a SIGBUS -------------

@pytest.fixture
def small_tmpfs(short_tmp):
    """An 8 MiB tmpfs, as a container's small /dev/shm would be (needs root, as `make demo` runs)."""
    path = os.path.join(short_tmp, "shm8m")
    os.mkdir(path)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=1777", "tmpfs", path], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {proc.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False)


def test_small_shm_fails_one_request_not_the_dispatcher(server_factory, identity_repo, small_tmpfs):
    srv = server_factory(identity_repo, extra=["--window", "2"], env={"BLOCKFLOW_SHM_DIR": small_tmpfs})
    srv.call("POST", "/system/update", IPC, timeout=60)
    system = srv.call("GET", "/system")
    assert system["shm"]["dir"].startswith(small_tmpfs) and system["shm"]["size_bytes"] == 8 << 20
    dispatcher_pid = system["dispatcher"]["pid"]
    big = torch.ones(4 << 20)  # 16 MiB: no slot of that size fits in 8 MiB
    with Client(srv.dispatcher, timeout=30) as c:
        assert torch.equal(c.infer("t", torch.ones(1024)), torch.full((1024,), 2.0))
        with pytest.raises(BlockFlowError) as e:
            c.infer("t", big)
        msg = str(e.value)
        assert e.value.code == "no_shared_memory", (e.value.code, msg)
        assert "shared memory" in msg and "8 MiB" in msg and "BLOCKFLOW_WINDOW" in msg and "BLOCKFLOW_SHM_DIR" in msg
        # everything else is still served, by the same dispatcher
        for i in range(20):
            assert torch.equal(c.infer("t", torch.full((1024,), float(i))), torch.full((1024,), 2.0 * i))
        # 3 MiB: the dispatcher's 4 MiB slot fits, block d's result does not: the block answers
        # with the same error and keeps serving
        with pytest.raises(BlockFlowError) as e:
            c.infer("t", torch.ones(3 << 18))
        assert e.value.code == "no_shared_memory" and "block d" in str(e.value), (e.value.code, str(e.value))
        mid = torch.ones(1 << 18)  # 1 MiB fits on both edges
        assert torch.equal(c.infer("t", mid), mid * 2)
    assert srv.call("GET", "/system")["dispatcher"]["pid"] == dispatcher_pid
    assert srv.call("GET", "/system")["dispatcher"]["restarts"] == 0


def test_slot_budget_is_reported_against_the_filesystem(small_tmpfs, caplog):
    from blockflow.manager.state import slot_budget
    from blockflow.core.schema import BlockDecl, Update
    # a ResNet50-like first stage at batch 1: 3x224x224 in (0.6 MB), 256x56x56 out (3.2 MB)
    upd = Update("tensormq", "ipc", {"b1": BlockDecl("b1", "r/block1.pt"), "b2": BlockDecl("b2", "r/head.pt")},
                 {"t": ["b1", "b2"]},
                 {"r/block1.pt": {"input_shape": [1, 3, 224, 224], "output_shape": [1, 256, 56, 56]},
                  "r/head.pt": {"input_shape": [1, 256, 56, 56], "output_shape": [1, 1000]}})
    os.mkdir(os.path.join(small_tmpfs, "slots"))
    with caplog.at_level("WARNING", logger="blockflow.state"):
        budget = slot_budget(upd, 8, os.path.join(small_tmpfs, "slots"))
    # dispatcher->b1: 8 x 1 MiB, b1->b2: 8 x 4 MiB, b2->dispatcher: 8 x 4 KiB (+ a 64-byte header each)
    assert budget["edges"] == 3 and budget["needed_bytes_batch1"] == 8 * ((1 << 20) + (4 << 20) + 4096 + 3 * 64)
    assert budget["size_bytes"] == 8 << 20 and budget["fits"] is False
    assert "BLOCKFLOW_WINDOW" in caplog.text and "40.0 MiB" in caplog.text


# -- 5. no unauthenticated server on the network; with a token, reads are guarded too ----------

@pytest.mark.parametrize("flag", ["--host", "--dispatcher-host"])
def test_non_loopback_without_token_is_refused(short_tmp, identity_repo, flag, monkeypatch):
    env = {k: v for k, v in os.environ.items() if k != "BLOCKFLOW_TOKEN"}
    state = os.path.join(short_tmp, "st")
    proc = subprocess.run(serve_cmd(identity_repo, state, flag, "0.0.0.0"), capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "without a token" in proc.stderr and "--insecure-no-token" in proc.stderr and "0.0.0.0" in proc.stderr
    assert not os.path.exists(os.path.join(state, "ready.json"))


def test_insecure_no_token_is_explicit(server_factory, identity_repo):
    srv = server_factory(identity_repo, extra=["--dispatcher-host", "0.0.0.0", "--insecure-no-token"],
                         env={"BLOCKFLOW_TOKEN": ""})
    assert srv.dispatcher.startswith("tcp://0.0.0.0:")
    assert srv.call("GET", "/health/live")["status"] == "ok"


def test_token_guards_every_endpoint_but_health(server_factory, identity_repo):
    srv = server_factory(identity_repo, extra=["--token", "s3cret"])
    srv.call("POST", "/system/update", IPC, token="s3cret", timeout=60)
    for method, path in [("GET", "/"), ("GET", "/system"), ("GET", "/blocks"), ("GET", "/blocks/d"),
                         ("GET", "/blocks/d/ping"), ("POST", "/blocks/d/kpi")]:
        err = rest_error(srv, method, path)
        assert err.status == 401, (method, path, err.status, err.body)
        assert "pid" not in json.dumps(err.body), err.body
        assert rest_error(srv, method, path, token="wrong").status == 401
    assert srv.call("GET", "/health/live")["status"] == "ok"
    assert srv.call("GET", "/health/ready")["status"] == "ok"
    assert srv.call("GET", "/blocks/d", token="s3cret")["name"] == "d"
    # reading KPIs writes the logs out: a POST; GET says so
    err = rest_error(srv, "GET", "/blocks/d/kpi", token="s3cret")
    assert err.status == 405 and "POST /blocks/d/kpi" in err.body["error"], err.body
    with Client(srv.dispatcher, timeout=20, token="s3cret") as c:
        for _ in range(3):
            c.infer("t", torch.ones(4))
    assert srv.call("POST", "/blocks/d/kpi", token="s3cret")["count"] == 3


# -- 6. a restarted server serves what it served ------------------------------------------------

def start_detached(cmd: list[str], ready: str, log_path: str, timeout: float = 120.0):
    if os.path.exists(ready):
        os.unlink(ready)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, start_new_session=True, stdout=log, stderr=log,
                                env=dict(os.environ, BLOCKFLOW_LOG="INFO"))
    try:
        return proc, wait_ready_file(proc, ready, timeout)
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}: {open(log_path).read()[-2000:]}") from None
    except TimeoutError:
        kill_tree(proc.pid)
        raise


def test_restarted_server_reapplies_the_last_update(identity_repo, short_tmp, leak_check):
    from blockflow.demo import stop_server
    from blockflow.restclient import call
    state_dir = os.path.join(short_tmp, "st")
    os.makedirs(state_dir)
    ready, log_path = os.path.join(state_dir, "ready.json"), os.path.join(short_tmp, "serve.log")
    procs, all_pids = [], set()
    try:
        proc, info = start_detached(serve_cmd(identity_repo, state_dir), ready, log_path)
        procs.append(proc)
        call("POST", info["rest"] + "/system/update", IPC, timeout=60)
        with Client(info["dispatcher"], timeout=20) as c:
            assert torch.equal(c.infer("t", torch.ones(8)), torch.full((8,), 2.0))
        old = tree(proc.pid)
        all_pids.update(old)
        os.killpg(proc.pid, signal.SIGKILL)  # the whole server: manager, forkserver, dispatcher, blocks
        proc.wait(10)
        wait_for(lambda: all(gone(p) for p in old), 10, "the killed server exits")

        # the same command again: the update is back before the server says it is ready
        t0 = time.monotonic()
        proc, info = start_detached(serve_cmd(identity_repo, state_dir), ready, log_path)
        procs.append(proc)
        took = time.monotonic() - t0
        all_pids.update(tree(proc.pid))
        with Client(info["dispatcher"], timeout=20) as c:
            assert torch.equal(c.infer("t", torch.full((8,), 3.0)), torch.full((8,), 6.0))
        system = call("GET", info["rest"] + "/system")
        assert sorted(b["name"] for b in system["blocks"]) == ["a", "d"]
        assert all(b["status"] == "ready" for b in system["blocks"])
        assert "re-applying the last update" in open(log_path).read()
        print(f"\nrestarted server serving its last update again {took:.2f}s after the restart command")
        assert stop_server(proc) == 0

        # --fresh starts empty
        proc, info = start_detached(serve_cmd(identity_repo, state_dir, "--fresh"), ready, log_path)
        procs.append(proc)
        assert call("GET", info["rest"] + "/system")["blocks"] == []
        with Client(info["dispatcher"], timeout=20) as c:
            with pytest.raises(BlockFlowError) as e:
                c.infer("t", torch.ones(8))
            assert e.value.code == "unknown_task"
        assert stop_server(proc) == 0
    finally:
        reap(procs, all_pids)


def test_deleted_blocks_are_not_brought_back(server_factory, identity_repo):
    """What a restart re-applies follows DELETE: a removed topology stays removed."""
    srv = server_factory(identity_repo)
    srv.call("POST", "/system/update", {**IPC, "blocks": IPC["blocks"] + [{"name": "spare",
                                                                          "model": "toy/identity.pt"}]}, timeout=60)
    srv.call("DELETE", "/blocks/spare", timeout=60)
    recorded = StateDir(srv.state_dir).load()["update"]
    assert [b["name"] for b in recorded["blocks"]] == ["a", "d"]
    srv.call("DELETE", "/system", timeout=60)
    assert StateDir(srv.state_dir).load()["update"] is None


# -- 7. KPI records reach the disk within a second ----------------------------------------------

def test_kpi_records_survive_a_killed_block(server_factory, identity_repo):
    srv = server_factory(identity_repo)
    srv.call("POST", "/system/update", {**IPC, "blocks": IPC["blocks"] + [{"name": "spare",
                                                                          "model": "toy/identity.pt"}]}, timeout=60)
    run_dir = srv.call("GET", "/system")["run_dir"]
    log = os.path.join(run_dir, "d.latency.jsonl")
    n = 25
    with Client(srv.dispatcher, timeout=20) as c:
        for i in range(n):
            c.infer("t", torch.full((4,), float(i)))
    answered = time.monotonic()

    def records() -> int:
        with open(log) as f:
            return sum(1 for _ in f)

    # no store command, no shutdown: the block writes them on its own
    wait_for(lambda: records() >= n, 3.0, f"{n} KPI records of block d on disk")
    took = time.monotonic() - answered
    os.kill(srv.call("GET", "/blocks/d")["pid"], signal.SIGKILL)
    assert records() == n
    print(f"\n{n} KPI records on disk {took:.2f}s after the last reply; all {n} kept after kill -9 of the block")

    out = subprocess.run([sys.executable, "-m", "blockflow.cli", "kpi", run_dir], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "no records yet from block(s) spare" in out.stderr, out.stderr
    assert "spare" in out.stdout and " d " in out.stdout


# -- 9. model files that resolve outside the repository ------------------------------------------

@pytest.fixture
def linked_repo(identity_repo, short_tmp):
    """A repository whose toy/outside.pt is a link to a TorchScript file outside it, and whose
    toy/passwd.pt is a link to an arbitrary host file."""
    repo = os.path.join(short_tmp, "repo")
    outside = os.path.join(short_tmp, "elsewhere")
    os.makedirs(os.path.join(repo, "toy"))
    os.makedirs(outside)
    shutil.copy(os.path.join(identity_repo, "toy", "double.pt"), os.path.join(repo, "toy", "double.pt"))
    shutil.copy(os.path.join(identity_repo, "toy", "double.pt"), os.path.join(outside, "double.pt"))
    with open(os.path.join(outside, "secret"), "w") as f:
        f.write("root:x:0:0\n")
    os.symlink(os.path.join(outside, "double.pt"), os.path.join(repo, "toy", "outside.pt"))
    os.symlink(os.path.join(outside, "secret"), os.path.join(repo, "toy", "passwd.pt"))
    os.symlink(outside, os.path.join(repo, "linked"))  # a whole model directory outside
    with open(os.path.join(outside, "manifest.json"), "w") as f:  # a manifest outside vouches for nothing
        json.dump({"blocks": {"double.pt": {"sha256": hashlib.sha256(open(os.path.join(outside, "double.pt"), "rb")
                                                                      .read()).hexdigest()}}}, f)
    return repo


def test_model_files_outside_the_repository(linked_repo):
    from blockflow.blocks.repository import BlockFileError, verify_block
    assert verify_block(linked_repo, "toy/double.pt") is None  # an unlisted file inside: served as is
    for rel in ("toy/outside.pt", "toy/passwd.pt", "linked/double.pt"):
        with pytest.raises(BlockFileError, match="outside the repository") as e:
            verify_block(linked_repo, rel)
        assert os.path.basename(rel) in str(e.value) and "sha256" in str(e.value)
    # named with its sha256 in the manifest inside the repository: served; a wrong hash is not
    digest = hashlib.sha256(open(os.path.join(linked_repo, "toy", "outside.pt"), "rb").read()).hexdigest()
    manifest = os.path.join(linked_repo, "toy", "manifest.json")
    with open(manifest, "w") as f:
        json.dump({"blocks": {"outside.pt": {"sha256": digest}, "passwd.pt": {"sha256": "0" * 64}}}, f)
    assert verify_block(linked_repo, "toy/outside.pt")["sha256"] == digest
    with pytest.raises(BlockFileError, match="does not match"):
        verify_block(linked_repo, "toy/passwd.pt")


def test_update_with_a_file_outside_the_repository(server_factory, linked_repo):
    srv = server_factory(linked_repo)
    body = {"blocks": [{"name": "x", "model": "toy/outside.pt"}], "tasks": [{"id": "t", "path": ["x"]}]}
    err = rest_error(srv, "POST", "/system/update", body, timeout=60)
    assert err.status == 400 and err.body["field"] == "blocks[0].model", err.body
    assert "outside.pt" in err.body["error"] and "outside the repository" in err.body["error"]
    assert srv.call("GET", "/system")["blocks"] == []
    digest = hashlib.sha256(open(os.path.join(linked_repo, "toy", "outside.pt"), "rb").read()).hexdigest()
    with open(os.path.join(linked_repo, "toy", "manifest.json"), "w") as f:
        json.dump({"blocks": {"outside.pt": {"sha256": digest}}}, f)
    srv.call("POST", "/system/update", body, timeout=60)
    with Client(srv.dispatcher, timeout=20) as c:
        assert torch.equal(c.infer("t", torch.ones(3)), torch.full((3,), 2.0))


def test_a_request_the_dispatcher_cannot_place_is_answered(server_factory, identity_repo):
    # Found by killing the dispatcher while another job deleted /dev/shm/blockflow-* (what a
    # careless cleanup script does): the new dispatcher could not create its slot file, logged the
    # exception and never answered, so the client waited for its whole deadline.
    srv = server_factory(identity_repo)
    srv.call("POST", "/system/update", IPC, timeout=60)
    shm_dir = srv.call("GET", "/system")["shm"]["dir"]
    shutil.rmtree(shm_dir)  # before the first request: no slot exists yet
    t0 = time.monotonic()
    with Client(srv.dispatcher, timeout=30) as c:
        with pytest.raises(BlockFlowError) as e:
            c.infer("t", torch.ones(1024))
    assert time.monotonic() - t0 < 10, "answered at once, not at the client's deadline"
    assert e.value.code == "unavailable" and shm_dir in str(e.value), (e.value.code, str(e.value))
    os.makedirs(shm_dir, mode=0o700)  # so the server's own clean-up finds what it expects
