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
buffers do not: each block reads its own copy of the attribute).  A cut crossed by one tensor
hands that tensor on, as a ResNet block does.  A cut crossed by k > 1 tensors (a skip
connection that jumps over it, a U-Net's encoder outputs) hands on a tuple of the k tensors
in program order (the order of :func:`crossing`): the block before it returns that tuple,
the block after it takes them as k positional arguments.  A value that jumps over a whole
block is one of that block's inputs and, unchanged, one of its outputs.  The last block and
``full`` return what the model returns: a tensor, a tuple of tensors or a dict of tensors.

Only tensors travel, at most :data:`MAX_HOP_TENSORS` per hop, so the model is first run on an
example input (``torch.fx``'s ``ShapeProp``) to learn what each node computes; a cut crossed
by anything else (an int from ``x.size(0)``, a tuple, None) is split on torch.export's graph
where that graph takes it (an int of a shape becomes a size each block recomputes: Note [Which
tracer]), else refused, naming the cut and the value.  A graph traced without an example knows nothing of its values: only cuts one
value crosses are valid there (and the value is checked when the blocks are run).

The blocks are ``torch.fx.GraphModule`` copies of their slice of the graph, sharing the
model's parameters; chaining them is, node for node, the traced model.  ``full`` is the
traced model itself.  Files and manifest are written as for ResNet exports
(:mod:`blockflow.blocks.repository`), in a fresh interpreter with ``PYTHONHASHSEED=0`` so
that the same request gives the same bytes.
"""
from __future__ import annotations

import contextlib
import difflib
import hashlib
import importlib
import io
import logging
import os
import re
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata, _extract_tensor_metadata

from blockflow.tensormq import bundle
from . import repository as repo
# the caller's side of an export (no torch), re-exported: what split's worker runs is below
from .exporter import DEFAULT_DIM_BOUNDS, InputDecl, export_split, worker_main  # noqa: F401

log = logging.getLogger("blockflow.blocks.split")

#: How many times each node is timed when ``--blocks N`` balances the blocks (after two warm-ups).
TIMING_REPEATS = 5
#: Largest difference the export accepts between the chained blocks and the whole model (fp32).
CHAIN_TOLERANCE = 1e-4
#: Most tensors that may cross one cut: the wire's limit on tensors per message (tensormq carries
#: a bundle of 1 to 16 tensors in one message).
MAX_HOP_TENSORS = bundle.MAX_MEMBERS  # what one hop's header carries (tensormq/bundle.py)
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


def check_model_name(spec: str) -> None:
    """ValueError, with the names nearest to it, when ``spec`` is neither ``package.module:callable``
    nor a torchvision classification model (the callable itself is imported later)."""
    if ":" in spec:
        return
    known = torchvision_models()
    if spec not in known:
        near = difflib.get_close_matches(spec, known, n=5, cutoff=0.5)
        raise ValueError(f"--model {spec!r} is neither a torchvision classification model nor "
                         f"package.module:callable; did you mean {', '.join(near) or 'resnet50'}?")


def _from_torchvision(name: str, seed: int) -> nn.Module:
    import torchvision
    check_model_name(name)
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


def trace(net: nn.Module, example: torch.Tensor | None = None) -> fx.GraphModule:
    """The model as one flat ``torch.fx`` graph (program order), taking one tensor.

    With ``example`` (an input of the shape the model will be served at) the graph is run once
    by ``ShapeProp``, so each node that computes a tensor carries ``node.meta["tensor_meta"]``:
    that is what lets a cut where several tensors cross be made, and one where an int or a
    tuple crosses be refused.  Without it only cuts one value crosses are valid."""
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
    gm.eval()
    if example is not None:
        _propagate_shapes(gm, example, type(net).__name__)
    return gm


def _propagate_shapes(gm: fx.GraphModule, example: torch.Tensor, what: str) -> None:
    """Run ``gm`` on ``example`` with ``ShapeProp``: every node records its result's type
    (``meta["type"]``) and, for a tensor, its shape and dtype (``meta["tensor_meta"]``)."""
    printed = io.StringIO()
    try:
        # ShapeProp prints a traceback before it raises; the one line below says it instead
        with torch.no_grad(), contextlib.redirect_stderr(printed):
            ShapeProp(gm).propagate(example)
    except Exception as exc:
        cause = exc.__cause__ or exc
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise ValueError(f"{what} does not run on an input of shape {list(example.shape)} ({first}); "
                         "give the shape it takes with --input-shape") from None


# --------------------------------------------------------------------------
# Inputs as the model takes them, and the torch.export graph
# --------------------------------------------------------------------------

#: Bounds of a dynamic dimension declared without them (``N``, or ``S`` alone).
def export_graph(net: nn.Module, decls: list[InputDecl], example: tuple) -> fx.GraphModule:
    """The model as one flat graph from ``torch.export`` (strict, then non-strict where strict
    fails), taking the declared inputs positionally and returning a tensor, a tuple or a dict
    (a Hugging Face ``ModelOutput`` becomes the dict of its tensors).  Its nodes carry what
    :func:`trace` with an example gives (``nn_module_stack``, ``tensor_meta``, ``type``);
    sizes of dynamic dimensions are nodes of type int that each block recomputes from its own
    inputs (:func:`_block`)."""
    what = type(net).__name__
    named: dict[str, torch.export.Dim] = {}
    dynamic = {d.name: {i: named.setdefault(dim[0], torch.export.Dim(dim[0], min=dim[1], max=dim[2]))
                        for i, dim in enumerate(d.dims) if not isinstance(dim, int)} or None for d in decls}
    kwargs = {d.name: x for d, x in zip(decls, example)}
    errors = []
    for strict in (True, False):
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                program = torch.export.export(net, (), kwargs, dynamic_shapes=dynamic, strict=strict)
            break
        except Exception as exc:  # torch.export raises many kinds; the non-strict try says more
            errors.append(exc)
    else:
        exc = errors[-1]
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"torch.export cannot export {what} on inputs "
                         f"{', '.join(f'{d.name} {d.dtype} {list(x.shape)}' for d, x in zip(decls, example))} "
                         f"({first[:300]}){_model_line(exc)}; check --input (names, dtypes, shapes as "
                         "forward takes them)") from None
    gm = program.module()
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":  # checks of the whole model's inputs
            graph.erase_node(node)
    for node in graph.nodes:
        if node.target is torch.ops.aten.sym_size.int:  # x.size(d): TorchScript cannot call the op itself
            node.op, node.target = "call_method", "size"
        elif isinstance(node.target, torch._ops.OpOverload):  # nor an overload: the packet, resolved by schema
            node.target = node.target.overloadpacket
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            node.meta["tensor_meta"] = _extract_tensor_metadata(val)
            node.meta["type"] = torch.Tensor
        elif isinstance(val, (torch.SymInt, int)):
            node.meta["type"] = int
        elif val is None and node.op == "call_function":
            node.meta["type"] = type(None)
    # each dynamic dimension's symbol (s43) -> its declared name and bounds, for the manifest
    symbols = {}
    for node, decl in zip([n for n in graph.nodes if n.op == "placeholder"], decls):
        for size, dim in zip(node.meta["val"].shape, decl.dims):
            if not isinstance(dim, int):
                symbols[str(size)] = dim
    out = next(n for n in graph.nodes if n.op == "output")
    flat, spec = list(out.args[0]), gm._out_spec
    keys = spec.context if isinstance(spec.context, list) and all(isinstance(k, str) for k in spec.context) else None
    value = (flat[0] if spec.is_leaf() or len(flat) == 1 and not keys
             else dict(zip(keys, flat)) if keys and len(keys) == len(flat) else tuple(flat))
    out.args = (value,)
    graph._codegen = fx.graph.CodeGen()  # plain positional inputs, no pytree
    # a plain GraphModule over the same graph and parameters: the program's own refuses eval()
    plain = fx.GraphModule(gm, graph).eval()
    plain.meta["dims"] = symbols
    return plain


def _model_line(exc: BaseException) -> str:
    """`` at file:line: code`` of the innermost frame outside torch where ``exc`` was raised
    (the model's line that export could not follow), or ``""``."""
    torch_dir = os.path.dirname(torch.__file__)
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(torch_dir)]
    inner = [f for f in frames if not f.filename.startswith(os.path.dirname(__file__))]
    if not inner:
        return ""
    f = inner[-1]
    return f" at {os.path.basename(f.filename)}:{f.lineno}: {(f.line or '').strip()[:120]}"


def _is_size(node: fx.Node) -> bool:
    """Whether ``node`` is the size of a dynamic dimension (a SymInt), which no hop carries:
    each block recomputes it from its own inputs."""
    return isinstance(node.meta.get("val"), torch.SymInt)


def _shaped(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` was traced with an example, so its nodes know what they compute."""
    return any(n.op == "placeholder" and "tensor_meta" in n.meta for n in gm.graph.nodes)


def _is_tensor(node: fx.Node) -> bool:
    """Whether ``node`` computed one tensor when the graph ran on the example (a tuple of
    tensors records a tuple of metadata, not one)."""
    return isinstance(node.meta.get("tensor_meta"), TensorMetadata)


# --------------------------------------------------------------------------
# Cuts
# --------------------------------------------------------------------------


def _node_modules(node: fx.Node) -> set[str]:
    """Qualified names of the submodules ``node`` ran inside (leaf modules included)."""
    # torch.export's placeholder for a node with no stack is no submodule of the model
    names = {path for path, _ in node.meta.get("nn_module_stack", {}).values()
             if not path.startswith("_empty_nn_module_stack")}
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


def runs(gm: fx.GraphModule) -> dict[str, int]:
    """Each submodule that runs more than once in ``forward`` -> how many times: a loop over
    one module whose weights every pass shares (ALBERT's layer group, a recurrent cell, a
    ResNet block's one ReLU called twice).  ``torch.export`` tells the calls apart
    (``nn_module_stack`` keys ``id@1``, ``id@2``); for ``torch.fx`` a call is a stretch of
    consecutive nodes inside the module, or one ``call_module`` node of a leaf."""
    keys: dict[str, set] = {}
    stretches: dict[str, int] = {}
    inside: set[str] = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        names = _node_modules(node)
        for key, (path, _) in node.meta.get("nn_module_stack", {}).items():
            keys.setdefault(path, set()).add(key)
        leaf = {node.target} if node.op == "call_module" else set()
        for name in (names - inside) | leaf:  # a leaf's call is one node: the next one is another call
            stretches[name] = stretches.get(name, 0) + 1
        inside = names - leaf
    counts = {name: max(len(keys.get(name, ())), n) for name, n in stretches.items()}
    return {name: n for name, n in counts.items() if n > 1}


def crossing(gm: fx.GraphModule, pos: int) -> list[fx.Node]:
    """Values made at or before node ``pos`` and used after it (attributes, and the sizes of
    dynamic dimensions, which each block recomputes, excluded)."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    return [n for n in gm.graph.nodes if index[n] <= pos and n.op != "get_attr" and not _is_size(n)
            and any(index[u] > pos for u in n.users)]


def _last_op(gm: fx.GraphModule) -> int:
    """Index of the last node that computes something (the one before ``output``)."""
    return len(gm.graph.nodes) - 2


def valid_cuts(gm: fx.GraphModule) -> dict[str, int]:
    """Every submodule after which the model can be cut (only tensors cross it, at most
    :data:`MAX_HOP_TENSORS` of them, and something is left after it) -> its position."""
    end = _last_op(gm)
    shaped = _shaped(gm)
    repeated = runs(gm)
    return {name: pos for name, pos in cut_positions(gm).items()
            if pos < end and name not in repeated and _crossing_problem(crossing(gm, pos), shaped) is None}


def _crossing_problem(values: list[fx.Node], shaped: bool) -> str | None:
    """Why a cut crossed by ``values`` cannot be made (a phrase), or None when it can."""
    if not values:
        return "nothing crosses it (what follows does not use what comes before)"
    if not shaped:
        if len(values) == 1:
            return None
        return (f"{len(values)} values cross it ({', '.join(_describe(n) for n in values)}) and, "
                "traced without an example input, the splitter cannot tell whether they are all "
                "tensors; trace with one (split.trace(net, example)) to cut here")
    others = [n for n in values if not _is_tensor(n)]
    if others:
        return (f"{', '.join(f'{_describe(n)} ({_kind(n)})' for n in others)} "
                f"{'crosses' if len(others) == 1 else 'cross'} it, and a hop carries only tensors")
    if len(values) > MAX_HOP_TENSORS:
        return (f"{len(values)} tensors cross it ({', '.join(_describe(n) for n in values)}), more "
                f"than the {MAX_HOP_TENSORS} one hop carries")
    return None


def _kind(node: fx.Node) -> str:
    """What a non-tensor value is, as the example run found it: ``an int``, ``a tuple``, ``None``."""
    t = node.meta.get("type")
    if t is None:
        return "not known"
    if t is type(None):
        return "None"
    return f"{'an' if t.__name__[:1] in 'aeiouAEIOU' else 'a'} {t.__name__}"


def outermost(cuts: dict[str, int]) -> list[str]:
    """One name per position (the outermost, e.g. ``features.3`` over ``features.3.block``),
    in program order."""
    best: dict[int, str] = {}
    for name, pos in cuts.items():
        if pos not in best or (name.count("."), name) < (best[pos].count("."), best[pos]):
            best[pos] = name
    return [best[p] for p in sorted(best)]


def resolve_cuts(gm: fx.GraphModule, cuts: list[str], model: str) -> list[int]:
    """Positions of ``cuts``, which must be given in program order (block1 ends at the first);
    :class:`CutError` names the first bad one, or the order to give them in."""
    positions = cut_positions(gm)
    valid = valid_cuts(gm)
    shaped = _shaped(gm)
    repeated = runs(gm)
    seen: dict[int, str] = {}
    for cut in cuts:
        if cut not in positions:
            raise CutError(f"cut {cut!r}: {model} has no submodule of that name that runs in "
                           f"forward; nearby: {_nearby_names(cut, valid)}")
        pos = positions[cut]
        if cut in repeated:
            raise CutError(f"cut {cut!r}: {cut} runs {repeated[cut]} times in forward (one module called in a loop "
                           "or more than once, every pass sharing its weights and the state it carries), so no one "
                           f"place follows it; cut before or after the loop, or give each pass its own module (an nn.ModuleList) "
                           f"to cut between passes; nearby valid cuts: {_nearby_positions(pos, valid)}")
        if pos >= _last_op(gm):
            raise CutError(f"cut {cut!r}: it ends {model}, so no block would be left after it; "
                           f"cut earlier, nearby: {_nearby_positions(pos, valid)}")
        problem = _crossing_problem(crossing(gm, pos), shaped)
        if problem:
            raise CutError(f"cut {cut!r}: {problem}; nearby valid cuts: {_nearby_positions(pos, valid)}")
        if pos in seen:
            raise CutError(f"cut {cut!r} is the same place as cut {seen[pos]!r}; give each place once")
        seen[pos] = cut
    if list(seen) != sorted(seen):
        # refused, not reordered: block1 ends at the first cut, so a silent reordering would
        # number the files otherwise than the user wrote them
        order = [seen[p] for p in sorted(seen)]
        raise CutError(f"cuts {', '.join(cuts)} are out of order: {model} runs {' before '.join(order)}; "
                       f"give them in that order: {' '.join('--cut ' + c for c in order)}")
    return sorted(seen)


def _describe(node: fx.Node) -> str:
    """A value as a user knows it: the output of a submodule, the model's input, or an
    operation inside the innermost submodule it ran in."""
    if node.op == "call_module":
        return f"output of {node.target}"
    if node.op == "placeholder":
        return f"the input {node.name}"
    # (torch.export's stack starts at the model itself, whose path is "": an operation in the
    # model's own forward is named alone, as torch.fx's are)
    stack = [path for path, _ in node.meta.get("nn_module_stack", {}).values() if path]
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
    graph modules that share ``gm``'s parameters and, chained, compute ``gm``.  A block ending
    at a cut that several tensors cross returns their tuple, and the next one takes them as
    positional arguments, both in program order (see the module docstring)."""
    nodes = list(gm.graph.nodes)
    bounds = [-1, *positions, len(nodes) - 1]
    blocks = []
    for start, stop in zip(bounds, bounds[1:]):
        inputs = [n for n in nodes if n.op == "placeholder"] if start < 0 else crossing(gm, start)
        body = nodes[start + 1:stop + 1]
        if stop == len(nodes) - 1:
            out = nodes[-1].args[0]
        else:
            values = crossing(gm, stop)
            out = values[0] if len(values) == 1 else tuple(values)
        block = _block(gm, inputs, body, out)
        block.meta["members"] = (inputs, _out_nodes(out))
        blocks.append(block)
    return blocks


def _out_nodes(out) -> list[fx.Node]:
    return list(out.values()) if isinstance(out, dict) else list(out) if isinstance(out, (tuple, list)) else [out]


def dim_fields(gm: fx.GraphModule, inputs: list[fx.Node], outputs: list[fx.Node]) -> dict:
    """The manifest fields of a block's dynamic dimensions, for a graph ``torch.export`` made
    with some (:func:`export_graph`): ``input_dims``/``output_dims`` (per member, each dimension
    its size or the name of the declared dynamic one, None for a size computed from them) and
    ``dim_bounds`` (name -> [low, high])."""
    symbols = gm.meta.get("dims") or {}
    if not symbols:
        return {}

    def dims(node: fx.Node) -> list:
        shape = node.meta["val"].shape
        return [symbols[str(d)][0] if str(d) in symbols else int(d) if isinstance(d, int) else None for d in shape]

    fields = {"input_dims": [dims(n) for n in inputs], "output_dims": [dims(n) for n in outputs],
              "dim_bounds": {name: [low, high] for name, low, high in symbols.values()},
              "dim_buckets": {name: buckets(low, high) for name, low, high in symbols.values()}}
    return fields


def name_fields(gm: fx.GraphModule, inputs: list[fx.Node], outputs: list[fx.Node], ends_at_cut: bool) -> dict:
    """The manifest's names of what a block takes (``input_names``) and, where it ends at a
    cut, of what it hands on (``output_names``, the next block's ``input_names``); the last
    block's outputs are the model's (``output_keys`` where it returns a dict)."""
    fields = {"input_names": member_names(gm, inputs)}
    if ends_at_cut:
        fields["output_names"] = member_names(gm, outputs)
    return fields


def member_names(gm: fx.GraphModule, nodes: list[fx.Node]) -> list[str]:
    """Values of the graph by names a user knows: the model's input it is (``input_ids``), the
    submodule whose output it is (the outermost one it is the last value of: ``encoder.layer.0``),
    else the graph's own name for it (``expand_2``: BERT's attention mask, made in the model's
    ``forward`` itself). Distinct within one list (a repeated name gets the graph's after a colon)."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    ends: dict[int, str] = {}  # node index -> the outermost submodule that ends there
    for module, i in cut_positions(gm).items():
        if module and (i not in ends or module.count(".") < ends[i].count(".")):
            ends[i] = module
    names: list[str] = []
    for n in nodes:
        name = n.name if n.op == "placeholder" else ends.get(index[n], n.name)
        names.append(f"{name}:{n.name}" if name in names else name)
    return names


#: Sizes a dynamic dimension is warmed up at (and, on a GPU, a CUDA graph captured for), at most,
#: and the largest size warmed: beyond it a shape runs eager (blocks/runner.py, GraphCache).
MAX_DIM_BUCKETS = 4
MAX_BUCKET_SIZE = 128


def buckets(low: int, high: int, most: int = MAX_DIM_BUCKETS, cap: int = MAX_BUCKET_SIZE) -> list[int]:
    """The sizes of a dynamic dimension declared ``low..high`` that a block warms up at: powers
    of two within the bounds (the way vLLM and TensorRT-LLM pick the sizes they capture), none
    above ``cap``, at most ``most`` of them spread from the smallest to the largest; ``[low]``
    when no power of two is in range."""
    sizes = [1 << k for k in range(0, 31) if low <= 1 << k <= min(high, cap)] or [low]
    if len(sizes) <= most:
        return sizes
    step = (len(sizes) - 1) / (most - 1)
    return sorted({sizes[round(i * step)] for i in range(most)})


def _block(gm: fx.GraphModule, inputs: list[fx.Node], body: list[fx.Node], out) -> fx.GraphModule:
    """A graph module taking ``inputs`` (positionally, in that order) that runs ``body`` and
    returns ``out``.  Attributes (``get_attr``) are copied where they are first used, so no
    block needs another's."""
    g = fx.Graph()
    env = {inp: g.placeholder(inp.name) for inp in inputs}

    def lookup(node: fx.Node) -> fx.Node:
        if node not in env:
            if node.op == "get_attr":
                env[node] = g.get_attr(node.target)
            elif _is_size(node):
                env[node] = _size_from(g, node, inputs, env, lookup)
            else:
                raise RuntimeError(f"{node.name} crosses a cut the splitter accepted")  # a bug
        return env[node]

    for node in body:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        env[node] = g.node_copy(node, lookup)
    g.output(fx.map_arg(out, lookup))
    # torch.export numbers the sizes of dynamic dimensions over the whole model, so the same
    # first layers of two models (one encoder, two heads) would differ in these names alone:
    # renumbered per block, the same layers are the same bytes (configs/bert_tasks.py)
    for i, node in enumerate(n for n in g.nodes if n.op == "call_method" and n.target == "size"):
        node._rename(f"dim_size_{i}")
    block = fx.GraphModule(gm, g)
    return block.eval()


def _size_from(g: fx.Graph, node: fx.Node, inputs: list[fx.Node], env: dict, lookup) -> fx.Node:
    """The size ``node`` (a dynamic dimension, or arithmetic on such sizes) in a block taking
    ``inputs``: read off the first input that has that dimension, else recomputed from the
    sizes it is made of."""
    want = str(node.meta["val"])
    for inp in inputs:
        val = inp.meta.get("val")
        if isinstance(val, torch.Tensor):
            for dim, size in enumerate(val.shape):
                if str(size) == want:
                    return g.call_method("size", (env[inp], dim))
    if node.op == "call_function":
        return g.node_copy(node, lookup)
    raise CutError(f"the size {want} of a dynamic dimension is used after a cut that no tensor with that "
                   "dimension crosses; cut where a tensor of that size crosses, or make the dimension static")


def chain(blocks: list[nn.Module], x: torch.Tensor) -> list:
    """Run ``x`` through ``blocks`` in turn: every block's output.  A tuple is handed on as
    positional arguments (``block(*x)``), a dict as keyword arguments (``block(**x)``).  Each
    output is checked to be a tensor, a tuple of tensors or a flat dict of them: a hop carries
    nothing else."""
    outs = []
    with torch.no_grad():
        for i, block in enumerate(blocks, 1):
            x = bundle.call(block, x)
            check_tensors(x, f"block{i}")
            outs.append(x)
    return outs


def check_tensors(value, what: str) -> None:
    """A ``ValueError`` naming ``what`` unless ``value`` is a tensor, or a tuple, list or dict
    (str keys) of 1 to :data:`MAX_HOP_TENSORS` tensors."""
    if isinstance(value, torch.Tensor):
        return
    if not isinstance(value, (tuple, list, dict)):
        raise ValueError(f"{what} returns {type(value).__name__}, not a tensor, a tuple of tensors or "
                         "a dict of tensors; only tensors travel between blocks")
    keys = list(value) if isinstance(value, dict) else list(range(len(value)))
    if not 1 <= len(keys) <= MAX_HOP_TENSORS:
        raise ValueError(f"{what} returns {len(keys)} tensors; one hop carries 1 to {MAX_HOP_TENSORS}")
    for k in keys:
        if isinstance(value, dict) and not isinstance(k, str):
            raise ValueError(f"{what} returns a dict with key {k!r}; only str keys can be named on the wire")
        if not isinstance(value[k], torch.Tensor):
            raise ValueError(f"{what}[{k!r}] is {type(value[k]).__name__}, not a tensor; only tensors "
                             "travel between blocks (nested values cannot)")


def max_diff(got, want) -> float:
    """Largest absolute difference, member by member, between two outputs of the same
    structure (a tensor, a tuple of tensors, a dict of tensors); ``inf`` when the structures
    (tensor or tuple, tuple length, dict keys, shapes) differ."""
    def layout(v):
        return list(v) if isinstance(v, dict) else len(v) if isinstance(v, (tuple, list)) else None

    gs, ws = repo.members(got), repo.members(want)
    if layout(got) != layout(want) or [t.shape for t in gs] != [t.shape for t in ws]:
        return float("inf")
    return max((a.double() - b.double()).abs().max().item() if a.numel() else 0.0 for a, b in zip(gs, ws))


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
    args = example if isinstance(example, tuple) else (example,)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            for _ in range(2):
                timer.run(*args)
            timer.times = [float("inf")] * len(timer.times)
            for _ in range(repeats):
                timer.run(*args)
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
        raise ValueError(f"--blocks {blocks}: this model has only {len(names)} places where it can be "
                         f"cut, so at most {len(names) + 1} blocks")
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


def _export_in_process(model: str, out: str, cuts: list[str], blocks: int | None,
                       input_shape: list[int], name: str | None, fmt: str, method: str,
                       seed: int, inputs: list[str]) -> dict:
    """The work of :func:`export_split`, in the export child (which runs in the caller's
    current directory, so a callable is imported from there as it would be in the caller)."""
    net, default_name = build_model(model, seed)
    name = name or default_name
    gm, example = _graph(net, InputDecl.bind([InputDecl.parse(text) for text in inputs]), input_shape, seed)
    if not cuts:
        cuts = balance(gm, blocks, example)
        log.info("balanced cuts for %d blocks of %s: %s", blocks, name, " ".join(cuts) or "(none)")
    if gm.meta.get("tracer") == "fx" and _values_cross(gm, cuts):
        gm, example = _graph_for_cuts(gm, example, net, input_shape, seed, cuts, model)
    positions = resolve_cuts(gm, cuts, model)  # in program order, as given (or refused)
    parts = split(gm, positions)
    outs = chain(parts, example)
    with torch.no_grad():
        want = bundle.call(gm, example)
    diff = max_diff(outs[-1], want)
    if diff > CHAIN_TOLERANCE:
        raise RuntimeError(f"the chained blocks of {name} differ from the whole model by {diff:g}")
    log.info("chained blocks of %s equal the whole model (max abs diff %.2g)", name, diff)

    model_dir = Path(out) / name
    model_dir.mkdir(parents=True, exist_ok=True)
    inputs = [example, *outs[:-1]]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    jobs = [(repo.FULL, gm, example, want, None, (placeholders, _out_nodes(list(gm.graph.nodes)[-1].args[0])))]
    jobs += [(f"block{i}", mod, x, y, cut, mod.meta["members"]) for i, (mod, x, y, cut)
             in enumerate(zip(parts, inputs, outs, [*cuts, None]), 1)]
    entries = {}
    for bname, mod, x, y, cut, members in jobs:
        dims = dim_fields(gm, *members)
        fname, entry = _write_block(model_dir, bname, mod, x, y, fmt, method, seed, dims)
        entries[fname] = dict(entry, cut=cut, **dims, **name_fields(gm, *members, ends_at_cut=cut is not None))
    manifest_path = _merge_manifest(model_dir, name, seed, model, cuts, entries)
    return {"manifest": str(manifest_path), "name": name, "cuts": cuts}


# Note [Which tracer]
# ~~~~~~~~~~~~~~~~~~~
# A model split without ``--input`` is traced by torch.fx, where it can be: measured on the 2-core
# VM (experiments/split_tracers.py), fx made ResNet50's and MobileNetV3-Small's graphs 19x and
# 116x faster than torch.export (0.27 s against 5.0 s, 0.06 s against 6.6 s), with the same
# valid cuts (125, 155) and blocks that run as fast once compiled (0.997x, 1.019x). torch.export
# is used where fx cannot trace the model (a size used as a slice index: Hugging Face models) and
# where a cut asked for is crossed, in fx's graph, by what a hop cannot carry: fx keeps
# ``n, c, h, w = x.shape`` as ints that every later use reads (ViT-B/16: its cut after
# ``conv_proj`` is refused there, 110 valid cuts), while torch.export makes them sizes of dynamic
# dimensions that each block recomputes from its own inputs (123 valid cuts, conv_proj among
# them). A cut that export's graph refuses too is refused as fx's graph words it.
def _graph(net: nn.Module, decls: list[InputDecl], input_shape: list[int], seed: int):
    """``(graph, example)``: the model's graph and the input it was traced on (a tensor, or a
    tuple of the declared inputs).  With no ``--input`` a float32 tensor of ``input_shape``
    through ``torch.fx``, then ``torch.export`` where fx cannot follow the model (a shape used
    as a slice index, as Hugging Face models do): Note [Which tracer]."""
    gen = torch.Generator().manual_seed(seed)
    if not decls:
        example = torch.randn(*input_shape, generator=gen)
        try:
            gm = trace(net, example)
            gm.meta["tracer"] = "fx"
            return gm, example
        except ValueError as exc:
            if not str(exc).startswith("torch.fx cannot trace"):
                raise
            log.info("%s; splitting the graph torch.export makes instead", exc)
        decls = _float_input(input_shape)
    example = tuple(d.example(net, gen) for d in decls)
    gm = export_graph(net, decls, example)
    return gm, example[0] if len(example) == 1 else example


def _float_input(input_shape: list[int]) -> list[InputDecl]:
    """What a model split without ``--input`` is exported with: one float32 tensor of
    ``input_shape``, its batch dynamic."""
    return [InputDecl("x", "float32", (("N", *DEFAULT_DIM_BOUNDS), *input_shape[1:]))]


def _values_cross(gm: fx.GraphModule, cuts: list[str]) -> bool:
    """Whether a value that is not a tensor (an int of ``x.shape``, a tuple) crosses one of
    ``cuts`` in ``gm`` (Note [Which tracer])."""
    positions = cut_positions(gm)
    return any(not _is_tensor(n) for c in cuts if c in positions for n in crossing(gm, positions[c]))


def _graph_for_cuts(gm: fx.GraphModule, example, net: nn.Module, input_shape: list[int], seed: int,
                    cuts: list[str], model: str):
    """fx's ``(gm, example)``, or torch.export's graph and example where that graph takes
    ``cuts`` that fx's refuses for a value a hop cannot carry (Note [Which tracer])."""
    decls = _float_input(input_shape)
    x = tuple(d.example(net, torch.Generator().manual_seed(seed)) for d in decls)
    try:
        exported = export_graph(net, decls, x)
        resolve_cuts(exported, cuts, model)
    except ValueError as exc:  # export cannot follow the model, or refuses the cut too: fx's words stand
        log.info("torch.export's graph does not take the cuts either (%s)", str(exc).splitlines()[0][:200])
        return gm, example
    log.info("a cut of %s is crossed by a value that is not a tensor in torch.fx's graph; splitting the "
             "graph torch.export makes, whose sizes each block recomputes (Note [Which tracer])", model)
    return exported, x[0]


def _write_block(model_dir: Path, bname: str, mod: nn.Module, x, y, fmt: str, method: str,
                 seed: int, dims: dict) -> tuple[str, dict]:
    """Compile ``mod`` to ``model_dir/bname.pt[2]``: its file name and manifest entry (the
    same fields as a ResNet block's, plus ``input_shapes``/``output_shapes``/``output_keys``
    where ``x`` is a tuple of tensors or ``y`` a tuple or dict: :func:`repository.shape_fields`)."""
    fname = bname + repo.SUFFIX[fmt]
    try:
        if fmt == "export":
            data = repo.export_program_bytes(mod, x, dims.get("input_dims"), dims.get("dim_bounds"))
        else:
            data = repo.compile_to_bytes(mod, method, x, strict=isinstance(y, (torch.Tensor, tuple)))
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
        **repo.shape_fields(x, y),
        **_dtype_fields(x, y), "params": sum(p.numel() for p in mod.parameters()),
        "param_bytes": sum(t.numel() * t.element_size() for t in tensors),
        "method": method if fmt == "torchscript" else "export", "format": fmt,
        "variant": None, "seed": seed,
    }


def _dtype_fields(x, y) -> dict:
    """``dtype``: the first input member's; ``input_dtypes``/``output_dtypes``: every member's,
    where a block takes or returns several tensors or one that is not float32."""
    xs, ys = repo.members(x), repo.members(y)
    fields = {"dtype": str(xs[0].dtype).removeprefix("torch.")}
    for key, ts, many in (("input_dtypes", xs, isinstance(x, (tuple, list, dict))),
                          ("output_dtypes", ys, isinstance(y, (tuple, list, dict)))):
        dtypes = [str(t.dtype).removeprefix("torch.") for t in ts]
        if many or dtypes != ["float32"]:
            fields[key] = dtypes
    return fields


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
