"""The state directory: sockets, KPI runs and the active-blocks file, private to the owner.

Layout (every directory 0700)::

    <state-dir>/state.json     what runs now (the thesis's active_blocks_info file)
    <state-dir>/server.lock    held (flock) by the server using the directory; its pid inside
    <state-dir>/sock/          ipc socket files of blocks, dispatcher and controller
    <state-dir>/runs/<stamp>/  KPI logs of one server run
    /dev/shm/blockflow-<uid>-<12 random hex>/       TensorMQ slots (tensormq/shm.py)

Note [Nothing planted in /tmp or /dev/shm is followed]
Both may be world-writable, and the server often runs as root. So every directory is made
with ``mkdir`` (which never follows a link) and then opened with ``O_NOFOLLOW|O_DIRECTORY``
and checked through the descriptor (``fstat``: a directory, ours, no access for others); a
mode is tightened with ``fchmod`` on that descriptor, never through a path. The slot
directory gets a fresh random name at every start, so nobody can plant a link where it will
be; its ``.owner`` record is created ``O_EXCL|O_NOFOLLOW``. Something that is not ours where
we would create stops the server with a message naming the path; a leftover that is not a
plain directory of ours is left alone, never emptied or removed through a link.

state.json records the slot directory, so a server started after a ``kill -9`` of its
predecessor finds, and removes, what the predecessor left: processes still listed in
state.json (matched by pid *and* start time, so a recycled pid is never killed), socket
files and slot files. A run killed with its state directory (a temporary one, as
tests and experiments use) cannot be found that way, so every server also sweeps the slot
directories of this user whose server is gone and whose slot files all name dead processes
(``sweep_orphans``); each records its owner beside it, in ``<directory>.owner``.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import secrets
import shutil
import signal
import stat
import tempfile
import time

import psutil

from blockflow.core import settings
from blockflow.core.childproc import pid_alive
from blockflow.tensormq.sizing import shm_space, slot_files_of, slot_pid, window_bytes

log = logging.getLogger("blockflow.state")

#: Beside a slot directory: which state directory and server process it belongs to.
OWNER_SUFFIX = ".owner"
#: In the state directory: the lock its server holds (StateDir.claim).
LOCK_FILE = "server.lock"
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


class UnsafePath(PermissionError):
    """Something that is not ours sits where BlockFlow would create or use a directory."""


class StateDirInUse(RuntimeError):
    """Another live BlockFlow server uses the state directory: it holds its lock, or (a server
    that takes no lock) state.json records it."""


_DIR_NOFOLLOW = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


def _open_own_dir(path: str, dir_fd: int | None = None) -> int:
    """A descriptor on ``path``, which must be a real directory (not a link) owned by us."""
    try:
        fd = os.open(path, _DIR_NOFOLLOW, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafePath(f"{path} is a symbolic link or not a directory; BlockFlow never follows links "
                             "where it keeps its files: remove it, or choose another --state-dir") from None
        raise
    st = os.fstat(fd)
    if st.st_uid != os.getuid():
        os.close(fd)
        raise UnsafePath(f"{path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}); something not "
                         "ours sits where BlockFlow keeps its files: remove it, or choose another --state-dir")
    return fd


def _private_dir(path: str, dir_fd: int | None = None) -> str:
    """Make (or reuse) ``path`` as a 0700 directory of ours, checked through its descriptor."""
    if dir_fd is None:
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
    try:
        os.mkdir(path, 0o700, dir_fd=dir_fd)
    except FileExistsError:
        pass
    fd = _open_own_dir(path, dir_fd)
    try:
        if os.fstat(fd).st_mode & 0o077:
            os.fchmod(fd, 0o700)  # ours (checked above): tighten it through the descriptor
    finally:
        os.close(fd)
    return path


def _clear_dir(path: str, remove: bool) -> int:
    """Unlink every file in ``path`` (and the directory itself if ``remove``), through a
    descriptor: a ``path`` that is a link or not ours is left alone. Returns files removed."""
    try:
        fd = _open_own_dir(path)
    except FileNotFoundError:
        return 0
    except UnsafePath as exc:
        log.warning("left %s alone: %s", path, exc)
        return 0
    removed = 0
    try:
        for name in os.listdir(fd):
            try:
                os.unlink(name, dir_fd=fd)  # unlink never follows a link: a planted one goes, its target stays
                removed += 1
            except (FileNotFoundError, IsADirectoryError, PermissionError):
                pass
    finally:
        os.close(fd)
    if remove:
        try:
            os.rmdir(path)
        except OSError:
            pass
    return removed


def _shm_parent() -> str | None:
    """BLOCKFLOW_SHM_DIR (default /dev/shm) when it is a writable directory."""
    path = os.path.abspath(settings.SHM_DIR)
    return path if os.path.isdir(path) and os.access(path, os.W_OK) else None


class StateDir:
    def __init__(self, root: str | None = None):
        self.root = os.path.abspath(root or default_state_dir())
        self.sock = os.path.join(self.root, "sock")
        self.runs = os.path.join(self.root, "runs")
        self.state_file = os.path.join(self.root, "state.json")
        self.shm_parent = _shm_parent() or self.root
        self._shm: str | None = None       # made by prepare(); see Note [Nothing planted ...]
        self._previous_shm: str | None = None
        self.run_dir: str | None = None
        self._lock_fd: int | None = None   # LOCK_FILE, held from claim() to release() or exit

    @property
    def shm(self) -> str | None:
        """This server's slot directory; before prepare(), the one state.json records (the
        running or last server's), so tools and tests can find it; None if there is none."""
        return self._shm or self.recorded_shm()

    def recorded_shm(self) -> str | None:
        path = self.load().get("shm_dir")
        if not isinstance(path, str):
            return None
        name = _SERVER_SHM.fullmatch(os.path.basename(path))
        if os.path.dirname(path) != self.shm_parent or not name or int(name.group(1)) != os.getuid():
            return None  # not a name we make: never act on it
        return path

    def prepare(self) -> None:
        for path in (self.root, self.sock, self.runs):
            _private_dir(path)
        self._previous_shm = self.recorded_shm()
        self._shm = self._make_shm_dir()
        self.run_dir = _private_dir(os.path.join(self.runs, time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"))

    def _make_shm_dir(self) -> str:
        """A slot directory under a fresh random name, and its owner record beside it."""
        parent_fd = os.open(self.shm_parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            name = f"blockflow-{os.getuid()}-{secrets.token_hex(6)}"
            path = os.path.join(self.shm_parent, name)
            try:
                os.mkdir(name, 0o700, dir_fd=parent_fd)
            except FileExistsError:
                raise UnsafePath(f"{path} already exists although its name was just drawn at random; something "
                                 "is planting entries in shared memory: not starting") from None
            _private_dir(name, dir_fd=parent_fd)
            try:
                fd = os.open(name + OWNER_SUFFIX, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600,
                             dir_fd=parent_fd)
            except FileExistsError:
                os.rmdir(name, dir_fd=parent_fd)
                raise UnsafePath(f"{path}{OWNER_SUFFIX} already exists and is not ours to overwrite; "
                                 "not starting") from None
            with os.fdopen(fd, "w") as f:
                json.dump({"root": self.root, "server": process_record(os.getpid())}, f)
            return path
        finally:
            os.close(parent_fd)

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

    def recorded_version(self) -> int:
        """The update version state.json records (0 without one). A server continues from it,
        with ``--fresh`` too, so that the versions an optimiser reads only grow."""
        version = self.load().get("version")
        return version if isinstance(version, int) and not isinstance(version, bool) and version > 0 else 0

    def claim(self) -> None:
        """Make the state directory and hold its lock (LOCK_FILE) while this process lives, or
        raise StateDirInUse naming the server that holds it (UnsafePath: a directory not ours).

        ``blockflow serve`` claims before anything starts, so a refusal is one line. The kernel
        drops a flock when its holder dies, kill -9 included, so a dead server never keeps its
        successor out; and two servers started at the same moment cannot both pass, as they
        could when state.json, written once the dispatcher is up, was the only record."""
        if self._lock_fd is not None:
            return
        _private_dir(self.root)
        dir_fd = _open_own_dir(self.root)
        try:
            fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 20).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StateDirInUse(self._in_use(holder)) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd
        try:
            self.check_unused()  # a server that holds no lock (an older BlockFlow's)
        except StateDirInUse:
            self.release()
            raise

    def release(self) -> None:
        """Let go of the lock claim() holds (a process that exits lets go of it anyway)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def check_unused(self) -> None:
        """Raise StateDirInUse while another live server records itself in state.json."""
        server = self.load().get("server")
        if isinstance(server, dict) and server.get("pid") != os.getpid() and _same_process(server):
            raise StateDirInUse(self._in_use(server["pid"]))

    def _in_use(self, pid) -> str:
        return (f"another BlockFlow server (pid {pid}) is using the state directory {self.root}; stop it, "
                "or choose another --state-dir")

    def clean_leftovers(self) -> dict:
        """Kill processes a dead predecessor left, remove its sockets and slots."""
        try:
            self.check_unused()
        except StateDirInUse:
            self.remove_runtime(sockets=False)  # our fresh slot directory; the other server's stays
            raise
        old = self.load()
        killed = []
        procs = list((old.get("blocks") or {}).values())
        if old.get("dispatcher"):
            procs.append(old["dispatcher"])
        for rec in procs:
            if rec.get("pid") and _same_process(rec):
                try:
                    os.kill(rec["pid"], signal.SIGKILL)
                    killed.append(rec["pid"])
                except ProcessLookupError:
                    pass
        removed = _clear_dir(self.sock, remove=False)
        previous = self._previous_shm
        if previous and previous != self._shm:
            removed += _clear_dir(previous, remove=True)
            _unlink(previous + OWNER_SUFFIX)
        if killed or removed:
            log.warning("cleaned up after a previous server: killed pids %s, removed %d socket/slot files",
                        killed, removed)
        return {"killed": killed, "removed": removed}

    def sweep_orphans(self) -> list[str]:
        """Remove this user's slot directories that no live process can still use: their
        server is gone (or, for a standalone pipeline, its creator) and every slot file in
        them names a dead producer. Returns the directories removed."""
        parent = self.shm_parent
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
        """Unlink the slot files of a process of this host that died without closing its pools
        (``remove_slots_of`` below)."""
        return remove_slots_of(self.shm, pid)

    def remove_runtime(self, sockets: bool = True) -> None:
        """At clean shutdown: sockets and slots go; KPI runs and state.json stay."""
        if self._shm:
            _clear_dir(self._shm, remove=True)
            _unlink(self._shm + OWNER_SUFFIX)
        if sockets:
            _clear_dir(self.sock, remove=False)


def _orphaned(path: str, name: str) -> bool:
    server, standalone = _SERVER_SHM.fullmatch(name), _STANDALONE_SHM.fullmatch(name)
    if not (server or standalone):
        return False
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            return False  # a link or a file: never ours, never followed
        files = os.listdir(path)
    except OSError:
        return False
    if st.st_uid != os.getuid() or (server and int(server.group(1)) != os.getuid()):
        return False
    if standalone and pid_alive(int(standalone.group(1))):
        return False
    if server:
        alive = _owner_alive(path + OWNER_SUFFIX)
        if alive or (alive is None and time.time() - st.st_mtime < UNOWNED_GRACE_S):
            return False
    for f in files:
        pid = slot_pid(f)
        if pid is not None and pid_alive(pid):  # a zombie producer maps nothing any more
            return False
    return True


def _owner_alive(owner_file: str) -> bool | None:
    """Whether the server an owner record names still runs; None without a readable record."""
    try:
        with os.fdopen(os.open(owner_file, os.O_RDONLY | os.O_NOFOLLOW)) as f:
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
        # an exited server that nobody reaped yet (a zombie) runs nothing: it is not alive
        return abs(p.create_time() - rec.get("create_time", 0)) < 1.0 and pid_alive(p.pid)
    except (psutil.NoSuchProcess, psutil.AccessDenied, KeyError, TypeError):
        return False


def process_record(pid: int) -> dict:
    try:
        return {"pid": pid, "create_time": psutil.Process(pid).create_time()}
    except psutil.NoSuchProcess:
        return {"pid": pid, "create_time": 0}


def slot_budget(upd, window: int, shm_dir: str | None) -> dict:
    """Shared memory an update's TensorMQ slots take at batch 1, against what the slot
    directory's filesystem holds; logs a warning when it does not fit.

    Every CPU producer keeps ``window`` slots per next hop (tensormq/shm.py), each sized for the
    tensor it carries rounded up to a power of two; the sizes come from the manifests (a file
    no manifest lists counts as unknown). Larger batches need proportionally more."""
    from blockflow.core.protocol import DISPATCHER

    def nbytes(shape) -> int | None:
        if not isinstance(shape, list) or not all(isinstance(d, int) and d > 0 for d in shape):
            return None
        n = 4  # float32, what the manifests declare
        for d in shape:
            n *= d
        return n

    edges: dict[tuple[str, str], int | None] = {}
    for path in upd.tasks.values():
        hops = [DISPATCHER, *path, DISPATCHER]
        for producer, consumer in zip(hops, hops[1:]):
            decl = upd.blocks.get(producer)
            if decl is not None and (decl.transport != "tensormq" or decl.device != "cpu"):
                continue  # bytes on the socket, or a CUDA slot (its data is on the GPU)
            if decl is None and upd.transport != "tensormq":
                continue
            model = (decl or upd.blocks[consumer]).model
            if isinstance(model, list):  # a fused block: its last file makes the output, its first takes the input
                model = model[-1] if decl else model[0]
            entry = upd.manifests.get(model) or {}
            shapes = entry.get("output_shapes" if decl else "input_shapes")  # several tensors per message
            sizes = [nbytes(s) for s in shapes] if shapes else [nbytes(entry.get("output_shape" if decl else "input_shape"))]
            edges[(producer, consumer)] = None if None in sizes else sum(sizes)
    known = [n for n in edges.values() if n is not None]
    needed = sum(window_bytes(n, window) for n in known)
    out = {"dir": shm_dir, "window": window, "edges": len(edges), "edges_unknown_size": len(edges) - len(known),
           "needed_bytes_batch1": needed, "size_bytes": None, "free_bytes": None, "fits": None}
    if shm_dir:
        try:
            out["size_bytes"], out["free_bytes"] = shm_space(shm_dir)
        except OSError:
            return out
        out["fits"] = needed <= out["free_bytes"]
        if not out["fits"]:
            log.warning("this update's TensorMQ slots need %.1f MiB of shared memory at batch 1 (%d edges x %d "
                        "slots) but %s has %.1f MiB free of %.1f MiB: requests that do not fit fail with "
                        "no_shared_memory. Give it more room (docker --shm-size), lower BLOCKFLOW_WINDOW / "
                        "serve --window, or set BLOCKFLOW_SHM_DIR to a larger tmpfs", needed / 2**20,
                        len(edges), window, os.path.dirname(shm_dir), out["free_bytes"] / 2**20,
                        out["size_bytes"] / 2**20)
    return out


def remove_slots_of(shm_dir: str, pid: int) -> int:
    """Unlink the slot files in ``shm_dir`` of process ``pid`` (of this host), which died
    without closing its pools. Returns how many were removed.

    Which process made a slot file its name says (tensormq/sizing.py ``slot_pid``). Consumers that
    still map one keep their mapping; a handle that arrives after this fails with a clear error.
    """
    removed = 0
    for path in slot_files_of(shm_dir, pid):
        try:
            os.unlink(path)
            removed += 1
        except FileNotFoundError:
            pass
    return removed
