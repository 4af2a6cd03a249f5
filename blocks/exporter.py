"""The caller's side of an export: ``blockflow export`` checks the request here, then runs the
export worker in a fresh interpreter and relays its logs and progress.

Nothing here imports torch: the worker imports it once (with ``PYTHONHASHSEED=0``, see
:mod:`blockflow.blocks.repository` on why exports run in a child process), and the command that
starts it does not import it a second time, about 2.5 s of CPU before the worker even starts
on a 2-core machine. What the worker runs lives beside the models it builds:
:mod:`blockflow.blocks.repository` (torchvision ResNets) and :mod:`blockflow.blocks.split`
(any model, cut at named layers); both re-export the names defined here.
"""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from blockflow.blocks.verify import RESNET_SPLITS, RESNETS
from blockflow.core.header import TENSOR_DTYPES

if TYPE_CHECKING:
    import torch
    from torch import nn

log = logging.getLogger("blockflow.blocks.repository")  # the name export logs were always under

MODELS = RESNETS
METHODS = ("script", "trace")
#: File formats: TorchScript archives (``.pt``) or torch.export programs (``.pt2``).
FORMATS = ("torchscript", "export")
SPLITS = RESNET_SPLITS
FULL = "full"
INPUT_SHAPE = (3, 224, 224)

#: Block names produced by :func:`split_model` for each ``blocks`` value, known
#: statically so arguments can be validated without building a model.
BLOCK_NAMES: dict[int, tuple[str, ...]] = {
    4: ("block1", "block2", "block3", "block4", "head"),
    2: ("block12", "block34", "head"),
    1: (),
}

_VARIANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_]*$")


# -- checking a request

def check_model(model: str) -> None:
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}")


def check_variants(variants: dict[str, list[str]], blocks: int) -> dict[str, list[str]]:
    """Validate variant names and their block lists up front (a ValueError
    here is nicer than a failure half-way through writing files)."""
    allowed = set(BLOCK_NAMES[blocks]) | {FULL}
    clean: dict[str, list[str]] = {}
    for name in sorted(variants):
        if not isinstance(name, str) or not _VARIANT_RE.fullmatch(name):
            raise ValueError(
                f"variant name {name!r} must match {_VARIANT_RE.pattern} "
                "(it becomes part of a file name)"
            )
        names = variants[name]
        if isinstance(names, str):
            names = [n for n in names.split(",") if n]
        unknown = sorted(set(names) - allowed)
        if unknown:
            raise ValueError(
                f"variant {name!r}: unknown block(s) {', '.join(unknown)} for "
                f"blocks={blocks}; known: {', '.join(sorted(allowed))}"
            )
        # keep split order, drop duplicates
        order = list(BLOCK_NAMES[blocks]) + [FULL]
        clean[name] = [b for b in order if b in set(names)]
    return clean




_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
DEFAULT_DIM_BOUNDS = (1, 4096)
_DECL_RE = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*):(?P<dtype>[a-z0-9]+):(?P<dims>[^:]+)"
                      r"(?::(?P<low>-?\d+)\.\.(?P<high>-?\d+))?$")
_DIM_RE = re.compile(r"^(?:(?P<size>\d+)|(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:=(?P<low>\d+)\.\.(?P<high>\d+))?)$")


@dataclass(frozen=True)
class InputDecl:
    """One model input as ``--input name:dtype:dims[:low..high]`` declares it: its keyword
    name, dtype, dimensions (an int, or the name of a dynamic dimension with its bounds, e.g.
    ``N`` the batch, ``S=2..128``) and, for an integer input, the range its trace example is
    drawn from (inclusive; default: ``0`` to the smallest ``nn.Embedding`` size - 1, token ids
    in range)."""
    name: str
    dtype: str
    dims: tuple  # int | (name, low, high)
    low: int | None = None
    high: int | None = None

    @classmethod
    def parse(cls, text: str) -> "InputDecl":
        m = _DECL_RE.fullmatch(text.strip())
        dtype = m and m["dtype"]
        if not m or dtype not in TENSOR_DTYPES:
            raise ValueError(f"--input {text!r}: give name:dtype:dims[:low..high], e.g. input_ids:int64:N,S=2..128 "
                             f"or attention_mask:int64:N,S:0..1 (dtype one of {', '.join(TENSOR_DTYPES)})")
        dims = []
        for part in m["dims"].split(","):
            d = _DIM_RE.fullmatch(part.strip())
            if not d or (d["size"] and int(d["size"]) < 1) or (d["low"] and not 1 <= int(d["low"]) <= int(d["high"])):
                raise ValueError(f"--input {text!r}: dimension {part!r} is neither a positive size nor a "
                                 "dynamic one (a name, e.g. N or S=2..128 with 1 <= low <= high)")
            if d["size"]:
                dims.append(int(d["size"]))
            else:
                dims.append((d["name"], *((int(d["low"]), int(d["high"])) if d["low"] else (None, None))))
        low = high = None
        if m["low"] is not None:
            low, high = int(m["low"]), int(m["high"])
            if low > high or dtype.startswith("float") or dtype == "bfloat16":
                raise ValueError(f"--input {text!r}: a value range low..high (low <= high) is for integer inputs")
        return cls(m["name"], dtype, tuple(dims), low, high)

    @staticmethod
    def bind(decls: list["InputDecl"]) -> list["InputDecl"]:
        """``decls`` with every dynamic dimension's bounds as declared once (``S=2..128`` in one
        input, ``S`` in another), :data:`DEFAULT_DIM_BOUNDS` where never; refused when an input
        is declared twice or a dimension with two bounds."""
        if len({d.name for d in decls}) != len(decls):
            raise ValueError(f"--input names {', '.join(d.name for d in decls)}: declare each input once")
        bounds: dict[str, tuple] = {}
        for decl in decls:
            for dim in decl.dims:
                if not isinstance(dim, int) and dim[1] is not None:
                    if bounds.setdefault(dim[0], dim[1:]) != dim[1:]:
                        raise ValueError(f"--input: dimension {dim[0]} is given bounds {bounds[dim[0]][0]}.."
                                         f"{bounds[dim[0]][1]} and {dim[1]}..{dim[2]}; give them once")
        return [InputDecl(d.name, d.dtype, tuple(dim if isinstance(dim, int) else
                                                 (dim[0], *bounds.get(dim[0], DEFAULT_DIM_BOUNDS)) for dim in d.dims),
                          d.low, d.high) for d in decls]

    def example_shape(self) -> list[int]:
        """The shape traced with: a dynamic dimension at 2 (torch.export specialises 0 and 1)
        or within its bounds, a fixed one as declared."""
        return [d if isinstance(d, int) else max(d[1], min(d[2], 2 if i == 0 else 8)) for i, d in enumerate(self.dims)]

    def example(self, net: "nn.Module", gen: "torch.Generator") -> "torch.Tensor":
        import torch
        from torch import nn
        shape, dtype = self.example_shape(), getattr(torch, self.dtype)
        if dtype.is_floating_point:
            return torch.randn(shape, generator=gen).to(dtype)
        if dtype == torch.bool:
            return torch.randint(0, 2, shape, generator=gen).bool()
        if self.low is not None:
            low, high = self.low, self.high
        else:
            sizes = [m.num_embeddings for m in net.modules() if isinstance(m, nn.Embedding)]
            low, high = 0, (min(sizes) - 1 if sizes else 1)
        return torch.randint(low, high + 1, shape, generator=gen, dtype=dtype)


# -- running the worker

def export_model(
    model: str,
    out: str | os.PathLike,
    blocks: int = 4,
    method: str = "script",
    variants: dict[str, list[str]] | None = None,
    seed: int = 0,
    batch: int = 1,
    fmt: str = "torchscript",
) -> Path:
    """Export ``model`` split into ``blocks`` blocks plus ``full.pt`` into
    ``out/<model>/`` and merge their entries into ``manifest.json``.

    ``method``: ``"script"`` (``torch.jit.script``) or ``"trace"``
    (``torch.jit.trace`` on a seeded ``(batch, 3, 224, 224)`` input).
    ``variants``: ``{"x": ["block4", "head"]}`` also exports differently seeded
    copies of those blocks as ``block4-x.pt``/``head-x.pt``.
    ``fmt``: ``"torchscript"`` (``.pt`` files, ``method`` applies) or ``"export"``
    (``torch.export`` programs, ``.pt2`` files, with a dynamic batch dimension).

    The work runs in a fresh interpreter with a fixed hash seed so the files
    are byte-for-byte repeatable (see :mod:`blockflow.blocks.repository`).  Returns the
    manifest path.
    """
    check_model(model)
    if blocks not in SPLITS:
        raise ValueError(f"blocks must be one of {SPLITS}, got {blocks!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an int, got {seed!r}")
    variants = check_variants(variants or {}, blocks)

    out_dir = Path(out).resolve()
    args = dict(model=model, out=str(out_dir), blocks=blocks, method=method,
                variants=variants, seed=seed, batch=batch, fmt=fmt)
    log.info("exporting %s (blocks=%d, %s, variants=%s, seed=%d) to %s", model, blocks,
             f"method={method}" if fmt == "torchscript" else "torch.export", variants or "none", seed, out_dir / model)
    total = 1 + len(BLOCK_NAMES[blocks]) + sum(len(v) for v in variants.values())
    # Load repository.py by its path in the child (not "import blocks.repository"): the
    # child must not depend on sys.path/cwd, and -P keeps cwd off sys.path.
    worker = str(Path(__file__).with_name("repository.py").resolve())
    code = (
        "import importlib.util as u, sys\n"
        f"s = u.spec_from_file_location('_blockflow_export_worker', {worker!r})\n"
        "m = u.module_from_spec(s); s.loader.exec_module(m)\n"
        "m._export_worker(sys.argv[1])\n"
    )
    result = run_export_worker(code, args, total, f"export {model} ({fmt})", f"{model} to {out_dir / model}")
    return Path(result["manifest"])


def run_export_worker(code: str, args: dict, total: int, label: str, what: str) -> dict:
    """Run ``python -P -c code json(args)`` in a fresh interpreter with ``PYTHONHASHSEED=0``
    (see :mod:`blockflow.blocks.repository`), relay its log records, count its progress records on a bar of
    ``total`` files, and return the JSON object its last stdout line holds.

    A result ``{"error": message}`` (a mistake in the request the worker found, such as a cut
    that does not exist) is raised here as a ``ValueError`` with that one-line message; any
    other failure is a ``RuntimeError`` with the tail of the worker's output.
    """
    args = dict(args, log_level=log.getEffectiveLevel())
    env = dict(os.environ, PYTHONHASHSEED="0")
    bar = progress(total, label)
    proc = subprocess.Popen(
        [sys.executable, "-P", "-c", code, json.dumps(args)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    lines = []
    for line in proc.stderr:  # the worker's log records as they come: one progress record per file
        if line.startswith('{"blockflow_progress"'):
            bar.update()
        else:
            lines.append(line)
    stdout = proc.stdout.read()
    proc.wait()
    bar.close()
    proc.stdout.close()
    proc.stderr.close()
    raw = relay_child_logs("".join(lines))
    try:
        result = json.loads(stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        result = None
    if isinstance(result, dict) and isinstance(result.get("error"), str):
        raise ValueError(result["error"])
    if proc.returncode != 0:
        tail = "\n".join(raw[-20:]) or "(no output)"
        raise RuntimeError(
            f"export of {what} failed in the export "
            f"worker (exit {proc.returncode}):\n{tail}"
        )
    if not isinstance(result, dict):
        raise RuntimeError(
            f"export worker for {what} returned no result; "
            f"stdout: {stdout[-500:]!r}"
        )
    return result


def export_split(model: str, out: str | os.PathLike, cuts: list[str] | None = None,
                 blocks: int | None = None, input_shape: tuple[int, ...] = (1, *INPUT_SHAPE),
                 name: str | None = None, fmt: str = "torchscript", method: str = "script",
                 seed: int = 0, inputs: list[str] | None = None) -> dict:
    """Split ``model`` (see :func:`build_model`) at ``cuts``, or at ``blocks - 1`` balanced
    cuts, and write ``out/<name>/block1..blockK`` plus ``full`` with their manifest.
    ``inputs`` (``--input name:dtype:dims``, see :class:`InputDecl`) declares the model's
    inputs and splits the graph ``torch.export`` makes; without them the model takes one
    float32 tensor of ``input_shape`` and is traced by ``torch.fx``, falling back to
    ``torch.export`` where ``torch.fx`` cannot trace it.

    Runs in a fresh interpreter (as :func:`blockflow.blocks.repository.export_model` does).
    Returns ``{"manifest": path, "name": name, "cuts": [the cuts made]}``; a cut that does
    not exist or cannot be made raises a ``ValueError`` naming it."""
    if bool(cuts) == bool(blocks):
        raise ValueError("give either cuts (--cut LAYER ...) or a number of blocks (--blocks N)")
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if len(input_shape) < 1 or any(not isinstance(d, int) or d < 1 for d in input_shape):
        raise ValueError(f"input shape must be positive integers, got {input_shape!r}")
    if name is not None and not _NAME_RE.fullmatch(name):
        raise ValueError(f"--name {name!r} must match {_NAME_RE.pattern} (it names a directory)")
    InputDecl.bind([InputDecl.parse(text) for text in inputs or []])  # refused here, before the worker starts
    args = dict(model=model, out=str(Path(out).resolve()), cuts=list(cuts or []), blocks=blocks,
                input_shape=list(input_shape), name=name, fmt=fmt, method=method, seed=seed,
                inputs=list(inputs or []))
    code = ("import sys\nfrom blockflow.blocks import split\n"
            "split.worker_main(sys.argv[1], split._export_in_process)\n")
    total = (len(cuts) + 2) if cuts else (blocks + 1)
    return run_export_worker(code, args, total, f"export {model} ({fmt})", f"{model} to {out}")


def relay_child_logs(stderr: str) -> list[str]:
    """Re-emit the worker's JSON log records through this process's logging
    (so the caller's handlers/levels apply); return the non-log lines
    (tracebacks, stray warnings) for error messages."""
    raw = []
    for line in stderr.splitlines():
        rec = None
        if line.startswith("{"):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                rec = None
        if isinstance(rec, dict) and "blockflow_log" in rec:
            # under the worker's logger name (split, manifest...), so the caller's per-logger levels apply
            source = rec.get("logger") if isinstance(rec.get("logger"), str) else log.name
            logging.getLogger(source).log(int(rec.get("level", logging.INFO)), "%s", rec["blockflow_log"])
        elif line.strip():
            raw.append(line)
    for line in raw:
        log.debug("export worker: %s", line)
    return raw


class _JsonLineHandler(logging.Handler):
    """Worker-side handler: one JSON object per record on stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = json.dumps({"blockflow_log": record.getMessage(), "level": record.levelno,
                              "logger": record.name})
            sys.stderr.write(msg + "\n")
            sys.stderr.flush()
        except Exception:  # pragma: no cover - logging must never raise
            self.handleError(record)


def worker_main(argv_json: str, fn) -> None:
    """Run ``fn(**args)`` in an export child (see :func:`run_export_worker`): log records go
    of every ``blockflow.*`` logger
    go to stderr as JSON lines, the JSON result to stdout.  A ``ValueError`` (the request is
    wrong, not the code) is reported as ``{"error": message}`` and exit status 2."""
    args = json.loads(argv_json)
    level = int(args.pop("log_level"))
    root = logging.getLogger("blockflow")  # every blockflow.* logger of the worker propagates to it
    root.handlers[:] = [_JsonLineHandler()]
    root.setLevel(level)
    root.propagate = False
    try:
        result = fn(**args)
    except ValueError as exc:
        sys.stdout.write(json.dumps({"error": str(exc)}) + "\n")
        sys.stdout.flush()
        sys.exit(2)
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


def progress(total: int, label: str):
    """A tqdm bar of files written, on stderr when it is a terminal (exports take minutes)."""
    from tqdm import tqdm
    return tqdm(total=total, desc=label, unit="file", disable=not sys.stderr.isatty(), leave=False)
