"""Any model split at named cuts (blocks/split.py, `blockflow export --cut`), and manifests of
hand-made block files (`blockflow manifest`): the chained blocks equal the whole model, in
process and served by `blockflow serve`; bad cuts and bad callables are refused by name."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from blockflow.blocks import split
from blockflow.blocks.repository import load_block, load_manifest
from blockflow.cli import Exit
from blockflow.client import Client

#: The user's own model: written to a module file for the CLI (`usermodels:skipnet`) and run
#: from that same source in process. ``body`` holds a skip connection inside one block.
USER_MODELS = '''
import torch
from torch import nn


class Residual(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.act = nn.ReLU()
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return x + self.conv2(self.act(self.conv1(x)))


class SkipNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.body = Residual(8)
        self.down = nn.Sequential(nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU())
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Linear(16, 10))

    def forward(self, x):
        return self.head(self.down(self.body(self.stem(x))))


def skipnet():
    return SkipNet().eval()


def not_a_module():
    return {"weights": 42}
'''
MOBILENET = "mobilenet_v3_small"
MOBILENET_CUTS = ("features.3", "features.8")
TOL = 1e-4


def blockflow(*args, cwd=None, timeout=240) -> subprocess.CompletedProcess:
    env = dict(os.environ, BLOCKFLOW_LOG="WARNING")
    env.pop("BLOCKFLOW_TOKEN", None)
    return subprocess.run([sys.executable, "-m", "blockflow.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


def one_line_error(res: subprocess.CompletedProcess, code: Exit, *words: str) -> str:
    assert res.returncode == code, (res.returncode, res.stderr)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def user_models(tmp_path_factory):
    """A directory holding usermodels.py, and that module's namespace."""
    d = tmp_path_factory.mktemp("user_models")
    (d / "usermodels.py").write_text(USER_MODELS)
    namespace: dict = {}
    exec(compile(USER_MODELS, str(d / "usermodels.py"), "exec"), namespace)
    return d, namespace


@pytest.fixture(scope="module")
def mobilenet_repo(tmp_path_factory):
    """mobilenet_v3_small cut after features.3 and features.8, exported by the CLI."""
    repo = tmp_path_factory.mktemp("split_repo")
    cuts = [a for c in MOBILENET_CUTS for a in ("--cut", c)]
    res = blockflow("export", "--model", MOBILENET, *cuts, "--out", str(repo))
    assert res.returncode == 0, res.stderr
    assert "cut after features.3, features.8" in res.stdout, res.stdout
    return str(repo)


def seeded_input(batch: int = 2, seed: int = 3) -> torch.Tensor:
    return torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(seed))


def chained(blocks, x):
    with torch.inference_mode():
        for b in blocks:
            x = b(x)
    return x


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_mobilenet_cut_in_features_equals_whole_model_in_process():
    net, name = split.build_model(MOBILENET, seed=0)
    gm = split.trace(net)
    blocks = split.split(gm, split.resolve_cuts(gm, list(MOBILENET_CUTS), name))
    assert len(blocks) == 3
    x = seeded_input()
    with torch.inference_mode():
        want = net(x)
    assert max_diff(chained(blocks, x), want) <= TOL


def test_vit_cut_inside_its_encoder_equals_whole_model():
    net, name = split.build_model("vit_b_16", seed=0)
    gm = split.trace(net)
    blocks = split.split(gm, split.resolve_cuts(gm, ["encoder.layers.encoder_layer_5"], name))
    x = seeded_input(1)
    with torch.inference_mode():
        want = net(x)
    assert max_diff(chained(blocks, x), want) <= TOL


def test_skip_connection_inside_a_block_equals_whole_model(user_models):
    _, ns = user_models
    torch.manual_seed(0)
    net = ns["skipnet"]()
    gm = split.trace(net)
    blocks = split.split(gm, split.resolve_cuts(gm, ["stem", "body", "down"], "skipnet"))
    assert len(blocks) == 4
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = net(x)
    assert max_diff(chained(blocks, x), want) <= TOL
    # the blocks survive TorchScript as the export writes them
    scripted = [torch.jit.script(b) for b in blocks]
    assert max_diff(chained(scripted, x), want) <= TOL


def test_a_cut_crossed_by_the_skip_is_refused_naming_what_crosses(user_models):
    _, ns = user_models
    gm = split.trace(ns["skipnet"]())
    with pytest.raises(split.CutError) as exc:
        split.resolve_cuts(gm, ["body.conv1"], "skipnet")
    msg = str(exc.value)
    assert "'body.conv1'" in msg and "2 tensors" in msg and "multi-tensor hops are not supported" in msg
    assert "output of stem.2" in msg and "output of body.conv1" in msg
    assert "stem" in msg.split("nearby")[1] and "body" in msg.split("nearby")[1]


def test_balanced_cuts_are_valid_and_in_order():
    net, _ = split.build_model(MOBILENET, seed=0)
    gm = split.trace(net)
    cuts = split.balance(gm, 3, seeded_input(1))
    positions = split.resolve_cuts(gm, cuts, MOBILENET)
    assert len(cuts) == 2 and positions == sorted(positions)
    assert split._min_max_partition([0, 1, 2, 3, 4, 8], [1, 2, 3, 4, 5], 2) == [3]  # 4 | 4


def test_exported_mobilenet_manifest_and_chain(mobilenet_repo):
    manifest = load_manifest(mobilenet_repo, MOBILENET)
    files = sorted(manifest["blocks"])
    assert files == ["block1.pt", "block2.pt", "block3.pt", "full.pt"]
    assert manifest["cuts"] == list(MOBILENET_CUTS)
    for entry in manifest["blocks"].values():
        assert len(entry["sha256"]) == 64 and entry["dtype"] == "float32"
        assert entry["input_shape"][0] == 1 and entry["format"] == "torchscript"
    assert manifest["blocks"]["block1.pt"]["input_shape"] == [1, 3, 224, 224]
    assert manifest["blocks"]["block3.pt"]["output_shape"] == [1, 1000]
    x = seeded_input()
    blocks = [load_block(mobilenet_repo, f"{MOBILENET}/block{i}.pt") for i in (1, 2, 3)]
    want = chained([load_block(mobilenet_repo, f"{MOBILENET}/full.pt")], x)
    assert max_diff(chained(blocks, x), want) <= TOL


def test_served_mobilenet_blocks_equal_whole_model_for_two_tasks(server_factory, mobilenet_repo):
    """Two tasks share block1; the second runs block2+block3 fused in one process."""
    srv = server_factory(mobilenet_repo)
    m = MOBILENET
    update = {"blocks": [{"name": "b1", "model": f"{m}/block1.pt", "threads": 1},
                         {"name": "b2", "model": f"{m}/block2.pt", "threads": 1},
                         {"name": "b3", "model": f"{m}/block3.pt", "threads": 1},
                         {"name": "b23", "model": [f"{m}/block2.pt", f"{m}/block3.pt"], "threads": 1}],
              "tasks": [{"id": "three", "path": ["b1", "b2", "b3"]},
                        {"id": "two", "path": ["b1", "b23"]}]}
    srv.call("POST", "/system/update", update, timeout=180)
    x = seeded_input()
    with torch.inference_mode():
        want = load_block(mobilenet_repo, f"{m}/full.pt")(x)

    def infer(task):
        with Client(srv.dispatcher, timeout=120) as c:
            return c.infer(task, x)

    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(("three", "two"), pool.map(infer, ("three", "two"))))
    for task, y in results.items():
        assert y.shape == want.shape and max_diff(y, want) <= TOL, task


def test_cli_refuses_a_cut_that_does_not_exist_naming_it_and_nearby_names(tmp_path):
    res = blockflow("export", "--model", MOBILENET, "--cut", "features.33", "--out", str(tmp_path))
    line = one_line_error(res, Exit.BAD_INPUT, "'features.33'", "nearby", "features.3")
    assert "no submodule" in line


def test_cli_exports_a_callable_and_refuses_a_multi_tensor_cut(tmp_path, user_models):
    models_dir, _ = user_models
    out = tmp_path / "repo"
    common = ("--model", "usermodels:skipnet", "--input-shape", "1,3,32,32", "--out", str(out))
    res = blockflow("export", *common, "--cut", "body.conv1", cwd=models_dir)
    one_line_error(res, Exit.BAD_INPUT, "'body.conv1'", "multi-tensor hops are not supported yet", "stem")
    res = blockflow("export", *common, "--cut", "stem", "--cut", "body", "--cut", "down", "--format", "export",
                    cwd=models_dir)
    assert res.returncode == 0, res.stderr
    assert sorted(load_manifest(out, "skipnet")["blocks"]) == [f"block{i}.pt2" for i in range(1, 5)] + ["full.pt2"]
    # balanced, and a split with fewer blocks than the last one leaves no stale block behind
    res = blockflow("export", *common, "--blocks", "2", "--format", "export", cwd=models_dir)
    assert res.returncode == 0, res.stderr
    assert "balanced cuts: --cut " in res.stdout
    assert sorted(load_manifest(out, "skipnet")["blocks"]) == ["block1.pt2", "block2.pt2", "full.pt2"]
    assert not (out / "skipnet" / "block3.pt2").exists()


def test_cli_refuses_a_callable_that_returns_no_module(tmp_path, user_models):
    models_dir, _ = user_models
    res = blockflow("export", "--model", "usermodels:not_a_module", "--cut", "x", "--out", str(tmp_path),
                    cwd=models_dir)
    one_line_error(res, Exit.BAD_INPUT, "usermodels:not_a_module", "not an nn.Module")


@pytest.fixture
def hand_made_repo(tmp_path, user_models):
    """SkipNet cut by hand into three TorchScript files that no manifest lists yet."""
    _, ns = user_models
    torch.manual_seed(0)
    net = ns["skipnet"]()
    d = tmp_path / "repo" / "mine"
    d.mkdir(parents=True)
    for fname, part in (("stem.pt", net.stem), ("body.pt", net.body),
                        ("tail.pt", torch.nn.Sequential(net.down, net.head))):
        torch.jit.save(torch.jit.script(part.eval()), str(d / fname))
    return d, net


def test_manifest_of_hand_made_files_is_served_and_check_catches_a_change(server_factory, hand_made_repo):
    d, net = hand_made_repo
    res = blockflow("manifest", str(d), "--input-shape", "1,3,32,32", "--chain", "stem.pt,body.pt,tail.pt")
    assert res.returncode == 0, res.stderr
    blocks = json.loads((d / "manifest.json").read_text())["blocks"]
    assert sorted(blocks) == ["body.pt", "stem.pt", "tail.pt"]
    assert blocks["stem.pt"]["input_shape"] == [1, 3, 32, 32] and blocks["stem.pt"]["output_shape"] == [1, 8, 32, 32]
    assert blocks["tail.pt"]["output_shape"] == [1, 10] and len(blocks["body.pt"]["sha256"]) == 64
    assert blockflow("manifest", str(d), "--check").returncode == 0

    srv = server_factory(str(d.parent))
    update = {"blocks": [{"name": n, "model": f"mine/{n}.pt", "threads": 1} for n in ("stem", "body", "tail")],
              "tasks": [{"id": "mine", "path": ["stem", "body", "tail"]}]}
    srv.call("POST", "/system/update", update, timeout=120)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    with Client(srv.dispatcher, timeout=60) as c:
        y = c.infer("mine", x)
    with torch.inference_mode():
        assert max_diff(y, net(x)) <= TOL
    assert srv.stop() == 0

    data = bytearray((d / "body.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (d / "body.pt").write_bytes(bytes(data))
    shutil.copy(d / "stem.pt", d / "extra.pt")
    res = blockflow("manifest", str(d), "--check")
    line = one_line_error(res, Exit.FAILED, "body.pt has changed", "extra.pt is not listed")
    assert "stem.pt" not in line and "tail.pt" not in line, line


def test_manifest_refuses_files_that_do_not_chain(hand_made_repo):
    d, _ = hand_made_repo
    res = blockflow("manifest", str(d), "--input-shape", "1,3,32,32", "--chain", "stem.pt,tail.pt,body.pt")
    one_line_error(res, Exit.BAD_INPUT, "body.pt does not take the output of tail.pt", "--chain")
    assert not (d / "manifest.json").exists()


def test_resnet_export_keeps_its_blocks_and_variants(tmp_path):
    res = blockflow("export", "--model", "resnet18", "--blocks", "2", "--variant", "x", "--variant-blocks", "head",
                    "--out", str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert "resnet18 (TorchScript, script, 2 blocks)" in res.stdout
    assert sorted(load_manifest(tmp_path, "resnet18")["blocks"]) == [
        "block12.pt", "block34.pt", "full.pt", "head-x.pt", "head.pt"]


def test_manifest_rewrite_of_an_exported_directory_changes_nothing(mobilenet_repo, tmp_path):
    copy = tmp_path / MOBILENET
    shutil.copytree(os.path.join(mobilenet_repo, MOBILENET), copy)
    before = (copy / "manifest.json").read_text()
    assert blockflow("manifest", str(copy), "--check").returncode == 0
    assert blockflow("manifest", str(copy)).returncode == 0
    assert (copy / "manifest.json").read_text() == before
