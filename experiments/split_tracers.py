"""How a model without ``--input`` is turned into a graph to split: ``torch.fx`` against
``torch.export``, measured (issue 43 item 1: "fx tracing stays only where it works better").

    python -m experiments.split_tracers [--quick] [--rounds R] [--n N] [--models a,b] [--out DIR]

(not one of ``blockflow bench all``'s experiments: it measures the export CLI, once per change to
how a model is traced, not the serving path every bench run measures; tests/process/test_experiments.py
runs it in quick mode)

``blockflow export --model M --cut ...`` without ``--input`` traces the model with ``torch.fx``
(``split.trace``: a symbolic trace, then a run of the example input for every value's shape) and
falls back to ``torch.export`` only where fx cannot follow the model; with ``--input`` it always
exports (``split.export_graph``). Here both tracers make the graph of the same seeded models, at
the same input (a float32 image; for export the batch dynamic, traced at batch 2, as the fallback
declares it; every chain below runs batch 1), in
``--rounds`` interleaved rounds, and each graph goes the rest of the export's way: the cuts
resolved (or refused), the blocks split and chained against the model run directly, each block
compiled by ``torch.jit.script`` as ``blockflow export`` writes it, and the compiled blocks run
back to back on one thread, the two tracers' chains interleaved request by request.

Per model and tracer (``rows``): ``graph_s`` (median of the rounds' graph times), ``nodes``,
``valid_cuts`` (how many places the model can be cut, ``split.valid_cuts``), the cuts given and
whether they were taken (``refused``: the one-line refusal), ``max_diff`` of the chained blocks
against the model, ``script_s`` (compiling every block), ``chain_ms`` (p50 of the compiled
blocks run back to back, batch 1) and ``error`` where the tracer cannot make the graph at all.
``ratios`` give export over fx for the graph time and the chained blocks' p50 where both made
them. The models: torchvision's ResNet50 (cut at its four stages), MobileNetV3-Small (the
README's cuts) and ViT-B/16, whose ``n, c, h, w = x.shape`` puts ints across every cut before its
encoder in fx's graph (refused there: a hop carries only tensors) while in export's graph a
size is a dynamic dimension each block recomputes.
"""
from __future__ import annotations

import io
import statistics
import sys
import time

from . import common

NAME = "split_tracers"
#: model -> (input shape, cuts): the cuts are the places the README and the tests cut them.
MODELS = {
    "resnet50": ([1, 3, 224, 224], ["layer1", "layer2", "layer3", "layer4"]),
    "mobilenet_v3_small": ([1, 3, 224, 224], ["features.3", "features.8"]),
    "vit_b_16": ([1, 3, 224, 224], ["conv_proj", "encoder.layers.encoder_layer_5"]),
}
QUICK_MODELS = ["mobilenet_v3_small"]
TRACERS = ("fx", "export")


def make_graph(tracer: str, net, example):
    """The graph ``blockflow export`` would split, made by ``tracer``; (graph, seconds)."""
    import torch

    from blockflow.blocks import split
    t0 = time.perf_counter()
    if tracer == "fx":
        gm = split.trace(net, example)
    else:  # as split._graph's fallback declares a float input (the batch dynamic) and traces it
        # at the batch the declaration gives (2: torch.export specialises a dimension of size 1)
        decls = split._float_input(list(example.shape))
        gm = split.export_graph(net, decls, tuple(d.example(net, torch.Generator().manual_seed(0)) for d in decls))
    return gm, time.perf_counter() - t0


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:400] if text else type(exc).__name__


def measure_model(model: str, rounds: int, n: int) -> list[dict]:
    import torch

    from blockflow.blocks import repository as repo
    from blockflow.blocks import split

    shape, cuts = MODELS[model]
    net, _ = split.build_model(model, seed=0)
    gen = torch.Generator().manual_seed(0)
    example = torch.randn(*shape, generator=gen)
    with torch.no_grad():
        want = net(example)
    rows = {t: {"model": model, "tracer": t, "input_shape": shape, "cuts": cuts, "graph_s_rounds": []}
            for t in TRACERS}
    graphs = {}
    for _ in range(rounds):  # the tracers take turns, so that both see the same machine
        for tracer in TRACERS:
            row = rows[tracer]
            if "error" in row:
                continue
            try:
                gm, seconds = make_graph(tracer, net, example)
            except Exception as exc:  # a model a tracer cannot follow: its refusal is the result
                row["error"] = first_line(exc)
                continue
            row["graph_s_rounds"].append(seconds)
            graphs[tracer] = gm
    chains = {}
    for tracer, gm in graphs.items():
        row = rows[tracer]
        row["graph_s"] = statistics.median(row["graph_s_rounds"])
        row["nodes"] = len(gm.graph.nodes)
        row["valid_cuts"] = len(split.outermost(split.valid_cuts(gm)))
        try:
            parts = split.split(gm, split.resolve_cuts(gm, cuts, model))
        except split.CutError as exc:
            row["refused"] = first_line(exc)
            continue
        outs = split.chain(parts, example)
        row["max_diff"] = split.max_diff(outs[-1], want)
        t0 = time.perf_counter()
        compiled = []
        for mod, x, y in zip(parts, [example, *outs[:-1]], outs):
            data = repo.compile_to_bytes(mod, "script", x, strict=isinstance(y, (torch.Tensor, tuple)))
            compiled.append(torch.jit.load(io.BytesIO(data)).eval())
        row["script_s"] = time.perf_counter() - t0
        chains[tracer] = compiled
    if chains:
        times = {t: [] for t in chains}
        with torch.inference_mode():
            for blocks in chains.values():  # warm-up: TorchScript's profiling runs
                for _ in range(3):
                    split.chain(blocks, example)
            for _ in range(n):
                for tracer, blocks in chains.items():
                    t0 = time.perf_counter()
                    split.chain(blocks, example)
                    times[tracer].append((time.perf_counter() - t0) * 1e3)
            for tracer, blocks in chains.items():  # the compiled blocks answer as the graph's did
                rows[tracer]["compiled_max_diff"] = split.max_diff(split.chain(blocks, example)[-1], want)
        for tracer, ts in times.items():
            rows[tracer]["chain_ms"] = common.describe(ts)
    return list(rows.values())


def main(argv: list[str] | None = None) -> int:
    import torch
    ap = common.parser(NAME, __doc__)
    ap.add_argument("--rounds", type=int, help="interleaved rounds of graph making (default 3, quick 1)")
    ap.add_argument("--models", help=f"comma-separated, of {', '.join(MODELS)} (default all; quick: "
                                     f"{', '.join(QUICK_MODELS)})")
    args = ap.parse_args(argv)
    common.setup_logging(args.verbose)
    torch.set_num_threads(1)
    rounds = args.rounds or (1 if args.quick else 3)
    n = args.n or (3 if args.quick else 20)
    models = args.models.split(",") if args.models else (QUICK_MODELS if args.quick else list(MODELS))
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        ap.error(f"--models: {', '.join(unknown)} not measured here; choose from {', '.join(MODELS)}")
    settings = {"models": {m: {"input_shape": MODELS[m][0], "cuts": MODELS[m][1]} for m in models},
                "rounds": rounds, "n": n, "threads": 1, "quick": args.quick, "method": "script",
                "export_input": "x:float32 with the batch dynamic (N), as split._graph's fallback declares it"}
    env = common.env_info(settings)
    rows = []
    for model in models:
        common.log.info("%s: both tracers, %d round(s)", model, rounds)
        rows.extend(measure_model(model, rounds, n))
    ratios = {}
    for model in models:
        fx, ex = (next(r for r in rows if r["model"] == model and r["tracer"] == t) for t in TRACERS)
        ratios[model] = {
            "graph_export_over_fx": ex["graph_s"] / fx["graph_s"] if "graph_s" in fx and "graph_s" in ex else None,
            "chain_p50_export_over_fx": (ex["chain_ms"]["p50"] / fx["chain_ms"]["p50"]
                                         if "chain_ms" in fx and "chain_ms" in ex else None)}
    common.write_json(args.out, NAME, {"env": env, "settings": settings, "rows": rows, "ratios": ratios})
    for r in rows:
        what = (f"error: {r['error']}" if "error" in r else f"refused: {r['refused']}" if "refused" in r else
                f"graph {r['graph_s']:.2f} s, {r['valid_cuts']} valid cuts, blocks p50 {r['chain_ms']['p50']:.1f} ms, "
                f"max |diff| {r['max_diff']:.1e}")
        print(f"{r['model']} by {r['tracer']}: {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
