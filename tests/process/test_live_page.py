"""GET / in a browser: the live page of the deployment (blockflow/page.html), loaded by a real
headless Chromium (Debian's ``chromium``; ``make observability-tools``) against a running,
token-protected server; its DOM must show every deployed block and every task."""
from __future__ import annotations

import base64
import html.parser
import json
import os
import shutil
import subprocess
import urllib.error
import urllib.request

import pytest
import torch

from blockflow.client import Client

TOKEN = "live-page-token"
UPDATE = {"blocks": [{"name": "a", "model": "toy/identity.pt"},
                     {"name": "p", "model": "toy/double.pt", "replicas": 2},
                     {"name": "d", "model": "toy/double.pt", "process": "g"},
                     {"name": "e", "model": "toy/identity.pt", "process": "g"}],
          "tasks": [{"id": "t", "path": ["a", "p"]}, {"id": "u", "path": ["a", "d", "e"]}, {"id": "v", "path": ["e"]}]}


def get(url: str, accept: str, auth: str | None = None):
    req = urllib.request.Request(url, headers={"Accept": accept, **({"Authorization": auth} if auth else {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


def basic(token: str, user: str = "operator") -> str:
    return "Basic " + base64.b64encode(f"{user}:{token}".encode()).decode()


def test_root_serves_the_page_to_a_browser_and_json_to_the_api(server_factory, identity_repo):
    srv = server_factory(identity_repo, env={"BLOCKFLOW_TOKEN": TOKEN})
    browser = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"
    # the token guards the page as it guards the API, and the 401 lets a browser ask for it
    code, headers, _ = get(srv.url + "/", browser)
    assert code == 401 and "Basic" in headers["WWW-Authenticate"] and "Bearer" in headers["WWW-Authenticate"]
    assert get(srv.url + "/", browser, basic("wrong"))[0] == 401
    assert get(srv.url + "/", browser, "Basic !!not-base64!!")[0] == 401
    code, headers, body = get(srv.url + "/", browser, basic(TOKEN))
    assert code == 200 and headers["Content-Type"].startswith("text/html"), (code, headers)
    assert b"<svg" in body and b"/status" in body and b"/system" in body
    # Basic works for the API calls the page makes, Bearer still does, and JSON clients get JSON
    assert get(srv.url + "/system", "application/json", basic(TOKEN))[0] == 200
    code, headers, body = get(srv.url + "/", "application/json", f"Bearer {TOKEN}")
    assert code == 200 and headers["Content-Type"].startswith("application/json")
    assert "/status" in json.loads(body)["endpoints"]
    assert json.loads(get(srv.url + "/", "*/*", f"Bearer {TOKEN}")[2])["service"] == "blockflow"


class _Nodes(html.parser.HTMLParser):
    """The page's data-node / data-task attributes and its text, from Chromium's dumped DOM."""

    def __init__(self):
        super().__init__()
        self.nodes, self.tasks, self.text, self.loaded = set(), set(), [], False
        self.error, self._in_error = "", False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self._in_error = a.get("id") == "error"
        if "data-node" in a:
            self.nodes.add(a["data-node"])
        if tag == "polyline" and "data-task" in a:
            self.tasks.add(a["data-task"])
        if tag == "body" and a.get("data-loaded") == "1":
            self.loaded = True

    def handle_data(self, data):
        self.text.append(data)
        if self._in_error:
            self.error += data

    def handle_endtag(self, tag):
        self._in_error = False


def chromium() -> str:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.skip("Chromium is not installed: `make observability-tools` installs Debian's chromium package")
    return binary


def browse(binary: str, url: str, tmp_path, screenshot: str | None = None) -> str:
    """Chromium, headless, loads ``url``, lets its scripts run, and prints the DOM (or saves a
    screenshot). Its own profile directory, removed with tmp_path."""
    args = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--no-first-run", "--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}",
            "--virtual-time-budget=8000", "--window-size=1300,700"]
    args += [f"--screenshot={screenshot}"] if screenshot else ["--dump-dom"]
    done = subprocess.run([*args, url], capture_output=True, timeout=180, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_a_real_browser_shows_every_block_and_task(server_factory, identity_repo, tmp_path):
    """Without a token: headless Chromium answers no password prompt (the token's 401 and the
    Basic credentials a browser sends are the test above)."""
    binary = chromium()
    srv = server_factory(identity_repo)
    srv.call("POST", "/system/update", UPDATE, timeout=120)
    with Client(srv.dispatcher, timeout=15) as c:
        for _ in range(5):
            assert torch.equal(c.infer("t", torch.ones(3)), torch.full((3,), 2.0))
            assert torch.equal(c.infer("u", torch.ones(3)), torch.full((3,), 2.0))
    url = srv.url + "/"
    page = _Nodes()
    page.feed(browse(binary, url, tmp_path))
    text = " ".join(page.text)
    assert page.loaded, f"the page never drew the deployment: {text[:500]}"
    assert page.nodes == {"@dispatcher", "a", "p", "d", "e"}, page.nodes
    assert page.tasks == {"t", "u", "v"}, page.tasks
    assert "p ×2" in text, "the replicas of p are not shown"
    assert "group g" in text, "the shared process of d and e is not shown"
    assert not page.error, page.error

    shot = tmp_path / "page.png"
    browse(binary, url, tmp_path, screenshot=str(shot))
    assert shot.stat().st_size > 10_000  # a rendered page, not a blank one
