"""TorchScript is deprecated upstream (torch 2.14 warns on every ``torch.jit.script``, ``trace``,
``save`` and ``load`` call) but is still one of the two block formats BlockFlow writes and serves
(README, "Block formats"). BlockFlow's own TorchScript calls print no deprecation warning however
BlockFlow was imported, every other FutureWarning still shows, ``.pt2`` blocks call no torch.jit
at all, and the suite's own toy TorchScript blocks do not fill ``make test``'s output with the
deprecation (53 copies of it before: issue 42, point 14)."""
from __future__ import annotations

import io
import re
import subprocess
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

from blockflow.blocks import repository
from conftest import ROOT

#: A fresh interpreter that imports BlockFlow inside ``warnings.catch_warnings()``, as pytest's
#: collection does (and any host may): a filter installed at import is gone afterwards, so the
#: call sites themselves must keep torch's deprecation quiet.
CODE = r'''
import warnings
from pathlib import Path
with warnings.catch_warnings():
    from blockflow.blocks import repository
import torch
from torch import nn
x = torch.randn(2, 3, 8, 8)
mod = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
for method in ("script", "trace"):
    data = repository.compile_to_bytes(mod, method, x)                    # torch.jit.script/trace, save
    y = repository.load_bytes(Path("block.pt"), data, torch.device("cpu"))(x)  # torch.jit.load
    assert y.shape == (2, 4, 6, 6), y.shape
warnings.warn("someone else's FutureWarning", FutureWarning)
print("ok")
'''


def test_torchscript_blocks_export_and_load_without_deprecation_warnings():
    proc = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr
    assert "torch.jit" not in proc.stderr, proc.stderr
    assert "someone else's FutureWarning" in proc.stderr, proc.stderr  # only torch.jit's deprecation is silenced


def test_pt2_blocks_call_no_torch_jit(monkeypatch):
    calls = []

    def refuse(name):
        def call(*args, **kwargs):
            calls.append(name)
            raise RuntimeError(f"torch.jit.{name} called for a .pt2 block")
        return call

    for name in ("script", "trace", "save", "load"):
        monkeypatch.setattr(torch.jit, name, refuse(name))
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    mod = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data = repository.export_program_bytes(mod, x)
        block = repository.load_bytes(Path("block.pt2"), data, torch.device("cpu"))
        with torch.inference_mode():
            y, want = block(x), mod(x)
    assert calls == []
    assert not [str(w.message) for w in caught if "torch.jit" in str(w.message)]
    torch.testing.assert_close(y, want)


def test_the_suites_own_torchscript_blocks_print_no_deprecation():
    """Tests make toy TorchScript blocks with torch.jit directly: pyproject.toml's filterwarnings
    keeps exactly that deprecation out of the warnings summary, and nothing else."""
    with warnings.catch_warnings(record=True) as caught:  # within the filters pytest set for this test
        torch.jit.save(torch.jit.script(nn.ReLU()), io.BytesIO())
        warnings.warn("someone else's FutureWarning", FutureWarning)
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "torch.jit" in m], messages
    assert "someone else's FutureWarning" in messages


def test_the_filter_matches_what_torch_says():
    """The filter's message is torch's own words: a torch that rewords its deprecation would print
    it again, and this fails first (every TorchScript entry point BlockFlow calls, heard here)."""
    x = torch.randn(2, 3, 8, 8)
    mod = nn.Sequential(nn.Conv2d(3, 4, 3)).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.simplefilter("always")
        buf = io.BytesIO()
        torch.jit.save(torch.jit.script(mod), buf)
        torch.jit.save(torch.jit.trace(mod, x), io.BytesIO())
        torch.jit.load(io.BytesIO(buf.getvalue()))
    said = {str(w.message) for w in caught if issubclass(w.category, FutureWarning)}
    jit = {m for m in said if m.startswith("`torch.jit.")}
    assert {m.split("`")[1] for m in jit} >= {f"torch.jit.{c}" for c in ("script", "trace", "save", "load")}, said
    assert all(re.match(repository.JIT_DEPRECATION, m) for m in jit), jit


def test_the_suites_filter_is_blockflows():
    import tomllib
    with open(Path(ROOT) / "pyproject.toml", "rb") as f:
        filters = tomllib.load(f)["tool"]["pytest"]["ini_options"]["filterwarnings"]
    assert f"ignore:{repository.JIT_DEPRECATION}:FutureWarning" in filters, filters


def test_the_default_format_is_one_this_torch_still_has():
    """TorchScript stays the default while torch has it (README, "Block formats", says why); the
    torch that drops it fails here first: make export the default in the same change as the pin."""
    from blockflow.cli import DEFAULT_FORMAT
    assert DEFAULT_FORMAT in repository.FORMATS
    if DEFAULT_FORMAT == "torchscript":
        missing = [f for f in ("script", "trace", "save", "load") if not callable(getattr(torch.jit, f, None))]
        assert not missing, (f"torch {torch.__version__} has no torch.jit.{', '.join(missing)}: set DEFAULT_FORMAT = "
                             "'export' in blockflow/cli.py and re-export repositories with --format export")
