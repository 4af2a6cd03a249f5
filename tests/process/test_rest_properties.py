"""Property-based tests of the REST API: every malformed or invalid call gets a 4xx JSON error
that names the problem, and ``GET /system`` is unchanged afterwards.

One real ``blockflow serve`` (with a token) serves the whole module; hypothesis generates the
calls: mutated updates (wrong types, huge values, unknown fields, cycles, paths through missing
blocks, unicode names), arbitrary JSON and bytes, wrong content types, oversized bodies, forged
tokens and unicode block names in URLs.
"""
from __future__ import annotations

import copy
import http.client
import json
import os
import shutil
import tempfile
import urllib.parse

import psutil
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

TOKEN = "pr0p-t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BASE = {"blocks": [{"name": "a", "model": "toy/identity.pt"}, {"name": "d", "model": "toy/double.pt"}],
        "tasks": [{"id": "t", "path": ["a", "d"]}]}
EXAMPLES = int(os.environ.get("BLOCKFLOW_PROPERTY_EXAMPLES", 400))  # x7 properties: ~2,800 requests
#: CI replays the same examples every run (a red build names a bug, not bad luck); set
#: BLOCKFLOW_PROPERTY_RANDOM=1 to explore new ones.
PROPS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                 derandomize=os.environ.get("BLOCKFLOW_PROPERTY_RANDOM") != "1",
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                        HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def server(identity_repo):
    from blockflow.demo import start_server, stop_server
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    state = tempfile.mkdtemp(prefix="bfp-")
    proc, info = start_server(identity_repo, state, extra=["--token", TOKEN])
    srv = Http(info["rest"])
    srv.dispatcher = info["dispatcher"]
    try:
        status, body = srv.request("POST", "/system/update", json.dumps(BASE).encode(), headers=AUTH)
        assert status == 200, body
        srv.baseline = fingerprint(srv)
        yield srv
    finally:
        code = stop_server(proc)
        shutil.rmtree(state, ignore_errors=True)
    assert code == 0, f"server exited with {code}"
    left = [p for p in me.children(recursive=True) if p.pid not in before and p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"children left behind: {left}"


class Http:
    """Raw HTTP, so any body, content type and header can be sent."""

    def __init__(self, url: str):
        u = urllib.parse.urlsplit(url)
        self.host, self.port = u.hostname, u.port
        self.baseline = None

    def request(self, method: str, path: str, body: bytes | None = None, content_type: str | None = "application/json",
                headers: dict | None = None):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        try:
            h = dict(headers or {})
            if content_type is not None and body is not None:
                h["Content-Type"] = content_type
            conn.request(method, path, body=body, headers=h)
            resp = conn.getresponse()
            raw = resp.read()
            try:
                data = json.loads(raw) if raw else None
            except ValueError:
                data = {"not_json": raw[:200]}
            return resp.status, data
        finally:
            conn.close()


def fingerprint(srv: Http) -> dict:
    status, system = srv.request("GET", "/system", headers=AUTH)
    assert status == 200, system
    return {"version": system["version"], "tasks": system["tasks"],
            "blocks": sorted((b["name"], b["pid"], b["incarnation"], b["status"], b["model"]) for b in system["blocks"])}


def assert_refused(srv: Http, status: int, body, expect=range(400, 500), field: bool = False) -> None:
    assert status in expect, (status, body)
    assert isinstance(body, dict) and "not_json" not in body, f"error body is not JSON: {body!r}"
    assert isinstance(body.get("error"), str) and body["error"], body
    if field:  # the offending part ('' only for an unknown top-level field named '')
        assert isinstance(body.get("field"), str), body
    assert fingerprint(srv) == srv.baseline, "a refused call changed the system"


# -- strategies ---------------------------------------------------------------------------------
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(1 << 80), max_value=1 << 80),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40))
json_values = st.recursive(json_scalars, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                                st.dictionaries(st.text(max_size=8), kids, max_size=4)),
                           max_leaves=12)
#: Values a typed field never accepts (names and models are strings; threads an int 1-256; ...).
not_a_string = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                         st.lists(json_scalars, max_size=3), st.dictionaries(st.text(max_size=4), json_scalars, max_size=2))
bad_threads = st.one_of(st.integers(max_value=0), st.integers(min_value=257), st.just(10 ** 100), st.booleans(),
                        st.floats(allow_nan=False), st.text(max_size=10), st.lists(st.integers(), max_size=2))  # (null = default)
bad_cpus = st.one_of(st.just([]), st.lists(st.integers(max_value=-1), min_size=1, max_size=3),
                     st.lists(st.integers(min_value=4096, max_value=1 << 70), min_size=1, max_size=3),
                     st.text(max_size=6), st.integers(), st.lists(st.booleans(), min_size=1, max_size=2))
bad_names = st.one_of(st.just(""), st.text(min_size=64, max_size=100),
                      st.text(min_size=1, max_size=20).filter(lambda s: not s.isascii() or not s.replace("_", "").replace(
                          "-", "").replace(".", "").isalnum() or not s[0].isalnum()))
unknown_keys = st.text(min_size=1, max_size=12).filter(
    lambda k: k not in {"name", "model", "device", "transport", "protocol", "cpus", "threads", "blocks", "tasks", "id", "path"})


@st.composite
def invalid_updates(draw):
    """The valid base update with one change that makes it invalid; returns (body, expected field prefix)."""
    body = copy.deepcopy(BASE)
    kind = draw(st.sampled_from(["block_field", "threads", "cpus", "device", "transport", "name", "model",
                                 "unknown_top", "unknown_block", "unknown_task", "missing_block", "cycle",
                                 "task_id", "path_type", "too_many", "top_type"]))
    i = draw(st.integers(0, 1))
    if kind == "block_field":
        key = draw(st.sampled_from(["name", "model"]))
        body["blocks"][i][key] = draw(not_a_string)
        return body, f"blocks[{i}].{key}"
    if kind == "threads":
        body["blocks"][i]["threads"] = draw(bad_threads)
        return body, f"blocks[{i}].threads"
    if kind == "cpus":
        body["blocks"][i]["cpus"] = draw(bad_cpus)
        return body, f"blocks[{i}].cpus"
    if kind == "device":
        body["blocks"][i]["device"] = draw(st.one_of(not_a_string, st.text(max_size=12).filter(lambda s: s != "cpu"),
                                                     st.sampled_from(["cuda", "cuda:1", "cuda:99", "tpu", "CPU"])))
        return body, f"blocks[{i}].device"
    if kind == "transport":
        where = draw(st.sampled_from(["top", "block"]))
        val = draw(st.one_of(not_a_string, st.text(max_size=12).filter(lambda s: s not in ("tensormq", "zeromq"))))
        if where == "top":
            body["transport"] = val
            return body, "transport"
        body["blocks"][i]["transport"] = val
        return body, f"blocks[{i}].transport"
    if kind == "name":
        body["blocks"][i]["name"] = draw(bad_names)
        return body, f"blocks[{i}].name"
    if kind == "model":
        body["blocks"][i]["model"] = draw(st.one_of(
            # (letters only: "toy/missing-/../identity.pt" would name a real block)
            st.text(alphabet="abcxyz019_", max_size=30).map(lambda s: "toy/missing-" + s),
            st.just("../../etc/passwd"), st.just("/etc/passwd"),
            st.text(min_size=1, max_size=5).map(lambda s: "../" * 5 + s)))
        return body, f"blocks[{i}].model"
    if kind == "unknown_top":
        body[draw(unknown_keys.filter(lambda k: k not in ("transport", "protocol")))] = draw(json_values)
        return body, ""
    if kind == "unknown_block":
        body["blocks"][i][draw(unknown_keys)] = draw(json_values)
        return body, f"blocks[{i}]."
    if kind == "unknown_task":
        body["tasks"][0][draw(unknown_keys)] = draw(json_values)
        return body, "tasks[0]."
    if kind == "missing_block":
        missing = draw(st.text(min_size=1, max_size=20).filter(lambda s: s not in ("a", "d")))
        path = ["a", "d"]
        path.insert(draw(st.integers(0, 2)), missing)
        body["tasks"][0]["path"] = path
        return body, "tasks[0].path["
    if kind == "cycle":
        body["tasks"][0]["path"] = draw(st.sampled_from([["a", "a"], ["a", "d", "a"], ["d", "a", "d"], ["a", "d", "d"]]))
        return body, "tasks[0].path["
    if kind == "task_id":
        body["tasks"][0]["id"] = draw(st.one_of(not_a_string, bad_names))
        return body, "tasks[0].id"
    if kind == "path_type":
        body["tasks"][0]["path"] = draw(st.one_of(st.just([]), st.text(max_size=5), st.integers(),
                                                  st.lists(st.integers(), min_size=1, max_size=3), st.none()))
        return body, "tasks[0].path"
    if kind == "too_many":
        body["blocks"] = [{"name": f"b{k}", "model": "toy/identity.pt"} for k in range(65)]
        body["tasks"] = []
        return body, "blocks"
    body[draw(st.sampled_from(["blocks", "tasks"]))] = draw(st.one_of(st.dictionaries(st.text(max_size=3), json_scalars),
                                                                      st.text(max_size=5), st.integers(), st.none()))
    return body, ""


# -- properties ---------------------------------------------------------------------------------

@PROPS
@given(case=invalid_updates())
def test_invalid_update_is_refused_with_its_field(server, case):
    body, prefix = case
    status, reply = server.request("POST", "/system/update", json.dumps(body).encode(), headers=AUTH)
    assert status == 400, (status, reply, body)
    assert_refused(server, status, reply, field=True)
    assert reply["field"].startswith(prefix), (reply["field"], prefix, body)


@PROPS
@given(body=json_values.filter(lambda v: not isinstance(v, dict) or "blocks" not in v or not isinstance(v["blocks"], list)))
def test_any_json_that_is_not_an_update_is_refused(server, body):
    status, reply = server.request("POST", "/system/update", json.dumps(body).encode(), headers=AUTH)
    assert_refused(server, status, reply, expect=(400,), field=True)


@PROPS
@given(raw=st.one_of(st.binary(max_size=300), st.text(max_size=100).map(lambda s: s.encode("utf-8", "surrogatepass")),
                     st.just(b""), st.just(b"   "), st.just(b"[" * 100000)))
def test_any_bytes_are_refused_or_understood(server, raw):
    try:
        parsed = json.loads(raw)
        if isinstance(parsed, dict) and isinstance(parsed.get("blocks"), list):
            return  # (vanishingly rare) a JSON update; covered by the other properties
    except (ValueError, RecursionError):
        pass
    status, reply = server.request("POST", "/system/update", raw, headers=AUTH)
    assert_refused(server, status, reply, expect=(400,), field=True)


@PROPS
@given(ctype=st.one_of(st.sampled_from(["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                        "application/xml", "application/jsonx", "json", "", "application/octet-stream"]),
                       st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7e), min_size=1, max_size=30)
                       .filter(lambda s: not s.lower().startswith("application/json"))),
       path=st.sampled_from(["/system/update", "/blocks/a/monitor"]))
def test_wrong_content_type_is_415(server, ctype, path):
    status, reply = server.request("POST", path, json.dumps(BASE).encode(), content_type=ctype, headers=AUTH)
    assert_refused(server, status, reply, expect=(415,))


def test_oversized_body_is_413(server):
    big = json.dumps({**BASE, "pad": "x" * (2 << 20)}).encode()
    status, reply = server.request("POST", "/system/update", big, headers=AUTH)
    assert_refused(server, status, reply, expect=(413,))


@PROPS
@given(auth=st.one_of(st.none(), st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xff, blacklist_characters="\x7f"),
                                         max_size=40),
                      st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xff, blacklist_characters="\x7f"),
                              max_size=20).map(lambda s: "Bearer " + s)),
       call=st.sampled_from([("POST", "/system/update"), ("DELETE", "/system"), ("DELETE", "/blocks/a"),
                             ("POST", "/blocks/a/monitor"), ("GET", "/system"), ("GET", "/blocks"),
                             ("GET", "/blocks/a"), ("GET", "/blocks/a/ping"), ("POST", "/blocks/a/kpi"),
                             ("GET", "/")]))
def test_wrong_token_is_401(server, auth, call):
    if auth is not None and auth.strip() in (f"Bearer {TOKEN}",):
        return
    headers = {} if auth is None else {"Authorization": auth}
    body = json.dumps({"enabled": False}).encode() if call[0] == "POST" else None
    status, reply = server.request(call[0], call[1], body, headers=headers)
    assert_refused(server, status, reply, expect=(401,))


@PROPS
@given(name=st.text(min_size=1, max_size=40).filter(lambda s: s not in ("a", "d")),
       action=st.sampled_from(["", "/ping", "/kpi", "/monitor"]),
       method=st.sampled_from(["GET", "DELETE", "POST"]))
def test_unknown_or_unicode_block_names_get_json_errors(server, name, action, method):
    path = "/blocks/" + urllib.parse.quote(name, safe="") + action
    body = json.dumps({"enabled": True}).encode() if method == "POST" else None
    status, reply = server.request(method, path, body, headers=AUTH)
    assert_refused(server, status, reply, expect=(400, 404, 405))


@PROPS
@given(params=st.dictionaries(st.text(min_size=1, max_size=10), st.text(max_size=10), min_size=1, max_size=3),
       path=st.sampled_from(["/blocks", "/blocks/a", "/blocks/a/ping", "/health/live"]))
def test_unknown_query_parameters_are_400(server, params, path):
    status, reply = server.request("GET", path + "?" + urllib.parse.urlencode(params), headers=AUTH)
    assert_refused(server, status, reply, expect=(400,))


def test_server_still_serves_after_the_properties(server):
    import torch
    from blockflow.client import Client
    assert fingerprint(server) == server.baseline
    with Client(server.dispatcher, timeout=20, token=TOKEN) as c:
        assert torch.equal(c.infer("t", torch.ones(2)), torch.full((2,), 2.0))


@pytest.mark.parametrize("where,value", [("name", "a\n"), ("device", "cpu\n"), ("name", "a\r\n")])
def test_a_trailing_newline_is_not_a_valid_name_or_device(server, where, value):
    # ('$' in a regex matches before a final newline; names must match the whole string)
    body = copy.deepcopy(BASE)
    body["blocks"][0][where] = value
    status, reply = server.request("POST", "/system/update", json.dumps(body).encode(), headers=AUTH)
    assert status == 400, reply
    assert_refused(server, status, reply, field=True)
    assert reply["field"] == f"blocks[0].{where}"
