"""configs/mobilenet_shared.json and its models (configs/mobilenet_tasks.py), run as README
"Bring your own model" shows them: make the heads, export each task with the README's own
`blockflow export` line, serve the update, and every task's served answer is its whole model's.

The README's commands write into model_repo/; here the same commands write into a temporary
repository (``--out``) and head directory (``MOBILENET_TASKS_HEADS``)."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from blockflow.blocks.repository import load_block, load_manifest
from blockflow.client import Client
from conftest import ROOT
from configs import mobilenet_tasks

CONFIG = os.path.join(ROOT, "configs", "mobilenet_shared.json")
SHARED = ("block1.pt", "block2.pt")
TOL = 1e-4


def readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def readme_export_args(task: str, out: str, tasks_module: str = "mobilenet_tasks") -> list[str]:
    """The README's `blockflow export` line for ``task`` of ``configs.<tasks_module>`` (one
    line, run once per task: ``$task``), writing into ``out``, as arguments."""
    line = re.compile(rf"^\s*(blockflow export --model configs\.{tasks_module}:\$task .*)$", re.M)
    lines = line.findall(readme())
    assert len(lines) == 1, f"README should show one `blockflow export --model configs.{tasks_module}:$task` line: {lines}"
    args = shlex.split(lines[0].replace("$task", task))[2:]  # after `blockflow export`
    assert args[args.index("--out") + 1] == "model_repo", args
    args[args.index("--out") + 1] = out
    return args


def run(cmd: list[str], env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run ``cmd`` in the repository root (the README's directory: it imports configs.*)."""
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, (cmd, res.stdout, res.stderr)
    return res


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``(repo, heads dir)``: the heads made and the three tasks exported by the README's commands."""
    base = tmp_path_factory.mktemp("mobilenet_tasks")
    repo, heads = base / "repo", base / "heads"
    env = dict(os.environ, BLOCKFLOW_LOG="WARNING", **{mobilenet_tasks.HEADS_ENV: str(heads)})
    env.pop("BLOCKFLOW_TOKEN", None)
    assert "python -m configs.mobilenet_tasks make-heads" in readme()
    made = run([sys.executable, "-m", "configs.mobilenet_tasks", "make-heads"], env)
    assert sorted(p.name for p in heads.iterdir()) == sorted(f"{t}.pt" for t in mobilenet_tasks.TASKS), made.stdout

    def export(task):
        return run([sys.executable, "-m", "blockflow.cli", "export", *readme_export_args(task, str(repo))], env)

    with ThreadPoolExecutor(len(mobilenet_tasks.TASKS)) as pool:  # three fresh interpreters at once
        for res in pool.map(export, mobilenet_tasks.TASKS):
            assert "3 blocks, cut after features.6, features" in res.stdout, res.stdout
    return str(repo), heads


def test_the_shared_blocks_are_the_same_bytes_in_every_export_and_the_heads_differ(exported):
    repo, _ = exported
    manifests = {t: load_manifest(repo, f"mobilenet_{t}") for t in mobilenet_tasks.TASKS}
    for fname in SHARED:
        sums = {t: m["blocks"][fname]["sha256"] for t, m in manifests.items()}
        assert len(set(sums.values())) == 1, (fname, sums)
        on_disk = {hashlib.sha256(open(os.path.join(repo, f"mobilenet_{t}", fname), "rb").read()).hexdigest()
                   for t in mobilenet_tasks.TASKS}
        assert on_disk == set(sums.values()), fname
    heads = {t: m["blocks"]["block3.pt"] for t, m in manifests.items()}
    assert len({h["sha256"] for h in heads.values()}) == len(heads)
    for task, head in heads.items():
        assert head["input_shape"] == [1, 576, 7, 7]
        assert head["output_shape"] == [1, len(mobilenet_tasks.TASKS[task])], task


def test_the_config_serves_each_task_as_its_whole_model(server_factory, exported):
    repo, _ = exported
    with open(CONFIG) as f:
        update = json.load(f)
    srv = server_factory(repo)
    res = srv.call("POST", "/system/update", update, timeout=180)
    print(f"\nmobilenet_shared.json ({len(update['blocks'])} blocks) applied in {res['seconds']:.2f}s")
    assert sorted(res["diff"]["tasks"]["added"]) == sorted(mobilenet_tasks.TASKS)
    paths = {t["id"]: t["path"] for t in update["tasks"]}
    assert len({tuple(p[:2]) for p in paths.values()}) == 1, "the three tasks share their first two blocks"

    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        want = {t: load_block(repo, f"mobilenet_{t}/full.pt")(x) for t in mobilenet_tasks.TASKS}

    def infer(task):
        with Client(srv.dispatcher, timeout=120) as c:
            return c.infer(task, x)

    tasks = list(mobilenet_tasks.TASKS)
    with ThreadPoolExecutor(len(tasks)) as pool:  # all three at once through the shared blocks
        results = dict(zip(tasks, pool.map(infer, tasks)))
    for task, y in results.items():
        assert y.shape == (2, len(mobilenet_tasks.TASKS[task])) == want[task].shape, task
        assert (y - want[task]).abs().max().item() <= TOL, task


def test_a_missing_head_is_refused_naming_the_file_and_the_command(tmp_path, monkeypatch):
    """A ValueError too: `blockflow export` prints it as one line instead of a traceback."""
    monkeypatch.setenv(mobilenet_tasks.HEADS_ENV, str(tmp_path / "none"))
    with pytest.raises(ValueError) as info:
        mobilenet_tasks.vehicles()
    assert isinstance(info.value, FileNotFoundError)
    msg = str(info.value)
    assert str(tmp_path / "none" / "vehicles.pt") in msg
    assert f"python -m configs.mobilenet_tasks make-heads {tmp_path / 'none'}" in msg
