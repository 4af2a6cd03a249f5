"""The REST control plane (CherryPy, MethodDispatcher): JSON in, JSON out, errors included.

    GET    /system                    blocks (pid, device, endpoint, status, restarts), tasks, version
    DELETE /system                    terminate every block
    POST   /system/update             apply a system update (blockflow/core/schema.py)
    GET    /blocks                    the blocks
    GET    /blocks/{name}             one block
    DELETE /blocks/{name}             stop a block no task uses (409 otherwise)
    GET    /blocks/{name}/ping        round trip through the control channel
    POST   /blocks/{name}/kpi         write out its KPI logs, then their latency components and
                                      resource means (a POST: it changes files; GET answers 405)
    POST   /blocks/{name}/monitor     {"enabled": true|false}
    GET    /health/live               the server answers
    GET    /health/ready              the dispatcher and every block are ready (503 otherwise)
    GET    /metrics                   Prometheus text format (blockflow/metrics.py)
    GET    /                          a browser (Accept: text/html): the live page of the deployment
                                      (blockflow/page.html); otherwise the list of endpoints
    /v2/...                           the Open Inference Protocol, KServe v2 (blockflow/openinference.py)

With a token configured, every call but ``GET /health/live`` and ``GET /health/ready`` needs
``Authorization: Bearer <token>``: reads too, since they show pids, paths and the state dir. A
browser has no way to send a bearer token, so HTTP Basic with the token as the password (any user
name) is taken too, and a 401 offers both: the browser asks for it once and sends it on the page's
own calls.
"""
from __future__ import annotations

import base64
import binascii
import functools
import hmac
import json
import logging
import os

import cherrypy

from blockflow.core.protocol import Cmd, Monitor
from blockflow.core.schema import UpdateError
from blockflow.manager.manager import Conflict, Manager, UpdateFailed

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
    except RecursionError:  # e.g. [[[[...]]]] nested deeper than the parser's stack
        fail(400, "body: JSON nested too deeply", field="body")


def block_name() -> str:
    """The {name} of /blocks/{name}[/action], as the URL path says it.

    Kept on the request, not in ``request.params``: CherryPy merges the query string into
    ``params`` after dispatching, so ``DELETE /blocks/a?name=b`` would otherwise act on b.
    """
    return cherrypy.request.blockflow_block


def no_params(params: dict) -> None:
    if params:
        fail(400, f"unexpected query parameter(s): {', '.join(sorted(params))}", field=sorted(params)[0])


#: What a load balancer or orchestrator probes without a token; they reveal only up/ready.
OPEN_PATHS = ("/health/live", "/health/ready")


def token_required() -> bool:
    return bool(cherrypy.request.app.config.get("blockflow", {}).get("token"))


def presented_token(auth: str) -> bytes | None:
    """The token an Authorization header carries: ``Bearer <token>``, or a browser's ``Basic``
    credentials whose password is the token (the user name is not looked at)."""
    if auth.startswith("Bearer "):
        return auth[7:].strip().encode()
    if auth.startswith("Basic "):
        try:
            user_pass = base64.b64decode(auth[6:].strip(), validate=True)
        except (binascii.Error, ValueError):
            return None
        return user_pass.partition(b":")[2]
    return None


def check_token():
    token = cherrypy.request.app.config.get("blockflow", {}).get("token")
    if token and cherrypy.request.path_info.rstrip("/") not in OPEN_PATHS:
        given = presented_token(cherrypy.request.headers.get("Authorization", ""))
        # compared as bytes: compare_digest raises TypeError (a 500) on a non-ASCII header value
        if given is None or not hmac.compare_digest(given, token.encode()):
            cherrypy.response.headers["WWW-Authenticate"] = 'Basic realm="BlockFlow", charset="UTF-8", Bearer'
            fail(401, "missing or wrong token: send 'Authorization: Bearer <token>' (a browser: the token as "
                      "the password it asks for)")


cherrypy.tools.blockflow_auth = cherrypy.Tool("before_handler", check_token, priority=20)


def no_length_means_empty():
    """A request with neither Content-Length nor Transfer-Encoding has an empty body (RFC 9112,
    section 6.3), as ``curl -X POST URL`` sends it; CherryPy would answer 411 Length Required."""
    req = cherrypy.request
    if "Content-Length" not in req.headers and "Transfer-Encoding" not in req.headers:
        req.headers["Content-Length"] = "0"
        req.body.length = 0


cherrypy.tools.blockflow_empty_body = cherrypy.Tool("on_start_resource", no_length_means_empty)


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
        return None

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
    def GET(self, **params):
        name = block_name()
        no_params(params)
        self._child(name)
        if self.action == "kpi":
            cherrypy.response.headers["Allow"] = "POST"
            fail(405, f"GET is not allowed on /blocks/{name}/kpi: it writes the block's KPI logs out, so it is "
                      f"a POST (no body): POST /blocks/{name}/kpi", allow="POST")
        try:
            if self.action == "ping":
                return self.manager.ping(name)
        except Conflict as exc:
            fail(409, str(exc))
        except TimeoutError as exc:
            fail(504, str(exc))
        fail(405, f"GET is not allowed on /blocks/{name}/{self.action}")

    @cherrypy.tools.json_out()
    def POST(self, **params):
        name = block_name()
        no_params(params)
        self._child(name)
        if self.action == "kpi":
            from blockflow.kpi import summarize_block
            try:
                self.manager.command(name, Cmd.STORE)
            except Conflict as exc:
                fail(409, str(exc))
            except TimeoutError as exc:
                fail(504, str(exc))
            return summarize_block(self.manager.state.run_dir, name)
        if self.action != "monitor":
            fail(405, f"POST is not allowed on /blocks/{name}/{self.action}")
        body = read_json()
        if not isinstance(body, dict) or not isinstance(body.get("enabled"), bool):
            fail(400, "enabled: must be true or false", field="enabled")
        try:
            return self.manager.command(name, Cmd.MONITOR, Monitor(body["enabled"]))
        except Conflict as exc:
            fail(409, str(exc))


@cherrypy.expose
class BlockList:
    """/blocks"""

    def __init__(self, manager: Manager):
        self.manager = manager

    @cherrypy.tools.json_out()
    def GET(self, **params):
        no_params(params)
        return self.manager.snapshot()["blocks"]

    @cherrypy.tools.json_out()
    def DELETE(self, **params):
        fail(405, "DELETE /blocks/{name} removes one block; DELETE /system removes them all")


@cherrypy.expose
class Block:
    """/blocks/{name}"""

    def __init__(self, manager: Manager):
        self.manager = manager

    @cherrypy.tools.json_out()
    def GET(self, **params):
        name = block_name()
        no_params(params)
        try:
            return self.manager.child(name).describe()
        except KeyError:
            fail(404, f"no block named {name!r}; GET /blocks lists them")

    @cherrypy.tools.json_out()
    def DELETE(self, **params):
        name = block_name()
        no_params(params)
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
            cherrypy.request.blockflow_health = vpath.pop(0)
            return self
        return None

    @cherrypy.tools.json_out()
    def GET(self, *vpath, **params):
        if vpath:
            fail(404, f"no /health/{'/'.join(vpath)}; use /health/live or /health/ready")
        no_params(params)
        what = getattr(cherrypy.request, "blockflow_health", "live")
        if what == "ready" and not self.manager.ready():
            # open without a token: the details (pids, paths) only where no token guards them
            details = {} if token_required() else {"system": self.manager.snapshot()}
            fail(503, "not ready: the dispatcher or a block is not running", **details)
        return {"status": "ok", "version": self.manager.version}


@cherrypy.expose
class MetricsPage:
    """/metrics: Prometheus text format (blockflow/metrics.py)."""

    def __init__(self, manager: Manager):
        from blockflow.metrics import Metrics
        self.metrics = Metrics(manager)

    def GET(self, **params):
        no_params(params)
        from prometheus_client import CONTENT_TYPE_LATEST
        cherrypy.response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return self.metrics.render()


@cherrypy.expose
class StatusPage:
    """/status: one row per process, for ``blockflow status`` (BlockFlowCollector.status)."""

    def __init__(self, metrics):
        self.metrics = metrics

    @cherrypy.tools.json_out()
    def GET(self, **params):
        no_params(params)
        return {"processes": self.metrics.metrics.collector.status()}


@cherrypy.expose
class Root:
    """/blocks/... is routed here by _cp_dispatch, never by attribute lookup: CherryPy looks a
    path segment up with getattr() first, so a block named like an attribute of a handler
    object ("manager", "GET", "exposed", ...) would otherwise reach that attribute."""

    def __init__(self, manager: Manager):
        self.system = System(manager)
        self.health = Health(manager)
        self.metrics = MetricsPage(manager)
        self.status = StatusPage(self.metrics)  # the same log readers as /metrics
        from blockflow.openinference import V2
        self.v2 = V2(manager)  # the Open Inference Protocol (KServe v2)
        self._block_list = BlockList(manager)
        self._block = Block(manager)
        self._actions = {a: BlockAction(manager, a) for a in ("ping", "kpi", "monitor")}

    def _cp_dispatch(self, vpath):
        if not vpath or vpath[0] != "blocks":
            return None
        if len(vpath) == 1:
            del vpath[:1]
            return self._block_list
        if len(vpath) == 2:
            cherrypy.request.blockflow_block = vpath[1]
            del vpath[:2]
            return self._block
        if len(vpath) == 3 and vpath[2] in self._actions:
            cherrypy.request.blockflow_block = vpath[1]
            action = self._actions[vpath[2]]
            del vpath[:3]
            return action
        return None

    def GET(self):
        """A browser gets the live page; an API client the list of endpoints, as JSON."""
        if wants_html(cherrypy.request.headers.get("Accept", "")):
            cherrypy.response.headers["Content-Type"] = "text/html; charset=utf-8"
            cherrypy.response.headers["Cache-Control"] = "no-store"
            return live_page()
        cherrypy.response.headers["Content-Type"] = "application/json"
        return json.dumps({"service": "blockflow", "endpoints": [
            "/", "/system", "/system/update", "/blocks", "/health/live", "/health/ready", "/metrics", "/status",
            "/v2"]}).encode()


def wants_html(accept: str) -> bool:
    """True when ``Accept`` asks for HTML before JSON (a browser's navigation does; curl, the CLI
    and the client library ask for JSON or anything)."""
    kinds = [part.split(";")[0].strip().lower() for part in accept.split(",")]
    if "text/html" not in kinds:
        return False
    return "application/json" not in kinds or kinds.index("text/html") < kinds.index("application/json")


@functools.cache
def live_page() -> bytes:
    """blockflow/page.html, read once."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "page.html"), "rb") as f:
        return f.read()


def app_config(token: str | None) -> dict:
    return {
        "/": {
            "request.dispatch": cherrypy.dispatch.MethodDispatcher(),
            "error_page.default": json_error_page,
            "tools.blockflow_auth.on": True,
            "tools.blockflow_empty_body.on": True,
            "tools.encode.on": True,
            "request.show_tracebacks": False,
            # bodies are JSON, read by read_json(); never let CherryPy parse a form body into
            # handler arguments (a form POST must get 415, not a confusing 400/404)
            "request.body.processors": {},
        },
        "blockflow": {"token": token},
    }
