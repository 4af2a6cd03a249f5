"""Blocks on several machines through a Ray cluster (issue 30): ``blockflow serve --ray``.

One real three-node Ray cluster for the module (``ray.cluster_utils.Cluster``: a head and the
nodes ``edge-a`` and ``edge-b``, each with its own raylet, every one on 127.0.0.1: see
conftest.py for RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER) and one real server joined to it. Blocks
with ``node`` run as children of Ray actors placed by that custom resource; hops between
nodes must travel as bytes over CURVE TCP and hops within a node as TensorMQ handles -- even
though every node has the same address and the same disk, which is why locality has to come
from node identity. Marked ``cluster``; ``make test`` runs them (the cluster extra is installed).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time

import psutil
import pytest
import torch
import zmq

from blockflow.client import BlockFlowError, Client
from blockflow.core.protocol import ErrorCode

from conftest import wait_for
from test_control_plane import rest_error

ray = pytest.importorskip("ray", reason="the cluster extra is not installed: pip install -e '.[cluster]'")

# exclusive: partitions and node losses are seen by deadlines; and a Ray cluster at a time.
pytestmark = [pytest.mark.cluster, pytest.mark.exclusive]

MODEL = "resnet50"
SPLIT = {"b1": ("block1", "edge-a"), "b2": ("block2", "edge-a"), "b3": ("block3", "edge-b"),
         "b4": ("block4", "edge-b"), "h": ("head", "edge-b")}
PATH = list(SPLIT)
#: The nodes' custom resources, a node each (the ``cluster`` fixture).
RESOURCES = ("edge-a", "edge-b")


def _node(resource: str):
    from experiments.chaos import ClusterNodes
    return ClusterNodes.node_args(resource)


def _live_resources(c) -> set[str]:
    """What live nodes advertise in Ray's node table (the GCS): what the server's update check
    asks (manager/ray_launcher.py ``live_resources``)."""
    return {r for n in c.global_state.node_table() if n.get("Alive") for r in n.get("Resources", {})}


@pytest.fixture(scope="module")
def cluster():
    """(ray.cluster_utils.Cluster, {resource: node}): a head, edge-a and edge-b (experiments/chaos.py)."""
    from experiments.chaos import ClusterNodes
    tmp = tempfile.mkdtemp(prefix="bfray-")
    mp = pytest.MonkeyPatch()
    mp.setenv("RAY_TMPDIR", tmp)  # restored after: ClusterNodes.start puts all of Ray's files there
    try:
        nodes = ClusterNodes.start(list(RESOURCES), tmp)
        try:
            yield nodes.cluster, nodes.nodes
        finally:
            nodes.cluster.shutdown()
    finally:
        mp.undo()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(autouse=True)
def nodes_up(cluster):
    """Each test starts with a live node for edge-a and one for edge-b. A test that removes or
    cuts a node adds one back at its end; one that failed before that would leave every later
    test without it (``no node of the Ray cluster advertises the resource 'edge-b'``)."""
    c, nodes = cluster
    for stray in [n for n in list(c.worker_nodes) if n not in nodes.values()]:
        try:  # popped by a failed test (cut, or removed halfway): whatever of it is left goes
            c.remove_node(stray, allow_graceful=False)
        except Exception as exc:  # it may be half gone already
            print(f"\nremoving a stray node of an earlier test: {exc}")
    for resource in RESOURCES:
        if resource in nodes and resource in _live_resources(c):
            continue
        if resource in nodes:  # in our table, dead in Ray's
            try:
                c.remove_node(nodes.pop(resource), allow_graceful=False)
            except Exception as exc:
                print(f"\nremoving the dead {resource} node: {exc}")
        print(f"\nan earlier test left no live {resource} node: adding one")
        nodes[resource] = c.add_node(**_node(resource))
        wait_for(lambda: resource in _live_resources(c), 60, f"a live {resource} node in Ray's node table")
    yield


def _remote_blocks() -> list[psutil.Process]:
    """Block processes started by a node agent (manager/ray_launcher.py: ``-m
    blockflow.blocks.process --spec -``), on any node of the test cluster (all on this machine)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = p.info["cmdline"] or []
        if "blockflow.blocks.process" in cmd and cmd[-2:] == ["--spec", "-"] and p.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(p)
    return found


@pytest.fixture(scope="module")
def server(cluster, model_repo):
    from blockflow.demo import start_server, stop_server
    c, _ = cluster
    state = tempfile.mkdtemp(prefix="bfc-")
    proc, info = start_server(model_repo, state, extra=["--ray", c.address], env=dict(os.environ))

    class Srv:
        url, dispatcher, state_dir = info["rest"], info["dispatcher"], state

        def call(self, method, path, body=None, **kw):
            from blockflow.restclient import call
            return call(method, self.url + path, body, **kw)

    try:
        yield Srv()
    finally:
        code = stop_server(proc)
        leftover = [p.pid for p in _remote_blocks()]
        shutil.rmtree(state, ignore_errors=True)
        assert code == 0, f"server exited with {code} on SIGTERM"
        assert not leftover, f"block processes left on the nodes after the server stopped: {leftover}"


def _why_still_running(pids: dict[str, int]) -> str:
    """For a failure message: each of ``pids`` (block name -> pid) still running, with its state,
    its parent's (the node agent it watches), its threads' stacks (py-spy, where installed) and
    the last lines it logged (a block started by an agent logs into that Ray worker's .err file)."""
    import glob
    import subprocess
    import sys
    lines = []
    spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
    for name, pid in pids.items():
        try:
            p = psutil.Process(pid)
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            ppid = p.ppid()
            parent = psutil.Process(ppid)
            lines.append(f"{name} (pid {pid}, {p.status()}): parent {ppid} {parent.name()} {parent.status()}")
        except psutil.Error as exc:
            lines.append(f"{name} (pid {pid}): {exc!r}")
            continue
        if os.path.exists(spy):
            dump = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
            lines.append(dump.stdout + dump.stderr)
        for err in glob.glob(os.path.join(os.environ.get("RAY_TMPDIR", "/nonexistent"), "**", f"worker-*-{ppid}.err"),
                             recursive=True):
            with open(err, errors="replace") as f:
                lines.append(f"{err}, its last lines:\n" + "".join(f.readlines()[-15:]))
    return "\n".join(lines)


def _body(nodes: dict[str, str | None]) -> dict:
    blocks = []
    for name, (stem, _) in SPLIT.items():
        b = {"name": name, "model": f"{MODEL}/{stem}.pt", "threads": 1}
        if nodes.get(name):
            b["node"] = nodes[name]
        blocks.append(b)
    return {"transport": "tensormq", "blocks": blocks, "tasks": [{"id": "classify", "path": PATH}]}


def _expected(model_repo, x):
    from blockflow.blocks.repository import load_block
    with torch.inference_mode():
        return load_block(model_repo, f"{MODEL}/full.pt")(x)


def _hops(srv) -> dict[str, dict[str, str]]:
    return {b["name"]: b["next_hops"] for b in srv.call("GET", "/system")["blocks"]}


# First in the module, before the module's ``server`` exists: that server's own blocks on edge-a
# would be respawned on the rejoining node too, and on a loaded 2-core machine the two servers'
# torch imports there delayed this run's recovery past its quiet time (b1 ready 36 s after the removal).
def test_chaos_with_a_node_removed_and_rejoining(cluster, model_repo):
    """The chaos run (experiments/chaos.py) with blocks on two nodes and a node-removal fault
    first, then kills and updates: every request still gets exactly one right reply, and every
    fault's tasks serve again (the removed node's blocks once a node with its resource rejoins)."""
    from experiments.chaos import CLUSTER_NODES, ClusterNodes, run_chaos
    from test_chaos import assert_one_reply_each, assert_recovered
    # faults stop 25 s before the load does: a node that rejoins 3 s after its removal then has
    # time to start its blocks again (an agent, a process importing torch) on a loaded 2-core machine
    # (make test runs this file beside the chaos file; with a CPU hog as well, 15 s once fell short)
    report = run_chaos(model_repo, duration=40.0, rate=5.0, seed=149, fault_every=4.0, cluster=ClusterNodes(*cluster),
                       nodes=CLUSTER_NODES, kinds=("remove_node", "kill_block", "update"), quiet_s=25.0)
    assert report["faults"][0]["kind"] == "remove_node", report["faults"]
    assert_recovered(report)
    # A removed node's tasks are refused (``unavailable``) until a node with its resource is back
    # and its blocks have started again: 11 s in one run, 17 s in another (2-core machine, make
    # test's exclusive phase), and a node's removal is first seen by the requests after it only
    # once Ray calls the node dead, so neither the share of answered requests (59%, 26%, 34% in
    # three runs) nor the first answer after the removal says whether serving came back whole.
    # What holds whatever the load: each task's last requests, sent once every fault is over,
    # are all answered with results.
    removal = report["faults"][0]
    assert removal["outcome"].startswith("recovered"), removal  # seed 149: the node's tasks are kept
    print(f"\nnode removed at {removal['t']:.1f}s: {report['ok']} of {report['sent']} answered, errors "
          f"{report['errors']}; each task's last run of results {report['final_streak']}")
    assert_one_reply_each(report, ok_share=0.0)
    assert set(report["final_streak"]) == {"classify", "special"}, report["final_streak"]
    assert all(n >= 5 for n in report["final_streak"].values()), \
        f"a task did not end serving (its last requests were refused): {report['final_streak']}"


def test_a_split_task_across_two_nodes_answers_as_the_whole_model(server, model_repo):
    res = server.call("POST", "/system/update", _body({n: node for n, (_, node) in SPLIT.items()}), timeout=240)
    assert sorted(res["diff"]["spawned"]) == sorted(SPLIT), res
    system = server.call("GET", "/system")
    nodes = {b["name"]: b["node"] for b in system["blocks"]}
    assert nodes["b1"] == nodes["b2"] != nodes["b3"] == nodes["b4"] == nodes["h"], nodes
    assert system["dispatcher"]["node"] not in (nodes["b1"], nodes["b3"]), system["dispatcher"]
    # the hop kinds follow the nodes, though every node is 127.0.0.1 on one disk
    assert _hops(server) == {"b1": {"b2": "handles"}, "b2": {"b3": "tcp"}, "b3": {"b4": "handles"},
                             "b4": {"h": "handles"}, "h": {"@dispatcher": "tcp"}}
    xs = [torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    with Client(server.dispatcher, timeout=120) as c:
        ys = [c.infer("classify", x) for x in xs]
    for x, y in zip(xs, ys):
        want = _expected(model_repo, x)
        assert torch.allclose(y, want, atol=1e-4), (y - want).abs().max()
    # what each block saw: b3 (first on edge-b) got bytes over TCP, b2 and b4 got handles
    kinds = {name: server.call("GET", f"/blocks/{name}/ping").get("received", {}) for name in ("b2", "b3", "b4")}
    assert kinds["b2"].get("shm", 0) >= 3 and not kinds["b2"].get("bytes"), kinds
    assert kinds["b3"].get("bytes", 0) >= 3 and not kinds["b3"].get("shm"), kinds
    assert kinds["b4"].get("shm", 0) >= 3 and not kinds["b4"].get("bytes"), kinds


def test_a_block_moves_to_the_other_node_by_an_update(server, model_repo):
    placed = {n: node for n, (_, node) in SPLIT.items()}
    server.call("POST", "/system/update", _body(placed), timeout=240)
    before = {b["name"]: (b["node"], b["incarnation"]) for b in server.call("GET", "/system")["blocks"]}
    res = server.call("POST", "/system/update", _body({**placed, "b3": "edge-a"}), timeout=240)
    assert res["diff"]["replaced"] == ["b3"], res
    after = {b["name"]: (b["node"], b["incarnation"]) for b in server.call("GET", "/system")["blocks"]}
    assert after["b3"][0] == before["b1"][0] != before["b3"][0], (before, after)
    assert {n: after[n] for n in ("b1", "b2", "b4", "h")} == {n: before[n] for n in ("b1", "b2", "b4", "h")}
    assert _hops(server)["b2"] == {"b3": "handles"} and _hops(server)["b3"] == {"b4": "tcp"}
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(7))
    with Client(server.dispatcher, timeout=120) as c:
        y = c.infer("classify", x)
    assert torch.allclose(y, _expected(model_repo, x), atol=1e-4)


def test_an_update_naming_a_node_nobody_advertises_is_refused_at_once(server):
    err = rest_error(server, "POST", "/system/update", _body({"b1": "edge-z"}))
    message = err.body["error"]
    assert err.status == 400 and "edge-z" in message and "ray start --resources" in message, err.body


def test_a_peer_without_the_cluster_key_is_refused_by_a_block(server):
    server.call("POST", "/system/update", _body({n: node for n, (_, node) in SPLIT.items()}), timeout=240)
    system = server.call("GET", "/system")
    b3 = next(b for b in system["blocks"] if b["name"] == "b3")
    public = system["cluster"]["server_public_key"]
    assert b3["endpoint"].startswith("tcp://127.0.0.1:")  # Ray mode: paths name blocks by their TCP endpoint
    ctx = zmq.Context()
    try:
        push = ctx.socket(zmq.PUSH)
        push.linger = 0
        monitor = push.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        stranger_public, stranger_secret = zmq.curve_keypair()  # knows the server's key, not the cluster's client key
        push.curve_serverkey, push.curve_publickey, push.curve_secretkey = public.encode(), stranger_public, stranger_secret
        push.connect(b3["endpoint"])
        push.send(b'{"rid": 1}', zmq.NOBLOCK)
        from zmq.utils.monitor import recv_monitor_message
        assert monitor.poll(10000), "no handshake outcome within 10 s"
        event = recv_monitor_message(monitor)
        assert event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH, event
        monitor.close(linger=0)
        push.close(linger=0)
    finally:
        ctx.term()
    assert next(b for b in server.call("GET", "/system")["blocks"] if b["name"] == "b3")["status"] == "ready"


def test_a_node_lost_under_load_answers_every_request_and_serving_resumes_when_it_rejoins(server, cluster,
                                                                                          model_repo):
    c, nodes = cluster
    placed = {n: node for n, (_, node) in SPLIT.items()}
    server.call("POST", "/system/update", _body(placed), timeout=240)
    b2_node = {b["name"]: b["node"] for b in server.call("GET", "/system")["blocks"]}["b2"]
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(3))
    want = _expected(model_repo, x)
    outcomes: list[tuple[str, float, float]] = []  # (ok | error code, sent, answered)
    stop = threading.Event()

    def client():
        with Client(server.dispatcher, timeout=30) as cl:
            while not stop.is_set():
                sent = time.monotonic()
                try:
                    y = cl.infer("classify", x)
                    outcomes.append(("ok" if torch.allclose(y, want, atol=1e-4) else "wrong", sent, time.monotonic()))
                except BlockFlowError as exc:
                    outcomes.append((str(exc.code), sent, time.monotonic()))
                    time.sleep(0.05)

    threads = [threading.Thread(target=client) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: sum(o[0] == "ok" for o in outcomes) >= 4, 120, "four answers before the fault")
        removed_at = time.monotonic()
        c.remove_node(nodes.pop("edge-b"), allow_graceful=False)
        wait_for(lambda: any(o[1] >= removed_at + 1 and o[0] != "ok" for o in outcomes), 30,
                 "requests refused while edge-b is gone")
        seen: list = []  # what GET /system said last about b3, b4 and h: the failure names it

        def waiting():
            seen[:] = [{b["name"]: (b.get("waiting_for_node"), b["status"], b["incarnation"], b.get("last_exit"))
                        for b in server.call("GET", "/system")["blocks"] if b["name"] in ("b3", "b4", "h")}]
            return {name: row[0] for name, row in seen[0].items()} == {"b3": "edge-b", "b4": "edge-b", "h": "edge-b"}
        try:
            wait_for(waiting, 60, "GET /system saying which blocks wait for a node with edge-b")
        except AssertionError as exc:
            alive = [n.get("NodeID", "?")[:8] for n in c.global_state.node_table()
                     if n.get("Alive") and "edge-b" in n.get("Resources", {})]
            raise AssertionError(f"{exc}; b3, b4, h (waiting_for_node, status, incarnation, last_exit): {seen}; "
                                 f"live nodes advertising edge-b in Ray's node table: {alive}") from None
        blocks_waited = time.monotonic() - removed_at
        ray_still_listed = "edge-b" in _live_resources(c)
        # GET /system may say so before Ray's node table, which the update's check asks, stops
        # listing edge-b: Ray reports the agents dead at once, their respawns wait unplaced, and
        # it lists the node alive until its health checks give up on it (about 2 s,
        # experiments/chaos.py). An update in between passes the check, Ray places b2 on the dying
        # node, and the rollback refuses it ("b2#1 exited before it was ready [exit code 5 (its
        # node was lost)]; the update was rolled back": also 422, nothing changed; posted 0.01 s
        # after a removal it always is). Both refusals are right for what Ray knew when asked;
        # this test is about the check, so it asks once Ray's table says the node is gone.
        wait_for(lambda: "edge-b" not in _live_resources(c), 30, "Ray's node table calling edge-b dead")
        ray_dead = time.monotonic() - removed_at
        # an update that would start a block on the missing node is refused at once, nothing changed
        asked = time.monotonic()
        err = rest_error(server, "POST", "/system/update", _body({**placed, "b2": "edge-b"}))
        assert err.status == 422 and err.body["block"] == "b2" and "no live node" in err.body["error"], err.body
        assert time.monotonic() - asked < 10, "refused only after waiting for a node"
        assert {b["name"]: b["node"] for b in server.call("GET", "/system")["blocks"]}["b2"] == b2_node
        rejoined_at = time.monotonic()
        nodes["edge-b"] = c.add_node(**_node("edge-b"))
        wait_for(lambda: any(o[1] >= rejoined_at and o[0] == "ok" for o in outcomes), 90,
                 "serving again after edge-b rejoined")
        serving_again = min(o[2] for o in outcomes if o[1] >= rejoined_at and o[0] == "ok") - rejoined_at
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    in_flight = [o for o in outcomes if o[1] <= removed_at <= o[2]]
    print(f"\nnode lost: {len(outcomes)} requests, {len(in_flight)} in flight answered at most "
          f"{max((o[2] - removed_at for o in in_flight), default=0):.2f}s after the removal; blocks waiting "
          f"{blocks_waited:.1f}s after it (Ray's node table {'still' if ray_still_listed else 'no longer'} "
          f"listing edge-b), Ray calling it dead {ray_dead:.1f}s after it; serving again "
          f"{serving_again:.1f}s after edge-b rejoined")
    assert all(o[2] - removed_at <= 5.0 for o in in_flight), in_flight  # answered within 5 s of the loss
    assert not [o for o in outcomes if o[0] == "wrong"]
    assert {o[0] for o in outcomes} <= {"ok", ErrorCode.BLOCK_FAILED.value, ErrorCode.UNAVAILABLE.value}, \
        {o[0] for o in outcomes}
    assert serving_again <= 60


def test_a_partition_that_heals_leaves_no_block_running_twice(server, cluster, model_repo):
    """edge-b cut off (its raylet and Ray's processes under it stopped: the head hears nothing from
    the node and the node hears nothing from the head; its blocks run on), then back: Ray declared
    it dead meanwhile, so its raylet and workers end when it returns, and the old block processes
    with them (each watches its agent); the blocks come back once per name on a node that joins."""
    import signal as sig
    from ray._private import ray_constants
    c, nodes = cluster
    server.call("POST", "/system/update", _body({n: node for n, (_, node) in SPLIT.items()}), timeout=240)
    before = {b["name"]: b["pid"] for b in server.call("GET", "/system")["blocks"] if b["name"] in ("b3", "b4", "h")}
    cut = nodes.pop("edge-b")
    raylet = psutil.Process(cut.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid)
    # The whole node is cut off, not only its raylet: a Ray worker (a block's agent) that still
    # heard the head would learn that its node was declared dead and exit at once, its block with
    # it, before the partition healed. The blocks themselves keep running, as on a real partition.
    ray_side = [raylet] + [p for p in raylet.children(recursive=True) if p.pid not in before.values()]
    for p in ray_side:
        p.send_signal(sig.SIGSTOP)
    try:
        wait_for(lambda: all(b.get("waiting_for_node") == "edge-b" for b in server.call("GET", "/system")["blocks"]
                             if b["name"] in before), 60, "edge-b's blocks waiting for a node after the cut")
        assert all(psutil.pid_exists(p) for p in before.values())  # cut off, not dead: they still run
    finally:
        for p in reversed(ray_side):
            try:
                p.send_signal(sig.SIGCONT)
            except psutil.NoSuchProcess:
                pass
    # 120 s: once the raylet has learnt its node was declared dead, its workers (the blocks' agents)
    # end and each block follows its agent (or BLOCKFLOW_CONTROL_LEASE of silence); beside the chaos
    # tests of make test's exclusive phase, on two loaded cores, 60 s was once not enough
    try:
        wait_for(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                                 for p in before.values()), 120, "the cut-off node's old block processes ending")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; still running:\n{_why_still_running(before)}") from None
    c.remove_node(cut, allow_graceful=False)  # whatever of it is left
    nodes["edge-b"] = c.add_node(**_node("edge-b"))
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(5))
    want = _expected(model_repo, x)

    def serves():
        try:
            with Client(server.dispatcher, timeout=30) as cl:
                return torch.allclose(cl.infer("classify", x), want, atol=1e-4)
        except BlockFlowError:
            return False
    wait_for(serves, 90, "serving again on the new edge-b")
    after = [b for b in server.call("GET", "/system")["blocks"] if b["name"] in before]
    assert len(after) == 3 and all(b["status"] == "ready" and b["pid"] not in before.values() for b in after), after
    running = _remote_blocks()
    assert len(running) == len(SPLIT), [(p.pid, p.cmdline()[-1:]) for p in running]


def test_every_process_of_the_cluster_listens_on_the_loopback_only(server):
    """Every Ray these tests start stays on 127.0.0.1 (conftest.py): the GCS, raylets, agents,
    workers, and BlockFlow's own server, blocks and node agents, all descendants of this test."""
    server.call("POST", "/system/update", _body({n: node for n, (_, node) in SPLIT.items()}), timeout=240)
    ours = {p.pid for p in psutil.Process().children(recursive=True)}
    listening = [(c.laddr.ip, c.laddr.port, c.pid) for c in psutil.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.pid in ours]
    assert len(listening) > 5, listening  # the GCS, three raylets, the controller, the blocks, ...
    outside = [x for x in listening if not (x[0].startswith(("127.", "::ffff:127.")) or x[0] == "::1")]
    assert not outside, outside
