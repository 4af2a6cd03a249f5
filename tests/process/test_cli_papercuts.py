"""What a new operator tripped over in the blockflow command (issue 42, points 5, 6, 10, 11): a
closed pipe, hints that named the wrong command or file, --version, taking a deployment down,
help that promised what --config decides, exports that changed what was asked without saying so,
and a status table wider than a terminal."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections import OrderedDict
from importlib import metadata

import pytest
import torch
from torch import nn

from blockflow.blocks import split
from blockflow.blocks.verify import BlockFileError, verify_block
from blockflow.cli import STATUS_WIDTH, Exit, format_status
from test_cli import blockflow, user_error

# -- 10: --version, help that says what happens, exports that refuse instead of guessing ---------------


def test_version_is_the_installed_package_version():
    res = blockflow("--version")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"blockflow {metadata.version('blockflow')}", res.stdout


def test_help_says_what_demo_deploys_and_what_variant_blocks_is_for():
    demo = " ".join(blockflow("demo", "--help").stdout.split())
    assert "deploy two tasks" not in demo, demo  # the update decides, whatever --config says
    assert "each of its tasks" in demo and "configs/resnet50_shared.json, two tasks" in demo, demo
    export = " ".join(blockflow("export", "--help").stdout.split())
    assert "--variant-blocks VARIANT_BLOCKS with --variant (ResNet export only)" in export, export


def test_a_resnet_export_refuses_a_block_count_it_does_not_make(tmp_path):
    # --out under a file: were the count not refused first, the (old) balanced splitter's run would
    # stop at once on the output directory instead of exporting for minutes
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    res = blockflow("export", "--model", "resnet50", "--blocks", "3", "--out", str(blocker / "repo"))
    line = user_error(res, Exit.USAGE, "--blocks 3", "makes 4 (block1..block4 + head), 2 or 1 blocks", "--cut layer2",
                      "--model torchvision.models:resnet50 --blocks 3")
    assert "--name resnet50_3" in line, line  # never the ResNet export's own directory


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.seq = nn.Sequential(OrderedDict(a=nn.Linear(4, 4), b=nn.ReLU(), c=nn.Linear(4, 2)))

    def forward(self, x):
        return self.seq(x)


def test_a_misspelt_model_is_named_before_the_missing_cut(tmp_path):
    # without --cut or --blocks the export asked for a cut first, which could not help a typo
    res = blockflow("export", "--model", "resnet5", "--out", str(tmp_path / "repo"))
    user_error(res, Exit.BAD_INPUT, "--model 'resnet5' is neither a torchvision classification model",
               "did you mean resnet50")
    res = blockflow("export", "--model", "mobilenet_v3_small", "--out", str(tmp_path / "repo"))
    user_error(res, Exit.USAGE, "--model mobilenet_v3_small: give where to cut it")
    assert not (tmp_path / "repo").exists()


def test_cuts_out_of_order_are_refused_naming_the_order():
    gm = split.trace(_Tiny(), torch.randn(1, 4))
    first, second = split.resolve_cuts(gm, ["seq.a", "seq.b"], "tiny")  # in the model's order: taken
    assert first < second
    with pytest.raises(split.CutError) as exc:
        split.resolve_cuts(gm, ["seq.b", "seq.a"], "tiny")
    assert str(exc.value) == ("cuts seq.b, seq.a are out of order: tiny runs seq.a before seq.b; give them in "
                              "that order: --cut seq.a --cut seq.b"), exc.value
    # (the command says a CutError in one line, as tests/process/test_split.py checks for a cut that does not exist)


# -- 6: hints that name the command and the file that fix it ---------------------------------------------


def _listed(directory, files: dict[str, dict], **manifest) -> None:
    """Write ``files`` ({name: manifest entry without sha256}) with some bytes, and their manifest."""
    os.makedirs(directory, exist_ok=True)
    blocks = {}
    for name, entry in files.items():
        data = f"not a model: {name}".encode()
        with open(os.path.join(directory, name), "wb") as f:
            f.write(data)
        blocks[name] = dict(entry, file=name, sha256=hashlib.sha256(data).hexdigest())
    with open(os.path.join(directory, "manifest.json"), "w") as f:
        json.dump(dict(manifest, blocks=blocks), f)


def _refusal(repo, relpath) -> str:
    with pytest.raises(BlockFileError) as exc:
        verify_block(repo, relpath)
    return str(exc.value)


def test_a_changed_hand_made_block_names_blockflow_manifest(tmp_path, identity_repo):
    from blockflow.blocks import manifest
    mine = tmp_path / "mine"
    mine.mkdir()
    shutil.copy(os.path.join(identity_repo, "toy", "double.pt"), mine / "double.pt")
    manifest.write_manifest(mine)
    assert json.loads((mine / "manifest.json").read_text())["blocks"]["double.pt"]["method"] == "hand-made"
    shutil.copy(os.path.join(identity_repo, "toy", "identity.pt"), mine / "double.pt")  # edited by hand
    message = _refusal(str(tmp_path), "mine/double.pt")
    assert f"`blockflow manifest {tmp_path / 'mine'}`" in message and "blockflow export" not in message, message
    # such a file gone: put it back, no export command
    (mine / "double.pt").unlink()
    message = _refusal(str(tmp_path), "mine/double.pt")
    assert "put it back" in message and "blockflow export" not in message, message


def test_a_split_export_missing_a_block_names_the_file_there_and_the_export_that_made_it(tmp_path):
    entry = {"method": "export", "format": "export", "variant": None, "seed": 0}
    _listed(tmp_path / "mine", {"full.pt2": dict(entry, name="full", input_shape=[1, 3, 224, 224]),
                                "block1.pt2": dict(entry, name="block1", cut="layer2"),
                                "block2.pt2": dict(entry, name="block2", cut=None)},
            model="mine", seed=0, source="resnet18", cuts=["layer2"])
    # the update names the TorchScript file; the export wrote a .pt2
    message = _refusal(str(tmp_path), "mine/full.pt")
    assert "has full.pt2" in message and "name `mine/full.pt2` in the update" in message, message
    assert "--model mine" not in message, message
    # the listed .pt2 itself gone: the command that writes it again, with the model it was made of
    (tmp_path / "mine" / "full.pt2").unlink()
    message = _refusal(str(tmp_path), "mine/full.pt2")
    want = f"`blockflow export --model resnet18 --cut layer2 --name mine --format export --out {tmp_path}`"
    assert want in message, message
    # changed: the same command
    (tmp_path / "mine" / "block1.pt2").write_bytes(b"edited")
    assert want in _refusal(str(tmp_path), "mine/block1.pt2")


def test_a_changed_resnet_variant_names_its_own_export(tmp_path):
    _listed(tmp_path / "resnet18", {"block4-x.pt": {"name": "block4", "variant": "x", "method": "trace",
                                                    "format": "torchscript", "seed": 123}},
            model="resnet18", seed=0)
    (tmp_path / "resnet18" / "block4-x.pt").write_bytes(b"edited")
    message = _refusal(str(tmp_path), "resnet18/block4-x.pt")
    assert (f"`blockflow export --model resnet18 --variant x --variant-blocks block4 --format torchscript "
            f"--method trace --out {tmp_path}`") in message, message
    message = _refusal(str(tmp_path), "resnet50/block1.pt")  # never exported here
    assert f"`blockflow export --model resnet50 --out {tmp_path}`" in message, message


# -- 11: a status table that fits a terminal -------------------------------------------------------------

NODE_ID = "3f" * 28  # a Ray node id: 56 hex digits


def _row(process, block, replica, status="ready", **kw):
    row = {"process": process, "block": block, "replica": replica, "group": None, "status": status, "pid": 123456,
           "node": NODE_ID, "next_hops": {"@dispatcher": "tcp"}, "waiting_for_node": None, "device": "cuda:0",
           "restarts": 12, "uptime_s": 7384.2, "last_exit": None, "requests_per_s": 1234.5, "errors": 10234,
           "p50_ms": 1234.5, "p99_ms": 12345.6, "window_s": 60.0}
    row.update(kw)
    return row


def test_status_fits_100_columns_and_wide_shows_the_rest():
    rows = [_row("@dispatcher", "@dispatcher", None, device="-", node="head-node-1"),
            _row("resnet50_classifier_block4_special", "resnet50_classifier_block4_special", 0,
                 group="shared_group_one", last_exit="exit code 5 (its node was lost)"),
            _row("resnet50_classifier_block4_special.r1", "resnet50_classifier_block4_special", 1,
                 status="restarting", waiting_for_node="edge-b", node=None, pid=None,
                 last_exit="killed by SIGKILL")]
    system = {"version": 12, "run_dir": "/run/user/1000/blockflow-abc/runs/20261127-120000-1234",
              "tasks": [{"id": "classify", "path": [f"resnet50_classifier_block{i}" for i in range(1, 9)]}]}
    text = format_status(rows, system)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= STATUS_WIDTH, "\n".join(line for line in lines if len(line) > 100)
    assert lines[0].split()[:3] == ["PROCESS", "STATUS", "PID"] and "NODE" in lines[0], lines[0]  # two nodes here
    assert "last exit of resnet50_classifier_block4_special: exit code 5 (its node was lost)" in lines, text
    assert any("--wide" in line for line in lines), text
    wide = format_status(rows, system, wide=True)
    head = wide.splitlines()[0]
    for column in ("BLOCK", "REPLICA", "GROUP", "NODE", "NEXT HOPS", "LAST EXIT"):
        assert column in head, head
    assert "resnet50_classifier_block4_special.r1" in wide and "@dispatcher:tcp" in wide
    # one node and no waiting: no NODE column
    one = format_status([_row("a", "a", 0, node="vm")], {"version": 1, "tasks": [], "run_dir": "/r"})
    assert "NODE" not in one.splitlines()[0], one


# -- 5, 6, 10, 11 against a real server: status, a closed pipe, an update's hint, down ------------------


def test_status_pipe_hint_and_down_against_a_server(server_factory, identity_repo, tmp_path):
    from blockflow.blocks import manifest
    repo = tmp_path / "repo"
    (repo / "mine").mkdir(parents=True)
    for name in ("identity.pt", "double.pt"):
        shutil.copy(os.path.join(identity_repo, "toy", name), repo / "mine" / name)
    manifest.write_manifest(repo / "mine")  # hand-made blocks, as `blockflow manifest` lists them
    srv = server_factory(str(repo))
    update = tmp_path / "u.json"
    update.write_text(json.dumps({"blocks": [{"name": "a", "model": "mine/identity.pt"},
                                             {"name": "d", "model": "mine/double.pt", "replicas": 2}],
                                  "tasks": [{"id": "t", "path": ["a", "d"]}]}))
    # the server's URL given once, by BLOCKFLOW_URL; what the update changed, in lines that fit
    res = blockflow("update", str(update), env={"BLOCKFLOW_URL": srv.url})
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert re.fullmatch(r"applied update version 1 in \d+\.\d\d s", lines[0]), res.stdout
    assert lines[1:3] == ["processes: spawned a, d, d.r1; replaced -; kept -; removed -",
                          "tasks: added t; changed -; removed -"], res.stdout
    # dispatcher -> a -> d -> dispatcher; hand-made blocks: no manifest declares their shapes
    assert re.fullmatch(r"TensorMQ slots: 3 edges x 8 slots, sized by their first tensors; \d+ MiB free in \S+",
                        " ".join(line.strip() for line in lines[3:])), res.stdout
    assert all(len(line) <= STATUS_WIDTH for line in lines), res.stdout

    res = blockflow("status", env={"BLOCKFLOW_URL": srv.url})
    assert res.returncode == 0, res.stderr
    assert max(len(line) for line in res.stdout.splitlines()) <= STATUS_WIDTH, res.stdout
    assert [line.split()[0] for line in res.stdout.splitlines()[1:5]] == ["@dispatcher", "a", "d", "d.r1"], res.stdout

    # `blockflow kpi` with no run_dir reads the run of the server BLOCKFLOW_URL names
    from blockflow.client import Client
    from conftest import wait_for
    with Client(srv.dispatcher, timeout=30) as c:
        for _ in range(3):
            assert torch.equal(c.infer("t", torch.ones(2, 3)), torch.full((2, 3), 2.0))
    run_dir = srv.call("GET", "/system")["run_dir"]
    log = os.path.join(run_dir, "a.latency.jsonl")  # a record per request, written at least once a second

    def records() -> int:
        with open(log) as f:
            return sum(1 for line in f if line.endswith("\n"))
    wait_for(lambda: os.path.exists(log) and records() == 3, 30, "block a's 3 KPI records")
    res = blockflow("kpi", "--warmup", "0", "--json", env={"BLOCKFLOW_URL": srv.url})
    assert res.returncode == 0, res.stderr
    assert f"run of the server at {srv.url}: {run_dir}" in res.stderr, res.stderr
    assert {row["name"]: row["count"] for row in json.loads(res.stdout)}["a"] == 3, res.stdout

    # 5: the reader closed the pipe before anything was written (`| head` that is done): quiet, 141
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        res = subprocess.run([sys.executable, "-m", "blockflow.cli", "status", "--json", "--url", srv.url],
                             stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60,
                             env=dict(os.environ, BLOCKFLOW_LOG="WARNING"))
    finally:
        os.close(write_end)
    assert (res.returncode, res.stderr) == (Exit.CLOSED_PIPE, ""), (res.returncode, res.stderr)

    # 6: a hand-made block changed on disk: the update names `blockflow manifest DIR`, not an export
    shutil.copy(os.path.join(identity_repo, "toy", "identity.pt"), repo / "mine" / "double.pt")
    line = user_error(blockflow("update", str(update), "--url", srv.url), Exit.FAILED, "blocks[1].model",
                      f"`blockflow manifest {repo / 'mine'}`")
    assert "blockflow export" not in line, line
    assert line.count("blocks[1].model") == 1, line  # the field named once, not again as "(field ...)"

    # 10: down removes every block and task and says so; the server stays up, empty
    res = blockflow("down", "--url", srv.url)
    assert res.returncode == 0, res.stderr
    assert "removed processes: a, d, d.r1\nremoved tasks: t\n" in res.stdout, res.stdout
    assert all(len(line) <= STATUS_WIDTH for line in res.stdout.splitlines()), res.stdout
    system = srv.call("GET", "/system")
    assert system["blocks"] == [] and system["tasks"] == [], system


def test_readme_shows_the_operator_a_status_that_fits_version_and_down():
    from conftest import ROOT
    with open(os.path.join(ROOT, "README.md")) as f:
        using = f.read().split("## Using it", 1)[1].split("\n## ", 1)[0]
    shots = [block for block in using.split("```text\n")[1:]]
    status = next(block.split("```")[0] for block in shots if block.startswith("PROCESS "))
    assert max(len(line) for line in status.splitlines()) <= STATUS_WIDTH, status
    assert "blockflow --version" in using and "blockflow down" in using, using[:500]


def test_help_never_prints_the_token(monkeypatch, capsys):
    """`status --help` and `update --help` printed BLOCKFLOW_TOKEN's value as the --token default:
    a secret on the screen (and in a shared terminal's scroll-back) for asking how a command works."""
    from blockflow.core import settings
    from blockflow.cli import main
    monkeypatch.setattr(settings, "TOKEN", "s3cret-t0ken")
    for cmd in ("status", "update", "down", "serve", "load"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        out = capsys.readouterr().out
        assert "--token" in out, (cmd, out)
        assert "s3cret-t0ken" not in out, (cmd, out)
