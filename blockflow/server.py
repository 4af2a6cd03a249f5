"""``blockflow serve``: the REST API, the manager, the controller and the dispatcher, in one command.

CherryPy's engine bus drives the life-cycle: ``ManagerPlugin.start`` runs before the HTTP
server accepts requests, ``stop`` after it stopped accepting them. SIGTERM and Ctrl-C go
through the bus too, so both shut everything down in the manager's documented order.

A server started on a state directory whose state.json records an update (its predecessor
crashed, was killed or was restarted) applies that update again before it accepts requests,
so clients are served without the optimiser posting it again; ``--fresh`` starts empty.
"""
from __future__ import annotations

import json
import logging
import os
import re
from typing import NoReturn

import cherrypy
from cherrypy.process import plugins

from blockflow.core import settings
from blockflow.manager.manager import Manager, UpdateFailed
from blockflow.core.schema import UpdateError
from blockflow.manager.state import StateDir, StateDirInUse, UnsafePath

from .rest import Root, app_config

log = logging.getLogger("blockflow.server")


class _NoCherryPyTime(logging.Filter):
    """CherryPy starts each error-log line with its own time (``[27/Nov/2026:17:31:55] ENGINE
    ...``); the log format already has one."""

    TIME = re.compile(r"\[\d+/\w+/\d+:\d\d:\d\d:\d\d\] ")

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = self.TIME.sub("", record.msg, count=1)
        return True


def _route_cherrypy_logs(loggers, quiet: bool) -> None:
    """CherryPy's loggers go through Python logging only, once per line: its own screen log
    (``log.screen``) is off, since it printed every line a second time beside the root handler.
    They carry their own INFO level: hold them to the level the user chose (BLOCKFLOW_LOG), the
    access log to WARNING when quiet."""
    root_level = logging.getLogger().getEffectiveLevel()
    for logs in loggers:
        logs.error_log.setLevel(root_level)
        logs.access_log.setLevel(max(root_level, logging.WARNING) if quiet else root_level)
        if not any(isinstance(f, _NoCherryPyTime) for f in logs.error_log.filters):
            logs.error_log.addFilter(_NoCherryPyTime())


class ManagerPlugin(plugins.SimplePlugin):
    """Owns the manager on CherryPy's engine bus."""

    def __init__(self, bus, manager: Manager, ready_file: str | None, rest_url: str, restore: bool = True):
        super().__init__(bus)
        self.manager, self.ready_file, self.rest_url = manager, ready_file, rest_url
        self.restore = restore

    def start(self):
        self.bus.log("starting the BlockFlow manager")
        previous = self.manager.state.load() if self.restore else {}  # read before start() rewrites it
        self.manager.start()
        if previous.get("update"):
            self.restore_update(previous)

    def restore_update(self, previous: dict) -> None:
        """Apply the update the previous server on this state directory was serving."""
        log.info("re-applying the last update (version %s) recorded in %s; start with --fresh to start empty",
                 previous.get("version"), self.manager.state.state_file)
        try:
            result = self.manager.apply(previous["update"])
        except (UpdateError, UpdateFailed) as exc:
            log.error("could not re-apply the recorded update (%s); serving with no blocks until an update "
                      "is posted", exc)
            return
        log.info("re-applied the recorded update: blocks %s", ", ".join(result["diff"]["spawned"]) or "none")

    start.priority = 40  # before the HTTP server (75): nobody can POST to a manager that is not up

    def stop(self):
        self.bus.log("stopping the BlockFlow manager")
        self.manager.stop()
        if self.ready_file:
            try:
                os.unlink(self.ready_file)
            except FileNotFoundError:
                pass


def refuse(exc: Exception) -> NoReturn:
    """End ``blockflow serve`` with one line on stderr and exit code 1 (cli.Exit.FAILED), before
    the engine starts (once it has, a start listener's failure is a traceback and exit 70).

    A SystemExit, not cli.UserError: under ``python -m blockflow.cli`` the CLI catches
    ``__main__.UserError``, a class other than the ``blockflow.cli.UserError`` this module would
    import, so that one would end as an "unexpected" error with code 70."""
    raise SystemExit(f"blockflow serve: {exc}") from None


def serve(host: str = "127.0.0.1", port: int = 8080, dispatcher_host: str = "127.0.0.1",
          dispatcher_port: int = 5580, repo: str = "model_repo", state_dir: str | None = None,
          token: str | None = None, ready_file: str | None = None, window: int | None = None,
          quiet: bool = False, restore: bool = True, ray_address: str | None = None) -> None:
    state = StateDir(state_dir)
    try:
        # before the engine: a start listener that fails makes CherryPy print a traceback and exit 70
        state.claim()
    except (StateDirInUse, UnsafePath) as exc:
        refuse(exc)
    manager = Manager(repo, state, f"tcp://{dispatcher_host}:{dispatcher_port}", token=token,
                      window=window or settings.WINDOW, ray_address=ray_address)
    cherrypy.config.update({
        "server.socket_host": host,
        "server.socket_port": port,
        "server.thread_pool": 8,
        # no limit in cheroot: its 413 is plain text sent before the app runs; rest.read_json
        # reads at most MAX_BODY + 1 bytes and answers a larger body with a JSON 413
        "server.max_request_body_size": 0,
        "engine.autoreload.on": False,
        "log.screen": False,  # through Python logging only (_route_cherrypy_logs)
        "checker.on": False,
        "environment": "production",
    })
    # cheroot's connection loop notices a stop only when its select() times out: every
    # `expiration_interval` (0.5 s) when idle, which every server stop waited for on average
    httpserver, bind_addr = cherrypy.server.httpserver_from_self()
    httpserver.expiration_interval = 0.05
    cherrypy.server.httpserver, cherrypy.server.bind_addr = httpserver, bind_addr
    app = cherrypy.tree.mount(Root(manager), "/", app_config(token))
    _route_cherrypy_logs((cherrypy.log, app.log), quiet)
    plugin = ManagerPlugin(cherrypy.engine, manager, ready_file, "", restore=restore)
    plugin.subscribe()
    if hasattr(cherrypy.engine, "signal_handler"):
        cherrypy.engine.signal_handler.subscribe()
    cherrypy.engine.start()
    if cherrypy.engine.state != cherrypy.engine.states.STARTED:
        # a plugin failed to start (port in use, another server on this state dir): the bus
        # already logged why; make the exit code say it too
        cherrypy.engine.exit()
        raise SystemExit(1)
    bound = cherrypy.server.bound_addr
    rest_url = f"http://{bound[0]}:{bound[1]}"
    info = {"rest": rest_url, "dispatcher": manager.dispatcher.endpoint, "pid": os.getpid(),
            "state_dir": state.root, "run_dir": state.run_dir}
    log.info("BlockFlow serving: REST %s, dispatcher %s, state %s", rest_url, info["dispatcher"], state.root)
    if ready_file:
        tmp = ready_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(info, f)
        os.replace(tmp, ready_file)
    cherrypy.engine.block()
    state.release()
