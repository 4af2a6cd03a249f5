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

#: The user's own models: written to a module file for the CLI (`usermodels:skipnet`) and run
#: from that same source in process. SkipNet's ``body`` holds a skip connection (a cut inside it
#: is crossed by two tensors); UNet's decoder concatenates the encoder's outputs (cuts crossed by
#: two and three tensors); TwoHeads returns a tuple of two; torchvision's ViT, small, reads
#: ``x.shape`` (ints cross the cut after ``conv_proj``).
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


def _conv(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU())


class UNet(nn.Module):
    """Two encoder stages, a bottleneck and a decoder that concatenates the encoder's outputs:
    ``enc2`` is crossed by e1 and e2, ``mid`` by e1, e2 and m, ``dec2`` by e1 and d2."""

    def __init__(self):
        super().__init__()
        self.enc1 = _conv(3, 8)
        self.enc2 = nn.Sequential(nn.MaxPool2d(2), _conv(8, 16))
        self.mid = nn.Sequential(nn.MaxPool2d(2), _conv(16, 16), nn.Upsample(scale_factor=2.0))
        self.dec2 = nn.Sequential(_conv(32, 8), nn.Upsample(scale_factor=2.0))
        self.dec1 = _conv(16, 8)
        self.out = nn.Conv2d(8, 2, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(e1)
        m = self.mid(e2)
        d2 = self.dec2(torch.cat([m, e2], 1))
        return self.out(self.dec1(torch.cat([d2, e1], 1)))


class TwoHeads(nn.Module):
    """A shared trunk and two heads (class scores and a box), returned as a tuple."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(),
                                   nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),
                                   nn.AdaptiveAvgPool2d(1), nn.Flatten(1))
        self.classify = nn.Linear(16, 10)
        self.regress = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))

    def forward(self, x):
        f = self.trunk(x)
        return self.classify(f), self.regress(f)


def skipnet():
    return SkipNet().eval()


def unet():
    return UNet().eval()


def twoheads():
    return TwoHeads().eval()


def tinyvit():
    from torchvision.models import VisionTransformer
    return VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16,
                             mlp_dim=32).eval()


def _relu_if_positive(t):
    return t.relu() if bool(t.sum() > 0) else t  # control flow on a value: torch.export cannot follow it


torch.fx.wrap("_relu_if_positive")  # torch.fx keeps the call whole (one node)


class Gated(nn.Module):
    """An int of the input's shape crosses the cut after ``a``; torch.fx traces the model,
    torch.export cannot."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        n = x.shape[1]
        return self.b(_relu_if_positive(self.a(x))) * n


def gated():
    return Gated().eval()


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
    """Each block on the one before's output: a tuple's members as positional arguments."""
    with torch.inference_mode():
        for b in blocks:
            x = b(*x) if isinstance(x, tuple) else b(x)
    return x


def max_diff(a, b) -> float:
    """Largest difference of two tensors, or of two tuples of tensors member by member."""
    if isinstance(b, tuple):
        assert isinstance(a, tuple) and len(a) == len(b), (type(a), type(b))
        return max(max_diff(p, q) for p, q in zip(a, b))
    return (a - b).abs().max().item()


def small_input(batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def user_model(user_models, name: str):
    _, ns = user_models
    torch.manual_seed(0)
    return ns[name]()


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


def test_a_cut_crossed_by_the_skip_hands_on_both_tensors_once_traced_with_an_example(user_models):
    net = user_model(user_models, "skipnet")
    # traced without an example nothing says the two values are tensors: refused, naming them
    with pytest.raises(split.CutError) as exc:
        split.resolve_cuts(split.trace(net), ["body.conv1"], "skipnet")
    msg = str(exc.value)
    assert "'body.conv1'" in msg and "2 values" in msg and "example" in msg and "not supported" not in msg
    assert "output of stem.2" in msg and "output of body.conv1" in msg
    assert "stem" in msg.split("nearby")[1] and "body" in msg.split("nearby")[1]
    # with one, the block before returns both in program order and the next takes both
    x = small_input(3)
    gm = split.trace(net, x[:1])
    assert [n.name for n in split.crossing(gm, split.cut_positions(gm)["body.conv1"])] == ["stem_2", "body_conv1"]
    first, second = split.split(gm, split.resolve_cuts(gm, ["body.conv1"], "skipnet"))
    with torch.inference_mode():
        skip, inner = first(x)
        assert max_diff(second(skip, inner), net(x)) <= TOL
        assert max_diff(skip, net.stem(x)) == 0


def test_unet_cuts_crossed_by_several_tensors_equal_whole_model(user_models):
    net = user_model(user_models, "unet")
    x = small_input()
    gm = split.trace(net, x[:1])
    valid = split.valid_cuts(gm)
    assert [len(split.crossing(gm, valid[c])) for c in ("enc1", "enc2", "mid", "dec2", "dec1")] == [1, 2, 3, 2, 1]
    blocks = split.split(gm, split.resolve_cuts(gm, ["enc2", "mid", "dec2"], "unet"))
    outs = split.chain(blocks, x)
    assert [len(o) if isinstance(o, tuple) else 1 for o in outs] == [2, 3, 2, 1]
    assert outs[1][0] is outs[0][0]  # e1 jumps over block2: its input and, unchanged, its output
    with torch.inference_mode():
        want = net(x)
    assert max_diff(outs[-1], want) <= TOL and max_diff(chained(blocks, x), want) <= TOL
    assert split.balance(gm, 3, x[:1])  # --blocks N may pick multi-tensor cuts too


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


#: The user's models exported beside MobileNet for the served test: (callable, cuts, input shape).
SERVED_MODELS = {"unet": ("usermodels:unet", ("enc2", "mid", "dec2"), (1, 3, 32, 32)),
                 "twoheads": ("usermodels:twoheads", ("trunk", "classify"), (1, 3, 32, 32)),
                 "tinyvit": ("usermodels:tinyvit", ("encoder.layers.encoder_layer_0",), (1, 3, 32, 32))}


@pytest.fixture(scope="module")
def served_repo(mobilenet_repo, user_models):
    """mobilenet_repo plus the U-Net (cuts crossed by 2 and 3 tensors), the model with two
    outputs and a torchvision VisionTransformer cut inside its encoder, exported by the CLI."""
    models_dir, _ = user_models
    for name, (model, cuts, shape) in SERVED_MODELS.items():
        res = blockflow("export", "--model", model, *[a for c in cuts for a in ("--cut", c)],
                        "--input-shape", ",".join(map(str, shape)), "--out", mobilenet_repo, cwd=models_dir)
        assert res.returncode == 0, (name, res.stderr)
    return mobilenet_repo


def served_update(transport: str) -> dict:
    """Two tasks per model; the second one of each runs its blocks another way (fused, or batching)."""
    m = MOBILENET

    def blk(name, model, **kw):
        return {"name": name, "model": model, "threads": 1, **kw}

    batching = {"max_batch": 4, "max_queue_delay_us": 20_000}
    blocks = [blk("m1", f"{m}/block1.pt"), blk("m2", f"{m}/block2.pt"), blk("m3", f"{m}/block3.pt"),
              blk("m23", [f"{m}/block2.pt", f"{m}/block3.pt"]),
              *[blk(f"u{i}", f"unet/block{i}.pt") for i in (1, 2, 3, 4)],
              blk("u23", ["unet/block2.pt", "unet/block3.pt"]),
              *[blk(f"t{i}", f"twoheads/block{i}.pt") for i in (1, 2, 3)],
              blk("t3b", "twoheads/block3.pt", batching=batching),
              blk("v1", "tinyvit/block1.pt"), blk("v2", "tinyvit/block2.pt"),
              blk("v2b", "tinyvit/block2.pt", batching=batching)]
    tasks = {"mobilenet": ["m1", "m2", "m3"], "mobilenet_fused": ["m1", "m23"],
             "unet": ["u1", "u2", "u3", "u4"], "unet_fused": ["u1", "u23", "u4"],
             "twoheads": ["t1", "t2", "t3"], "twoheads_batched": ["t1", "t2", "t3b"],
             "tinyvit": ["v1", "v2"], "tinyvit_batched": ["v1", "v2b"]}
    return {"transport": transport, "blocks": blocks, "tasks": [{"id": t, "path": p} for t, p in tasks.items()]}


@pytest.mark.parametrize("transport", ["tensormq", "zeromq"])
def test_served_blocks_of_any_model_equal_the_whole_model_for_two_concurrent_tasks(server_factory, served_repo,
                                                                                   transport):
    """Issue 29's acceptance: MobileNet cut in its features, a torchvision ViT cut inside its
    encoder, a U-Net whose cuts are crossed by two and three tensors, and a model with two
    outputs, each served as blocks by `blockflow serve` for two tasks at once, equal the whole
    model (fp32, max abs difference <= 1e-4), over both transports."""
    srv = server_factory(served_repo)
    update = served_update(transport)
    srv.call("POST", "/system/update", update, timeout=240)
    fulls = {name: load_block(served_repo, f"{name}/full.pt") for name in (MOBILENET, *SERVED_MODELS)}
    inputs = {MOBILENET: seeded_input(), **{n: small_input(2, seed=i) for i, n in enumerate(SERVED_MODELS)}}
    model_of = {t["id"]: (MOBILENET if t["id"].startswith("mobilenet") else t["id"].split("_")[0])
                for t in update["tasks"]}

    def infer(task):
        with Client(srv.dispatcher, timeout=120) as c:
            return c.infer(task, inputs[model_of[task]])

    with ThreadPoolExecutor(len(model_of)) as pool:
        results = dict(zip(model_of, pool.map(infer, model_of)))
    for task, y in results.items():
        model = model_of[task]
        with torch.inference_mode():
            want = fulls[model](inputs[model])
        assert type(y) is type(want), (task, type(y))
        assert max_diff(y, want) <= TOL, task
    assert isinstance(results["twoheads"], tuple) and len(results["twoheads"]) == 2


def test_cli_refuses_a_cut_that_does_not_exist_naming_it_and_nearby_names(tmp_path):
    res = blockflow("export", "--model", MOBILENET, "--cut", "features.33", "--out", str(tmp_path))
    line = one_line_error(res, Exit.BAD_INPUT, "'features.33'", "nearby", "features.3")
    assert "no submodule" in line


def test_cli_exports_a_callable_at_a_cut_two_tensors_cross(tmp_path, user_models):
    models_dir, _ = user_models
    conv1 = tmp_path / "conv1"
    res = blockflow("export", "--model", "usermodels:skipnet", "--input-shape", "1,3,32,32", "--out", str(conv1),
                    "--cut", "body.conv1", cwd=models_dir)
    assert res.returncode == 0, res.stderr
    assert "cut after body.conv1" in res.stdout, res.stdout
    blocks = load_manifest(conv1, "skipnet")["blocks"]
    assert blocks["block1.pt"]["output_shapes"] == [[1, 8, 32, 32], [1, 8, 32, 32]]
    assert blocks["block2.pt"]["input_shapes"] == [[1, 8, 32, 32], [1, 8, 32, 32]]
    assert "output_shapes" not in blocks["block2.pt"] and "input_shapes" not in blocks["block1.pt"]
    x = small_input()
    parts = [load_block(conv1, f"skipnet/block{i}.pt") for i in (1, 2)]
    assert max_diff(chained(parts, x), chained([load_block(conv1, "skipnet/full.pt")], x)) <= TOL

    out = tmp_path / "repo"
    common = ("--model", "usermodels:skipnet", "--input-shape", "1,3,32,32", "--out", str(out))
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


#: The shape fields a multi-tensor block adds, for the U-Net cut after enc2, mid and dec2.
E1, E2, M = [1, 8, 32, 32], [1, 16, 16, 16], [1, 16, 16, 16]
UNET_SHAPES = {
    "block1": {"input_shape": [1, 3, 32, 32], "output_shape": E1, "output_shapes": [E1, E2]},
    "block2": {"input_shape": E1, "input_shapes": [E1, E2], "output_shape": E1, "output_shapes": [E1, E2, M]},
    "block3": {"input_shape": E1, "input_shapes": [E1, E2, M], "output_shape": E1, "output_shapes": [E1, E1]},
    "block4": {"input_shape": E1, "input_shapes": [E1, E1], "output_shape": [1, 2, 32, 32]},
    "full": {"input_shape": [1, 3, 32, 32], "output_shape": [1, 2, 32, 32]},
}
SHAPE_FIELDS = ("input_shape", "output_shape", "input_shapes", "output_shapes", "output_keys")


def shape_fields(entry: dict) -> dict:
    return {k: entry[k] for k in SHAPE_FIELDS if k in entry}


@pytest.mark.parametrize("fmt", ["torchscript", "export"])
def test_cli_exports_unet_blocks_that_take_and_return_tuples(tmp_path, user_models, fmt):
    models_dir, _ = user_models
    res = blockflow("export", "--model", "usermodels:unet", "--cut", "enc2", "--cut", "mid", "--cut", "dec2",
                    "--input-shape", "1,3,32,32", "--format", fmt, "--out", str(tmp_path), cwd=models_dir)
    assert res.returncode == 0, res.stderr
    assert "4 blocks, cut after enc2, mid, dec2" in res.stdout, res.stdout
    suffix = ".pt" if fmt == "torchscript" else ".pt2"
    manifest = load_manifest(tmp_path, "unet")
    assert {f: shape_fields(e) for f, e in manifest["blocks"].items()} == {
        n + suffix: shapes for n, shapes in UNET_SHAPES.items()}
    x = small_input(3)
    blocks = [load_block(tmp_path, f"unet/block{i}{suffix}") for i in range(1, 5)]
    want = chained([load_block(tmp_path, f"unet/full{suffix}")], x)
    assert max_diff(chained(blocks, x), want) <= TOL


@pytest.mark.parametrize("how", [("--method", "trace"), ("--format", "export")], ids=["trace", "export"])
def test_cli_exports_a_model_with_two_outputs(tmp_path, user_models, how):
    models_dir, ns = user_models
    res = blockflow("export", "--model", "usermodels:twoheads", "--cut", "trunk", "--cut", "classify",
                    "--input-shape", "1,3,32,32", *how, "--out", str(tmp_path), cwd=models_dir)
    assert res.returncode == 0, res.stderr
    suffix = ".pt2" if "export" in how else ".pt"
    blocks = load_manifest(tmp_path, "twoheads")["blocks"]
    assert shape_fields(blocks[f"block3{suffix}"]) == {"input_shape": [1, 16], "input_shapes": [[1, 16], [1, 10]],
                                                       "output_shape": [1, 10], "output_shapes": [[1, 10], [1, 4]]}
    assert blocks[f"full{suffix}"]["output_shapes"] == [[1, 10], [1, 4]]
    x = small_input(3)
    got = chained([load_block(tmp_path, f"twoheads/block{i}{suffix}") for i in (1, 2, 3)], x)
    want = chained([load_block(tmp_path, f"twoheads/full{suffix}")], x)
    assert isinstance(got, tuple) and [t.shape for t in got] == [(3, 10), (3, 4)]
    assert max_diff(got, want) <= TOL
    with torch.inference_mode():
        assert max_diff(want, user_model(user_models, "twoheads")(x)) <= TOL


def test_a_cut_crossed_by_a_non_tensor_is_refused_naming_it(tmp_path, user_models):
    models_dir, _ = user_models
    gm = split.trace(user_model(user_models, "tinyvit"), small_input(1))
    with pytest.raises(split.CutError) as exc:  # torchvision's ViT: n, c, h, w = x.shape
        split.resolve_cuts(gm, ["conv_proj"], "tinyvit")
    msg = str(exc.value)
    assert "'conv_proj'" in msg and "getitem (an int)" in msg and "only tensors" in msg
    assert "encoder" in msg.split("nearby")[1]
    with pytest.raises(split.CutError, match=r"self_attention \(a tuple\) crosses it"):
        split.resolve_cuts(gm, ["encoder.layers.encoder_layer_0.self_attention"], "tinyvit")
    assert "conv_proj" not in split.valid_cuts(gm) and "encoder.layers.encoder_layer_0" in split.valid_cuts(gm)
    # the CLI splits such a model on torch.export's graph, where n, c, h, w are sizes each block
    # recomputes and a tuple is taken apart (Note [Which tracer] in blocks/split.py)
    cuts = ("conv_proj", "encoder.layers.encoder_layer_0.self_attention")
    res = blockflow("export", "--model", "usermodels:tinyvit", *[a for c in cuts for a in ("--cut", c)],
                    "--input-shape", "1,3,32,32", "--out", str(tmp_path), cwd=models_dir)
    assert res.returncode == 0, res.stderr
    assert f"cut after {', '.join(cuts)}" in res.stdout, res.stdout
    entry = load_manifest(str(tmp_path), "tinyvit")["blocks"]["block2.pt"]
    assert entry["dim_bounds"] == {"N": list(split.DEFAULT_DIM_BOUNDS)}, entry  # export's graph: the batch dynamic
    x = small_input(3)  # another batch than the export's
    got = chained([load_block(tmp_path, f"tinyvit/block{i}.pt") for i in (1, 2, 3)], x)
    with torch.inference_mode():
        assert max_diff(got, user_model(user_models, "tinyvit")(x)) <= TOL
    # where torch.export cannot follow the model either, the refusal is fx's, in one line
    res = blockflow("export", "--model", "usermodels:gated", "--cut", "a", "--input-shape", "1,8",
                    "--out", str(tmp_path), cwd=models_dir)
    one_line_error(res, Exit.BAD_INPUT, "cut 'a'", "(an int)", "a hop carries only tensors")


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


def test_manifest_of_hand_made_files_that_take_and_return_tuples(tmp_path, user_models):
    from blockflow.blocks import manifest
    net = user_model(user_models, "unet")
    gm = split.trace(net, small_input(1))
    d = tmp_path / "unet"
    d.mkdir()
    for fname, part in zip(("block1.pt", "block2.pt", "block3.pt", "block4.pt"),
                           split.split(gm, split.resolve_cuts(gm, ["enc2", "mid", "dec2"], "unet"))):
        torch.jit.save(torch.jit.script(part), str(d / fname))
    torch.jit.save(torch.jit.script(gm), str(d / "full.pt"))
    blocks = json.loads(manifest.write_manifest(d, (1, 3, 32, 32)).read_text())["blocks"]
    assert {f: shape_fields(e) for f, e in blocks.items()} == {n + ".pt": s for n, s in UNET_SHAPES.items()}
    with pytest.raises(ValueError, match="block3.pt does not take the output of block1.pt"):
        manifest.write_manifest(d, (1, 3, 32, 32), ["block1.pt", "block3.pt"])


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
