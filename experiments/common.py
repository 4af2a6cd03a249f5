"""Shared helpers for the experiments: where results go, what machine and code made them, a
progress bar, warm-up handling, the model repository, a real ``blockflow serve`` and small statistics.

An experiment writes ``<out>/<name>.json`` (plus CSV/PNG files). Without ``--out`` that is the
git-ignored scratch directory ``experiments/results/_runs/<machine>/``; the committed results in
``experiments/results/<machine>/`` are written only when ``--out`` names that directory, so a
smoke run never overwrites them. ``<machine>`` is a stable label such as ``x86_64-2cpu`` or
``x86_64-16cpu-nvidia-h100-80gb-hbm3``: no host name, so results from two runs on the same kind
of machine land in the same place. Every JSON records the commit that produced it
(:func:`provenance`); tests/process/test_experiments.py fails when a committed one is older than the
code it measures.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import json
import logging
import math
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

log = logging.getLogger("experiments")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS_ROOT = os.path.join(HERE, "results")
#: Where a run without ``--out`` writes (git-ignored): ``_runs/<machine>/`` under RESULTS_ROOT.
SCRATCH_ROOT = os.path.join(RESULTS_ROOT, "_runs")
#: The folders whose code a result measures; ``dirty`` lists their modified tracked files.
CODE_DIRS = ("blockflow", "blocks", "dispatcher", "manager", "tensormq", "experiments")
DEFAULT_REPO = os.path.join(ROOT, "model_repo")

#: Warm-up samples dropped before statistics (thesis 4.1.2 and 4.2.2: "discarding the first 250").
WARMUP_FULL = 250
WARMUP_QUICK = 5

#: ResNet50 4-block pipeline as the thesis deploys it: block name in the update -> file stem.
PIPELINE = (("b1", "block1"), ("b2", "block2"), ("b3", "block3"), ("b4", "block4"), ("h", "head"))
TRANSPORTS = ("zeromq", "tensormq")
TASK = "classify"


# -- the machine and the results directory ----------------------------------------------------
def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def gpu_names() -> list[str]:
    try:
        import torch
        if torch.cuda.is_available():
            return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # a broken driver must not stop CPU experiments
        pass
    return []


def machine_label() -> str:
    """``<arch>-<N>cpu[-<gpu slug>[-xK]]``: stable for a kind of machine, free of host names."""
    label = f"{platform.machine() or 'unknown'}-{os.cpu_count() or 0}cpu"
    gpus = gpu_names()
    if gpus:
        label += "-" + _slug(gpus[0]) + (f"-x{len(gpus)}" if len(gpus) > 1 else "")
    return label


def committed_dir() -> str:
    """``experiments/results/<machine>``: the committed results of this kind of machine."""
    return os.path.join(RESULTS_ROOT, machine_label())


_told_scratch: list[str] = []


def results_dir(out: str | None = None) -> str:
    """``out`` if given, else the scratch directory ``experiments/results/_runs/<machine>``
    (git-ignored; said once on stderr); created if missing. Committed results are written only
    by naming their directory: ``--out experiments/results/<machine>``."""
    path = out or os.path.join(SCRATCH_ROOT, machine_label())
    os.makedirs(path, exist_ok=True)
    if not out and not _told_scratch:
        _told_scratch.append(path)
        print(f"no --out given: writing to the scratch directory {os.path.relpath(path)} (git-ignored); "
              f"to replace the committed results pass --out {os.path.relpath(committed_dir())}", file=sys.stderr)
    return path


def _git(*args: str, strip: bool = True) -> str | None:
    try:
        proc = subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    return proc.stdout.strip() if strip else proc.stdout


def command_line() -> str:
    """This process's command line as one would type it again (``python -m experiments.X ...``)."""
    import __main__
    spec = getattr(__main__, "__spec__", None)
    argv = ["python", "-m", spec.name, *sys.argv[1:]] if spec is not None else ["python", *sys.argv]
    return shlex.join(argv)


def provenance() -> dict:
    """Which code made a result: ``commit`` (HEAD of the checkout, None outside git),
    ``commit_date``, ``dirty`` (modified tracked files under CODE_DIRS, results excluded; empty
    when clean), ``created`` (UTC) and the ``command``. BLOCKFLOW_SOURCE_COMMIT, where set, names
    the commit of the clean checkout that was copied here instead (recorded with ``commit_from``)."""
    # A copied working tree (a lent GPU machine) may come without .git or with a stale one (seen on
    # an H200: its .git was the session's first HEAD, its files a later commit): whoever copied a
    # clean checkout names its commit; dirty cannot be checked there.
    source = os.environ.get("BLOCKFLOW_SOURCE_COMMIT")
    commit = source or _git("rev-parse", "HEAD")
    dirty = []
    if commit and not source:
        status = _git("status", "--porcelain", "--untracked-files=no", "--", *CODE_DIRS, strip=False) or ""
        results = os.path.relpath(RESULTS_ROOT, ROOT) + os.sep
        dirty = sorted(line[3:].split(" -> ")[-1] for line in status.splitlines()
                       if line[3:] and not line[3:].startswith(results))
    out = {"commit": commit, "commit_date": _git("show", "-s", "--format=%cI", "HEAD") if commit and not source else None,
           "dirty": dirty, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": command_line()}
    if source:
        out["commit_from"] = "BLOCKFLOW_SOURCE_COMMIT"
    return out


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def env_info(settings: dict | None = None) -> dict:
    """What produced a result: versions, devices, CPU, memory, load, and the settings used."""
    import psutil
    import torch
    info = {
        "machine": machine_label(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpus": gpu_names(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads_default": torch.get_num_threads(),
        "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "loadavg_at_start": [round(v, 2) for v in os.getloadavg()],
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if torch.cuda.is_available():
        info["cudnn"] = torch.backends.cudnn.version()
        try:
            import pynvml
            pynvml.nvmlInit()
            info["nvidia_driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception:
            pass
    try:
        import zmq
        import cherrypy
        info["pyzmq"], info["libzmq"], info["cherrypy"] = zmq.__version__, zmq.zmq_version(), cherrypy.__version__
    except Exception:
        pass
    info["git_commit"] = _git("rev-parse", "HEAD")  # the full record is the JSON's provenance keys
    if settings is not None:
        info["settings"] = settings
    return info


def write_json(out: str | None, name: str, data: dict) -> str:
    """Write ``<out>/<name>.json`` (``out`` None: the scratch directory) with the provenance keys
    (commit, commit_date, dirty, created, command) first; ``data`` should carry ``env``
    (env_info) and ``settings``."""
    data = {"experiment": name, **provenance(), **data}
    if "env" in data:
        data["env"]["loadavg_at_end"] = [round(v, 2) for v in os.getloadavg()]
    path = os.path.join(results_dir(out), f"{name}.json")
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=_jsonable)
        f.write("\n")
    print(f"wrote {path}")
    return path


def _jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if hasattr(v, "tolist"):
        return v.tolist()
    return str(v)


def write_csv(out: str, filename: str, header: list[str], rows) -> str:
    path = os.path.join(results_dir(out), filename)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        for r in rows:
            w.writerow([f"{v:.4f}" if isinstance(v, float) else v for v in r])
    print(f"wrote {path}")
    return path


def pyplot():
    """matplotlib.pyplot with the Agg backend (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_fig(fig, out: str, filename: str, dpi: int = 80) -> str:
    path = os.path.join(results_dir(out), filename)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    print(f"wrote {path}")
    return path


# -- command line --------------------------------------------------------------------------
OUT_HELP = ("results directory (default: the git-ignored scratch directory experiments/results/_runs/<machine>); "
            "committing results is explicit: --out experiments/results/<machine>")


def parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"python -m experiments.{name}", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short settings (smoke run)")
    ap.add_argument("--repo", default=DEFAULT_REPO, help=f"model repository (default {DEFAULT_REPO}); "
                                                         "ResNet50 blocks are exported into it if missing")
    ap.add_argument("--out", help=OUT_HELP)
    ap.add_argument("--n", type=int, help="override the number of samples per measurement")
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return ap


def add_pipeline_args(ap: argparse.ArgumentParser, threads_help: str = "torch threads per block (default 1)",
                      transports: bool = True) -> None:
    """The options every experiment that runs blocks shares: --threads, --device, --transports."""
    ap.add_argument("--threads", type=int, default=1, help=threads_help)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    if transports:
        ap.add_argument("--transports", default=",".join(TRANSPORTS), help="comma-separated (default both)")


def device_and_transports(args) -> tuple[str, list[str]]:
    """The device (cuda when available unless --device says) and the transports to run."""
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return device, [t for t in (getattr(args, "transports", None) or "").split(",") if t]


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.jit")
    warnings.filterwarnings("ignore", message=r"`torch\.jit\.")


# -- progress and warm-up ------------------------------------------------------------------
class Progress:
    """Progress on stderr: a tqdm bar on a terminal, a line per 50% otherwise (logs stay readable)."""

    def __init__(self, total: int, label: str = "", width: int = 30):
        self.total, self.label = max(1, int(total)), label
        self.n = 0
        self.t0 = time.monotonic()
        self.bar = None
        self._last_decile = -1
        if sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=self.total, desc=label, file=sys.stderr, leave=True, dynamic_ncols=True)

    def update(self, k: int = 1) -> None:
        self.n += k
        if self.bar is not None:
            self.bar.update(k)
            return
        decile = int(min(1.0, self.n / self.total) * 10)
        if decile != self._last_decile and (decile % 5 == 0 or self.n == self.total):
            self._last_decile = decile
            sys.stderr.write(f"{self.label}: {self.n}/{self.total} ({time.monotonic() - self.t0:.1f}s)\n")
            sys.stderr.flush()

    def to(self, n: float) -> None:
        """Move to ``n`` (e.g. the seconds elapsed), never backwards."""
        if int(n) > self.n:
            self.update(int(n) - self.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def warmup_count(n_total: int, quick: bool) -> int:
    """Samples to drop: 250 as in the thesis (5 in quick mode), never more than a quarter."""
    return min(WARMUP_QUICK if quick else WARMUP_FULL, n_total // 4)


def discard_warmup(values: list, quick: bool) -> list:
    return list(values)[warmup_count(len(values), quick):]


# -- statistics ----------------------------------------------------------------------------
def pct(values, q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def bootstrap_ci(sample: list, stat, draws: int = 1000, seed: int = 0) -> list[float]:
    """The 2.5th and 97.5th percentiles of ``stat`` over ``draws`` resamples (with replacement,
    seeded) of ``sample``: the statistic's 95% interval."""
    import random
    rng = random.Random(seed)
    got = sorted(stat(rng.choices(sample, k=len(sample))) for _ in range(draws))
    return [got[int(0.025 * draws)], got[int(0.975 * draws) - 1]]


def ratio_parts(nums: list[float], dens: list[float], parts: int = 5) -> list[float]:
    """The p50 of ``nums`` over the p50 of ``dens`` (paired samples of one interleaved series) in
    each of ``parts`` consecutive parts of the series, fewer when it is short (5 pairs a part at
    least): the spread of a ratio measured in one series (issue 40 item 6)."""
    n = min(len(nums), len(dens))
    parts = max(1, min(parts, n // 5))
    size = n / parts
    out = []
    for i in range(parts):
        lo, hi = round(i * size), round((i + 1) * size)
        if hi > lo:
            out.append(pct(nums[lo:hi], 0.5) / pct(dens[lo:hi], 0.5))
    return out


def describe(values) -> dict:
    """n, mean, std, min, p50, p90, p99, max (milliseconds in, milliseconds out)."""
    v = [float(x) for x in values]
    if not v:
        return {"n": 0}
    return {"n": len(v), "mean": statistics.fmean(v), "std": statistics.stdev(v) if len(v) > 1 else 0.0,
            "min": min(v), "p50": pct(v, 0.5), "p90": pct(v, 0.9), "p99": pct(v, 0.99), "max": max(v)}


# -- the model repository ------------------------------------------------------------------
@contextlib.contextmanager
def exporting(folder: str):
    """Hold an exclusive lock on ``folder`` (created if missing) while its model is checked and
    exported: two processes (two pytest workers, a test and an experiment) that both find an
    export missing would otherwise write the same files at once. The second waits, then finds it.
    The lock is on the folder itself, so no lock file lands anywhere."""
    import fcntl
    os.makedirs(folder, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def ensure_repo(repo: str = DEFAULT_REPO, model: str = "resnet50", method: str = "script") -> str:
    """``repo`` with ``<model>`` exported (4 blocks, head, full and the 'x' variant of block4/head)."""
    from blockflow.blocks.repository import export_model
    with exporting(os.path.join(repo, model)):
        if not os.path.exists(os.path.join(repo, model, "block4-x.pt")):
            log.info("exporting %s blocks (%s) into %s (seeded weights, once)", model, method, repo)
            export_model(model, repo, blocks=4, method=method, variants={"x": ["block4", "head"]})
    return repo


def traced_repo(repo: str = DEFAULT_REPO, model: str = "resnet50") -> str:
    """A repository with traced blocks, kept inside ``repo`` (``<repo>/_traced``) so it is ignored
    by git along with the repository and never overwrites the scripted files."""
    from blockflow.blocks.repository import export_model
    path = os.path.join(repo, "_traced")
    with exporting(os.path.join(path, model)):
        if not os.path.exists(os.path.join(path, model, "manifest.json")):
            log.info("exporting traced %s blocks into %s (once)", model, path)
            export_model(model, path, blocks=4, method="trace")
    return path


def exported_repo(repo: str = DEFAULT_REPO, model: str = "resnet50") -> str:
    """A repository with torch.export programs (``.pt2``), kept in ``<repo>/_export``."""
    from blockflow.blocks.repository import export_model
    path = os.path.join(repo, "_export")
    with exporting(os.path.join(path, model)):
        if not os.path.exists(os.path.join(path, model, "manifest.json")):
            log.info("exporting %s as torch.export programs into %s (once)", model, path)
            export_model(model, path, blocks=4, fmt="export")
    return path


def manifest_entries(repo: str, model: str = "resnet50") -> dict:
    from blockflow.blocks.repository import load_manifest
    return load_manifest(repo, model)["blocks"]


# -- a real server -------------------------------------------------------------------------
class Server:
    def __init__(self, proc, info):
        self.proc, self.info = proc, info
        self.rest, self.dispatcher, self.run_dir = info["rest"], info["dispatcher"], info["run_dir"]

    def call(self, method: str, path: str, body=None, timeout: float = 120.0):
        from blockflow.restclient import call
        return call(method, self.rest + path, body, timeout=timeout)

    def update(self, body: dict) -> dict:
        res = self.call("POST", "/system/update", body)
        log.info("update v%s applied in %.2fs (spawned %s, replaced %s)", res["version"], res["seconds"],
                 res["diff"]["spawned"], res["diff"]["replaced"])
        return res

    def block_pids(self) -> dict[str, int]:
        return {b["name"]: b["pid"] for b in self.call("GET", "/system")["blocks"]}

    def dispatcher_pid(self) -> int | None:
        d = self.call("GET", "/system").get("dispatcher")
        return d["pid"] if d else None

    def kpi(self, name: str) -> dict:
        """POST /blocks/{name}/kpi (also flushes the block's KPI logs into run_dir)."""
        return self.call("POST", f"/blocks/{name}/kpi")

    def flush_kpi(self) -> None:
        for name in self.block_pids():
            self.kpi(name)


@contextlib.contextmanager
def blockflow_server(repo: str, log_level: str = "WARNING", extra: list[str] | None = None,
                     env: dict | None = None, code: str | None = None):
    """``blockflow serve`` on free ports with a private, short state directory (ipc paths are
    limited to ~107 characters); stopped with SIGTERM and cleaned up on exit. ``env``: extra
    environment variables of the server (and so of the processes it starts). ``code``: a directory
    holding another version's ``blockflow`` package (:func:`code_at`): the server and every process
    it starts import that code instead of this checkout's."""
    from blockflow.demo import start_server, stop_server, wait_ready_file
    state = tempfile.mkdtemp(prefix="bfx-")
    env = {**os.environ, "BLOCKFLOW_LOG": log_level, **(env or {})}
    t0 = time.monotonic()
    if code is None:
        proc, info = start_server(os.path.abspath(repo), state, extra=["--quiet", *(extra or [])], env=env)
    else:  # the command start_server runs, from ``code`` (its working directory is first on sys.path)
        ready = os.path.join(state, "ready.json")
        cmd = [sys.executable, "-m", "blockflow.cli", "serve", "--port", "0", "--dispatcher-port", "0",
               "--repo", os.path.abspath(repo), "--state-dir", state, "--ready-file", ready, "--quiet",
               *(extra or [])]
        proc = subprocess.Popen(cmd, env=code_env(code, env), cwd=code)
        try:
            info = wait_ready_file(proc, ready, 120.0)
        except BaseException:
            proc.kill()
            proc.wait()
            shutil.rmtree(state, ignore_errors=True)
            raise
    log.info("blockflow serve up in %.1fs (REST %s, dispatcher %s)", time.monotonic() - t0, info["rest"],
             info["dispatcher"])
    try:
        yield Server(proc, info)
    finally:
        code = stop_server(proc)
        if code != 0:
            log.warning("blockflow serve exited with code %s", code)
        shutil.rmtree(state, ignore_errors=True)


# -- another version's code ------------------------------------------------------------------
def code_env(code: str, env: dict | None = None) -> dict:
    """``env`` (default: this process's) with ``code`` first on PYTHONPATH: ahead of the editable
    install of this checkout, whose finder Python consults only after sys.path."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([code, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    return env


@contextlib.contextmanager
def code_at(commit: str):
    """The ``blockflow`` package of ``commit`` in a temporary directory, laid out as that commit's
    pyproject.toml maps its folders (``blockflow.blocks`` = ``blocks/``, ...), the way an install
    would: a process started there (cwd and PYTHONPATH, :func:`code_env`) imports that code. Taken
    with ``git archive``, so the repository itself is not touched; removed on exit, even on error.
    The output-in-slot extension is found as the installed code finds it (``<prefix>/lib/
    blockflow-ext``, keyed by its source's hash): built for that commit's source or not used."""
    import io
    import tarfile
    import tomllib
    root = tempfile.mkdtemp(prefix="bf-code-")
    try:
        def git(*args: str) -> bytes:
            return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, check=True, timeout=60).stdout
        meta = tomllib.loads(git("show", f"{commit}:pyproject.toml").decode())
        for package, folder in sorted(meta["tool"]["setuptools"]["package-dir"].items()):
            dest = os.path.join(root, *package.split("."))
            os.makedirs(dest, exist_ok=True)
            with tarfile.open(fileobj=io.BytesIO(git("archive", "--format=tar", f"{commit}:{folder}"))) as tar:
                tar.extractall(dest, filter="data")
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def pipeline_update(transport: str, model: str = "resnet50", threads: int | None = 1, device: str = "cpu",
                    devices: list[str] | None = None) -> dict:
    """The update that deploys only the 4-block + head ``classify`` path (b1..h)."""
    blocks = []
    for i, (name, stem) in enumerate(PIPELINE):
        b = {"name": name, "model": f"{model}/{stem}.pt", "device": devices[i] if devices else device}
        if threads:
            b["threads"] = threads
        blocks.append(b)
    return {"transport": transport, "protocol": "ipc", "blocks": blocks,
            "tasks": [{"id": TASK, "path": [n for n, _ in PIPELINE]}]}


def input_tensor(batch: int = 1, seed: int = 0):
    import torch
    return torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(seed))


def process_tree_rss(pids) -> float:
    """Sum of RSS (MB) of ``pids``; vanished processes count 0."""
    import psutil
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total / 2**20


class CpuSampler:
    """Samples CPU% and RSS of a set of pids every ``interval`` seconds in a thread (psutil),
    the way the thesis collected per-process CPU timelines for Fig. 4.6."""

    def __init__(self, pids: dict[str, int], interval: float = 0.25):
        import threading

        import psutil
        self.interval = interval
        self.procs = {}
        for name, pid in pids.items():
            try:
                p = psutil.Process(pid)
                p.cpu_percent(None)
                self.procs[name] = p
            except psutil.NoSuchProcess:
                pass
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="cpu-sampler")
        self.t0 = time.monotonic()

    def _loop(self):
        import psutil
        while not self._stop.wait(self.interval):
            rec = {"t": time.monotonic() - self.t0}
            for name, p in self.procs.items():
                try:
                    with p.oneshot():
                        rec[name] = p.cpu_percent(None)
                        rec[name + ".rss_mb"] = p.memory_info().rss / 2**20
                except psutil.NoSuchProcess:
                    rec[name] = None
            self.samples.append(rec)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(2)
