"""Manifests for hand-made block files: ``blockflow manifest DIR [--check]``.

A user's own TorchScript (``.pt``) or ``torch.export`` (``.pt2``) files can be served as
they are, unlisted; a manifest makes the server check each file's sha256 before loading it
(a stale or half-copied file is refused instead of answering wrong numbers), lets a block
warm up on a zero input of its ``input_shape``, and gives the Open Inference Protocol and
the shared-memory sizing their shapes.  This module writes that manifest, with the fields
:func:`blockflow.blocks.repository.export_model` writes, and checks it.

Where the shapes come from: a block file does not say what it takes, so they are probed.
With ``input_shape`` the files are run in turn on a seeded float32 input of that shape --
the chain, in the order given or else every file in natural name order (block2 before
block10) except those named ``full*``, which take ``input_shape`` themselves -- and each
file gets the shape it was given and the shape it returned (batch dimension 1, as exports
write them).  A file may return a tuple of tensors, handed to the next as positional
arguments (as ``blockflow export`` writes the blocks of a cut several tensors cross), and the
last a dict of tensors: such a file's entry lists every member's shape, with the fields an
export writes (``input_shapes``, ``output_shapes``, ``output_keys``:
:func:`blockflow.blocks.repository.shape_fields`).  Without ``input_shape`` no file is run
and the entries carry no shapes: they are served the same, with no warm-up and unknown
shapes where those are shown.

Rewriting a manifest keeps, for each file whose sha256 has not changed, what the earlier
entry said beyond the freshly computed fields (an export's seed, cut and method, shapes
that were not probed this time); a changed file gets a fresh entry, marked ``"method":
"hand-made"``.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
from pathlib import Path

import torch

from blockflow.tensormq import bundle

from . import repository as repo
from . import split

log = logging.getLogger("blockflow.blocks.manifest")

def block_files(directory: str | os.PathLike) -> list[Path]:
    """The ``.pt``/``.pt2`` files directly in ``directory``, in natural name order."""
    d = Path(directory)
    if not d.is_dir():
        raise FileNotFoundError(2, "no such directory", str(d))
    files = [p for p in d.iterdir() if p.suffix in repo.SUFFIX.values() and p.is_file()]
    return sorted(files, key=natural_key)


def natural_key(path: Path) -> list:
    """``block2`` before ``block10``."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


def write_manifest(directory: str | os.PathLike, input_shape: tuple[int, ...] | None = None,
                   chain: list[str] | None = None) -> Path:
    """Write ``directory/manifest.json`` listing every block file in it with its sha256 and,
    with ``input_shape``, its probed shapes (see the module docstring).  Returns its path."""
    d = Path(directory)
    files = block_files(d)
    if not files:
        raise ValueError(f"{d} holds no .pt or .pt2 files to list")
    loaded = {p.name: _load(p) for p in files}
    shapes = probe_shapes({n: m for n, (m, _) in loaded.items()}, input_shape, chain) if input_shape else {}
    manifest = _old_manifest(d)
    old = manifest.get("blocks", {})
    entries = {}
    for name, (module, digest) in loaded.items():
        entry = _entry(Path(name), module, digest, shapes.get(name))
        previous = old.get(name)
        # an unchanged file keeps what an export said of it (seed, cut, method, shapes not re-probed)
        unchanged = isinstance(previous, dict) and previous.get("sha256") == digest
        entries[name] = {**previous, **entry} if unchanged else {"method": "hand-made", **entry}
    for name in sorted(set(old) - set(entries)):
        log.info("%s: %s is listed but gone; unlisted", d / repo.MANIFEST, name)
    path = d / repo.MANIFEST
    manifest.update(model=manifest.get("model", d.name), blocks=entries)
    repo.atomic_write(path, repo.manifest_bytes(manifest))
    log.info("manifest %s lists %d files (%s)", path, len(entries),
             "shapes probed" if shapes else "shapes not probed: no --input-shape")
    return path


def check_manifest(directory: str | os.PathLike) -> list[str]:
    """What differs between ``directory/manifest.json`` and the block files in it: one short
    phrase per file (changed, listed but missing, present but unlisted); ``[]`` when none."""
    d = Path(directory)
    path = d / repo.MANIFEST
    if not path.exists():
        return [f"{path} does not exist"]
    listed = repo.read_manifest(path).get("blocks", {})
    present = {p.name for p in block_files(d)}
    problems = []
    for name in sorted(set(listed) | present, key=lambda n: natural_key(Path(n))):
        entry = listed.get(name)
        if name not in present:
            problems.append(f"{name} is listed but missing")
        elif not isinstance(entry, dict):
            problems.append(f"{name} is not listed")
        elif repo.sha256_file(d / name) != entry.get("sha256"):
            problems.append(f"{name} has changed (sha256 differs)")
    return problems


def probe_shapes(modules: dict[str, torch.nn.Module], input_shape: tuple[int, ...],
                 chain: list[str] | None = None) -> dict[str, dict]:
    """``{file: its shape fields}`` (``input_shape``, ``output_shape`` and, for tuples and
    dicts, the fields :func:`repository.shape_fields` adds): the chain run in turn from a
    seeded input of ``input_shape``, and each ``full*`` file not in it run on that input alone."""
    if chain is None:
        chain = [n for n in modules if not n.startswith(repo.FULL)]
    unknown = [n for n in chain if n not in modules]
    if unknown:
        raise ValueError(f"--chain names {', '.join(unknown)}, not block files here; "
                         f"the files are {', '.join(modules)}")
    x0 = torch.randn(*input_shape, generator=torch.Generator().manual_seed(0))
    shapes = {}
    x, previous = x0, None
    for name in chain:
        y = _run(modules[name], x, name, previous)
        shapes[name] = repo.shape_fields(x, y)
        x, previous = y, name
    for name in modules:
        if name.startswith(repo.FULL) and name not in shapes:
            shapes[name] = repo.shape_fields(x0, _run(modules[name], x0, name, None))
    return shapes


def _run(module: torch.nn.Module, x, name: str, previous: str | None):
    """``module`` on ``x`` (a tuple's members as positional arguments, a dict's as keyword
    arguments), or a ValueError saying which file did not take what or returned what cannot
    be handed on."""
    try:
        with torch.inference_mode():
            y = bundle.call(module, x)
    except Exception as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        given = f"the output of {previous}" if previous else "--input-shape"
        shapes = [list(t.shape) for t in repo.members(x)]
        shown = f"shape {shapes[0]}" if isinstance(x, torch.Tensor) else f"shapes {shapes}"
        raise ValueError(f"{name} does not take {given} ({shown}): {reason}; "
                         "give the files' order with --chain, or fix --input-shape") from None
    split.check_tensors(y, name)
    return y


def _load(path: Path) -> tuple[torch.nn.Module, str]:
    """The module in ``path`` and the sha256 of the very bytes it was loaded from."""
    data = path.read_bytes()
    return repo.load_bytes(path, data, torch.device("cpu")), hashlib.sha256(data).hexdigest()


def _entry(path: Path, module: torch.nn.Module, digest: str, shapes: dict | None) -> dict:
    """A manifest entry with the fields an export writes (shapes only when probed)."""
    fmt = "export" if path.suffix == repo.SUFFIX["export"] else "torchscript"
    tensors = list(module.parameters()) + list(module.buffers())
    entry = {"name": path.stem, "file": path.name, "sha256": digest, "format": fmt, "dtype": "float32",
             "params": sum(p.numel() for p in module.parameters()),
             "param_bytes": sum(t.numel() * t.element_size() for t in tensors)}
    if shapes:
        entry.update(shapes)
    return entry


def _old_manifest(d: Path) -> dict:
    """The manifest already in ``d`` (``{}`` when there is none or it is unreadable)."""
    path = d / repo.MANIFEST
    try:
        manifest = repo.read_manifest(path) if path.exists() else {}
    except repo.BlockFileError as exc:
        log.warning("%s; writing a new one", exc)
        return {}
    return dict(manifest, blocks=dict(manifest.get("blocks", {})))
