"""The control plane end to end: a real ``blockflow serve`` on free ports, driven over HTTP.

Covers the acceptance of the control-plane issue: updates applied, changed and torn down while
requests flow (every request answered exactly once), every class of invalid update refused with
400 and the offending field, crash detection and respawn, all-or-nothing updates, block
deletion rules, the per-block endpoints, health, the token, and the ResNet50 shared config.
"""
from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import tempfile
import threading
import time
import urllib.parse

import psutil
import pytest
import torch

from blockflow.client import BlockFlowError, Client
from blockflow.restclient import RestError
from conftest import loaded_libraries, slot_files_of, wait_for

#: Error codes a request may legitimately end with when a change caught it in flight.
ALLOWED_CODES = {"unknown_task", "block_failed", "unavailable", "shutdown"}
CLIENT_TIMEOUT = 15.0


# -- helpers -----------------------------------------------------------------------------------

def update_body(blocks: dict, tasks: dict, **top) -> dict:
    """blocks: name -> model path or dict of block fields; tasks: id -> path."""
    decls = []
    for name, spec in blocks.items():
        decl = {"name": name, **(spec if isinstance(spec, dict) else {"model": spec})}
        decls.append(decl)
    return {**top, "blocks": decls, "tasks": [{"id": t, "path": list(p)} for t, p in tasks.items()]}


def rest_error(server, method, path, body=None, **kw) -> RestError:
    with pytest.raises(RestError) as info:
        server.call(method, path, body, timeout=30, **kw)
    err = info.value
    assert isinstance(err.body, dict) and not err.body.get("not_json"), f"error body is not JSON: {err.body}"
    assert "error" in err.body, err.body
    return err




def post_without_length(server, path: str) -> tuple[int, dict | None]:
    """POST as ``curl -X POST URL`` sends it: no body, and no Content-Length header either."""
    u = urllib.parse.urlsplit(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        conn.putrequest("POST", path)
        conn.endheaders()  # a plain request sends no Content-Length (conn.request would add one)
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, json.loads(raw) if raw.startswith(b"{") else {"not_json": raw[:200]}
    finally:
        conn.close()


def block_of(system: dict, name: str) -> dict | None:
    return next((b for b in system["blocks"] if b["name"] == name), None)


def fingerprint(system: dict) -> dict:
    """What must not change when an update is refused."""
    return {"version": system["version"],
            "blocks": sorted((b["name"], b["pid"], b["incarnation"], b["status"], b["model"]) for b in system["blocks"]),
            "tasks": system["tasks"]}


def pid_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


TOY = {"identity": "toy/identity.pt", "double": "toy/double.pt", "sleepy": "toy/sleepy.pt",
       "broken": "toy/broken.pt"}
SIMPLE = update_body({"a": TOY["identity"], "d": TOY["double"]}, {"t": ["a", "d"]})


# -- 1. apply, change and tear down while requests flow ------------------------------------------

# Each phase: (blocks, tasks). Phase 4 is DELETE /system.
PHASES = [
    ({"s": TOY["sleepy"], "d": TOY["double"]},
     {"t1": ["s", "d"], "t2": ["d"]}),
    ({"s": TOY["sleepy"], "d": TOY["double"], "d2": TOY["double"]},                    # add a block (+ a task on it)
     {"t1": ["s", "d"], "t2": ["d"], "t3": ["d", "d2"]}),
    ({"s": TOY["sleepy"], "d": TOY["double"], "d2": {"model": TOY["double"], "threads": 1}},  # d2 replaced
     {"t1": ["s", "d", "d2"], "t2": ["d"], "t3": ["d", "d2"]}),                           # t1's path changed
    ({"s": TOY["sleepy"], "d": TOY["double"], "d2": {"model": TOY["double"], "threads": 1}},
     {"t1": ["s", "d", "d2"], "t3": ["d", "d2"]}),                                       # t2 removed
    ({}, {}),                                                                            # DELETE /system
]
#: Tasks whose in-flight requests a transition into phase k may fail (a block on their path went away).
DISRUPTED = {0: set(), 1: set(), 2: {"t3"}, 3: {"t2"}, 4: {"t1", "t2", "t3"}}


def test_topology_changes_while_requests_flow(server_factory, identity_repo):
    srv = server_factory(identity_repo)
    local = {m: torch.jit.load(os.path.join(identity_repo, m)) for m in (TOY["identity"], TOY["double"], TOY["sleepy"])}
    inputs = [torch.randn(1, 16384, generator=torch.Generator().manual_seed(i)) for i in range(3)]

    def model_of(phase, name):
        spec = PHASES[phase][0][name]
        return spec["model"] if isinstance(spec, dict) else spec

    def expected(phase, task, i):
        if task not in PHASES[phase][1]:
            return None
        x = inputs[i]
        with torch.inference_mode():
            for name in PHASES[phase][1][task]:
                x = local[model_of(phase, name)](x)
        return x

    table = {(p, t, i): expected(p, t, i) for p in range(len(PHASES)) for t in ("t1", "t2", "t3") for i in range(3)}

    state = {"phase": 0}
    stop = threading.Event()
    records: list[tuple] = []          # (task, i, phase at submit, phase at answer, kind, detail)
    left_waiting: list[list] = []      # request ids a client loop still waited for when it ended
    lock = threading.Lock()

    def loop(tasks):
        n = 0
        with Client(srv.dispatcher, timeout=CLIENT_TIMEOUT) as c:
            while not stop.is_set():
                task, i = tasks[n % len(tasks)], n % len(inputs)
                n += 1
                ps = state["phase"]
                try:
                    y = c.infer(task, inputs[i], timeout=CLIENT_TIMEOUT)
                    out = ("ok", y)
                except BlockFlowError as exc:
                    out = ("error", (exc.code, str(exc)))
                except TimeoutError as exc:
                    out = ("timeout", str(exc))
                except Exception as exc:  # noqa: BLE001 - everything else is a failure to record
                    out = ("other", repr(exc))
                with lock:
                    records.append((task, i, ps, state["phase"], *out))
                if out[0] == "error":
                    time.sleep(0.005)  # errors come back at once; do not spin
            if c._waiting:  # checked by the test after the join: an assert here would only warn
                with lock:
                    left_waiting.append(sorted(c._waiting))

    threads = [threading.Thread(target=loop, args=(["t1"],), daemon=True),
               threading.Thread(target=loop, args=(["t2", "t3", "t1"],), daemon=True)]

    def progress(n=6):
        start = len(records)
        wait_for(lambda: len(records) >= start + n, 20, f"{n} more answered requests")

    res = srv.call("POST", "/system/update", update_body(*PHASES[0]), timeout=60)
    assert res["version"] == 1 and sorted(res["diff"]["spawned"]) == ["d", "s"]
    for t in threads:
        t.start()
    try:
        progress()
        res = srv.call("POST", "/system/update", update_body(*PHASES[1]), timeout=60)
        state["phase"] = 1
        assert res["diff"]["spawned"] == ["d2"] and sorted(res["diff"]["kept"]) == ["d", "s"]
        assert res["diff"]["tasks"]["added"] == ["t3"]
        progress()
        res = srv.call("POST", "/system/update", update_body(*PHASES[2]), timeout=60)
        state["phase"] = 2
        assert res["diff"]["replaced"] == ["d2"] and res["diff"]["tasks"]["changed"] == ["t1"]
        progress()
        res = srv.call("POST", "/system/update", update_body(*PHASES[3]), timeout=60)
        state["phase"] = 3
        assert res["diff"]["tasks"]["removed"] == ["t2"] and res["diff"]["spawned"] == res["diff"]["replaced"] == []
        progress()
        pids = [b["pid"] for b in srv.call("GET", "/system")["blocks"]]
        res = srv.call("DELETE", "/system", timeout=60)
        state["phase"] = 4
        assert sorted(res["removed"]) == ["d", "d2", "s"]
        progress()
    finally:
        stop.set()
        for t in threads:
            t.join(CLIENT_TIMEOUT + 10)
    assert not any(t.is_alive() for t in threads), "a client loop hangs"
    assert not left_waiting, f"requests still waiting for their reply when the loops ended: {left_waiting}"

    system = srv.call("GET", "/system")
    assert system["blocks"] == [] and system["tasks"] == [] and system["version"] == 5
    # the control plane ran five updates, spawned, replaced and retired blocks without torch:
    # it never runs a model (blocks/spec.py, blockflow/core/header.py), so it never loads libtorch
    assert not loaded_libraries(srv.proc.pid, "libtorch"), "blockflow serve loaded torch"
    wait_for(lambda: all(pid_gone(p) for p in pids), 10, "removed blocks exit")

    unanswered = [r for r in records if r[4] in ("timeout", "other")]
    bad_values, bad_errors = [], []
    for task, i, ps, pd, kind, detail in records:
        window = range(ps, min(pd + 1, len(PHASES) - 1) + 1)
        if kind == "ok":
            if not any(table[(p, task, i)] is not None and torch.allclose(detail, table[(p, task, i)], atol=1e-5)
                       for p in window):
                bad_values.append((task, i, ps, pd))
        elif kind == "error":
            code, msg = detail
            excused = any(task not in PHASES[p][1] or task in DISRUPTED[p] for p in window)
            if code not in ALLOWED_CODES or not excused:
                bad_errors.append((task, ps, pd, code, msg))
    oks = {(r[0], r[2]) for r in records if r[4] == "ok" and r[2] == r[3]}
    summary = {k: sum(1 for r in records if r[4] == k) for k in ("ok", "error", "timeout", "other")}
    print(f"\n{len(records)} requests during the topology changes: {summary}")
    assert not unanswered, f"{len(unanswered)} requests were not answered: {unanswered[:5]}"
    assert not bad_values, f"wrong results: {bad_values[:5]}"
    assert not bad_errors, f"errors that no change explains: {bad_errors[:5]}"
    for phase in range(4):  # the pipeline really served in every phase, not only errors
        assert ("t1", phase) in oks, f"no successful t1 request within phase {phase}"
    assert ("t3", 2) in oks or ("t3", 3) in oks
    assert summary["ok"] > 20


# -- 2. every class of invalid update refused ----------------------------------------------------

BASE_BLOCKS = [{"name": "a", "model": TOY["identity"]}, {"name": "d", "model": TOY["double"]}]
BASE_TASKS = [{"id": "t", "path": ["a", "d"]}]


def _body(blocks=None, tasks=None, **top):
    return {**top, "blocks": BASE_BLOCKS if blocks is None else blocks, "tasks": BASE_TASKS if tasks is None else tasks}


def _block(**fields):
    return [{"name": "a", "model": TOY["identity"], **fields}]


J = "application/json"
# id: (body (dict/list) or raw bytes, content type, expected status, expected "field")
INVALID = {
    "path-undeclared-block": (_body(tasks=[{"id": "t", "path": ["a", "zzz"]}]), J, 400, "tasks[0].path[1]"),
    "duplicate-block-name": (_body(blocks=BASE_BLOCKS + [{"name": "a", "model": TOY["double"]}]), J, 400,
                             "blocks[2].name"),
    "duplicate-task-id": (_body(tasks=BASE_TASKS + [{"id": "t", "path": ["d"]}]), J, 400, "tasks[1].id"),
    "model-not-in-repo": (_body(blocks=_block(model="toy/missing.pt"), tasks=[]), J, 400, "blocks[0].model"),
    "model-escapes-repo": (_body(blocks=_block(model="../../etc/passwd"), tasks=[]), J, 400, "blocks[0].model"),
    "model-absolute-path": (_body(blocks=_block(model="/etc/passwd"), tasks=[]), J, 400, "blocks[0].model"),
    "model-fails-manifest": (_body(blocks=_block(model="resnet18/block1.pt"), tasks=[]), J, 400, "blocks[0].model"),
    "model-not-a-string": (_body(blocks=_block(model=7), tasks=[]), J, 400, "blocks[0].model"),
    "model-missing": (_body(blocks=[{"name": "a"}], tasks=[]), J, 400, "blocks[0].model"),
    "device-unknown": (_body(blocks=_block(device="tpu"), tasks=[]), J, 400, "blocks[0].device"),
    "device-cuda-on-cpu-host": (_body(blocks=_block(device="cuda"), tasks=[]), J, 400, "blocks[0].device"),
    "device-cuda1-on-cpu-host": (_body(blocks=_block(device="cuda:1"), tasks=[]), J, 400, "blocks[0].device"),
    "transport-bad": (_body(transport="carrier-pigeon"), J, 400, "transport"),
    "block-transport-bad": (_body(blocks=_block(transport="udp"), tasks=[]), J, 400, "blocks[0].transport"),
    "protocol-bad": (_body(protocol="udp"), J, 400, "protocol"),
    "block-protocol-bad": (_body(blocks=_block(protocol=5), tasks=[]), J, 400, "blocks[0].protocol"),
    "body-not-json": (b"{not json", J, 400, "body"),
    "body-empty": (b"", J, 400, "body"),
    "body-whitespace": (b"  \n ", J, 400, "body"),
    "body-not-utf8": (b"\xff\xfe\xfa", J, 400, "body"),
    "body-a-list": ([], J, 400, "body"),
    "body-null": (b"null", J, 400, "body"),
    "body-deeply-nested": (b"[" * 200000 + b"]" * 200000, J, 400, "body"),
    "blocks-not-a-list": ({"blocks": {"a": TOY["identity"]}, "tasks": []}, J, 400, "blocks"),
    "blocks-missing": ({"tasks": []}, J, 400, "blocks"),
    "block-not-an-object": (_body(blocks=["a"], tasks=[]), J, 400, "blocks[0]"),
    "tasks-not-a-list": (_body(tasks={"t": ["a"]}), J, 400, "tasks"),
    "task-without-path": (_body(tasks=[{"id": "t"}]), J, 400, "tasks[0].path"),
    "task-empty-path": (_body(tasks=[{"id": "t", "path": []}]), J, 400, "tasks[0].path"),
    "task-hop-not-a-string": (_body(tasks=[{"id": "t", "path": [1]}]), J, 400, "tasks[0].path[0]"),
    "threads-a-string": (_body(blocks=_block(threads="two"), tasks=[]), J, 400, "blocks[0].threads"),
    "threads-zero": (_body(blocks=_block(threads=0), tasks=[]), J, 400, "blocks[0].threads"),
    "threads-bool": (_body(blocks=_block(threads=True), tasks=[]), J, 400, "blocks[0].threads"),
    "threads-float": (_body(blocks=_block(threads=1.5), tasks=[]), J, 400, "blocks[0].threads"),
    "cpus-out-of-range": (_body(blocks=_block(cpus=[0, 4096]), tasks=[]), J, 400, "blocks[0].cpus"),
    "cpus-negative": (_body(blocks=_block(cpus=[-1]), tasks=[]), J, 400, "blocks[0].cpus"),
    "cpus-empty": (_body(blocks=_block(cpus=[]), tasks=[]), J, 400, "blocks[0].cpus"),
    "cpus-not-a-list": (_body(blocks=_block(cpus="0-3"), tasks=[]), J, 400, "blocks[0].cpus"),
    "name-invalid": (_body(blocks=_block(name="a b/c"), tasks=[]), J, 400, "blocks[0].name"),
    "name-too-long": (_body(blocks=_block(name="x" * 64), tasks=[]), J, 400, "blocks[0].name"),
    "task-id-invalid": (_body(tasks=[{"id": "", "path": ["a"]}]), J, 400, "tasks[0].id"),
    "unknown-top-level-field": (_body(extra=1), J, 400, "extra"),
    "unknown-block-field": (_body(blocks=_block(gpu=0), tasks=[]), J, 400, "blocks[0].gpu"),
    "unknown-task-field": (_body(tasks=[{"id": "t", "path": ["a"], "weight": 2}]), J, 400, "tasks[0].weight"),
    "path-loops": (_body(tasks=[{"id": "t", "path": ["a", "d", "a"]}]), J, 400, "tasks[0].path[2]"),
    "too-many-blocks": (_body(blocks=[{"name": f"b{i}", "model": TOY["identity"]} for i in range(65)], tasks=[]),
                        J, 400, "blocks"),
    "content-type-text": (_body(), "text/plain", 415, None),
    "content-type-form": (_body(), "application/x-www-form-urlencoded", 415, None),
    "content-type-multipart": (b"--x\r\n\r\n--x--", "multipart/form-data; boundary=x", 415, None),
    "content-type-json-with-charset-still-checked": (b"[", "application/json; charset=utf-8", 400, "body"),
}


@pytest.fixture(scope="class")
def refusing_server(model_repo, identity_repo, tmp_path_factory):
    """One server for every invalid-update case; its repository has a corrupt manifest-listed file."""
    from blockflow.demo import start_server, stop_server
    from blockflow.restclient import call

    repo = tmp_path_factory.mktemp("refuse_repo")
    shutil.copytree(os.path.join(identity_repo, "toy"), repo / "toy")
    os.makedirs(repo / "resnet18")
    for name in ("manifest.json", "block1.pt"):
        shutil.copy(os.path.join(model_repo, "resnet18", name), repo / "resnet18" / name)
    data = bytearray((repo / "resnet18" / "block1.pt").read_bytes())
    for k in range(len(data) // 2, len(data) // 2 + 16):
        data[k] ^= 0xFF
    (repo / "resnet18" / "block1.pt").write_bytes(bytes(data))

    me = psutil.Process()
    before_children = {p.pid for p in me.children(recursive=True)}
    state = tempfile.mkdtemp(prefix="bft-")
    proc, info = start_server(str(repo), state)

    class S:
        url, dispatcher = info["rest"], info["dispatcher"]

        def call(self, method, path, body=None, **kw):
            return call(method, self.url + path, body, **kw)

    srv = S()
    try:
        srv.call("POST", "/system/update", _body(), timeout=60)
        yield srv
    finally:
        code = stop_server(proc)
        shutil.rmtree(state, ignore_errors=True)
    assert code == 0, f"server exited with {code}"

    def leftovers():
        return [p for p in me.children(recursive=True) if p.pid not in before_children and p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE]

    wait_for(lambda: not leftovers(), 10, "every child of the server exits")


class TestInvalidUpdates:
    @pytest.mark.parametrize("case", sorted(INVALID))
    def test_refused_with_field_and_nothing_changes(self, refusing_server, case):
        body, ctype, status, field = INVALID[case]
        before = fingerprint(refusing_server.call("GET", "/system"))
        assert before["version"] == 1 and len(before["blocks"]) == 2
        kw = {"raw": body} if isinstance(body, bytes) else {}
        err = rest_error(refusing_server, "POST", "/system/update", None if kw else body, content_type=ctype, **kw)
        assert err.status == status, f"{case}: HTTP {err.status} {err.body}"
        assert err.body.get("status") == status
        if field is not None:
            assert err.body.get("field") == field, f"{case}: {err.body}"
            assert err.body["error"].startswith(field), err.body
        assert fingerprint(refusing_server.call("GET", "/system")) == before

    def test_server_still_serves_after_refusals(self, refusing_server):
        with Client(refusing_server.dispatcher, timeout=CLIENT_TIMEOUT) as c:
            assert torch.equal(c.infer("t", torch.ones(3)), torch.full((3,), 2.0))
        # a valid update still goes through afterwards (the first one is still the one applied)
        res = refusing_server.call("POST", "/system/update", _body(tasks=[{"id": "t", "path": ["d", "a"]}]),
                                   timeout=60)
        assert res["version"] == 2 and res["diff"]["tasks"]["changed"] == ["t"] and res["diff"]["spawned"] == []


# -- 3. a killed block is detected, respawned, and serves again --------------------------------

def test_killed_block_is_respawned(server_factory, identity_repo):
    srv = server_factory(identity_repo)
    srv.call("POST", "/system/update", SIMPLE, timeout=60)
    x = torch.arange(6, dtype=torch.float32)
    with Client(srv.dispatcher, timeout=CLIENT_TIMEOUT) as c:
        assert torch.equal(c.infer("t", x), x * 2)
        old = srv.call("GET", "/blocks/d")
        assert old["status"] == "ready" and old["restarts"] == 0
        t0 = time.monotonic()
        assert slot_files_of(old["pid"]), "block d should own the slots of its result edge"
        os.kill(old["pid"], signal.SIGKILL)

        def respawned():
            b = block_of(srv.call("GET", "/system"), "d")
            return b if b and b["restarts"] >= 1 and b["pid"] != old["pid"] and b["status"] == "ready" else None

        new = wait_for(respawned, 10, "the killed block is respawned")
        took = time.monotonic() - t0
        print(f"\nkilled block detected and respawned in {took:.2f}s")
        assert took < 5, f"respawn took {took:.1f}s"
        assert new["incarnation"] > old["incarnation"]
        # the manager reaps the child and names how it ended (manager.on_child_down)
        assert "SIGKILL" in (new.get("last_exit") or ""), new
        assert not slot_files_of(old["pid"]), "the killed block's slot files were left in /dev/shm"
        assert srv.call("GET", "/blocks/a")["pid"] == srv.call("GET", "/system")["blocks"][0]["pid"]
        assert srv.call("GET", "/health/ready")["status"] == "ok"
        # the pipeline serves again (a request may still meet the switch: retry briefly)
        y = wait_for(lambda: _try_infer(c, "t", x), 10, "the respawned pipeline serves")
        assert torch.equal(y[0], x * 2)
        for _ in range(5):
            assert torch.equal(c.infer("t", x), x * 2)
    assert srv.call("GET", "/system")["version"] == 1


def test_restart_budget_is_for_crash_loops(server_factory, identity_repo):
    """A block that keeps dying at once is marked failed; one that ran a while gets a fresh budget."""
    srv = server_factory(identity_repo, env={"BLOCKFLOW_MAX_RESTARTS": "1", "BLOCKFLOW_RESTART_WINDOW": "4"})
    srv.call("POST", "/system/update", SIMPLE, timeout=60)

    def killed_and_back(pid, restarts):
        os.kill(pid, signal.SIGKILL)
        return wait_for(lambda: (lambda b: b if b["pid"] != pid and b["status"] in ("ready", "failed")
                                 and b["restarts"] >= restarts else None)(block_of(srv.call("GET", "/system"), "d")),
                        10, f"block d handled after kill {restarts}")

    first = srv.call("GET", "/blocks/d")
    b = killed_and_back(first["pid"], 1)  # the first death uses the whole budget of 1
    assert b["status"] == "ready", b
    time.sleep(4.5)                         # it ran longer than the window: not a crash loop
    b = killed_and_back(b["pid"], 2)
    assert b["status"] == "ready", b
    os.kill(b["pid"], signal.SIGKILL)       # dies again at once: the loop's budget is spent
    b = wait_for(lambda: (lambda x: x if x["status"] == "failed" else None)(block_of(srv.call("GET", "/system"), "d")),
                 10, "block d marked failed")
    assert "restarts within" in b["failure"], b


def _try_infer(client, task, x):
    try:
        return [client.infer(task, x, timeout=5)]
    except BlockFlowError:
        return None


# -- 4. a block that cannot load fails the whole update; nothing changes -----------------------

def test_update_with_unloadable_block_is_rolled_back(server_factory, identity_repo):
    srv = server_factory(identity_repo)
    srv.call("POST", "/system/update", SIMPLE, timeout=60)
    before = fingerprint(srv.call("GET", "/system"))
    x = torch.ones(4)
    bad_updates = [
        # a new block that cannot load
        update_body({"a": TOY["identity"], "d": TOY["double"], "bad": TOY["broken"]},
                    {"t": ["a", "d"], "u": ["bad"]}),
        # a new good block and a replaced block that cannot load: the good one is stopped again
        update_body({"a": TOY["identity"], "d": TOY["broken"], "n": TOY["double"]}, {"t": ["a", "d", "n"]}),
    ]
    for body in bad_updates:
        err = rest_error(srv, "POST", "/system/update", body)
        assert err.status == 422, err.body
        assert err.body["rolled_back"] is True and err.body["block"] in ("bad", "d"), err.body
        assert "broken.pt" in err.body["error"], err.body
        after = srv.call("GET", "/system")
        assert fingerprint(after) == before
        assert all(b["status"] == "ready" for b in after["blocks"])
        with Client(srv.dispatcher, timeout=CLIENT_TIMEOUT) as c:
            assert torch.equal(c.infer("t", x), x * 2)
            with pytest.raises(BlockFlowError) as e:
                c.infer("u", x)
            assert e.value.code == "unknown_task"
    assert srv.call("GET", "/health/ready")["status"] == "ok"


# -- 5. deleting a block -------------------------------------------------------------------------

#: Valid block names that are also attribute names of CherryPy handler objects.
AWKWARD_NAMES = ["manager", "GET", "DELETE", "exposed", "actions", "update", "x.y", "ping"]


def test_delete_block_rules(server_factory, identity_repo):
    srv = server_factory(identity_repo)
    blocks = {"a": TOY["identity"], "d": TOY["double"], "spare": TOY["identity"]}
    blocks.update({n: TOY["identity"] for n in AWKWARD_NAMES})
    srv.call("POST", "/system/update", update_body(blocks, {"t": ["a", "d"]}), timeout=60)
    # every valid name is addressable, whatever attributes the handler objects have
    for name in AWKWARD_NAMES:
        assert srv.call("GET", f"/blocks/{name}")["name"] == name
        assert srv.call("GET", f"/blocks/{name}/ping")["name"] == name
    # the block is the one the path names; a query string cannot redirect the call
    err = rest_error(srv, "DELETE", "/blocks/spare?name=d")
    assert err.status == 400
    assert rest_error(srv, "GET", "/blocks/d?name=spare").status == 400
    for name in AWKWARD_NAMES:
        assert srv.call("DELETE", f"/blocks/{name}", timeout=30)["removed"] == name
    err = rest_error(srv, "DELETE", "/blocks/d")
    assert err.status == 409 and "t" in err.body["error"]
    err = rest_error(srv, "DELETE", "/blocks/nope")
    assert err.status == 404
    err = rest_error(srv, "DELETE", "/blocks")
    assert err.status == 405
    spare_pid = srv.call("GET", "/blocks/spare")["pid"]
    res = srv.call("DELETE", "/blocks/spare", timeout=30)
    assert res["removed"] == "spare"
    system = srv.call("GET", "/system")
    assert sorted(b["name"] for b in system["blocks"]) == ["a", "d"]
    assert rest_error(srv, "GET", "/blocks/spare").status == 404
    wait_for(lambda: pid_gone(spare_pid), 10, "the deleted block exits")
    with Client(srv.dispatcher, timeout=CLIENT_TIMEOUT) as c:
        assert torch.equal(c.infer("t", torch.ones(2)), torch.full((2,), 2.0))


# -- 6. per-block endpoints, health, JSON errors -------------------------------------------------

def test_block_endpoints_health_and_json_errors(server_factory, identity_repo):
    srv = server_factory(identity_repo, env={"BLOCKFLOW_MAX_RESTARTS": "0"})
    assert srv.call("GET", "/health/live")["status"] == "ok"
    srv.call("POST", "/system/update", SIMPLE, timeout=60)
    assert srv.call("GET", "/health/ready")["status"] == "ok"
    blocks = srv.call("GET", "/blocks")
    assert sorted(b["name"] for b in blocks) == ["a", "d"]

    ping = srv.call("GET", "/blocks/d/ping")
    assert ping["rtt_ms"] > 0 and ping["pid"] == srv.call("GET", "/blocks/d")["pid"]

    n = 7
    with Client(srv.dispatcher, timeout=CLIENT_TIMEOUT) as c:
        for i in range(n):
            assert torch.equal(c.infer("t", torch.full((8,), float(i))), torch.full((8,), 2.0 * i))
    assert rest_error(srv, "GET", "/blocks/d/kpi").status == 405  # it writes logs out: a POST
    kpi = srv.call("POST", "/blocks/d/kpi")
    assert kpi["name"] == "d" and kpi["count"] >= n
    # as the 405 says and curl sends it: no body, no Content-Length (was 411 Length Required)
    status, kpi = post_without_length(srv, "/blocks/d/kpi")
    assert status == 200 and kpi["name"] == "d" and kpi["count"] >= n, (status, kpi)
    status, err = post_without_length(srv, "/system/update")  # a JSON refusal that says what to send
    assert status == 415 and "application/json" in err["error"], (status, err)
    assert kpi["latency_ms"]["inf"]["mean"] > 0 and kpi["latency_ms"]["total"]["mean"] >= kpi["latency_ms"]["inf"]["mean"]

    assert srv.call("POST", "/blocks/d/monitor", {"enabled": False}) == {"enabled": False}
    assert srv.call("POST", "/blocks/d/monitor", {"enabled": True}) == {"enabled": True}
    for bad in ({"enabled": "x"}, {}, [], {"enabled": 1}):
        err = rest_error(srv, "POST", "/blocks/d/monitor", bad)
        assert err.status == 400 and err.body["field"] == "enabled", err.body
    assert rest_error(srv, "POST", "/blocks/d/monitor", raw=b"{", content_type=J).status == 400
    assert rest_error(srv, "POST", "/blocks/d/monitor", {"enabled": True}, content_type="text/plain").status == 415
    assert rest_error(srv, "POST", "/blocks/nope/monitor", {"enabled": True}).status == 404
    assert rest_error(srv, "GET", "/blocks/nope/ping").status == 404
    assert rest_error(srv, "POST", "/blocks/nope/kpi").status == 404
    assert rest_error(srv, "GET", "/blocks/nope").status == 404
    assert rest_error(srv, "POST", "/blocks/d/ping", {}).status == 405

    for path in ("/nope", "/blocks/d/nope", "/system/nope", "/health/nope"):
        err = rest_error(srv, "GET", path)
        assert err.status == 404, (path, err.status, err.body)
    err = rest_error(srv, "PUT", "/system", {"x": 1})
    assert err.status == 405
    assert rest_error(srv, "GET", "/system/update").status == 405

    # a block that dies with no restarts left is marked failed: not ready, its task unavailable
    os.kill(srv.call("GET", "/blocks/d")["pid"], signal.SIGKILL)
    wait_for(lambda: block_of(srv.call("GET", "/system"), "d")["status"] == "failed", 10, "block marked failed")
    err = rest_error(srv, "GET", "/health/ready")
    assert err.status == 503 and "system" in err.body
    assert srv.call("GET", "/health/live")["status"] == "ok"
    assert rest_error(srv, "GET", "/blocks/d/ping").status == 409
    with Client(srv.dispatcher, timeout=CLIENT_TIMEOUT) as c:
        with pytest.raises(BlockFlowError) as e:
            c.infer("t", torch.ones(2))
        assert e.value.code == "unavailable"
        # posting the same update again replaces the failed block
        res = srv.call("POST", "/system/update", SIMPLE, timeout=60)
        assert res["diff"]["replaced"] == ["d"] and res["diff"]["kept"] == ["a"]
        assert srv.call("GET", "/health/ready")["status"] == "ok"
        assert torch.equal(c.infer("t", torch.ones(2)), torch.full((2,), 2.0))


# -- 7. the token ------------------------------------------------------------------------------

def test_token_guards_mutations_and_clients(server_factory, identity_repo, monkeypatch):
    monkeypatch.delenv("BLOCKFLOW_TOKEN", raising=False)
    srv = server_factory(identity_repo, extra=["--token", "s3cret"])
    err = rest_error(srv, "POST", "/system/update", SIMPLE)
    assert err.status == 401
    assert rest_error(srv, "POST", "/system/update", SIMPLE, token="wrong").status == 401
    assert rest_error(srv, "GET", "/system").status == 401  # reads show pids and paths: guarded too
    assert srv.call("GET", "/system", token="s3cret")["version"] == 0  # nothing was applied
    assert srv.call("GET", "/health/live")["status"] == "ok"  # probes stay open
    res = srv.call("POST", "/system/update", SIMPLE, token="s3cret", timeout=60)
    assert res["version"] == 1
    assert rest_error(srv, "DELETE", "/blocks/a").status == 401
    assert rest_error(srv, "DELETE", "/system").status == 401
    assert rest_error(srv, "POST", "/blocks/a/monitor", {"enabled": False}).status == 401
    x = torch.ones(3)
    with Client(srv.dispatcher, timeout=CLIENT_TIMEOUT, token="") as c:
        with pytest.raises(BlockFlowError) as e:
            c.infer("t", x)
        assert e.value.code == "unauthorized"
    with Client(srv.dispatcher, timeout=CLIENT_TIMEOUT, token="nope") as c:
        with pytest.raises(BlockFlowError) as e:
            c.infer("t", x)
        assert e.value.code == "unauthorized"
    with Client(srv.dispatcher, timeout=CLIENT_TIMEOUT, token="s3cret") as c:
        assert torch.equal(c.infer("t", x), x * 2)
    assert srv.call("DELETE", "/system", token="s3cret", timeout=60)["removed"] == ["a", "d"]


# -- 8. the ResNet50 shared config ---------------------------------------------------------------

@pytest.mark.parametrize("transport", ["tensormq", "zeromq"])
def test_resnet50_shared_config(server_factory, model_repo, transport):
    """The config as shipped (TensorMQ) and with bytes on every hop: both tasks, in flight at
    once, equal their whole models."""
    from blockflow.blocks.repository import load_block

    config = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs",
                          "resnet50_shared.json")
    with open(config) as f:
        update = json.load(f)
    update["transport"] = transport
    srv = server_factory(model_repo)
    res = srv.call("POST", "/system/update", update, timeout=120)
    # how long an update takes is a figure for the experiments (soak.json's updates), not a timed
    # assertion on a loaded CI machine: printed here, not asserted
    print(f"\nresnet50_shared.json ({len(update['blocks'])} blocks) applied in {res['seconds']:.2f}s")
    assert res["version"] == 1 and len(res["diff"]["spawned"]) == 7
    system = srv.call("GET", "/system")
    assert all(b["status"] == "ready" for b in system["blocks"]) and len(system["blocks"]) == 7

    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    with Client(srv.dispatcher, timeout=60) as c:
        fy, fz = c.submit("classify", x), c.submit("special", x)
        y, z = fy.result(), fz.result()
    with torch.inference_mode():
        expected = load_block(model_repo, "resnet50/full.pt")(x)
        special = x
        for b in ("block1", "block2", "block3", "block4-x", "head-x"):
            special = load_block(model_repo, f"resnet50/{b}.pt")(special)
    assert y.shape == z.shape == (2, 1000)
    assert torch.allclose(y, expected, atol=1e-4), (y - expected).abs().max()
    assert torch.allclose(z, special, atol=1e-4), (z - special).abs().max()
    assert not torch.allclose(y, z)
