"""``blockflow demo`` (what ``make demo`` runs): the whole system, end to end, in about a minute.

Start ``blockflow serve`` on free ports, POST an update (``--config``; by default
configs/resnet50_shared.json, two tasks sharing ResNet50's block1-3, whose files are exported
first when missing), send requests for each of its tasks through the dispatcher, print per-task
latency and the per-block KPI table, shut down cleanly.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIG = os.path.join(os.path.dirname(HERE), "configs", "resnet50_shared.json")


def start_server(repo: str, state_dir: str, extra: list[str] | None = None, timeout: float = 120.0,
                 env: dict | None = None) -> tuple[subprocess.Popen, dict]:
    """Run ``blockflow serve`` on free ports; return the process and its ready-file contents."""
    ready = os.path.join(state_dir, "ready.json")
    cmd = [sys.executable, "-m", "blockflow.cli", "serve", "--port", "0", "--dispatcher-port", "0",
           "--repo", repo, "--state-dir", state_dir, "--ready-file", ready, "--quiet", *(extra or [])]
    proc = subprocess.Popen(cmd, env=env)
    try:
        return proc, wait_ready_file(proc, ready, timeout)
    except TimeoutError:
        proc.kill()
        proc.wait()
        raise
    except BaseException:  # interrupted while it starts (Ctrl-C, SIGTERM): no server left behind
        stop_server(proc, timeout=10.0)
        raise


def wait_ready_file(proc: subprocess.Popen, ready: str, timeout: float) -> dict:
    """The contents of ``blockflow serve``'s ready file once it is written. RuntimeError when the
    process exits first, TimeoutError after ``timeout`` s (the caller decides what to kill)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(ready):
            with open(ready) as f:
                return json.load(f)
        if proc.poll() is not None:
            raise RuntimeError(f"blockflow serve exited with code {proc.returncode} before it was ready")
        time.sleep(0.05)
    raise TimeoutError(f"blockflow serve was not ready within {timeout:.0f}s")


def stop_server(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def export_missing_resnet50(repo: str, update: dict) -> None:
    """Export the ResNet50 blocks (with the "x" variant of block4 and head, as the default
    config uses them) when the update names a resnet50/ file the repository lacks; any other
    missing file is the server's to refuse, naming it."""
    files = [m for b in update.get("blocks", []) if isinstance(b, dict)
             for m in ([b.get("model")] if isinstance(b.get("model"), str) else b.get("model") or [])]
    missing = [f for f in files if isinstance(f, str) and f.startswith("resnet50/")
               and not os.path.exists(os.path.join(repo, f))]
    if missing:
        from blockflow.blocks.repository import export_model
        fmt = "export" if missing[0].endswith(".pt2") else "torchscript"  # the format the update names
        print(f"exporting ResNet50 blocks into {repo} (seeded weights, once): the update names {missing[0]}")
        export_model("resnet50", repo, blocks=4, method="script", variants={"x": ["block4", "head"]}, fmt=fmt)


@contextlib.contextmanager
def terminate_as_interrupt():
    """SIGTERM (``kill``, ``timeout``, a CI runner's cancel) handled as Ctrl-C while the block
    runs: Python's default SIGTERM ends the process at once, skipping the ``finally`` clauses that
    stop the server and remove the state directory. The handler before is restored afterwards.
    Outside the main thread (where no handler can be set) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second one must not cut the clean-up short
        raise KeyboardInterrupt(f"signal {signum}")
    before = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def run_demo(repo: str = "model_repo", config: str | None = None, requests: int = 20, keep: bool = False) -> int:
    """Serve, deploy, send, print the KPI table. The server's state directory (run directory with
    the KPI logs, sockets) is a fresh temporary one, removed at the end unless ``keep``, also when
    the demo is interrupted (Ctrl-C or SIGTERM: ``terminate_as_interrupt``)."""
    with terminate_as_interrupt():
        return _run_demo(repo, config, requests, keep)


def _run_demo(repo: str, config: str | None, requests: int, keep: bool) -> int:
    import torch

    from .client import Client
    from .kpi import format_table, percentile, summarize_block
    from .restclient import call

    with open(config or DEFAULT_CONFIG) as f:
        update = json.load(f)
    export_missing_resnet50(repo, update)
    state_dir = tempfile.mkdtemp(prefix="blockflow-demo-")
    t0 = time.monotonic()
    # the server's own log only when something goes wrong (BLOCKFLOW_LOG=INFO shows it all)
    env = dict(os.environ)
    env.setdefault("BLOCKFLOW_LOG", "WARNING")
    try:
        proc, info = start_server(repo, state_dir, env=env)
    except BaseException:
        shutil.rmtree(state_dir, ignore_errors=True)
        raise
    try:
        print(f"server up in {time.monotonic() - t0:.1f}s: REST {info['rest']}, dispatcher {info['dispatcher']}")
        res = call("POST", f"{info['rest']}/system/update", update)
        print(f"update applied in {res['seconds']:.2f}s (version {res['version']}): spawned {res['diff']['spawned']}")
        x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(0))
        with Client(info["dispatcher"], timeout=60) as client:
            for task in [t["id"] for t in update["tasks"]]:
                client.infer(task, x)  # warm-up
                times = []
                for _ in range(requests):
                    t = time.perf_counter()
                    y = client.infer(task, x)
                    times.append((time.perf_counter() - t) * 1e3)
                print(f"task {task:10s} {requests} requests: mean {sum(times) / len(times):7.2f} ms, "
                      f"p50 {percentile(times, .5):7.2f} ms, p99 {percentile(times, .99):7.2f} ms; "
                      f"output {tuple(y.shape)}, top class {int(y.argmax())}")
        system = call("GET", f"{info['rest']}/system")
        names = [b["name"] for b in system["blocks"]]
        summaries = []
        for n in names:
            summaries.append(call("POST", f"{info['rest']}/blocks/{n}/kpi"))
        print(format_table(summaries))
        if keep:
            print(f"KPI logs: {system['run_dir']} (read them again with `blockflow kpi {system['run_dir']}`)")
    finally:
        code = stop_server(proc)
        print(f"server stopped (exit code {code}); total {time.monotonic() - t0:.1f}s")
        if keep:
            print(f"state directory kept: {state_dir}")
        else:
            shutil.rmtree(state_dir, ignore_errors=True)
            print("state directory removed (`blockflow demo --keep` keeps it, with the KPI logs)")
    return 0 if code == 0 else 1
