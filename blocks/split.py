"""Split any PyTorch model into blocks at named submodules, and export them.

``blockflow export --model NAME_OR_CALLABLE --cut LAYER ...`` lands here.  The model is
traced once with ``torch.fx.symbolic_trace`` into a flat graph whose nodes are in program
order; each node remembers the submodules it ran inside (``node.meta["nn_module_stack"]``).
A cut ``features.3`` is the position of the *last* node that ran inside ``features.3``;
the model is split just after it.  Nothing here knows a model family: a ResNet, a
MobileNet or a user's own module are cut the same way.

What crosses a cut::

    block1: x -> n1 -> n2 -> n3 |cut| n4 -> n5 -> out      block2
                   \\___________|___________/
                                 a value made before the cut and used after it

Every value made at or before the cut and used after it crosses the cut (parameters and
buffers do not: each block reads its own copy of the attribute).  A hop carries one tensor
today, so a cut crossed by exactly one tensor is accepted; a cut crossed by more (a skip
connection that jumps over it) is refused, naming the cut and the values that cross it.

The blocks are ``torch.fx.GraphModule`` copies of their slice of the graph, sharing the
model's parameters; chaining them is, node for node, the traced model.  ``full`` is the
traced model itself.  Files and manifest are written as for ResNet exports
(:mod:`blockflow.blocks.repository`), in a fresh interpreter with ``PYTHONHASHSEED=0`` so
that the same request gives the same bytes.
"""
from __future__ import annotations

import difflib
import hashlib
import importlib
import logging
import os
import re
import sys
import time
from pathlib import Path

import torch
from torch import fx, nn

from . import repository as repo

log = logging.getLogger("blockflow.blocks.split")

#: How many times each node is timed when ``--blocks N`` balances the blocks (after two warm-ups).
TIMING_REPEATS = 5
#: Largest difference the export accepts between the chained blocks and the whole model (fp32).
CHAIN_TOLERANCE = 1e-4
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_BLOCK_RE = re.compile(r"^block\d+$")


class CutError(ValueError):
    """A cut that does not exist or cannot be made; the message is one line naming it."""


# --------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------


def build_model(spec: str, seed: int = 0) -> tuple[nn.Module, str]:
    """``(model in eval mode, default name)`` for ``spec``: a torchvision classification model
    name (seeded weights, nothing downloaded) or ``package.module:callable`` returning an
    ``nn.Module``.  The callable is imported with the current directory on ``sys.path`` (as
    ``python -m`` would) and called with no arguments after ``torch.manual_seed(seed)``."""
    if ":" in spec:
        return _from_callable(spec, seed), spec.rsplit(":", 1)[1].rsplit(".", 1)[-1]
    return _from_torchvision(spec, seed), spec


def torchvision_models() -> list[str]:
    """Names of torchvision's classification models."""
    import torchvision  # lazy: block servers never need it
    return sorted(torchvision.models.list_models(module=torchvision.models))


def _from_torchvision(name: str, seed: int) -> nn.Module:
    import torchvision
    known = torchvision_models()
    if name not in known:
        near = difflib.get_close_matches(name, known, n=5, cutoff=0.5)
        raise ValueError(f"--model {name!r} is neither a torchvision classification model nor "
                         f"package.module:callable; did you mean {', '.join(near) or 'resnet50'}?")
    torch.manual_seed(seed)
    return torchvision.models.get_model(name, weights=None).eval()


def _from_callable(spec: str, seed: int) -> nn.Module:
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--model {spec}: cannot import {module_name!r} ({exc}); run from the "
                         "directory that holds it or put it on PYTHONPATH") from None
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ValueError(f"--model {spec}: {module_name} has no {attr!r}")
    if not callable(obj):
        raise ValueError(f"--model {spec}: {attr!r} is not callable; give a function or class "
                         "that returns an nn.Module")
    torch.manual_seed(seed)
    net = obj()
    if not isinstance(net, nn.Module):
        raise ValueError(f"--model {spec}: {attr}() returned {type(net).__name__}, not an "
                         "nn.Module; it must return the model to split")
    return net.eval()


def trace(net: nn.Module) -> fx.GraphModule:
    """The model as one flat ``torch.fx`` graph (program order), taking one tensor."""
    try:
        gm = fx.symbolic_trace(net)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"torch.fx cannot trace {type(net).__name__} ({first}); a model with "
                         "data-dependent control flow cannot be split at named cuts") from None
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(inputs) != 1:
        raise ValueError(f"{type(net).__name__}.forward takes {len(inputs)} inputs; only models "
                         "that take one tensor can be split")
    return gm.eval()


# --------------------------------------------------------------------------
# Cuts
# --------------------------------------------------------------------------


def _node_modules(node: fx.Node) -> set[str]:
    """Qualified names of the submodules ``node`` ran inside (leaf modules included)."""
    names = {path for path, _ in node.meta.get("nn_module_stack", {}).values()}
    if node.op == "call_module":
        parts = node.target.split(".")
        names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return names


def cut_positions(gm: fx.GraphModule) -> dict[str, int]:
    """Each submodule that runs in ``forward`` -> index of its last node in program order."""
    last: dict[str, int] = {}
    for i, node in enumerate(gm.graph.nodes):
        for name in _node_modules(node):
            last[name] = i
    return last


def crossing(gm: fx.GraphModule, pos: int) -> list[fx.Node]:
    """Values made at or before node ``pos`` and used after it (attributes excluded)."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    return [n for n in gm.graph.nodes
            if index[n] <= pos and n.op != "get_attr" and any(index[u] > pos for u in n.users)]


def _last_op(gm: fx.GraphModule) -> int:
    """Index of the last node that computes something (the one before ``output``)."""
    return len(gm.graph.nodes) - 2


def valid_cuts(gm: fx.GraphModule) -> dict[str, int]:
    """Every submodule after which the model can be cut (one tensor crosses, something is
    left after it) -> its position."""
    end = _last_op(gm)
    return {name: pos for name, pos in cut_positions(gm).items()
            if pos < end and len(crossing(gm, pos)) == 1}


def outermost(cuts: dict[str, int]) -> list[str]:
    """One name per position (the outermost, e.g. ``features.3`` over ``features.3.block``),
    in program order."""
    best: dict[int, str] = {}
    for name, pos in cuts.items():
        if pos not in best or (name.count("."), name) < (best[pos].count("."), best[pos]):
            best[pos] = name
    return [best[p] for p in sorted(best)]


def resolve_cuts(gm: fx.GraphModule, cuts: list[str], model: str) -> list[int]:
    """Positions of ``cuts`` in program order; :class:`CutError` names the first bad one."""
    positions = cut_positions(gm)
    valid = valid_cuts(gm)
    seen: dict[int, str] = {}
    for cut in cuts:
        if cut not in positions:
            raise CutError(f"cut {cut!r}: {model} has no submodule of that name that runs in "
                           f"forward; nearby: {_nearby_names(cut, valid)}")
        pos = positions[cut]
        if pos >= _last_op(gm):
            raise CutError(f"cut {cut!r}: it ends {model}, so no block would be left after it; "
                           f"cut earlier, nearby: {_nearby_positions(pos, valid)}")
        values = crossing(gm, pos)
        if len(values) != 1:
            raise CutError(f"cut {cut!r}: {len(values)} tensors cross it "
                           f"({', '.join(_describe(n) for n in values)}); multi-tensor hops are not "
                           f"supported yet; nearby single-tensor cuts: {_nearby_positions(pos, valid)}")
        if pos in seen:
            raise CutError(f"cut {cut!r} is the same place as cut {seen[pos]!r}; give each place once")
        seen[pos] = cut
    return sorted(seen)


def _describe(node: fx.Node) -> str:
    """A value as a user knows it: the output of a submodule, the model's input, or an
    operation inside the innermost submodule it ran in."""
    if node.op == "call_module":
        return f"output of {node.target}"
    if node.op == "placeholder":
        return f"the input {node.name}"
    stack = [path for path, _ in node.meta.get("nn_module_stack", {}).values()]
    return f"{node.name} in {stack[-1]}" if stack else node.name


def _nearby_names(cut: str, valid: dict[str, int]) -> str:
    """Valid cuts whose names look like ``cut`` (siblings first), at most six."""
    parent = cut.rpartition(".")[0]
    siblings = [n for n in outermost(valid) if parent and n.rpartition(".")[0] == parent]
    near = difflib.get_close_matches(cut, list(valid), n=6, cutoff=0.6)
    names = list(dict.fromkeys(near + siblings))[:6] or outermost(valid)[:6]
    return ", ".join(names) or "(none: this model cannot be cut)"


def _nearby_positions(pos: int, valid: dict[str, int]) -> str:
    """The valid cuts closest to position ``pos`` in program order (two before, two after)."""
    names = outermost(valid)
    before = [n for n in names if valid[n] < pos][-2:]
    after = [n for n in names if valid[n] > pos][:2]
    return ", ".join(before + after) or "(none: this model cannot be cut)"


# --------------------------------------------------------------------------
# Blocks
# --------------------------------------------------------------------------


def split(gm: fx.GraphModule, positions: list[int]) -> list[fx.GraphModule]:
    """The blocks between ``positions`` (from :func:`resolve_cuts`): ``len(positions) + 1``
    graph modules that share ``gm``'s parameters and, chained, compute ``gm``."""
    nodes = list(gm.graph.nodes)
    bounds = [-1, *positions, len(nodes) - 1]
    blocks = []
    for start, stop in zip(bounds, bounds[1:]):
        inp = nodes[0] if start < 0 else crossing(gm, start)[0]
        body = nodes[start + 1:stop + 1]
        out = nodes[-1].args[0] if stop == len(nodes) - 1 else crossing(gm, stop)[0]
        blocks.append(_block(gm, inp, body, out))
    return blocks


def _block(gm: fx.GraphModule, inp: fx.Node, body: list[fx.Node], out) -> fx.GraphModule:
    """A graph module taking ``inp`` that runs ``body`` and returns ``out``.  Attributes
    (``get_attr``) are copied where they are first used, so no block needs another's."""
    g = fx.Graph()
    env = {inp: g.placeholder(inp.name)}

    def lookup(node: fx.Node) -> fx.Node:
        if node not in env:
            if node.op != "get_attr":
                raise RuntimeError(f"{node.name} crosses a cut the splitter accepted")  # a bug
            env[node] = g.get_attr(node.target)
        return env[node]

    for node in body:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        env[node] = g.node_copy(node, lookup)
    g.output(fx.map_arg(out, lookup))
    block = fx.GraphModule(gm, g)
    return block.eval()


def chain(blocks: list[nn.Module], x: torch.Tensor) -> list[torch.Tensor]:
    """Run ``x`` through ``blocks`` in turn: every block's output, each checked to be one
    tensor (a block handing on anything else cannot be served by a one-tensor hop)."""
    outs = []
    with torch.no_grad():
        for i, block in enumerate(blocks, 1):
            x = block(x)
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"block{i} returns {type(x).__name__}, not one tensor; models "
                                 "with several outputs are not supported yet")
            outs.append(x)
    return outs


# --------------------------------------------------------------------------
# Balancing --blocks N
# --------------------------------------------------------------------------


class _NodeTimer(fx.Interpreter):
    """Runs the graph node by node, keeping each node's shortest wall time in ``times``."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.times = [float("inf")] * len(gm.graph.nodes)
        self.index = {n: i for i, n in enumerate(gm.graph.nodes)}

    def run_node(self, n: fx.Node):
        t0 = time.perf_counter()
        result = super().run_node(n)
        i = self.index[n]
        self.times[i] = min(self.times[i], time.perf_counter() - t0)
        return result


def node_times(gm: fx.GraphModule, example: torch.Tensor, repeats: int = TIMING_REPEATS) -> list[float]:
    """Shortest wall time of each node over ``repeats`` runs after two warm-up runs, on one
    thread (as a block served with ``"threads": 1`` runs).  The minimum, not the mean: on a
    shared machine one preempted run would otherwise move the cuts."""
    timer = _NodeTimer(gm)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            for _ in range(2):
                timer.run(example)
            timer.times = [float("inf")] * len(timer.times)
            for _ in range(repeats):
                timer.run(example)
    finally:
        torch.set_num_threads(threads)
    return timer.times


def balance(gm: fx.GraphModule, blocks: int, example: torch.Tensor) -> list[str]:
    """``blocks - 1`` cut names, among :func:`valid_cuts`, that make the slowest block as
    fast as possible by the measured node times (dynamic programming over the cut places)."""
    if blocks < 1:
        raise ValueError(f"--blocks must be at least 1, got {blocks}")
    valid = valid_cuts(gm)
    names = outermost(valid)
    if blocks - 1 > len(names):
        raise ValueError(f"--blocks {blocks}: this model has only {len(names)} single-tensor cut "
                         f"places, so at most {len(names) + 1} blocks")
    times = node_times(gm, example)
    cum = [0.0]
    for t in times:
        cum.append(cum[-1] + t)
    # a block ends after node p; places: the valid cuts, then the end of the graph
    ends = [valid[n] + 1 for n in names] + [len(times)]
    return [names[i] for i in _min_max_partition(cum, ends, blocks)]


def _min_max_partition(cum: list[float], ends: list[int], blocks: int) -> list[int]:
    """Indices into ``ends`` (the last one excluded) of ``blocks - 1`` block ends that
    minimise the largest block time; ``cum[e]`` is the time of all nodes before end ``e``."""
    n = len(ends)
    inf = float("inf")
    # best[k][j]: the smallest possible largest block when k blocks end exactly at ends[j]
    best = [[inf] * n for _ in range(blocks + 1)]
    back = [[-1] * n for _ in range(blocks + 1)]
    for j in range(n):
        best[1][j] = cum[ends[j]]
    for k in range(2, blocks + 1):
        for j in range(n):
            for i in range(j):
                cost = max(best[k - 1][i], cum[ends[j]] - cum[ends[i]])
                if cost < best[k][j]:
                    best[k][j], back[k][j] = cost, i
    picks, j = [], n - 1
    for k in range(blocks, 1, -1):
        j = back[k][j]
        picks.append(j)
    return sorted(picks)


# --------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------


def export_split(model: str, out: str | os.PathLike, cuts: list[str] | None = None,
                 blocks: int | None = None, input_shape: tuple[int, ...] = (1, *repo.INPUT_SHAPE),
                 name: str | None = None, fmt: str = "torchscript", method: str = "script",
                 seed: int = 0) -> dict:
    """Split ``model`` (see :func:`build_model`) at ``cuts``, or at ``blocks - 1`` balanced
    cuts, and write ``out/<name>/block1..blockK`` plus ``full`` with their manifest.

    Runs in a fresh interpreter (as :func:`blockflow.blocks.repository.export_model` does).
    Returns ``{"manifest": path, "name": name, "cuts": [the cuts made]}``; a cut that does
    not exist or cannot be made raises a ``ValueError`` naming it."""
    if bool(cuts) == bool(blocks):
        raise ValueError("give either cuts (--cut LAYER ...) or a number of blocks (--blocks N)")
    if fmt not in repo.FORMATS:
        raise ValueError(f"fmt must be one of {repo.FORMATS}, got {fmt!r}")
    if method not in repo.METHODS:
        raise ValueError(f"method must be one of {repo.METHODS}, got {method!r}")
    if len(input_shape) < 1 or any(not isinstance(d, int) or d < 1 for d in input_shape):
        raise ValueError(f"input shape must be positive integers, got {input_shape!r}")
    if name is not None and not _NAME_RE.fullmatch(name):
        raise ValueError(f"--name {name!r} must match {_NAME_RE.pattern} (it names a directory)")
    args = dict(model=model, out=str(Path(out).resolve()), cuts=list(cuts or []), blocks=blocks,
                input_shape=list(input_shape), name=name, fmt=fmt, method=method, seed=seed)
    code = ("import sys\nfrom blockflow.blocks import split\n"
            "split.repo.worker_main(sys.argv[1], split._export_in_process, split.log)\n")
    total = (len(cuts) + 2) if cuts else (blocks + 1)
    return repo.run_export_worker(code, args, total, f"export {model} ({fmt})", f"{model} to {out}")


def _export_in_process(model: str, out: str, cuts: list[str], blocks: int | None,
                       input_shape: list[int], name: str | None, fmt: str, method: str,
                       seed: int) -> dict:
    """The work of :func:`export_split`, in the export child (which runs in the caller's
    current directory, so a callable is imported from there as it would be in the caller)."""
    net, default_name = build_model(model, seed)
    name = name or default_name
    gm = trace(net)
    example = torch.randn(*input_shape, generator=torch.Generator().manual_seed(seed))
    if not cuts:
        cuts = balance(gm, blocks, example)
        log.info("balanced cuts for %d blocks of %s: %s", blocks, name, " ".join(cuts) or "(none)")
    positions = resolve_cuts(gm, cuts, model)
    ordered = [next(c for c in cuts if cut_positions(gm)[c] == p) for p in positions]
    parts = split(gm, positions)
    outs = chain(parts, example)
    with torch.no_grad():
        want = gm(example)
    diff = (outs[-1] - want).abs().max().item()
    if diff > CHAIN_TOLERANCE:
        raise RuntimeError(f"the chained blocks of {name} differ from the whole model by {diff:g}")
    log.info("chained blocks of %s equal the whole model (max abs diff %.2g)", name, diff)

    model_dir = Path(out) / name
    model_dir.mkdir(parents=True, exist_ok=True)
    inputs = [example, *outs[:-1]]
    jobs = [(repo.FULL, gm, example, want, None)]
    jobs += [(f"block{i}", mod, x, y, cut) for i, (mod, x, y, cut)
             in enumerate(zip(parts, inputs, outs, [*ordered, None]), 1)]
    entries = {}
    for bname, mod, x, y, cut in jobs:
        fname, entry = _write_block(model_dir, bname, mod, x, y, fmt, method, seed)
        entries[fname] = dict(entry, cut=cut)
    manifest_path = _merge_manifest(model_dir, name, seed, model, ordered, entries)
    return {"manifest": str(manifest_path), "name": name, "cuts": ordered}


def _write_block(model_dir: Path, bname: str, mod: nn.Module, x: torch.Tensor, y: torch.Tensor,
                 fmt: str, method: str, seed: int) -> tuple[str, dict]:
    """Compile ``mod`` to ``model_dir/bname.pt[2]``: its file name and manifest entry (the
    same fields as a ResNet block's)."""
    fname = bname + repo.SUFFIX[fmt]
    try:
        if fmt == "export":
            data = repo.export_program_bytes(mod, x)
        else:
            data = repo.compile_to_bytes(mod, method, x)
    except Exception as exc:  # torch.jit/torch.export raise many kinds; say which block and what to try
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        other = "--method trace or --format export" if fmt == "torchscript" else "--format torchscript"
        raise ValueError(f"{bname}: {'torch.export' if fmt == 'export' else 'torch.jit.' + method} cannot "
                         f"compile it ({first}); try {other}") from exc
    sys.stderr.write('{"blockflow_progress": "%s"}\n' % fname)  # run_export_worker's bar
    sys.stderr.flush()
    digest = hashlib.sha256(data).hexdigest()
    repo.atomic_write(model_dir / fname, data)
    tensors = list(mod.parameters()) + list(mod.buffers())
    log.info("wrote %s (%.1f MB, sha256 %s)", model_dir / fname, len(data) / 1e6, digest[:12])
    return fname, {
        "name": bname, "file": fname, "sha256": digest,
        "input_shape": repo.batch1(x.shape), "output_shape": repo.batch1(y.shape),
        "dtype": "float32", "params": sum(p.numel() for p in mod.parameters()),
        "param_bytes": sum(t.numel() * t.element_size() for t in tensors),
        "method": method if fmt == "torchscript" else "export", "format": fmt,
        "variant": None, "seed": seed,
    }


def _merge_manifest(model_dir: Path, name: str, seed: int, source: str, cuts: list[str],
                    entries: dict) -> Path:
    """Write ``entries`` into the manifest of ``model_dir``.  Blocks of an earlier split that
    this one does not make (block5 when there are now four) are unlisted and deleted: a
    stale block left listed would be served as if it belonged to this split."""
    path = model_dir / repo.MANIFEST
    merged = dict(repo.read_manifest(path).get("blocks", {})) if path.exists() else {}
    for fname, entry in list(merged.items()):
        stale = isinstance(entry, dict) and _BLOCK_RE.fullmatch(str(entry.get("name", "")))
        if stale and fname not in entries:
            del merged[fname]
            (model_dir / fname).unlink(missing_ok=True)
            log.info("removed %s: this split of %s has no %s", model_dir / fname, name, entry["name"])
    merged.update(entries)
    manifest = {"model": name, "seed": seed, "source": source, "cuts": cuts, "blocks": merged}
    repo.atomic_write(path, repo.manifest_bytes(manifest))
    log.info("manifest %s lists %d files", path, len(merged))
    return path
