"""torch.export blocks (.pt2): exported, checked against the manifest, served, equal to the full model."""
from __future__ import annotations

import os
import warnings

import pytest
import torch

from blockflow.blocks.repository import BlockFileError, export_model, load_block, load_manifest
from blockflow.client import Client

BLOCKS = ("block1", "block2", "block3", "block4", "head")


@pytest.fixture(scope="module")
def pt2_repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("pt2_repo")
    export_model("resnet18", repo, blocks=4, fmt="export", variants={"x": ["head"]})
    return str(repo)


def test_manifest_lists_pt2_files_with_sha256(pt2_repo):
    blocks = load_manifest(pt2_repo, "resnet18")["blocks"]
    assert sorted(blocks) == sorted([f"{b}.pt2" for b in BLOCKS] + ["full.pt2", "head-x.pt2"])
    for fname, entry in blocks.items():
        assert entry["format"] == "export" and len(entry["sha256"]) == 64
        assert os.path.getsize(os.path.join(pt2_repo, "resnet18", fname)) > 0


@pytest.mark.parametrize("batch", [1, 3])
def test_chain_of_exported_blocks_equals_full_model_without_jit_warnings(pt2_repo, batch):
    x = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(batch))
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()  # repository.py silences torch.jit's deprecation: hear everything here
        warnings.simplefilter("always")
        full = load_block(pt2_repo, "resnet18/full.pt2")
        y = x
        with torch.inference_mode():
            for b in BLOCKS:
                y = load_block(pt2_repo, f"resnet18/{b}.pt2")(y)
            want = full(x)
    assert y.shape == (batch, 1000)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    jit = [str(w.message) for w in caught if "torch.jit" in str(w.message)]
    assert not jit, jit


def test_modified_pt2_is_refused(pt2_repo, tmp_path):
    import shutil
    repo = tmp_path / "r"
    shutil.copytree(pt2_repo, repo)
    path = repo / "resnet18" / "head.pt2"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(BlockFileError, match="does not match"):
        load_block(str(repo), "resnet18/head.pt2")
    (repo / "resnet18" / "junk.pt2").write_bytes(b"not a program")
    with pytest.raises(BlockFileError, match="not a loadable torch.export program"):
        load_block(str(repo), "resnet18/junk.pt2")


def test_server_serves_pt2_and_pt_blocks_in_one_path(server_factory, pt2_repo):
    """A path may mix kinds: .pt2 blocks with a TorchScript head exported from the same seed."""
    export_model("resnet18", pt2_repo, blocks=4, fmt="torchscript")
    srv = server_factory(pt2_repo)
    update = {"blocks": [{"name": f"b{i}", "model": f"resnet18/block{i}.pt2", "threads": 1} for i in range(1, 5)]
              + [{"name": "h", "model": "resnet18/head.pt", "threads": 1}],
              "tasks": [{"id": "classify", "path": ["b1", "b2", "b3", "b4", "h"]}]}
    srv.call("POST", "/system/update", update, timeout=120)
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(7))
    with Client(srv.dispatcher, timeout=60) as c:
        y = c.infer("classify", x)
    with torch.inference_mode():
        want = load_block(pt2_repo, "resnet18/full.pt2")(x)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
