"""The state directory: sockets, KPI runs and the active-blocks file, private to the owner.

Layout (every directory 0700)::

    <state-dir>/state.json     what runs now (the thesis's active_blocks_info file)
    <state-dir>/sock/          ipc socket files of blocks, dispatcher and controller
    <state-dir>/runs/<stamp>/  KPI logs of one server run
    /dev/shm/blockflow-<uid>-<hash of state-dir>/   TensorMQ slots (tensormq/shm.py)

The shared-memory directory is derived from the state directory, so a server started after a
``kill -9`` of its predecessor finds, and removes, what the predecessor left: processes still
listed in state.json (matched by pid *and* start time, so a recycled pid is never killed),
socket files and slot files. A run killed with its state directory (a temporary one, as
tests and experiments use) cannot be found that way, so every server also sweeps the slot
directories of this user whose server is gone and whose slot files all name dead processes
(``sweep_orphans``); each records its owner beside it, in ``<directory>.owner``.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import signal
import tempfile
import time

import psutil

log = logging.getLogger("blockflow.state")

#: Beside a slot directory: which state directory and server process it belongs to.
OWNER_SUFFIX = ".owner"
#: A slot directory without an owner record (made by older BlockFlow) is swept only this old.
UNOWNED_GRACE_S = 600.0
_SERVER_SHM = re.compile(r"blockflow-(\d+)-[0-9a-f]{12}")
_OWNER = re.compile(r"(blockflow-\d+-[0-9a-f]{12})" + re.escape(OWNER_SUFFIX))
_STANDALONE_SHM = re.compile(r"blockflow-sa-(\d+)-.+")  # blockflow/standalone.py: creator's pid


def default_state_dir() -> str:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime) and os.access(runtime, os.W_OK):
        return os.path.join(runtime, "blockflow")
    return os.path.join(tempfile.gettempdir(), f"blockflow-{os.getuid()}")


def _private_dir(path: str) -> str:
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to uid {st.st_uid}, not to you; choose another --state-dir")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


class StateDir:
    def __init__(self, root: str | None = None):
        self.root = os.path.abspath(root or default_state_dir())
        self.sock = os.path.join(self.root, "sock")
        self.runs = os.path.join(self.root, "runs")
        self.state_file = os.path.join(self.root, "state.json")
        digest = hashlib.sha1(self.root.encode()).hexdigest()[:12]
        shm_root = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else self.root
        self.shm = os.path.join(shm_root, f"blockflow-{os.getuid()}-{digest}")
        self.run_dir: str | None = None

    def prepare(self) -> None:
        for path in (self.root, self.sock, self.runs, self.shm):
            _private_dir(path)
        fd = os.open(self.shm + OWNER_SUFFIX, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"root": self.root, "server": process_record(os.getpid())}, f)
        self.run_dir = _private_dir(os.path.join(self.runs, time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"))

    def save(self, state: dict) -> None:
        tmp = self.state_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(state, f, indent=2, sort_keys=True)
        os.replace(tmp, self.state_file)

    def load(self) -> dict:
        try:
            with open(self.state_file) as f:
                return json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def clean_leftovers(self) -> dict:
        """Kill processes a dead predecessor left, remove its sockets and slots."""
        old = self.load()
        killed = []
        procs = list((old.get("blocks") or {}).values())
        if old.get("dispatcher"):
            procs.append(old["dispatcher"])
        server = old.get("server")
        if server and server.get("pid") != os.getpid() and _same_process(server):
            raise RuntimeError(f"another BlockFlow server (pid {server['pid']}) is using {self.root}; "
                               "stop it or choose another --state-dir")
        for rec in procs:
            if rec.get("pid") and _same_process(rec):
                try:
                    os.kill(rec["pid"], signal.SIGKILL)
                    killed.append(rec["pid"])
                except ProcessLookupError:
                    pass
        removed = 0
        for d in (self.sock, self.shm):
            if os.path.isdir(d):
                for name in os.listdir(d):
                    try:
                        os.unlink(os.path.join(d, name))
                        removed += 1
                    except (FileNotFoundError, IsADirectoryError):
                        pass
        if killed or removed:
            log.warning("cleaned up after a previous server: killed pids %s, removed %d socket/slot files",
                        killed, removed)
        return {"killed": killed, "removed": removed}

    def sweep_orphans(self) -> list[str]:
        """Remove this user's slot directories that no live process can still use: their
        server is gone (or, for a standalone pipeline, its creator) and every slot file in
        them names a dead producer. Returns the directories removed."""
        parent = os.path.dirname(self.shm)
        try:
            names = os.listdir(parent)
        except FileNotFoundError:
            return []
        removed = []
        for name in names:
            path = os.path.join(parent, name)
            if path == self.shm or not _orphaned(path, name):
                continue
            shutil.rmtree(path, ignore_errors=True)
            _unlink(path + OWNER_SUFFIX)
            removed.append(path)
        for name in names:  # owner records whose directory is already gone
            owner = _OWNER.fullmatch(name)
            if owner and owner.group(1) not in names and not _owner_alive(os.path.join(parent, name)):
                _unlink(os.path.join(parent, name))
        if removed:
            log.warning("removed %d slot directories that dead BlockFlow runs left: %s", len(removed),
                        ", ".join(os.path.basename(p) for p in removed))
        return removed

    def remove_slots_of(self, pid: int) -> int:
        """Unlink the slot files of a process that died without closing its pools.

        Slot files are named ``<owner>.<pid>.<seq>`` (tensormq/shm.py). Consumers that still map
        one keep their mapping; a handle that arrives after this fails with a clear error.
        """
        removed = 0
        try:
            names = os.listdir(self.shm)
        except FileNotFoundError:
            return 0
        for name in names:
            parts = name.rsplit(".", 2)
            if len(parts) == 3 and parts[1] == str(pid):
                try:
                    os.unlink(os.path.join(self.shm, name))
                    removed += 1
                except FileNotFoundError:
                    pass
        return removed

    def remove_runtime(self) -> None:
        """At clean shutdown: sockets and slots go; KPI runs and state.json stay."""
        shutil.rmtree(self.shm, ignore_errors=True)
        _unlink(self.shm + OWNER_SUFFIX)
        if os.path.isdir(self.sock):
            for name in os.listdir(self.sock):
                try:
                    os.unlink(os.path.join(self.sock, name))
                except OSError:
                    pass


def _orphaned(path: str, name: str) -> bool:
    server, standalone = _SERVER_SHM.fullmatch(name), _STANDALONE_SHM.fullmatch(name)
    if not (server or standalone):
        return False
    try:
        st = os.stat(path)
        files = os.listdir(path)
    except OSError:
        return False
    if st.st_uid != os.getuid() or (server and int(server.group(1)) != os.getuid()):
        return False
    if standalone and psutil.pid_exists(int(standalone.group(1))):
        return False
    if server:
        alive = _owner_alive(path + OWNER_SUFFIX)
        if alive or (alive is None and time.time() - st.st_mtime < UNOWNED_GRACE_S):
            return False
    for f in files:  # slot files are <owner>.<pid>.<seq> (tensormq/shm.py)
        parts = f.rsplit(".", 2)
        if len(parts) == 3 and parts[1].isdigit() and psutil.pid_exists(int(parts[1])):
            return False
    return True


def _owner_alive(owner_file: str) -> bool | None:
    """Whether the server an owner record names still runs; None without a readable record."""
    try:
        with open(owner_file) as f:
            return _same_process(json.load(f)["server"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _same_process(rec: dict) -> bool:
    try:
        p = psutil.Process(rec["pid"])
        return abs(p.create_time() - rec.get("create_time", 0)) < 1.0
    except (psutil.NoSuchProcess, psutil.AccessDenied, KeyError, TypeError):
        return False


def process_record(pid: int) -> dict:
    try:
        return {"pid": pid, "create_time": psutil.Process(pid).create_time()}
    except psutil.NoSuchProcess:
        return {"pid": pid, "create_time": 0}
