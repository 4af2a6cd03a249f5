"""Chaos run: Poisson load through two tasks that share blocks while faults are injected.

At seeded random moments it SIGKILLs a block, SIGSTOPs one (a hang) and later resumes it,
SIGKILLs the dispatcher, and POSTs topology updates that add, replace and remove blocks and
change paths. With ``--batching`` the blocks both tasks share (b1-b3) batch across tasks
(issue 15), so kills and updates also hit requests waiting in a batch. It counts requests sent,
ok replies, error replies (by code), requests never answered (must be 0), duplicate replies (must
be 0), wrong results (compared with the monolithic model; must be 0), and each fault's recovery.

Recovery (Note [Recovery is per task]): the time from a fault to the first ok reply of a request
sent after the fault by a task that the fault touched: a task whose path holds the faulted block;
for a killed dispatcher or an update, any task the system then serves. Each fault ends as one of:
``recovered``; ``recovered_after_next_fault`` (its tasks served again only after the next fault
struck: the two overlap, so the time is not that fault's alone); ``tasks_removed`` (an update
removed every task it touched first); ``no_task_touched`` (a block on no path); ``not_recovered``
(none of its tasks served again before the run ended: a block left dead, a path that stays
broken). At the end every block must be ready again (``blocks_not_ready`` lists those that are not).

    python -m experiments.chaos [--duration 60] [--rate 6] [--seed 1] [--repo model_repo] [--batching]
                                [--faults kill_block,stop_block] [--fault-blocks hx]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time

import torch

MODEL = "resnet18"


def _blocks(names_models: dict[str, str]) -> list[dict]:
    return [{"name": n, "model": f"{MODEL}/{m}.pt", "device": "cpu", "threads": 1} for n, m in names_models.items()]


# The topologies the run cycles through. Every path computes the same function as the first
# (replacements load the same model file), so every ok result can be checked.
BASE = {"b1": "block1", "b2": "block2", "b3": "block3", "b4": "block4", "h": "head", "b4x": "block4-x", "hx": "head-x"}
TOPOLOGIES = [
    ("initial", BASE, {"classify": ["b1", "b2", "b3", "b4", "h"], "special": ["b1", "b2", "b3", "b4x", "hx"]}),
    ("add block, change path", {**BASE, "b4b": "block4"},
     {"classify": ["b1", "b2", "b3", "b4b", "h"], "special": ["b1", "b2", "b3", "b4x", "hx"]}),
    ("remove block and task", {k: v for k, v in BASE.items() if k not in ("b4x", "hx")},
     {"classify": ["b1", "b2", "b3", "b4", "h"]}),
    ("replace block (threads change)", BASE, {"classify": ["b1", "b2", "b3", "b4", "h"],
                                              "special": ["b1", "b2", "b3", "b4x", "hx"]}),
]


#: The blocks every topology's tasks share; ``--batching`` batches these.
SHARED = ("b1", "b2", "b3")
#: ``--batching``: a fixed delay, so batches form even at the chaos run's low rate.
BATCHING = {"max_batch": 4, "max_queue_delay_us": 50_000}


def topology_body(i: int, batching: dict | None = None, replicas: dict | None = None,
                  processes: dict | None = None, nodes: dict | None = None) -> tuple[str, dict]:
    label, blocks, tasks = TOPOLOGIES[i % len(TOPOLOGIES)]
    body = {"transport": "tensormq", "blocks": _blocks(blocks),
            "tasks": [{"id": t, "path": p} for t, p in tasks.items()]}
    for b in body["blocks"]:
        if replicas and b["name"] in replicas:
            b["replicas"] = replicas[b["name"]]
        if processes and b["name"] in processes:
            b["process"] = processes[b["name"]]
        if nodes and b["name"] in nodes:
            b["node"] = nodes[b["name"]]
    if batching:
        for b in body["blocks"]:
            if b["name"] in SHARED:
                b["batching"] = dict(batching)
    if i % len(TOPOLOGIES) == 3:  # a changed spec forces a replacement of b2
        for b in body["blocks"]:
            if b["name"] == "b2":
                b["threads"] = 2 if (i // len(TOPOLOGIES)) % 2 == 0 else 1
    return label, body


#: The faults a run injects, in the order the first four take (then at random).
KINDS = ("kill_block", "stop_block", "kill_dispatcher", "update")
#: Ray mode only (``cluster``): a node holding blocks is removed, and a node with its resource
#: joins NODE_DOWN_S later (issue 30).
NODE_FAULT = "remove_node"
NODE_DOWN_S = 3.0
#: The load's last seconds have no fault, so that the last fault's tasks can serve again before
#: the load ends (a respawn on a loaded 2-core machine takes a second or two).
QUIET_S = 5.0
#: How long a SIGSTOPped block stays stopped. A timer resumes it, so the hang lasts this long
#: even while the run waits for an update's answer (the loop used to resume it only between
#: faults: a stop followed by a slow update lasted 13 s, and was reported as a 12 s recovery).
STOP_S = 2.0


def _resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)  # if it was not killed as hung already
    except ProcessLookupError:
        pass


#: ``--cluster``: where the chaos run's blocks go on a three-node cluster of this machine.
CLUSTER_NODES = {"b1": "edge-a", "b2": "edge-a", "b3": "edge-b", "b4": "edge-b", "b4b": "edge-b", "h": "edge-b"}


class ClusterNodes:
    """What ``run_chaos`` needs of a Ray cluster: its ``address``, and a node removed or added
    by the custom resource it advertises (``ray.cluster_utils.Cluster`` underneath, every node of
    it on this machine). ``nodes``: resource -> the cluster's node advertising it."""

    def __init__(self, cluster, nodes: dict):
        self.cluster, self.nodes, self.address = cluster, nodes, cluster.address

    @staticmethod
    def node_args(resource: str) -> dict:
        return {"num_cpus": 1, "resources": {resource: 1000}}

    def remove(self, resource: str) -> None:
        self.cluster.remove_node(self.nodes.pop(resource), allow_graceful=False)

    def add(self, resource: str) -> None:
        self.nodes[resource] = self.cluster.add_node(**self.node_args(resource))

    @classmethod
    def start(cls, resources, temp_dir: str) -> "ClusterNodes":
        """A head and a node per resource, every one on 127.0.0.1 (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``
        must be set before ray is imported: ``main`` and tests/conftest.py do), Ray's files in
        ``temp_dir`` (``RAY_TMPDIR`` is set to it). Ray's health checks notice a dead node in about
        2 s and one cut off (a raylet that no longer answers: each check waits for its timeout) in
        about 6 s; Ray's defaults (a check every 3 s waiting up to 10 s, five misses) take about a
        minute for a cut-off node."""
        from ray.cluster_utils import Cluster
        os.environ["RAY_TMPDIR"] = temp_dir  # where Ray writes the cluster's address, under ray/
        os.makedirs(os.path.join(temp_dir, "ray"), exist_ok=True)
        fast = {"health_check_period_ms": 500, "health_check_timeout_ms": 1000, "health_check_failure_threshold": 4}
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                                "temp_dir": temp_dir, "_system_config": fast})
        return cls(cluster, {r: cluster.add_node(**cls.node_args(r)) for r in resources})


def _rejoin(cluster, rejoins: dict[str, float], every: bool = False) -> None:
    """Add back the nodes due (``every``: all, now), from this thread: the cluster is driven from
    one thread only."""
    for resource, due in list(rejoins.items()):
        if every or time.monotonic() >= due:
            cluster.add(resource)
            del rejoins[resource]


def run_chaos(repo: str, duration: float = 60.0, rate: float = 6.0, seed: int = 1, fault_every: float = 4.0,
              timeout: float = 20.0, log=print, batching: dict | None = None, kinds: tuple[str, ...] = KINDS,
              fault_blocks: tuple[str, ...] | None = None, server_env: dict | None = None,
              replicas: dict | None = None, processes: dict | None = None, cluster=None,
              nodes: dict | None = None, quiet_s: float = QUIET_S) -> dict:
    """One chaos run (see the module docstring). ``kinds``: the faults to inject; ``fault_blocks``:
    the only block processes a kill or a stop may pick (default any ready one); ``server_env``:
    the environment of ``blockflow serve`` (e.g. ``BLOCKFLOW_MAX_RESTARTS``); ``replicas``: block
    name -> replicas in every topology (a kill or stop may then hit one replica of several);
    ``processes``: block name -> shared process in every topology (a kill or stop of one of its
    blocks strikes the whole group: its tasks are every task through any block of the group);
    ``cluster`` (Ray mode): an object with ``address``, ``remove(resource)`` and ``add(resource)``
    (tests/cluster/test_cluster.py has one over ``ray.cluster_utils.Cluster``), the server joins it and
    ``nodes`` (block name -> resource) places blocks on its nodes; the fault ``remove_node``
    removes a node holding blocks and adds one with its resource NODE_DOWN_S later."""
    unknown = set(kinds) - set(KINDS) - ({NODE_FAULT} if cluster is not None else set())
    if unknown or not kinds:
        raise ValueError(f"unknown fault kinds {sorted(unknown)}: choose from {', '.join(KINDS)}")
    from blockflow.demo import start_server, stop_server
    from blockflow.loadgen import DEADLINE, UNANSWERED, generate_load
    from blockflow.restclient import RestError, call
    from blockflow.blocks.repository import load_block

    rng = random.Random(seed)
    log(f"chaos: seed {seed}, {duration:.0f}s at {rate}/s, a fault every ~{fault_every}s"
        + (f", shared blocks batched {batching}" if batching else "")
        + (f", replicas {replicas}" if replicas else "")
        + (f", shared processes {processes}" if processes else ""))
    gen = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(1, 3, 224, 224, generator=gen) for _ in range(4)]
    full = load_block(repo, f"{MODEL}/full.pt")
    special = [load_block(repo, f"{MODEL}/{m}.pt") for m in ("block1", "block2", "block3", "block4-x", "head-x")]
    with torch.inference_mode():
        expected = {"classify": [full(x) for x in inputs], "special": []}
        for x in inputs:
            y = x
            for m in special:
                y = m(y)
            expected["special"].append(y)

    rejoins: dict[str, float] = {}  # resource of a removed node -> when a node with it joins again
    state_dir = tempfile.mkdtemp(prefix="bf-chaos-")
    proc, info = start_server(repo, state_dir, env=server_env,
                              extra=["--ray", cluster.address] if cluster is not None else None)
    url = info["rest"]
    faults: list[dict] = []
    try:
        call("POST", f"{url}/system/update", topology_body(0, batching, replicas, processes, nodes)[1])
        t_start = time.monotonic()
        stop_at = t_start + duration

        def pick(rng_load, n):
            return ("classify" if rng_load.random() < 0.5 else "special"), rng_load.randrange(len(inputs))

        runs = []  # Poisson load through both tasks (blockflow.loadgen); replies are checked after the run
        loader = threading.Thread(target=lambda: runs.append(generate_load(
            info["dispatcher"], ["classify", "special"], inputs=inputs, rate=rate, duration=duration, seed=seed + 1,
            timeout=timeout, drain=timeout + 5, choose=pick, keep_results=True)), name="chaos-load", daemon=True)
        loader.start()
        resumes: list[tuple[int, threading.Timer]] = []  # SIGCONT due for each stopped block
        topo = 0
        kinds = list(kinds)
        time.sleep(min(2.0, duration / 4))
        while time.monotonic() < stop_at - quiet_s:
            kind = kinds[len(faults) % len(kinds)] if len(faults) < len(kinds) else rng.choice(kinds)
            system = call("GET", f"{url}/system")
            paths = {t["id"]: t["path"] for t in system["tasks"]}
            ready = [b for b in system["blocks"] if b["status"] == "ready"
                     and (fault_blocks is None or b["name"] in fault_blocks)]
            t_fault = time.monotonic()
            detail = ""
            touched = sorted(paths)  # a killed dispatcher or an update: every task
            if kind in ("kill_block", "stop_block") and ready:
                b = rng.choice(ready)
                # the signal strikes the process: every block in it (a shared process holds several);
                # a replica's tasks are its block's (the other replicas may serve them meanwhile)
                struck = {x.get("block", x["name"]) for x in system["blocks"] if x["pid"] == b["pid"]}
                touched = sorted(t for t, p in paths.items() if struck & set(p))
                detail = f"{b['name']} (pid {b['pid']})"
                os.kill(b["pid"], signal.SIGKILL if kind == "kill_block" else signal.SIGSTOP)
                if kind == "stop_block":
                    timer = threading.Timer(STOP_S, _resume, args=(b["pid"],))
                    timer.daemon = True
                    timer.start()
                    resumes.append((b["pid"], timer))
            elif kind == NODE_FAULT and nodes and set(nodes.values()) - set(rejoins):
                resource = rng.choice(sorted(set(nodes.values()) - set(rejoins)))
                on_it = {n for n, r in nodes.items() if r == resource}
                touched = sorted(t for t, p in paths.items() if on_it & set(p))
                detail = f"{resource} ({', '.join(sorted(on_it))})"
                cluster.remove(resource)
                rejoins[resource] = time.monotonic() + NODE_DOWN_S
            elif kind == "kill_dispatcher" and system.get("dispatcher"):
                detail = f"pid {system['dispatcher']['pid']}"
                os.kill(system["dispatcher"]["pid"], signal.SIGKILL)
            else:
                kind = "update"
                # an update waits for its new blocks, and a removed node rejoins only from this
                # thread (ray.cluster_utils adds nodes from the main thread only): nodes first
                _rejoin(cluster, rejoins, every=True)
                topo += 1
                label, body = topology_body(topo, batching, replicas, processes, nodes)
                detail = label
                try:
                    call("POST", f"{url}/system/update", body)
                    touched = sorted(t["id"] for t in body["tasks"])
                except RestError as exc:
                    detail += f" (refused: {exc})"
            faults.append({"t": t_fault - t_start, "kind": kind, "detail": detail, "tasks": touched,
                           "_t": t_fault})
            log(f"  {t_fault - t_start:6.1f}s  {kind:16s} {detail}")
            pause = rng.uniform(0.5, 1.5) * fault_every
            end_pause = time.monotonic() + pause
            while time.monotonic() < min(end_pause, stop_at - quiet_s):
                _rejoin(cluster, rejoins)
                time.sleep(0.05)
        while rejoins:  # the last removed nodes join when due, while the load goes on
            _rejoin(cluster, rejoins)
            time.sleep(0.05)
        for pid, timer in resumes:  # normally all long done
            timer.cancel()
            _resume(pid)
        loader.join(duration + timeout + 60)
        if not runs:
            raise RuntimeError("the chaos run's load generator stopped without a result (its traceback is above)")
        run = runs[0]
        counts = {"sent": len(run.records), "ok": 0, "wrong": 0, "errors": {}, "never_answered": 0,
                  "deadline_expired": 0, "duplicates": run.duplicates, "late_replies": run.late}
        for r in run.records:
            if r.ok:
                counts["ok"] += 1
                if not torch.allclose(r.result, expected[r.task][r.input], atol=1e-4, rtol=1e-4):
                    counts["wrong"] += 1
            elif r.status in (DEADLINE, UNANSWERED):
                # the client's deadline passed without any reply: counted as never answered
                counts["never_answered"] += 1
                counts["deadline_expired"] += r.status == DEADLINE
            else:
                counts["errors"][r.status] = counts["errors"].get(r.status, 0) + 1
        # how each task ended: its replies in the order the requests were sent, counted back from
        # the last until the first that was not a result (a task whose blocks never came back: 0)
        counts["final_streak"] = {}
        for task in sorted({r.task for r in run.records}):
            streak = 0
            for r in sorted((r for r in run.records if r.task == task), key=lambda r: r.sent, reverse=True):
                if not r.ok:
                    break
                streak += 1
            counts["final_streak"][task] = streak
        recovery_outcomes(faults, run)
        final = call("GET", f"{url}/system")
        batched = _batch_sizes(url, final) if batching else {}
    finally:
        _rejoin(cluster, rejoins, every=True)  # every removed node is back, whatever happened
        code = stop_server(proc)
        shutil.rmtree(state_dir, ignore_errors=True)  # its KPI logs were read above
    rec = [f["recovery_s"] for f in faults if f["outcome"] == "recovered"]
    outcomes: dict[str, int] = {}
    for f in faults:
        outcomes[f["outcome"]] = outcomes.get(f["outcome"], 0) + 1
    report = {"seed": seed, "duration_s": duration, "rate": rate, "batching": batching, "replicas": replicas,
              "processes": processes, "nodes": nodes,
              **counts,
              "errors_total": sum(counts["errors"].values()), "faults": faults, "outcomes": outcomes,
              "recovery_s": {"max": max(rec) if rec else None,
                             "median": sorted(rec)[len(rec) // 2] if rec else None, "of": len(rec)},
              "blocks_not_ready": sorted(f"{b['name']} ({b['status']})" for b in final["blocks"]
                                         if b["status"] != "ready"),
              "restarts": {b["name"]: b["restarts"] for b in final["blocks"]},
              "dispatcher_restarts": (final.get("dispatcher") or {}).get("restarts"),
              "server_exit_code": code, "batched_requests": batched}
    log(f"chaos: sent {counts['sent']}, ok {counts['ok']}, errors {counts['errors']}, never answered "
        f"{counts['never_answered']}, duplicates {counts['duplicates']}, wrong {counts['wrong']}; "
        f"faults {outcomes}, recovery max {report['recovery_s']['max']}; blocks not ready {report['blocks_not_ready']}")
    return report


# Note [Recovery is per task]
# A fault is over when what it broke works again, not when anything at all works: after a kill of
# `hx` the `classify` task, which never passed through it, keeps answering, so "the next ok reply
# after the fault" said 0.03 s whether or not `hx` ever came back. So a fault's recovery counts only
# the tasks it touched (whose path held the block, as GET /system said just before it struck), and
# only requests *sent after* the fault: a reply to a request that had already passed the block
# says nothing about the block. A fault whose tasks answer only after the next fault struck is
# reported as such, not folded into one long recovery of its own.


def recovery_outcomes(faults: list[dict], run) -> None:
    """Set each fault's ``outcome`` and ``recovery_s`` (see the module docstring) from the load
    run's records; drops the fault's private ``_t``."""
    ends = [f["_t"] for f in faults[1:]] + [float("inf")]
    for i, (f, next_t) in enumerate(zip(faults, ends)):
        touched = set(f["tasks"])
        served = min((run.t0 + r.done for r in run.records
                      if r.ok and r.task in touched and run.t0 + r.sent >= f["_t"]), default=None)
        if served is not None:
            f["recovery_s"] = served - f["_t"]
            f["outcome"] = "recovered" if served < next_t else "recovered_after_next_fault"
            continue
        f["recovery_s"] = None
        if not touched:  # a block on no task's path: blocks_not_ready says whether it came back
            f["outcome"] = "no_task_touched"
            continue
        removed = set()  # touched tasks that a later update took away
        for later in faults[i + 1:]:
            if later["kind"] == "update" and "refused" not in later["detail"]:
                removed |= touched - set(later["tasks"])
        f["outcome"] = "tasks_removed" if removed == touched else "not_recovered"
    for f in faults:
        del f["_t"]


def _batch_sizes(url: str, system: dict) -> dict:
    """Per shared block, how many requests its KPI log shows served in a batch of two or more
    (what the live incarnation recorded; a killed one's unflushed records are lost with it)."""
    from blockflow.restclient import RestError, call
    out = {}
    for b in system["blocks"]:
        if b["name"] not in SHARED or b["status"] != "ready":
            continue
        try:
            call("POST", f"{url}/blocks/{b['name']}/kpi")
        except RestError:
            continue
        path = os.path.join(system["run_dir"], f"{b['name']}.latency.jsonl")
        if os.path.exists(path):
            with open(path) as f:
                recs = [json.loads(line) for line in f if line.strip()]
            out[b["name"]] = sum(1 for r in recs if r.get("requests_in_batch", 1) > 1)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.chaos", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--rate", type=float, default=6.0, help="Poisson arrivals per second")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--fault-every", type=float, default=4.0, help="mean seconds between faults")
    ap.add_argument("--repo", default="model_repo")
    ap.add_argument("--quick", action="store_true", help="20 s instead of the default")
    ap.add_argument("--out", help="results directory (default: the git-ignored experiments/results/_runs/<machine>; "
                                  "committing results is explicit: --out experiments/results/<machine>)")
    ap.add_argument("--faults", default=",".join(KINDS),
                    help=f"comma-separated fault kinds to inject (default all: {','.join(KINDS)})")
    ap.add_argument("--fault-blocks", help="comma-separated blocks a kill or a stop may pick (default any ready block)")
    ap.add_argument("--replicas", help="block=n[,block=n]: run these blocks as n replicas in every topology "
                                       "(e.g. b2=2); a kill or stop may then hit one replica of several")
    ap.add_argument("--processes", help="block=group[,block=group]: run these blocks in shared processes in every "
                                        "topology (e.g. b1=g,b2=g,b3=g)")
    ap.add_argument("--batching", action="store_true",
                    help=f"batch the shared blocks {', '.join(SHARED)} across tasks ({BATCHING})")
    ap.add_argument("--cluster", action="store_true",
                    help="Ray mode (the cluster extra): start a three-node Ray cluster on this machine (a head, "
                         "edge-a, edge-b; all on 127.0.0.1), serve with --ray, place the blocks "
                         f"{', '.join(f'{b}@{n}' for b, n in CLUSTER_NODES.items())}, and add the fault "
                         f"{NODE_FAULT} (a node removed, one with its resource back {NODE_DOWN_S:.0f} s later)")
    args = ap.parse_args(argv)
    if not os.path.exists(os.path.join(args.repo, MODEL, "block4-x.pt")):
        from blockflow.blocks.repository import export_model
        export_model(MODEL, args.repo, blocks=4, variants={"x": ["block4", "head"]})
    kinds = tuple(k.strip() for k in args.faults.split(",") if k.strip())
    allowed = KINDS + ((NODE_FAULT,) if args.cluster else ())
    if set(kinds) - set(allowed) or not kinds:
        ap.error(f"--faults: unknown kind in {args.faults!r}; choose from {', '.join(allowed)}")
    if args.cluster and NODE_FAULT not in kinds:
        kinds = (NODE_FAULT, *kinds)  # first: a node removed early has time to come back
    fault_blocks = tuple(b.strip() for b in args.fault_blocks.split(",")) if args.fault_blocks else None
    replicas = None
    if args.replicas:
        try:
            replicas = {k.strip(): int(v) for k, v in (item.split("=") for item in args.replicas.split(","))}
        except ValueError:
            ap.error(f"--replicas: give block=n pairs separated by commas, e.g. b2=2; got {args.replicas!r}")
    pairs = [item.split("=", 1) for item in args.processes.split(",")] if args.processes else []
    processes = {p[0].strip(): p[1].strip() for p in pairs if len(p) == 2} or None
    if len(processes or {}) != len(pairs) or not all(k and v for k, v in (processes or {}).items()):
        ap.error(f"--processes: give block=group pairs separated by commas, e.g. b1=g,b2=g; got {args.processes!r}")
    cluster, ray_tmp = None, None
    if args.cluster:
        try:
            import ray  # noqa: F401
        except ImportError:
            ap.error("--cluster needs Ray: pip install -e '.[cluster]'")
        import tempfile
        ray_tmp = tempfile.mkdtemp(prefix="bf-chaos-ray-")
        cluster = ClusterNodes.start(sorted(set(CLUSTER_NODES.values())), ray_tmp)
    try:
        report = run_chaos(args.repo, 20.0 if args.quick else args.duration, args.rate, args.seed, args.fault_every,
                           batching=BATCHING if args.batching else None, kinds=kinds, fault_blocks=fault_blocks,
                           replicas=replicas, processes=processes, cluster=cluster,
                           nodes=CLUSTER_NODES if cluster else None, quiet_s=15.0 if cluster else QUIET_S)
    finally:
        if cluster is not None:
            cluster.cluster.shutdown()
            shutil.rmtree(ray_tmp, ignore_errors=True)
    from experiments.common import env_info, write_json
    settings = {"duration_s": 20.0 if args.quick else args.duration, "rate": args.rate, "seed": args.seed,
                "fault_every_s": args.fault_every, "quick": args.quick, "model": MODEL,
                "batching": BATCHING if args.batching else None, "faults": list(kinds),
                "fault_blocks": list(fault_blocks) if fault_blocks else None, "replicas": replicas,
                "processes": processes, "cluster": CLUSTER_NODES if args.cluster else None}
    write_json(args.out, "chaos", {"env": env_info(settings), "settings": settings, **report})
    bad = (report["never_answered"] or report["duplicates"] or report["wrong"]
           or report["outcomes"].get("not_recovered") or report["blocks_not_ready"])
    return 1 if bad else 0


if __name__ == "__main__":
    if "--cluster" in sys.argv:  # before ray is imported: Ray on the loopback, its files in our temp dir
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    sys.exit(main())
