"""configs/grafana/blockflow.json, checked against a real Prometheus scraping a real server.

Every query of every panel runs on Prometheus (Debian's ``prometheus`` package, ``make
observability-tools``) that scrapes a BlockFlow server under load with configs/prometheus.yml, and
must return series carrying the labels the panel's legend names: a renamed metric, a lost label or
a query Prometheus cannot parse fails here, not on an operator's screen. The GPU panels need NVML
and are checked where a GPU is present.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request

import pytest
import torch

from blockflow.client import BlockFlowError, Client

from conftest import ROOT, wait_for

DASHBOARD = os.path.join(ROOT, "configs", "grafana", "blockflow.json")
SCRAPE_CONFIG = os.path.join(ROOT, "configs", "prometheus.yml")
TOKEN = "dashboard-test-token"
#: What Grafana puts in place of the dashboard's variables when the check runs a query itself.
VARIABLES = {"$__rate_interval": "20s", "$__range": "5m", "$task": ".*", "$block": ".*"}
GPU_METRICS = re.compile(r"blockflow_(block_)?gpu_")


def panels() -> list[dict]:
    with open(DASHBOARD) as f:
        dash = json.load(f)
    return [p for p in dash["panels"] if p.get("type") != "row"]


def queries() -> list[tuple[str, str, str]]:
    """(panel title, PromQL with the variables filled in, legend format) of every target."""
    out = []
    for p in panels():
        for t in p["targets"]:
            expr = t["expr"]
            for var, value in VARIABLES.items():
                expr = expr.replace(var, value)
            out.append((p["title"], expr, t.get("legendFormat", "")))
    return out


def legend_labels(legend: str) -> set[str]:
    return set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))


def test_the_dashboard_is_well_formed():
    """Static checks Grafana would otherwise report one panel at a time: unique ids, a datasource
    variable on every query, a legend naming the series, no variable the check does not know."""
    with open(DASHBOARD) as f:
        dash = json.load(f)
    ps = panels()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "task", "block"}
    assert len(ps) >= 15
    for p in ps:
        assert p["targets"], p["title"]
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        for t in p["targets"]:
            assert legend_labels(t["legendFormat"]), f"{p['title']}: the legend names no label"
            leftover = set(re.findall(r"\$\w+", t["expr"])) - {v.split("[")[0] for v in VARIABLES}
            assert not leftover, f"{p['title']}: unknown variables {leftover}"
    titles = " ".join(p["title"] for p in ps).lower()
    for must in ("p50", "p99", "throughput", "errors", "queue", "batch", "memory", "restarts"):
        assert must in titles, f"no panel for {must}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _query(prom: str, expr: str) -> list[dict]:
    url = prom + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.load(resp)
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


@pytest.fixture
def prometheus(tmp_path):
    """A function starting Debian's Prometheus on a free port with configs/prometheus.yml aimed
    at a target; stopped (and its data removed) after the test."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("Prometheus is not installed: `make observability-tools` installs Debian's prometheus package")
    procs = []

    def start(target: str, token: str) -> str:
        with open(SCRAPE_CONFIG) as f:
            config = f.read()
        assert '"127.0.0.1:8080"' in config, "configs/prometheus.yml should aim at the default REST port"
        (tmp_path / "token").write_text(token)
        config = config.replace('"127.0.0.1:8080"', json.dumps(target))
        config = config.replace("scrape_interval: 5s", "scrape_interval: 1s")
        config = config.replace("    # authorization:\n    #   credentials_file: /etc/blockflow/token",
                                f"    authorization:\n      credentials_file: {tmp_path / 'token'}")
        assert "credentials_file: /etc" not in config, "the token lines of configs/prometheus.yml changed"
        (tmp_path / "prometheus.yml").write_text(config)
        port = _free_port()
        log = open(tmp_path / "prometheus.log", "wb")
        procs.append(subprocess.Popen(
            [binary, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT))
        url = f"http://127.0.0.1:{port}"

        def target_up():
            if procs[-1].poll() is not None:
                raise AssertionError(f"prometheus exited: {(tmp_path / 'prometheus.log').read_text()[-2000:]}")
            try:
                return [r for r in _query(url, 'up{job="blockflow"}') if r["value"][1] == "1"]
            except OSError:
                return None
        wait_for(target_up, 60, "Prometheus scraping the server")
        return url

    yield start
    for p in procs:
        p.terminate()
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@pytest.fixture(scope="module")
def picky_repo(identity_repo, tmp_path_factory):
    """The toy blocks plus one that fails on a negative input (a block error to chart)."""

    class Picky(torch.nn.Module):
        def forward(self, x):
            if bool(x.sum() < 0):
                raise RuntimeError("picky: negative input")
            return x + 1

    repo = tmp_path_factory.mktemp("picky_repo")
    shutil.copytree(os.path.join(identity_repo, "toy"), repo / "toy")
    torch.jit.save(torch.jit.script(Picky()), str(repo / "toy" / "picky.pt"))
    return str(repo)


def test_every_panel_query_returns_the_series_its_legend_names(server_factory, picky_repo, prometheus):
    srv = server_factory(picky_repo, env={"BLOCKFLOW_TOKEN": TOKEN})
    update = {"blocks": [{"name": "a", "model": "toy/identity.pt"},
                         {"name": "p", "model": "toy/picky.pt", "replicas": 2},
                         {"name": "d", "model": "toy/double.pt", "batching": {"max_batch": 4, "max_queue_delay_us": 2000}}],
              "tasks": [{"id": "t", "path": ["a", "p"]}, {"id": "u", "path": ["a", "d"]}]}
    srv.call("POST", "/system/update", update, token=TOKEN, timeout=120)
    prom = prometheus(urllib.parse.urlparse(srv.url).netloc, TOKEN)

    stop = threading.Event()
    sent = {"ok": 0, "errors": 0}

    def load():
        with Client(srv.dispatcher, timeout=15, token=TOKEN) as c:
            while not stop.is_set():
                for task, x in (("t", torch.ones(4)), ("u", torch.ones(4)), ("t", -torch.ones(4)),
                                ("nope", torch.ones(4))):
                    try:
                        c.infer(task, x)
                        sent["ok"] += 1
                    except BlockFlowError as exc:
                        sent["errors"] += 1
                        sent.setdefault(exc.code, 0)
                        sent[exc.code] += 1

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    gpu = torch.cuda.is_available()
    pending = {(title, expr, legend) for title, expr, legend in queries() if gpu or not GPU_METRICS.search(expr)}
    assert len(pending) >= 15
    results: dict = {}

    def labelled(title: str, **labels) -> bool:
        """Whether panel ``title`` shows a series with ``labels``, asked again now: its first
        answer can predate the scrape that saw a given series (an unknown task's error, sent
        after the other tasks' requests)."""
        for t, expr in [k for k in results if k[0] == title]:
            results[t, expr] = _query(prom, expr) or results[t, expr]
        return any(all(s["metric"].get(k) == v for k, v in labels.items())
                   for (t, _), series in results.items() if t == title for s in series)

    try:
        def all_answered():
            for title, expr, legend in sorted(pending):
                series = _query(prom, expr)
                if series and all(legend_labels(legend) <= set(s["metric"]) for s in series):
                    results[title, expr] = series
                    pending.discard((title, expr, legend))
            return not pending
        wait_for(all_answered, 120, "every panel query returning series", interval=1.0)
        # the series are the deployment's, not any series that happens to exist
        for title, labels in (("Task errors", {"task": "_unknown", "code": "unknown_task"}),
                              ("Block errors", {"block": "p"}), ("Block throughput", {"block": "p", "replica": "1"}),
                              ("Task p99 latency", {"task": "u"}), ("Batch size", {"block": "d"})):
            wait_for(lambda: labelled(title, **labels), 60, f"panel {title!r} showing a series labelled {labels}",
                     interval=1.0)
    except AssertionError as exc:
        missing = {title: [s["metric"] for s in _query(prom, expr)][:3] for title, expr, _ in pending}
        raise AssertionError(f"{exc}; panels without series carrying their legend's labels (with what their "
                             f"query returned): {missing}; sent {sent}") from None
    finally:
        stop.set()
        worker.join(timeout=30)
    assert sent["ok"] > 0 and sent["errors"] > 0, sent
