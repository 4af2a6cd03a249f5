"""The blockflow command as people use it: subprocess runs, exit codes, no tracebacks."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from blockflow.cli import EXPERIMENT_NAMES, Exit

SUBCOMMANDS = ["export", "manifest", "serve", "update", "status", "down", "load", "kpi", "demo", "bench", "block",
               "dispatcher"]
TOY_UPDATE = {"blocks": [{"name": "a", "model": "toy/identity.pt"}, {"name": "d", "model": "toy/double.pt"}],
              "tasks": [{"id": "t", "path": ["a", "d"]}]}


def blockflow(*args, timeout=120, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    """``blockflow ARGS`` in a subprocess; ``env``: variables on top of this one's, where the
    operator's own BLOCKFLOW_TOKEN, BLOCKFLOW_URL and BLOCKFLOW_DISPATCHER are unset."""
    base = dict(os.environ, BLOCKFLOW_LOG="WARNING")
    for name in ("BLOCKFLOW_TOKEN", "BLOCKFLOW_URL", "BLOCKFLOW_DISPATCHER"):
        base.pop(name, None)
    env = {**base, **(env or {})}
    return subprocess.run([sys.executable, "-m", "blockflow.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, **kw)


def user_error(res: subprocess.CompletedProcess, code: Exit, *words: str) -> str:
    """A user's mistake: the exit code of its kind, one line naming it, no traceback."""
    assert res.returncode == code, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_subcommand_explains_itself():
    for cmd in SUBCOMMANDS:
        res = blockflow(cmd, "--help")
        assert res.returncode == 0 and "usage: blockflow " + cmd in res.stdout, (cmd, res.stderr)
        assert "--verbose" in res.stdout
    assert "default: 10" in blockflow("kpi", "--help").stdout
    assert "default: resnet50" in blockflow("export", "--help").stdout
    bench = blockflow("bench", "--help").stdout
    assert all(name in bench for name in EXPERIMENT_NAMES)


def test_no_server_missing_file_bad_json(tmp_path):
    port = free_port()
    user_error(blockflow("status", "--url", f"http://127.0.0.1:{port}"), Exit.NO_SERVER, "blockflow serve", str(port))
    user_error(blockflow("update", str(tmp_path / "nope.json")), Exit.NO_FILE, "nope.json", "no such file")
    bad = tmp_path / "bad.json"
    bad.write_text('{"blocks": [')
    user_error(blockflow("update", str(bad)), Exit.BAD_INPUT, "bad.json", "not valid JSON")
    # -v, before or after the subcommand: the traceback is there
    for args in (["-v", "update", str(bad)], ["update", str(bad), "-v"], ["update", "--debug", str(bad)]):
        res = blockflow(*args)
        assert res.returncode == Exit.BAD_INPUT and "Traceback" in res.stderr, (args, res.stderr)
    user_error(blockflow("kpi", str(tmp_path / "nodir")), Exit.NO_FILE, "no such directory")
    user_error(blockflow("kpi", str(tmp_path)), Exit.NO_FILE, "no KPI logs")
    user_error(blockflow("load", "--task", "t", "--shape", "3,x"), Exit.BAD_INPUT, "--shape")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    user_error(blockflow("export", "--model", "resnet18", "--out", str(blocker / "repo")), Exit.NO_FILE, "--out")
    user_error(blockflow("export", "--variant", "x"), Exit.USAGE, "--variant-blocks")


def test_load_fails_fast_when_nobody_listens():
    t0 = time.monotonic()
    res = blockflow("load", "--task", "t", "--address", f"tcp://127.0.0.1:{free_port()}", "--duration", "60")
    user_error(res, Exit.NO_SERVER, "no dispatcher answers")
    assert time.monotonic() - t0 < 30


def test_serve_on_a_taken_port(tmp_path, identity_repo):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = blockflow("serve", "--port", str(port), "--dispatcher-port", "0", "--repo", identity_repo,
                        "--state-dir", str(tmp_path / "st"), timeout=60)
        user_error(res, Exit.PORT_TAKEN, f"port {port}", "--port")
        res = blockflow("serve", "--port", "0", "--dispatcher-port", str(port), "--repo", identity_repo,
                        "--state-dir", str(tmp_path / "st"), timeout=60)
        user_error(res, Exit.PORT_TAKEN, "--dispatcher-port")



def test_serve_refuses_a_repository_that_is_not_there(tmp_path):
    """A mistyped --repo (or the default model_repo/ from another directory) is refused at start,
    not served empty with every update failing later."""
    missing = tmp_path / "missing"
    res = blockflow("serve", "--port", "0", "--dispatcher-port", "0", "--repo", str(missing),
                    "--state-dir", str(tmp_path / "st"), timeout=60)
    user_error(res, Exit.NO_FILE, f"--repo {missing}: no such directory", "blockflow export")
    assert not (tmp_path / "st").exists()  # refused before anything started or was written
    res = blockflow("serve", "--port", "0", "--dispatcher-port", "0", "--state-dir", str(tmp_path / "st"),
                    timeout=60, cwd=str(tmp_path))  # the default, model_repo/, where there is none
    user_error(res, Exit.NO_FILE, f"--repo model_repo: no such directory (relative to {tmp_path})")

def test_load_and_kpi_against_a_server(server_factory, identity_repo, tmp_path):
    srv = server_factory(identity_repo)
    update = tmp_path / "u.json"
    update.write_text(json.dumps(TOY_UPDATE))
    res = blockflow("update", str(update), "--url", srv.url, "--json")  # the server's answer as it came
    assert res.returncode == 0 and json.loads(res.stdout)["version"] == 1, res.stderr

    t0 = time.monotonic()
    res = blockflow("load", "--address", srv.dispatcher, "--task", "t", "--shape", "1000000", "--duration", "2",
                    "--clients", "2")  # 4 MB: each request takes milliseconds
    took = time.monotonic() - t0
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    assert " ok, 0 failed" in res.stdout and took >= 2, (res.stdout, took)
    # each client's last request, sent just before the window ended, was waited for (--drain)
    assert "unanswered" not in res.stdout, res.stdout

    # an unknown task: the server's own message at once, exit 1, not --duration seconds of refusals
    t0 = time.monotonic()
    res = blockflow("load", "--address", srv.dispatcher, "--task", "nope", "--shape", "4", "--duration", "600")
    user_error(res, Exit.FAILED, "unknown_task: unknown task 'nope'; tasks served now: t", "--task")
    assert time.monotonic() - t0 < 60 and not res.stdout, res.stdout

    # blockflow status: one row per process, the last minute's figures from the KPI logs
    res = blockflow("status", "--url", srv.url, "--json")
    assert res.returncode == 0, res.stderr
    status = json.loads(res.stdout)
    rows = {r["process"]: r for r in status["processes"]}
    system = srv.call("GET", "/system")
    assert set(rows) == {"@dispatcher", "a", "d"}, rows
    assert rows["@dispatcher"]["pid"] == system["dispatcher"]["pid"]
    for b in system["blocks"]:
        r = rows[b["name"]]
        assert (r["pid"], r["status"], r["device"], r["restarts"], r["block"], r["replica"]) == \
            (b["pid"], "ready", "cpu", 0, b["name"], 0), r
        assert r["node"] == b["node"] == socket.gethostname(), r  # the local launcher: this machine
        assert r["requests_per_s"] > 0 and 0 < r["p50_ms"] <= r["p99_ms"] and r["uptime_s"] > 0, r
    assert rows["@dispatcher"]["requests_per_s"] > 0, rows["@dispatcher"]
    assert status["tasks"] == [{"id": "t", "path": ["a", "d"]}]
    res = blockflow("status", "--url", srv.url)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].split()[:4] == ["PROCESS", "STATUS", "PID", "DEVICE"], res.stdout  # one node: no NODE column
    assert [line.split()[0] for line in lines[1:4]] == ["@dispatcher", "a", "d"], res.stdout
    assert "  t: a -> d" in lines, res.stdout
    res = blockflow("status", "--url", srv.url, "--wide")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[:8] == ["PROCESS", "BLOCK", "REPLICA", "GROUP", "STATUS", "PID", "NODE", "DEVICE"], \
        res.stdout

    for b in ("a", "d"):
        srv.call("POST", f"/blocks/{b}/kpi")  # flush the KPI logs
    plot = tmp_path / "kpi.png"
    res = blockflow("kpi", srv.state_dir, "--plot", str(plot))  # the state dir: its newest run
    assert res.returncode == 0, res.stderr
    assert "newest run" in res.stderr and "(eq. 4.1: queue wait)" in res.stdout
    rows = {line.split()[0]: line.split() for line in res.stdout.splitlines() if line.split()[:1] in (["a"], ["d"])}
    assert set(rows) == {"a", "d"} and int(rows["a"][1]) > 0
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:4] == b"\x89PNG"
    res = blockflow("kpi", srv.state_dir, "--json", "--warmup", "0")
    counts = {s["name"]: s["count"] for s in json.loads(res.stdout)}
    assert counts["a"] == int(rows["a"][1]) + 10  # ten warm-up inferences dropped by default


def test_load_keeps_its_duration_when_the_server_stops(server_factory, identity_repo):
    srv = server_factory(identity_repo)
    srv.call("POST", "/system/update", TOY_UPDATE, timeout=60)
    env = dict(os.environ, BLOCKFLOW_LOG="WARNING")
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "blockflow.cli", "load", "--address", srv.dispatcher, "--task", "t",
                             "--shape", "4", "--duration", "8", "--timeout", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 60
    while srv.call("GET", "/blocks/a/ping")["served"] < 5:  # the load runs against a live server
        assert time.monotonic() < deadline and proc.poll() is None, "the load never reached the server"
        time.sleep(0.1)
    assert srv.stop() == 0
    out, err = proc.communicate(timeout=60)
    took = time.monotonic() - t0
    assert "Traceback" not in err, err
    assert 8 <= took < 30, took  # neither cut short nor stretched to the 60 s request timeout
    assert proc.returncode == Exit.FAILED and " ok, " in out, out
