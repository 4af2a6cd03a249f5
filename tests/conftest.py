"""Shared fixtures: a seeded model repository, leak checks, a real server on free ports."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import sys
import tempfile
import time

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
# The helpers other tiers share live in tests/process (test_control_plane.rest_error, test_chaos's
# assertions): tests/cluster imports them by module name, as the process tests do among themselves.
_PROCESS_TESTS = os.path.join(ROOT, "tests", "process")
if _PROCESS_TESTS not in sys.path:
    sys.path.append(_PROCESS_TESTS)

# Every Ray these tests start (tests/cluster/test_cluster.py, the peers' smoke test) stays on the loopback:
# with this, Ray 2.60 gives every node, the head's GCS included, 127.0.0.1 instead of this
# machine's interface address. Ray reads it when imported, and children inherit it.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

#: Where the servers these tests start put their TensorMQ slot directories (``blockflow-*``).
#: Under pytest-xdist (``make test`` runs most of the suite on two workers) every worker gets its
#: own temporary directory and its own slot directory under /dev/shm, set here before anything
#: reads them and inherited by every server it starts: the leak checks below look at "everything
#: in the directory", and one worker must not count (or remove) what another worker's test made.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER:
    import multiprocessing.util
    # multiprocessing's own directory (pymp-*, its forkserver's socket) is made in the machine's
    # temporary directory, before TMPDIR changes: multiprocessing removes it when the worker exits,
    # which is after pytest_unconfigure has removed the private directories below.
    multiprocessing.util.get_temp_dir()
    _private = {"TMPDIR": tempfile.mkdtemp(prefix=f"bfw-{_WORKER}-", dir="/tmp")}
    if os.path.isdir("/dev/shm"):
        _private["BLOCKFLOW_SHM_DIR"] = tempfile.mkdtemp(prefix=f"bfw-{_WORKER}-", dir="/dev/shm")
    os.environ.update(_private)
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
from blockflow.core import settings  # noqa: E402  (after the worker's environment: it reads it once)

SHM_DIR = settings.SHM_DIR


def pytest_unconfigure(config):
    """A worker removes its private directories (their contents were checked by leak_check)."""
    if _WORKER:
        for d in _private.values():
            shutil.rmtree(d, ignore_errors=True)


#: The tiers, one folder each, the way the code is: a test's folder gives it its marker, so
#: ``-m unit`` (or ``make test-unit``) runs exactly one folder. ``cuda`` is also the mark of a test
#: elsewhere that needs a GPU (the GPU cases of a process test): ``-m cuda`` runs every one.
TIERS = {
    "unit": "runs in the test process alone: no child process (enforced), no server",
    "process": "starts real processes, sockets or servers",
    "cluster": "starts a real multi-node Ray cluster on this machine",
    "cuda": "needs a CUDA GPU (skipped where none is visible)",
}


def _tier_of(path) -> str:
    rel = os.path.relpath(str(path), os.path.join(ROOT, "tests"))
    tier = rel.split(os.sep)[0]
    if tier not in TIERS or rel == tier:
        raise pytest.UsageError(
            f"tests/{rel} is in no tier: move it (git mv) into tests/unit, tests/process, tests/cluster "
            f"or tests/cuda, whichever says what it needs (CONTRIBUTING.md, 'Where a test goes')")
    return tier


#: The mark expressions of make test's later phases: they collect only the files that say ``exclusive``.
EXCLUSIVE_PHASES = ("exclusive", "exclusive and not alone", "alone")


def pytest_ignore_collect(collection_path, config):
    """make test's exclusive phases (``-m exclusive and not alone``, ``-m alone``) collect only
    the test files that mark a test exclusive (by name: ``pytestmark`` or a parameter's marks):
    importing the rest only to deselect every test in them cost that phase about 16 s of CPU."""
    if (config.getoption("markexpr") in EXCLUSIVE_PHASES and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_") and "exclusive" not in collection_path.read_text()):
        return True
    return None


def _check_alone(item) -> None:
    """``alone`` is a kind of ``exclusive``: a test marked alone but not exclusive would also run
    in the parallel phase."""
    if item.get_closest_marker("alone") is not None and item.get_closest_marker("exclusive") is None:
        raise pytest.UsageError(f"{item.nodeid} is marked alone but not exclusive: mark it both")


def pytest_collection_modifyitems(config, items):
    import torch
    for item in items:
        tier = _tier_of(item.path)
        if tier == "cuda" and item.get_closest_marker("cuda") is None:
            raise pytest.UsageError(f"{item.nodeid} is in tests/cuda but is not marked cuda: a test that "
                                    f"runs without a GPU goes in tests/unit or tests/process")
        item.add_marker(getattr(pytest.mark, tier))
        _check_alone(item)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible here")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


#: The audit events of a new process (os.fork covers multiprocessing's fork; subprocess.Popen
#: covers every ``python -c`` and CLI run).
_SPAWN_EVENTS = frozenset({"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec",
                           "os.system"})
_unit_test_running: list[str] = []  # the node id of the unit test running now, if one is


def _refuse_processes_in_unit_tests(event, args):
    if _unit_test_running and event in _SPAWN_EVENTS:
        raise RuntimeError(f"{_unit_test_running[0]} is a unit test and started a process ({event}): "
                           f"move it to tests/process (CONTRIBUTING.md, 'Where a test goes')")


sys.addaudithook(_refuse_processes_in_unit_tests)


def _guarded(item):
    """Run one phase of ``item`` with process starts refused when it is a unit test."""
    unit = item.get_closest_marker("unit") is not None
    if unit:
        _unit_test_running.append(item.nodeid)
    return unit


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    unit = _guarded(item)
    try:
        yield
    finally:
        if unit:
            _unit_test_running.clear()


pytest_runtest_call = pytest_runtest_setup  # the same guard around the test's call as around its setup


#: ``BLOCKFLOW_TEST_CPU=FILE``: every test appends a line to FILE with the CPU it cost (CONTRIBUTING.md,
#: "What a test costs"): this process's own, and its children's that were reaped during the test
#: (every server a test stops, with the forkserver and blocks under it; a module or session
#: fixture's cost lands on the test that set it up or tore it down).
_CPU_LOG = os.environ.get("BLOCKFLOW_TEST_CPU")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _CPU_LOG:
        yield
        return
    t0, w0, start = os.times(), time.monotonic(), time.time()
    yield
    t1 = os.times()
    own = t1.user + t1.system - t0.user - t0.system
    children = t1.children_user + t1.children_system - t0.children_user - t0.children_system
    with open(_CPU_LOG, "a") as f:  # one short write per line: two workers may append at once
        f.write(f"{item.nodeid}\t{time.monotonic() - w0:.2f}\t{own:.2f}\t{children:.2f}\t{_WORKER or 'main'}\t{start:.1f}\n")


#: The checkout's git-ignored model repository (experiments.common.DEFAULT_REPO, the one `make
#: demo` and the experiments use): the tests' seeded exports live there too, so that one export
#: serves the whole suite and the experiments' smoke tests instead of one per session and user.
MODEL_REPO = os.path.join(ROOT, "model_repo")
REPO_FILES = ("block1.pt", "block2.pt", "block3.pt", "block4.pt", "head.pt", "full.pt", "block4-x.pt", "head-x.pt")


@pytest.fixture(scope="session")
def model_repo():
    """resnet18 and resnet50 split into 4 blocks + head, with an 'x' variant of block4/head,
    exported into model_repo/ where a model lacks its manifest or a file (exports are
    byte-for-byte repeatable, and the server checks every file against the manifest's sha256)."""
    import fcntl
    # Two pytest-xdist workers may both find the repository incomplete. Each model has its lock
    # (held on the model's own folder, so no lock file lands anywhere): a worker first exports
    # the models nobody is exporting, then waits for the others, so two workers export the two
    # models side by side instead of one after the other.
    done = set()
    for blocking in (False, True):
        for model in MODELS:
            if model in done:
                continue
            folder = os.path.join(MODEL_REPO, model)
            os.makedirs(folder, exist_ok=True)
            lock = os.open(folder, os.O_RDONLY)
            try:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
                except BlockingIOError:
                    continue  # another worker exports it: the next model first
                _export_missing(model)
                done.add(model)
            finally:
                os.close(lock)  # releases the lock
    return MODEL_REPO


MODELS = ("resnet18", "resnet50")


def _export_missing(model: str) -> None:
    from blockflow.blocks.repository import BlockFileError, export_model, load_manifest
    try:
        listed = set(load_manifest(MODEL_REPO, model).get("blocks", {}))
    except BlockFileError:  # an unreadable manifest: export again
        listed = set()
    if not all(f in listed and os.path.exists(os.path.join(MODEL_REPO, model, f)) for f in REPO_FILES):
        export_model(model, MODEL_REPO, blocks=4, method="script", variants={"x": ["block4", "head"]})


@pytest.fixture(scope="session")
def identity_repo(tmp_path_factory):
    """Tiny TorchScript blocks that are not in any manifest (users may drop their own)."""
    import torch

    class Identity(torch.nn.Module):
        def forward(self, x):
            return x

    class Double(torch.nn.Module):
        def forward(self, x):
            return x * 2

    class Sleepy(torch.nn.Module):
        def forward(self, x):
            # about 50 ms of real work, so requests are in flight while tests change things
            y = x
            for _ in range(200):
                y = torch.tanh(y + 0.001)
            return y

    class Transpose(torch.nn.Module):
        def forward(self, x):
            return x.transpose(0, 1)  # a view of its input: it goes on by handle, not C-contiguous

    repo = tmp_path_factory.mktemp("identity_repo")
    os.makedirs(repo / "toy")
    torch.jit.save(torch.jit.script(Identity()), str(repo / "toy" / "identity.pt"))
    torch.jit.save(torch.jit.script(Double()), str(repo / "toy" / "double.pt"))
    torch.jit.save(torch.jit.script(Sleepy()), str(repo / "toy" / "sleepy.pt"))
    torch.jit.save(torch.jit.script(Transpose()), str(repo / "toy" / "transpose.pt"))
    (repo / "toy" / "broken.pt").write_bytes(b"this is not TorchScript")
    return str(repo)


def _shm_entries() -> set[str]:
    try:
        return {e for e in os.listdir(SHM_DIR) if e.startswith("blockflow-") and not _foreign(e)}
    except FileNotFoundError:
        return set()


#: Temporary directories BlockFlow's experiments and servers make (bf-chaos-, bf-hop-, bfx-, ...).
_TMP_PREFIXES = ("bf-", "bfx-")


def _tmp_entries() -> set[str]:
    return {e for e in os.listdir(tempfile.gettempdir()) if e.startswith(_TMP_PREFIXES)}


def _foreign(entry: str) -> bool:
    """A slot directory whose owner record names a live server that is not ours: another test
    run's or experiment's on the same machine. The leak check neither counts nor removes it."""
    try:
        with open(os.path.join(SHM_DIR, entry.removesuffix(".owner") + ".owner")) as f:
            pid = json.load(f)["server"]["pid"]
        mine = {p.pid for p in psutil.Process().children(recursive=True)}
        return psutil.pid_exists(pid) and pid not in mine
    except (OSError, ValueError, KeyError, TypeError):
        return False


@pytest.fixture
def leak_check():
    """Fail a test that leaves a child process, a slot directory, a socket or a server's state
    directory behind."""
    before_shm, before_tmp = _shm_entries(), _tmp_entries()
    me = psutil.Process()
    before_children = {p.pid for p in me.children(recursive=True)}
    yield
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        extra = [p for p in me.children(recursive=True) if p.pid not in before_children and p.is_running()
                 and p.status() != psutil.STATUS_ZOMBIE]
        left_shm = _shm_entries() - before_shm
        if not extra and not left_shm:
            break
        time.sleep(0.1)
    for p in extra:
        p.kill()
    for e in left_shm:
        shutil.rmtree(os.path.join(SHM_DIR, e), ignore_errors=True)
    assert not extra, f"child processes left behind: {[(p.pid, p.cmdline()[:4]) for p in extra]}"
    assert not left_shm, f"shared-memory directories left behind: {left_shm}"
    left_tmp = _tmp_entries() - before_tmp
    for e in left_tmp:
        shutil.rmtree(os.path.join(tempfile.gettempdir(), e), ignore_errors=True)
    assert not left_tmp, f"state directories left behind in {tempfile.gettempdir()}: {sorted(left_tmp)}"


@pytest.fixture
def shm_dir():
    """A private directory under /dev/shm for a test's own slot pools."""
    d = tempfile.mkdtemp(prefix="bftest-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def ctx():
    """A ZeroMQ context of the test's own, terminated after it."""
    import zmq
    c = zmq.Context()
    yield c
    c.term()


@pytest.fixture
def short_tmp():
    """A short directory for ipc socket paths (unix sockets are limited to ~107 characters)."""
    d = tempfile.mkdtemp(prefix="bft-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


class Server:
    def __init__(self, proc, info, state_dir):
        self.proc, self.info, self.state_dir = proc, info, state_dir
        self.url, self.dispatcher = info["rest"], info["dispatcher"]

    def call(self, method, path, body=None, **kw):
        from blockflow.restclient import call
        return call(method, self.url + path, body, **kw)

    def stop(self):
        from blockflow.demo import stop_server
        return stop_server(self.proc)


@pytest.fixture
def server_factory(short_tmp, leak_check):
    from blockflow.demo import start_server
    servers = []

    def start(repo, extra=None, env=None):
        state = os.path.join(short_tmp, f"s{len(servers)}")
        os.makedirs(state)
        full_env = dict(os.environ, **(env or {}))
        proc, info = start_server(repo, state, extra=extra, env=full_env)
        s = Server(proc, info, state)
        servers.append(s)
        return s

    yield start
    for s in servers:
        if s.proc.poll() is None:
            code = s.stop()
            assert code == 0, f"server exited with {code} on SIGTERM"


def slot_files_of(pid: int) -> list[str]:
    """TensorMQ slot files (``<owner>.<pid>.<seq>``) that process ``pid`` created."""
    import glob
    return [f for f in glob.glob(os.path.join(SHM_DIR, "blockflow-*", "*"))
            if os.path.basename(f).rsplit(".", 2)[1:2] == [str(pid)]]


def loaded_libraries(pid: int, name: str) -> set[str]:
    """The shared libraries process ``pid`` has mapped whose file name contains ``name``."""
    with open(f"/proc/{pid}/maps") as f:
        paths = {line.split()[-1] for line in f if line.count("/")}
    return {p for p in paths if name in os.path.basename(p)}


def needs(module: str):
    """A ``pytestmark`` skipping a test file when ``module`` is not installed, found without
    importing it (``pytest.importorskip`` imports it: 6 s of CPU for transformers, paid by every
    pytest process that collects the file, whether or not it runs a test of it)."""
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"{module} is not installed (the test extra has it: pip install -e '.[test]')")


def kill_tree(pid: int) -> None:
    try:
        for p in psutil.Process(pid).children(recursive=True):
            p.send_signal(signal.SIGKILL)
        os.kill(pid, signal.SIGKILL)
    except (psutil.NoSuchProcess, ProcessLookupError):
        pass


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    """Poll ``predicate`` until it returns something true (returned) or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"{what} did not happen within {timeout:.0f}s (last: {last!r})")


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def reap(procs, pids) -> None:
    """A test's last resort after a failure: kill the process tree of every ``procs`` entry
    (subprocess.Popen) still running, then every pid of ``pids`` not gone yet."""
    for p in procs:
        if p.poll() is None:
            kill_tree(p.pid)
            p.wait(10)
    for pid in pids:
        if not gone(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # it went between the look and the kill
                pass
