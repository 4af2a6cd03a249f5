"""The REST control plane (CherryPy, MethodDispatcher): JSON in, JSON out, errors included.

    GET    /system                    blocks (pid, device, endpoint, status, restarts), tasks, version
    DELETE /system                    terminate every block
    POST   /system/update             apply a system update (blockflow/schema.py)
    GET    /blocks                    the blocks
    GET    /blocks/{name}             one block
    DELETE /blocks/{name}             stop a block no task uses (409 otherwise)
    GET    /blocks/{name}/ping        round trip through the control channel
    GET    /blocks/{name}/kpi         latency components and resource means from its KPI logs
    POST   /blocks/{name}/monitor     {"enabled": true|false}
    GET    /health/live               the server answers
    GET    /health/ready              the dispatcher and every block are ready (503 otherwise)

With a token configured, every POST and DELETE needs ``Authorization: Bearer <token>``.
"""
from __future__ import annotations

import hmac
import json
import logging

import cherrypy

from blockflow.schema import UpdateError
from manager.manager import Conflict, Manager, UpdateFailed

log = logging.getLogger("blockflow.rest")

#: Largest request body accepted (bytes); larger ones get 413.
MAX_BODY = 1 << 20


def json_error_page(status, message, traceback, version):
    """CherryPy's error pages are HTML; ours are JSON like every other answer."""
    cherrypy.response.headers["Content-Type"] = "application/json"
    code = int(str(status).split()[0])
    return json.dumps({"error": message, "status": code})


def fail(code: int, message: str, **extra):
    """Raise an HTTP error whose JSON body carries ``extra`` fields too."""
    raise _JsonError(code, json.dumps({"error": message, "status": code, **extra}).encode())


class _JsonError(cherrypy.HTTPError):
    def __init__(self, code: int, body: bytes):
        super().__init__(code)
        self.body = body

    def set_response(self):
        super().set_response()
        cherrypy.response.headers["Content-Type"] = "application/json"
        cherrypy.response.body = self.body
        cherrypy.response.headers.pop("Content-Length", None)


def read_json():
    req = cherrypy.request
    ctype = req.headers.get("Content-Type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        fail(415, f"Content-Type must be application/json, got {ctype or 'none'}")
    raw = req.body.read(MAX_BODY + 1)
    if len(raw) > MAX_BODY:
        fail(413, f"body is larger than {MAX_BODY} bytes")
    if not raw.strip():
        fail(400, "body: empty; send a JSON object", field="body")
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        fail(400, f"body: not valid JSON ({exc})", field="body")


def check_token():
    token = cherrypy.request.app.config.get("blockflow", {}).get("token")
    if token and cherrypy.request.method in ("POST", "PUT", "PATCH", "DELETE"):
        auth = cherrypy.request.headers.get("Authorization", "")
        if not auth.startswith("Bearer ") or not hmac.compare_digest(auth[7:].strip(), token):
            cherrypy.response.headers["WWW-Authenticate"] = "Bearer"
            fail(401, "missing or wrong token: send 'Authorization: Bearer <token>'")


cherrypy.tools.blockflow_auth = cherrypy.Tool("before_handler", check_token, priority=20)


@cherrypy.expose
class SystemUpdate:
    def __init__(self, manager: Manager):
        self.manager = manager

    @cherrypy.tools.json_out()
    def POST(self):
        body = read_json()
        try:
            return self.manager.apply(body)
        except UpdateError as exc:
            fail(400, str(exc), field=exc.field)
        except UpdateFailed as exc:
            fail(422, f"{exc}; the update was rolled back, nothing changed", block=exc.block, rolled_back=True)


@cherrypy.expose
class System:
    def __init__(self, manager: Manager):
        self.manager = manager
        self.update = SystemUpdate(manager)

    def _cp_dispatch(self, vpath):
        if vpath and vpath[0] == "update":
            vpath.pop(0)
            return self.update
        return vpath

    @cherrypy.tools.json_out()
    def GET(self):
        return self.manager.snapshot()

    @cherrypy.tools.json_out()
    def DELETE(self):
        return self.manager.delete_all()


@cherrypy.expose
class BlockAction:
    """/blocks/{name}/{ping|kpi|monitor}"""

    def __init__(self, manager: Manager, action: str):
        self.manager, self.action = manager, action

    def _child(self, name):
        try:
            return self.manager.child(name)
        except KeyError:
            fail(404, f"no block named {name!r}; GET /blocks lists them")

    @cherrypy.tools.json_out()
    def GET(self, name):
        self._child(name)
        try:
            if self.action == "ping":
                return self.manager.ping(name)
            if self.action == "kpi":
                from blockflow.kpi import summarize_block
                self.manager.command(name, "store")
                return summarize_block(self.manager.state.run_dir, name)
        except Conflict as exc:
            fail(409, str(exc))
        except TimeoutError as exc:
            fail(504, str(exc))
        fail(405, f"GET is not allowed on /blocks/{name}/{self.action}")

    @cherrypy.tools.json_out()
    def POST(self, name):
        self._child(name)
        if self.action != "monitor":
            fail(405, f"POST is not allowed on /blocks/{name}/{self.action}")
        body = read_json()
        if not isinstance(body, dict) or not isinstance(body.get("enabled"), bool):
            fail(400, "enabled: must be true or false", field="enabled")
        try:
            return self.manager.command(name, "monitor", {"enabled": body["enabled"]})
        except Conflict as exc:
            fail(409, str(exc))


@cherrypy.expose
class Blocks:
    def __init__(self, manager: Manager):
        self.manager = manager
        self.actions = {a: BlockAction(manager, a) for a in ("ping", "kpi", "monitor")}

    def _cp_dispatch(self, vpath):
        if len(vpath) == 2 and vpath[1] in self.actions:
            cherrypy.request.params["name"] = vpath.pop(0)
            return self.actions[vpath.pop(0)]
        if len(vpath) == 1:
            cherrypy.request.params["name"] = vpath.pop(0)
            return self
        return vpath

    @cherrypy.tools.json_out()
    def GET(self, name=None):
        if name is None:
            return self.manager.snapshot()["blocks"]
        try:
            return self.manager.child(name).describe()
        except KeyError:
            fail(404, f"no block named {name!r}; GET /blocks lists them")

    @cherrypy.tools.json_out()
    def DELETE(self, name=None):
        if name is None:
            fail(405, "DELETE /blocks/{name} removes one block; DELETE /system removes them all")
        try:
            return self.manager.delete_block(name)
        except KeyError:
            fail(404, f"no block named {name!r}; GET /blocks lists them")
        except Conflict as exc:
            fail(409, str(exc))


@cherrypy.expose
class Health:
    def __init__(self, manager: Manager):
        self.manager = manager

    def _cp_dispatch(self, vpath):
        if len(vpath) == 1 and vpath[0] in ("live", "ready"):
            cherrypy.request.params["what"] = vpath.pop(0)
            return self
        return vpath

    @cherrypy.tools.json_out()
    def GET(self, what="live"):
        if what == "ready" and not self.manager.ready():
            fail(503, "not ready: the dispatcher or a block is not running", system=self.manager.snapshot())
        return {"status": "ok", "version": self.manager.version}


@cherrypy.expose
class Root:
    def __init__(self, manager: Manager):
        self.system = System(manager)
        self.blocks = Blocks(manager)
        self.health = Health(manager)

    @cherrypy.tools.json_out()
    def GET(self):
        return {"service": "blockflow", "endpoints": ["/system", "/system/update", "/blocks", "/health/live",
                                                      "/health/ready"]}


def app_config(token: str | None) -> dict:
    return {
        "/": {
            "request.dispatch": cherrypy.dispatch.MethodDispatcher(),
            "error_page.default": json_error_page,
            "tools.blockflow_auth.on": True,
            "tools.encode.on": True,
            "request.show_tracebacks": False,
        },
        "blockflow": {"token": token},
    }
