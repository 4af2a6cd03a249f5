"""Block repository: split torchvision ResNets into blocks, export them as
TorchScript files with a manifest, and load/verify them again.  Any other model
is split at named cuts by :mod:`blockflow.blocks.split`, and hand-made block files
get their manifest from :mod:`blockflow.blocks.manifest`; both write the manifest
fields described here.

Layout of a repository directory (``out`` / ``repo`` below)::

    <repo>/<model>/block1.pt ... head.pt   split blocks (one process each)
    <repo>/<model>/full.pt                 the monolithic model (baseline)
    <repo>/<model>/block4-x.pt             task-specialised variant "x"
    <repo>/<model>/manifest.json           sha256, shapes, sizes per file

Why a manifest with sha256: a block process that silently loads a stale or
half-copied file produces wrong numbers that are very hard to trace back, so
every listed file is checked before it is served; a mismatch is a
:class:`BlockFileError` that tells the user to re-export.

Why exports run in a child process: TorchScript archives are *not*
byte-for-byte repeatable inside an arbitrary Python process.  The scripted code
lists a module's ``Final`` constants in ``set`` iteration order (which depends
on the per-process string-hash seed), and the ``___torch_mangle_N`` class names
depend on which modules the process compiled before.  Running the export in a
fresh interpreter with ``PYTHONHASHSEED=0`` removes both sources of variation,
so the same ``(model, seed, method, ...)`` always gives the same bytes and the
same sha256, whatever the calling process did earlier.

Files that resolve outside the repository (a symlink in it, or a symlinked
model directory) are served only when the manifest of their directory -- itself
inside the repository -- lists them with their sha256: a link must not let an
update load, or probe, an arbitrary host file unchecked.

Only ``torch.jit.load`` is used to read files; nothing here unpickles
arbitrary Python objects (no ``torch.load``).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import sys
import warnings
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from blockflow.tensormq import bundle

# checking a file against its manifest needs no torch (the manager does it for every update):
# it lives in verify.py, and these names stay importable from here
from blockflow.blocks.verify import (MANIFEST, RESNET_SPLITS, RESNETS, SUFFIX, BlockFileError,  # noqa: F401
                                    check_digest, file_signature, read_manifest, remake_hint, resolve,
                                    sha256_file, verify_block)
# the caller's side of an export (no torch), re-exported: what its worker runs is below
from blockflow.blocks.exporter import (BLOCK_NAMES, FORMATS, FULL, INPUT_SHAPE, METHODS, MODELS,  # noqa: F401
                                       SPLITS, check_model, export_model, run_export_worker, worker_main)

log = logging.getLogger("blockflow.blocks.repository")

#: What torch (2.12+) says on every TorchScript call BlockFlow makes (``torch.jit.trace`` of a
#: module also says it for ``trace_method``).  TorchScript is deprecated upstream but still one of
#: the two block formats written and served (README, "Block formats", says which is the default
#: and why), so BlockFlow's own calls keep exactly this message quiet; any other warning shows.
JIT_DEPRECATION = r"`torch\.jit\.(script|trace|trace_method|save|load)` is deprecated"


def _quiet_jit_deprecation() -> None:
    """Make sure the filter ignoring :data:`JIT_DEPRECATION` is in the filter list in force now;
    called right before each of BlockFlow's torch.jit calls.

    Not only at import: a host that imports this module inside ``warnings.catch_warnings()``
    (pytest's collection does) loses an import-time filter when that block ends, and every later
    call printed the deprecation again (53 times in ``make test``).  Not ``catch_warnings()`` around
    the call either: block servers load files from several threads and catch_warnings swaps the
    process-wide filter list, which is not thread-safe.  The filter is added once per filter list
    (it is looked for first), so steady state changes nothing."""
    for action, message, category, _module, _lineno in warnings.filters:
        if action == "ignore" and category is FutureWarning and getattr(message, "pattern", None) == JIT_DEPRECATION:
            return
    warnings.filterwarnings("ignore", message=JIT_DEPRECATION, category=FutureWarning)


_quiet_jit_deprecation()  # for callers of torch.jit after importing this module (tools, experiments)


# --------------------------------------------------------------------------
# Building and splitting
# --------------------------------------------------------------------------


def build_reference(model: str, seed: int = 0) -> nn.Module:
    """Build an untrained torchvision ``model`` with deterministic weights.

    Seeded random weights (``weights=None``) instead of pretrained ones because
    nothing may be downloaded at run time, and because equivalence/latency
    experiments only need *fixed* weights, not good ones.
    """
    check_model(model)
    import torchvision  # lazy: block servers only load files, no torchvision

    torch.manual_seed(seed)
    net = getattr(torchvision.models, model)(weights=None)
    return net.eval()


def split_model(net: nn.Module, blocks: int = 4) -> "OrderedDict[str, nn.Module]":
    """Split a torchvision ResNet into sequential blocks.

    ``blocks=4``: block1 (stem + layer1), block2 (layer2), block3 (layer3),
    block4 (layer4), head (avgpool + flatten + fc).  ``blocks=2``: block12
    (stem + layer1 + layer2), block34 (layer3 + layer4), head.  ``blocks=1``:
    ``{}`` -- the model is only served whole (``full``).

    The blocks *share* modules with ``net`` (no copy): splitting is free and
    chaining the blocks is, by construction, the same computation as
    ``net.forward`` (``nn.Flatten(1)`` == ``torch.flatten(x, 1)``).
    """
    if blocks not in SPLITS:
        raise ValueError(f"blocks must be one of {SPLITS}, got {blocks!r}")
    missing = [
        n
        for n in ("conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3",
                  "layer4", "avgpool", "fc")
        if not hasattr(net, n)
    ]
    if missing:
        raise ValueError(
            f"split_model supports torchvision ResNets; {type(net).__name__} "
            f"lacks {', '.join(missing)}"
        )
    if blocks == 1:
        return OrderedDict()

    def seq(**mods: nn.Module) -> nn.Sequential:
        # Named children keep state-dict keys readable (block1.layer1.0.conv1...).
        return nn.Sequential(OrderedDict(mods))

    stem = dict(conv1=net.conv1, bn1=net.bn1, relu=net.relu, maxpool=net.maxpool)
    head = seq(avgpool=net.avgpool, flatten=nn.Flatten(1), fc=net.fc)
    if blocks == 4:
        parts = [
            ("block1", seq(**stem, layer1=net.layer1)),
            ("block2", seq(layer2=net.layer2)),
            ("block3", seq(layer3=net.layer3)),
            ("block4", seq(layer4=net.layer4)),
        ]
    else:
        parts = [
            ("block12", seq(**stem, layer1=net.layer1, layer2=net.layer2)),
            ("block34", seq(layer3=net.layer3, layer4=net.layer4)),
        ]
    out = OrderedDict(parts)
    out["head"] = head
    for m in out.values():
        m.eval()
    return out


def variant_seed(seed: int, variant: str) -> int:
    """Seed for a task-specialised variant: stable across runs and machines
    (crc32, not ``hash()``, which is salted per process)."""
    return seed + 1000 + zlib.crc32(variant.encode("utf-8"))


# --------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------


def _export_worker(argv_json: str) -> None:
    """Entry point of the export child process (see :func:`export_model`)."""
    worker_main(argv_json, lambda **args: {"manifest": str(_export_in_process(**args))})


def _export_in_process(model: str, out: str, blocks: int, method: str,
                       variants: dict[str, list[str]], seed: int, batch: int,
                       fmt: str = "torchscript") -> Path:
    """Do the export in this process.  Only byte-for-byte repeatable in a
    fresh interpreter with a fixed PYTHONHASHSEED; call :func:`export_model`."""
    model_dir = Path(out) / model
    model_dir.mkdir(parents=True, exist_ok=True)

    net = build_reference(model, seed)
    parts = split_model(net, blocks)

    # One seeded example input: its batch-1 slice gives the manifest shapes,
    # the full batch is what trace records with.
    gen = torch.Generator().manual_seed(seed)
    example = torch.randn(batch, *INPUT_SHAPE, generator=gen, dtype=torch.float32)
    inputs: dict[str, torch.Tensor] = {}
    shapes: dict[str, tuple[list[int], list[int]]] = {}
    with torch.no_grad():
        x = example
        for name, mod in parts.items():
            inputs[name] = x
            y = mod(x)
            shapes[name] = (batch1(x.shape), batch1(y.shape))
            x = y
        if not parts:  # blocks=1: still need the full model's output shape
            x = net(example)
    inputs[FULL] = example
    shapes[FULL] = (batch1(example.shape), batch1(x.shape))

    # Compile order matters for the bytes: TorchScript names classes
    # ___torch_mangle_N in order of first compilation.  full and head come
    # first so their files are identical whatever the split (a blocks=2 export
    # rewrites full.pt/head.pt with the very same bytes as a blocks=4 one).
    order = [n for n in ("head",) if n in parts] + [n for n in parts if n != "head"]
    jobs: list[tuple[str, str | None, int, nn.Module]] = [(FULL, None, seed, net)]
    jobs.extend((name, None, seed, parts[name]) for name in order)
    for vname, vblocks in variants.items():
        vseed = variant_seed(seed, vname)
        vnet = build_reference(model, vseed)
        vparts = split_model(vnet, blocks)
        vparts[FULL] = vnet
        jobs.extend((b, vname, vseed, vparts[b]) for b in vblocks)

    entries = {}
    for name, variant, bseed, mod in jobs:
        stem = name if variant is None else f"{name}-{variant}"
        fname = stem + SUFFIX[fmt]
        if fmt == "export":
            data = export_program_bytes(mod, inputs[name])
        else:
            data = compile_to_bytes(mod, method, inputs[name])
        sys.stderr.write(json.dumps({"blockflow_progress": fname}) + "\n")  # export_model's bar
        sys.stderr.flush()
        digest = hashlib.sha256(data).hexdigest()
        atomic_write(model_dir / fname, data)
        n_params = sum(p.numel() for p in mod.parameters())
        n_bytes = sum(t.numel() * t.element_size()
                      for t in list(mod.parameters()) + list(mod.buffers()))
        entries[fname] = {
            "name": name,
            "file": fname,
            "sha256": digest,
            "input_shape": shapes[name][0],
            "output_shape": shapes[name][1],
            "dtype": "float32",
            "params": n_params,
            "param_bytes": n_bytes,
            "method": method if fmt == "torchscript" else "export",
            "format": fmt,
            "variant": variant,
            "seed": bseed,
        }
        log.info("wrote %s (%.1f MB, sha256 %s)", model_dir / fname, len(data) / 1e6, digest[:12])

    # Merge, so exporting variants (or another split) later keeps earlier files listed.
    manifest_path = model_dir / MANIFEST
    manifest = read_manifest(manifest_path) if manifest_path.exists() else {}
    merged = dict(manifest.get("blocks", {}))
    merged.update(entries)
    manifest = {"model": model, "seed": seed, "blocks": merged}
    atomic_write(manifest_path, manifest_bytes(manifest))
    log.info("manifest %s lists %d files", manifest_path, len(merged))
    return manifest_path


def batch1(shape: torch.Size) -> list[int]:
    """``shape`` with batch 1, as manifests list shapes."""
    return [1, *shape[1:]]


def members(value) -> list:
    """The tensors of a block's input or output: a tensor alone, a tuple's (or list's) members
    in order, or a dict's values in key order (callers check that each is a tensor)."""
    if isinstance(value, dict):
        return list(value.values())
    if isinstance(value, (tuple, list)):
        return list(value)
    return [value]


def shape_fields(x, y) -> dict:
    """The shape fields of the manifest entry of a block that takes ``x`` and returns ``y``.

    ``input_shape``/``output_shape`` are the batch-1 shapes of the first tensor, so a reader
    that knows one tensor per hop still finds them.  A block that takes several tensors (a
    tuple, passed positionally) also gets ``input_shapes``; one that returns a tuple or dict
    gets ``output_shapes`` (every member's batch-1 shape, in order) and, for a dict,
    ``output_keys``.  A block taking and returning one tensor gets none of these."""
    xs, ys = members(x), members(y)
    fields = {"input_shape": batch1(xs[0].shape), "output_shape": batch1(ys[0].shape)}
    if isinstance(x, (tuple, list, dict)):
        fields["input_shapes"] = [batch1(t.shape) for t in xs]
    if isinstance(y, (tuple, list, dict)):
        fields["output_shapes"] = [batch1(t.shape) for t in ys]
    if isinstance(y, dict):
        fields["output_keys"] = [str(k) for k in y]
    return fields


def compile_to_bytes(mod: nn.Module, method: str, example: torch.Tensor | tuple[torch.Tensor, ...],
                     strict: bool = True) -> bytes:
    """TorchScript-compile ``mod`` and serialise it in memory (the bytes are
    hashed and then written in one go).  ``example`` is the input, or a tuple of
    the positional inputs of a block that takes several tensors; ``strict=False``
    lets ``trace`` record a module that returns a dict or a list."""
    mod.eval()
    _quiet_jit_deprecation()  # TorchScript is deprecated upstream, still a format BlockFlow writes
    if method == "script":
        compiled = torch.jit.script(mod)
    else:
        # check_trace re-runs the model only to detect data-dependent control
        # flow, which ResNets do not have; the equivalence tests cover it.
        with torch.no_grad():
            compiled = torch.jit.trace(mod, example, check_trace=False, strict=strict)
    buf = io.BytesIO()
    torch.jit.save(compiled, buf)
    return buf.getvalue()


def export_program_bytes(mod: nn.Module, example: torch.Tensor | tuple[torch.Tensor, ...],
                         dims: list | None = None, bounds: dict | None = None) -> bytes:
    """``torch.export`` ``mod`` (eval mode, dynamic batch dimension) and serialise
    the program in memory.  ``example`` is the input, or a tuple of the positional
    inputs of a block that takes several tensors (all share the batch dimension).
    The example is widened to batch 2: torch.export specialises a dimension of
    size 1, which would fix the batch to 1.  ``dims`` (per input, a dimension's
    name where it is dynamic, as the manifest's ``input_dims``) and ``bounds``
    (name -> [low, high]) make more dimensions dynamic; the first is the batch."""
    mod.eval()
    args = example if isinstance(example, tuple) else (example,)
    args = tuple(torch.cat([a[:1], a[:1]]) if a.shape[0] < 2 else a for a in args)
    named = {"batch": torch.export.Dim("batch", min=1, max=4096)}
    for name, (low, high) in (bounds or {}).items():
        named.setdefault(name, torch.export.Dim(name, min=low, max=high))
    dynamic = tuple({0: named["batch"], **{i: named[d] for i, d in enumerate(member) if i and isinstance(d, str)}}
                    for member in (dims or [[None]] * len(args)))
    with torch.no_grad():
        program = torch.export.export(mod, args, dynamic_shapes=dynamic)
    buf = io.BytesIO()
    torch.export.save(program, buf)
    return buf.getvalue()


def manifest_bytes(manifest: dict) -> bytes:
    """The manifest as written: sorted keys, indent 2, so equal manifests are equal bytes."""
    return (json.dumps(manifest, sort_keys=True, indent=2) + "\n").encode("utf-8")


def atomic_write(path: Path, data: bytes) -> None:
    """Write via a temp file + os.replace: a block server never sees a
    half-written file, and an interrupted export leaves the old file intact."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------
# Reading / verifying
# --------------------------------------------------------------------------


def load_manifest(repo: str | os.PathLike, model: str) -> dict:
    """Manifest of ``repo/<model>``; ``{}`` when there is none."""
    if not model or "/" in model or "\\" in model or model in (".", ".."):
        raise ValueError(f"model must be a plain directory name, got {model!r}")
    path = Path(repo) / model / MANIFEST
    if not path.exists():
        return {}
    return read_manifest(path)


def load_block(repo: str | os.PathLike, relpath: str,
               device: str = "cpu") -> nn.Module:
    """Verify and load one block file: an eval-mode TorchScript module (``.pt``)
    or the module of a ``torch.export`` program (``.pt2``); see :func:`open_block`."""
    return open_block(repo, relpath, device)[0]


def _load_program(path: Path, dev: torch.device, entry: dict | None, data: bytes | None = None,
                  repo: str | os.PathLike | None = None) -> nn.Module:
    """A ``.pt2`` file (or the bytes read from it) as a callable module on ``dev`` (no torch.jit involved)."""
    try:
        program = torch.export.load(io.BytesIO(data) if data is not None else str(path))
    except Exception as exc:  # the loader raises RuntimeError/ValueError/KeyError/...
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BlockFileError(
            f"block file {path} is not a loadable torch.export program ({reason}); "
            f"{remake_hint(path, repo)}", path) from exc
    mod = program.module()
    if dev.type != "cpu":
        mod = mod.to(dev)
    log.debug("loaded %s on %s (%s)", path, dev,
              "unlisted" if entry is None else f"sha256 {entry['sha256'][:12]} ok")
    return mod


def open_block(repo: str | os.PathLike, model: str | list[str], device: str = "cpu",
               verified: dict | None = None) -> tuple[torch.nn.Module, dict | None]:
    """Read each block file once, check it against its manifest and load it from those bytes:
    ``(module, manifest entry of the first file or None)``.

    ``model`` is one file or a list of files run in sequence (a fused block: one module that
    chains them, so the block process serves it as it serves one file).
    ``verified`` maps a file to ``{"sha256", "signature"}`` from whoever already hashed that
    version of it (the manager does, once per change of the file): when the opened file still
    has that signature its bytes are not hashed again. Otherwise they are, here, once; what is
    loaded is always the bytes that were checked (no second read between check and load).
    """
    files = [model] if isinstance(model, str) else list(model)
    if not files:
        raise BlockFileError("a fused block needs at least one model file")
    loaded = [_open_one(repo, f, device, (verified or {}).get(f)) for f in files]
    if len(loaded) == 1:
        return loaded[0]
    return Chain(*[m for m, _ in loaded]).eval(), loaded[0][1]


class Chain(torch.nn.Sequential):
    """The files of a fused block run in turn, where one file's output may be several tensors
    (a tuple or dict: tensormq/bundle.py) that the next takes as its arguments."""

    def forward(self, *args, **kwargs):
        modules = iter(self)
        x = next(modules)(*args, **kwargs)
        for module in modules:
            x = bundle.call(module, x)
        return x


def _open_one(repo, relpath: str, device: str, verified: dict | None):
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"cannot load {relpath} on {device}: CUDA is not available")
    path = resolve(repo, relpath)
    entry = verify_block(repo, relpath, hash_file=False)
    with open(path, "rb") as fh:
        signature = file_signature(os.fstat(fh.fileno()))
        data = fh.read()
    if entry is not None:
        expected = str(entry.get("sha256", ""))
        if not (verified and verified.get("signature") == signature and verified.get("sha256") == expected):
            check_digest(path, hashlib.sha256(data).hexdigest(), expected, repo)
    return load_bytes(path, data, dev, entry, repo), entry


def load_bytes(path: Path, data: bytes, dev: torch.device, entry: dict | None = None,
               repo: str | os.PathLike | None = None) -> nn.Module:
    """The module in ``data``, the bytes of block file ``path``: a ``.pt2`` program's module or
    an eval-mode TorchScript module, on ``dev``; a :class:`BlockFileError` when it is neither
    (saying how to make it again; ``repo``, the repository as the user named it, for its paths)."""
    if path.suffix == SUFFIX["export"]:
        return _load_program(path, dev, entry, data, repo)
    _quiet_jit_deprecation()  # TorchScript is deprecated upstream, still a format BlockFlow serves
    try:
        mod = torch.jit.load(io.BytesIO(data), map_location=dev)
    except Exception as exc:  # the loader raises RuntimeError/ValueError/...
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BlockFileError(
            f"block file {path} is not a loadable TorchScript file ({reason}); "
            f"{remake_hint(path, repo)}", path) from exc
    return mod.eval()


def list_blocks(repo: str | os.PathLike) -> list[dict[str, Any]]:
    """Every ``*.pt`` under ``repo``: ``{"path": relative posix path, "size":
    bytes, "entry": manifest entry or None}``, sorted by path.  Does not hash
    the files (cheap enough for a status endpoint); use :func:`verify_block`."""
    root = Path(repo).resolve()
    if not root.is_dir():
        return []
    manifests: dict[Path, dict] = {}
    out = []
    for path in sorted([*root.rglob("*.pt"), *root.rglob("*.pt2")]):
        if not path.is_file():
            continue
        if path.parent not in manifests:
            mpath = path.parent / MANIFEST
            try:
                manifests[path.parent] = read_manifest(mpath) if mpath.exists() else {}
            except BlockFileError as exc:
                log.warning("%s", exc)
                manifests[path.parent] = {}
        entry = manifests[path.parent].get("blocks", {}).get(path.name)
        out.append({"path": path.relative_to(root).as_posix(),
                    "size": path.stat().st_size, "entry": entry})
    return out


