"""Per-hop overhead of the data plane: chains of identity and of copying blocks, both transports,
and TensorMQ's hop between nodes (``cross-node``: bytes over CURVE TCP, on this one machine).

A hop's cost is what one more block on the path costs. It is measured inside the blocks:
each block stamps its hop record with ``t_in`` (message taken off its socket) and ``t_out``
(output encoded, message handed to the next hop's socket), on CLOCK_MONOTONIC, which every
process on the host shares (Note [Hop timestamps] in blocks/kpilog.py). In a chain of K
blocks (0..K-1), per request and per hop i = 1..K-2::

    hop_i = t_out[i] - t_out[i-1] - inf[i]

i.e. block i-1's send, the transit, block i's receive, queue wait, decode and encode: all it
costs beyond its own compute. Block K-1 is left out: it sends to the dispatcher, the way out
rather than a hop between blocks (on a GPU a device-to-host copy into a host slot, which an H200
run showed in the rows of its chain of three when block K-1 was counted); the floor's relays are
counted the same way. Rows give the median and p99 over every hop of every request
(``hop_median_ms``, ``hop_p99_ms``); ``hop_transit_ms`` is the median of
``t_in[i] - t_out[i-1]`` (send, socket, wake-up). The client's clock plays no part, so the
client-to-dispatcher transfer, which varies by more than a TensorMQ hop costs on a loaded
2-core machine, cannot swamp it.

As a cross-check the old method stays: the round trip through chains of 1 and K blocks,
``(RTT_K - RTT_1) / (K - 1)``, median and p99 over paired samples (``per_hop_paired_median_ms``,
``per_hop_p99_ms``); it includes the noise of two client round trips and can come out negative
for a hop below ~0.2 ms here.

Two kinds of block:

- ``identity`` returns its input: a TensorMQ hop forwards the handle it received and moves no
  tensor bytes, so its cost is the floor of the data plane.
- ``copy`` returns ``x + 1``, a new tensor, as real blocks do: with TensorMQ the block lends
  slots of its next edge to PyTorch's allocator and ``x + 1`` is made in one of them (Note
  [Outputs made in a slot]; ``made_in_slot`` is the share of outputs that were; without the
  extension they are copied into a slot). Its *transport cost* (``transport_ms``) is the hop
  above, the block's own compute (``inf``, which includes ``x + 1``) taken off per request.

and, measured in the same run, the *floor*: chains of bare pyzmq relay processes (receive,
stamp, send the same parts on) passing what a hop passes -- the header alone (tensormq's
handle) or the header and the tensor's bytes (zeromq). Each relay appends its own
perf_counter instant as an 8-byte frame, so the floor is measured the same way. No Python
block can hop faster than its floor. The TensorMQ floor is measured twice: as it is, and with
two copies of the tensor's bytes before each round trip (``floor-cold`` rows), as a BlockFlow
round trip makes them outside its hops (client to dispatcher, dispatcher into a slot, the way
back): a block in the chains below wakes, like those relays, with its caches emptied by them,
so its hop is compared with the cold floor at sizes beyond the caches (batch 32).

Several tensors per hop (tensormq/bundle.py): ``bundle-identity`` and ``bundle-copy`` blocks take
and return a tuple of three tensors that hold the same bytes as the one tensor of their stage,
split 2:1:1 by channels (a feature map and two skip connections, as a U-Net's cut hands them
on), in one message: a header with three descriptors (``xs``) and, with ZeroMQ, three payload
frames. ``bundle-identity`` returns its three inputs (each member's handle is forwarded),
``bundle-copy`` returns each plus one (three new tensors, each copied into a slot: a bundle's
outputs are not made in lent slots). Their rows carry the stage's shape (``shape``, the one
tensor whose bytes they split), the members' shapes (``shapes``) and ``vs_single``: their hop
median over that of the one-tensor block of the same kind, transport and stage, measured in the
same deployment. ``floor-bundle`` rows are the relays passing the same parts (the three-descriptor
header; with ZeroMQ also the three frames). By default the bundle rows are measured at the
block1 stage only (``--bundle-stages``), the stage the READMEs quote.

Every figure is measured in ``--rounds`` interleaved rounds: the relays of the floor stay up
beside the blocks, and each round samples the floor of the transport, then every kind of block
at every size. A row's figure is the median of its rounds' medians with their spread
(``<key>_spread_ms``); ``vs_floor`` is a block's hop over the floor's of the same round, the
median of the rounds' ratios (``vs_floor_spread``: their range). A difference below zero, or
spread over more than itself, is reported as not measured (Note [Not measured]).

Both kinds of block share one deployment per transport (process start-up, mostly importing
torch, is most of a short run). Each size is sampled until ``--n`` samples or, once
``--least`` are in, ``--budget`` seconds, so that 103 MB ZeroMQ hops do not stretch the run.
Sizes: ResNet50's stage outputs at batch 1 and 32. Run:

    python -m experiments.hop_overhead [--quick] [--rounds R] [--device cpu|cuda] [--out DIR]
        [--blocks identity,copy,bundle-identity,bundle-copy] [--batches 1,32]
        [--stages block1,block4] [--bundle-stages block1|all] [--chain K]
        [--n N] [--least N] [--budget S] [--no-floor]
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import shutil
import statistics
import struct
import sys
import tempfile
import time
from typing import Tuple

import torch

log = logging.getLogger("experiments.hop_overhead")

STAGES = {"block1": (256, 56, 56), "block2": (512, 28, 28), "block3": (1024, 14, 14), "block4": (2048, 7, 7)}


class Identity(torch.nn.Module):
    def forward(self, x):
        return x


class Copy(torch.nn.Module):
    def forward(self, x):
        return x + 1


class BundleIdentity(torch.nn.Module):
    """Three tensors in, the same three out: each member's handle is forwarded."""

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor]:
        return a, b, c


class BundleCopy(torch.nn.Module):
    """Three tensors in, three new ones out."""

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor]:
        return a + 1, b + 1, c + 1


KINDS = {"identity": Identity, "copy": Copy, "bundle-identity": BundleIdentity, "bundle-copy": BundleCopy}
#: A bundle kind -> the one-tensor kind its rows are compared with.
BUNDLE_OF = {"bundle-identity": "identity", "bundle-copy": "copy"}
#: Block names in a chain: a letter or two per kind, then the position.
PREFIX = {"identity": "i", "copy": "c", "bundle-identity": "bi", "bundle-copy": "bc"}
#: How a bundle splits its stage's channels between its members: 1/2, 1/4, 1/4 of the bytes.
SPLIT = (2, 1, 1)


def bundle_shapes(shape) -> list[tuple]:
    """The members' shapes of a bundle holding the bytes of one tensor of ``shape`` (N, C, H, W):
    its channels split by SPLIT, so the total is exact at every stage."""
    b, c, *rest = shape
    parts = sum(SPLIT)
    if c % parts:
        raise ValueError(f"{c} channels do not split {':'.join(map(str, SPLIT))}")
    return [(b, c * p // parts, *rest) for p in SPLIT]


def make_input(kind: str, shape):
    """What a chain of ``kind`` is sent: one tensor of ``shape``, or a bundle of the same bytes."""
    if kind in BUNDLE_OF:
        return tuple(torch.randn(*s) for s in bundle_shapes(shape))
    return torch.randn(*shape)


def expected(kind: str, x, chain: int):
    """What a chain of ``chain`` blocks of ``kind`` answers for ``x``: one ``+ 1`` per copying
    block, in turn (float sums round: three of them are not ``+ 3``)."""
    for _ in range(chain if kind in ("copy", "bundle-copy") else 0):
        x = tuple(t + 1 for t in x) if isinstance(x, tuple) else x + 1
    return x


def same_value(a, b) -> bool:
    if isinstance(b, tuple):
        return isinstance(a, tuple) and len(a) == len(b) and all(torch.equal(p, q) for p, q in zip(a, b))
    return isinstance(a, torch.Tensor) and torch.equal(a, b)


def _toy_repo(kinds) -> str:
    repo = tempfile.mkdtemp(prefix="bf-hop-")
    os.makedirs(os.path.join(repo, "toy"))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for kind in ([kinds] if isinstance(kinds, str) else kinds):
            torch.jit.save(torch.jit.script(KINDS[kind]()), os.path.join(repo, "toy", f"{kind}.pt"))
    return repo


def _pct(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def _sample(send_short, send_long, n: int, budget: float, least: int):
    """Paired samples (short, long, result of the long one) until ``n`` or, past ``least``
    samples, until ``budget`` seconds have gone: a 103 MB ZeroMQ round trip takes a second
    where a handle takes a millisecond, and the whole run must stay short."""
    short, long_, out = [], [], []
    stop = time.monotonic() + budget
    for i in range(n):
        t0 = time.perf_counter()
        send_short()
        t1 = time.perf_counter()
        r = send_long()
        t2 = time.perf_counter()
        short.append((t1 - t0) * 1e3)
        long_.append((t2 - t1) * 1e3)
        out.append(r)
        if i + 1 >= least and time.monotonic() > stop:
            break
    return short, long_, out


def _in_block(hops_per_request) -> dict:
    """Hop figures from the instants the blocks (or relays) stamped: for every request, its
    list of hop records in path order (``t_in``, ``t_out`` in seconds, ``inf`` in ms)."""
    net, gross, transit = [], [], []
    for hops in hops_per_request:
        for prev, h in zip(hops, hops[1:-1]):  # not into the last: its send is the way out
            d = (h["t_out"] - prev["t_out"]) * 1e3
            gross.append(d)
            net.append(d - h.get("inf", 0.0))
            if "t_in" in h:
                transit.append((h["t_in"] - prev["t_out"]) * 1e3)
    if not net:
        return {"hop_median_ms": None, "hop_p99_ms": None, "hop_gross_median_ms": None, "hop_transit_ms": None,
                "hops_measured": 0}
    return {"hop_median_ms": statistics.median(net), "hop_p99_ms": _pct(net, 0.99),
            "hop_gross_median_ms": statistics.median(gross),
            "hop_transit_ms": statistics.median(transit) if transit else None, "hops_measured": len(net)}


# Note [Not measured]
# ~~~~~~~~~~~~~~~~~~~
# Every figure of a row is the median of its rounds' medians (``--rounds``, interleaved with the
# floor's rounds, see ``measure``), and a figure that is a difference (a hop: one round trip
# minus another, or one block's instant minus its predecessor's) carries the spread of those
# rounds (``<key>_spread_ms``: the lowest and highest round). A difference below zero is noise,
# not a hop; so is a difference of two client round trips whose rounds spread over more than
# the figure itself (the client-to-dispatcher transfer varies by more than a hop costs). Either
# is reported as not measured -- None in the JSON, with the reason under ``not_measured`` -- in
# the printed tables and in no plot, never as a figure (a loaded 2-core machine printed a
# -1.278 ms hop at 103 MB from the difference of two round trips). The hop stamped inside the
# blocks takes no client round trip: its spread is the load of the machine changing between
# rounds, reported beside it, and only a negative one is refused.
def rounds_figure(values, spread_rule: bool = True) -> dict:
    """A difference measured once per round: ``median`` (None when not measured), ``low``,
    ``high``, ``rounds`` and ``why`` it is not measured (None when it is): Note [Not measured].
    ``spread_rule``: a spread over more than the figure makes it not measured too."""
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "low": None, "high": None, "rounds": 0, "why": "no samples"}
    med, low, high = statistics.median(vals), min(vals), max(vals)
    why = None
    if med < 0:
        why = f"below zero ({med:.3f} ms): the noise of what is subtracted is larger than the hop"
    elif spread_rule and high - low > med:
        why = (f"its {len(vals)} rounds spread over {high - low:.3f} ms ({low:.3f} to {high:.3f}), more than "
               f"the figure ({med:.3f} ms)")
    return {"median": None if why else med, "low": low, "high": high, "rounds": len(vals), "why": why}


def _set_figure(row: dict, key: str, values, spread_rule: bool = True) -> None:
    """``row[key]``: the rounds' figure of ``values`` (one per round), its spread beside it, and
    the reason under ``row["not_measured"][key]`` when it is not a figure."""
    fig = rounds_figure(values, spread_rule)
    row[key] = fig["median"]
    row[key.replace("_ms", "_spread_ms")] = [fig["low"], fig["high"]]
    if fig["why"]:
        row.setdefault("not_measured", {})[key] = fig["why"]


def _row(transport, kind, shape, device, chain, rounds, shapes=None) -> dict:
    """A row from the rounds of one (transport, kind, shape): each round ``(short, long_, hops)``,
    paired round trips (ms) and the hop records of the long chain's requests (Note [Not measured]).
    ``shapes``: a bundle's members (their bytes add up to one tensor of ``shape``)."""
    short = [v for r in rounds for v in r[0]]
    long_ = [v for r in rounds for v in r[1]]
    per_hop = sorted((l - s) / (chain - 1) for r in rounds for s, l in zip(r[0], r[1]))
    extra = {"members": 1} if shapes is None else {"members": len(shapes), "shapes": [list(m) for m in shapes]}
    row = {"transport": transport, "block": kind, "batch": shape[0], "device": device, "shape": list(shape),
           "mbytes": math.prod(shape) * 4 / 1e6, **extra, "n": len(short), "chain": chain, "rounds": len(rounds),
           "rtt1_median_ms": statistics.median(short), "rttK_median_ms": statistics.median(long_)}
    _set_figure(row, "per_hop_median_ms", [(statistics.median(r[1]) - statistics.median(r[0])) / (chain - 1)
                                           for r in rounds])
    _set_figure(row, "per_hop_paired_median_ms", [statistics.median((l - s) / (chain - 1) for s, l in zip(r[0], r[1]))
                                                  for r in rounds])
    row["per_hop_p99_ms"] = _pct(per_hop, 0.99) if row["per_hop_paired_median_ms"] is not None else None
    per_round = [_in_block(r[2]) for r in rounds]
    pooled = _in_block([h for r in rounds for h in r[2]])
    _set_figure(row, "hop_median_ms", [q["hop_median_ms"] for q in per_round], spread_rule=False)
    row["hop_p99_ms"] = pooled["hop_p99_ms"] if row["hop_median_ms"] is not None else None
    row["hop_gross_median_ms"] = _median_of([q["hop_gross_median_ms"] for q in per_round])
    row["hop_transit_ms"] = _median_of([q["hop_transit_ms"] for q in per_round])
    row["hops_measured"] = pooled["hops_measured"]
    row["hop_rounds_ms"] = [q["hop_median_ms"] for q in per_round]
    return row


def _median_of(values):
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def vs_floor(rows: list[dict]) -> None:
    """``vs_floor``: a block row's hop over the floor's (the bare relays of the same transport and
    size, measured in the same rounds), per round, as a rounds' figure: the median of the rounds'
    ratios and their range; None where either hop of a round is missing or not measured."""
    for row in rows:
        if row["block"] in FLOOR_KINDS:
            continue
        floor = next((r for r in rows if r["block"] == ("floor-bundle" if row["block"] in BUNDLE_OF else "floor")
                      and r["transport"] == row["transport"] and r["shape"] == row["shape"]), None)
        if floor is None or row.get("hop_median_ms") is None or floor.get("hop_median_ms") is None:
            row["vs_floor"] = None
            continue
        ratios = [h / f for h, f in zip(row["hop_rounds_ms"], floor["hop_rounds_ms"]) if h is not None and f]
        row["vs_floor"] = statistics.median(ratios) if ratios else None
        row["vs_floor_spread"] = [min(ratios), max(ratios)] if ratios else None


def _fig(row: dict, key: str, digits: int = 3) -> str:
    """A figure as printed: the value, '-' when absent, 'not measured' (Note [Not measured])."""
    if key in row.get("not_measured", {}):
        return NOT_MEASURED
    v = row.get(key)
    return "-" if v is None else f"{v:.{digits}f}"


def _print(row: dict) -> None:
    made = row.get("made_in_slot")
    made = "" if made is None else f", made in slot {made:.0%}"
    if row.get("members", 1) > 1:
        vs = row.get("vs_single")
        made += f", {row['members']} tensors" + ("" if vs is None else f": {vs:.2f}x the one-tensor hop")
    spread = row.get("hop_median_spread_ms") or [None, None]
    spread = "" if spread[0] is None else f" [rounds {spread[0]:.3f}-{spread[1]:.3f}]"
    print(f"{row['transport']:8s} {row['block']:15s} {str(row['shape']):22s} {row['mbytes']:8.1f} MB  hop median "
          f"{_fig(row, 'hop_median_ms')}{spread} p99 {_fig(row, 'hop_p99_ms')} (transit {row['hop_transit_ms'] or 0:.3f}, "
          f"share {row.get('hop_share_ms') or 0:.3f}, inf {row.get('hop_inf_ms') or 0:.3f}{made})  round-trip "
          f"difference {_fig(row, 'per_hop_paired_median_ms')}  rtt1 {row['rtt1_median_ms']:.3f} ms  "
          f"n {row['n']} in {row['rounds']} rounds", flush=True)


#: The transport rows: the two transports, and TensorMQ's hop between nodes (issue 30).
CROSS_NODE = "cross-node"
TRANSPORTS = ("tensormq", "zeromq", CROSS_NODE)


def measure(transport: str, sizes: list[tuple], n: int, chain: int, device: str = "cpu",
            kinds=("identity",), budget: float = 2.0, least: int = 10, bundle_sizes=None, rounds: int = 1,
            floor: "Floor | None" = None) -> list[dict]:
    """Chains of every kind of block in one deployment (one start-up per transport); the bundle
    kinds at ``bundle_sizes`` (default: ``sizes``), after the one-tensor kinds they are compared with.
    ``rounds`` rounds, each sampling every kind and size once and, with a ``floor``, the floor of
    this transport at the same sizes (Note [Not measured]); ``n``, ``least`` and ``budget`` are
    split between the rounds."""
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    kinds.sort(key=lambda k: k in BUNDLE_OF)  # the one-tensor rows first: vs_single needs them
    repo = _toy_repo(kinds)
    blocks, tasks = {}, {}
    for kind in kinds:
        names = [f"{PREFIX[kind]}{k}" for k in range(chain)]
        blocks.update({nm: f"toy/{kind}.pt" for nm in names})
        tasks[f"{kind}-short"], tasks[f"{kind}-long"] = names[:1], names
    per_kind = {k: (sizes if bundle_sizes is None or k not in BUNDLE_OF else bundle_sizes) for k in kinds}
    try:
        return _measure(repo, blocks, tasks, transport, per_kind, n, chain, device, kinds, budget, least, rounds,
                        floor)
    finally:
        shutil.rmtree(repo, ignore_errors=True)


def _measure(repo, blocks, tasks, transport, per_kind, n, chain, device, kinds, budget, least, rounds,
             floor) -> list[dict]:
    from blockflow.client import Client
    from blockflow.standalone import StandalonePipeline

    rows = []
    env = {"BLOCKFLOW_KPI_FLUSH_EVERY": "100000"}
    n_round, least_round = max(1, math.ceil(n / rounds)), max(2, math.ceil(least / rounds))
    budget_round = budget / rounds
    # its own shared-memory prefix: on a shared machine, other runs' leak checks sweep blockflow-*
    # cross-node: TensorMQ blocks laid out on two nodes in turn (blockflow/standalone.py), so that
    # every hop of a chain goes to another node: bytes over CURVE TCP, as between Ray nodes
    nodes = {nm: "ab"[int(nm[len(nm.rstrip("0123456789")):]) % 2] for nm in blocks} if transport == CROSS_NODE else None
    with StandalonePipeline(repo, blocks, tasks, transport="tensormq" if transport == CROSS_NODE else transport,
                            threads=1, env=env, device=device, shm_prefix="bfbench-hop", nodes=nodes) as p:
        with Client(p.address, timeout=120) as c:
            samples: dict[tuple, list] = {}  # (kind, shape) -> one (short, long, hops) per round
            counts: dict[tuple, list] = {}  # (kind, shape) -> [outputs made in a slot, requests served]
            ok: dict[tuple, bool] = {}
            inputs = {(kind, tuple(shape)): make_input(kind, shape) for kind in kinds for shape in per_kind[kind]}
            for (kind, shape), x in inputs.items():
                for _ in range(3):  # warm-up: slots, mappings, sockets
                    c.infer(f"{kind}-short", x)
                    got = c.infer(f"{kind}-long", x)
                ok[kind, shape] = same_value(got, expected(kind, x, chain))  # what the chain answers, checked once
                del got
            comps: dict[tuple, list] = {}
            for _ in range(rounds):
                if floor is not None:  # the floor of this transport, in the same round
                    floor.sample_round(transport, n_round, budget_round, least_round)
                for (kind, shape), x in inputs.items():
                    made0, served0 = _slot_counts(p, tasks[f"{kind}-long"])
                    short, long_, results = _sample(lambda: c.infer(f"{kind}-short", x),
                                                    lambda: c.infer_details(f"{kind}-long", x), n_round,
                                                    budget_round, least_round)
                    made, served = (a - b for a, b in zip(_slot_counts(p, tasks[f"{kind}-long"]), (made0, served0)))
                    tally = counts.setdefault((kind, shape), [0, 0])
                    tally[0], tally[1] = tally[0] + made, tally[1] + served
                    hops = [r.hops for r in results]
                    del results  # a 103 MB result per request: keep only the hop records
                    samples.setdefault((kind, shape), []).append((short, long_, hops))
                    # the blocks between the first (its wait includes dispatcher ingress) and the last (it sends to the dispatcher)
                    comps.setdefault((kind, shape), []).extend(hs[1:-1] for hs in hops)
            for (kind, shape), per_round in samples.items():
                def comp(key, hopss=comps[kind, shape]):
                    vals = [h.get(key, 0.0) for hs in hopss for h in hs]
                    return statistics.median(vals) if vals else None
                row = _row(transport, kind, shape, device, chain, per_round,
                           shapes=bundle_shapes(shape) if kind in BUNDLE_OF else None)
                row.update({"hop_wait_ms": comp("wait"), "hop_deser_ms": comp("deser"), "hop_inf_ms": comp("inf"),
                            "hop_share_ms": comp("share")})
                # what the hop costs beyond the block's own compute (inf includes x + 1), per request
                row["transport_ms"] = row["hop_median_ms"]
                made, served = counts[kind, shape]
                # Note [Outputs made in a slot]: the share of outputs sent from the slot the model made them in
                row["made_in_slot"] = made / served if served else None
                row["result_ok"] = ok[kind, shape]
                if kind in BUNDLE_OF:
                    _compare_with_single(row, rows, BUNDLE_OF[kind])
                rows.append(row)
        left = p.stop()
        if left["left"] != {"slots": [], "sockets": []}:
            log.warning("left behind: %s", left["left"])
    if floor is not None:
        rows = floor.rows(transport) + rows
    vs_floor(rows)
    for row in rows:
        _print(row)
    return rows


def _compare_with_single(row: dict, rows: list[dict], single: str) -> None:
    """``vs_single``: a bundle row's hop median over the one-tensor row of ``single`` at the same
    stage and transport (None when that was not measured)."""
    one = next((r for r in rows if r["block"] == single and r["transport"] == row["transport"]
                and r["shape"] == row["shape"] and r.get("device") == row.get("device")), None)
    base = None if one is None else one.get("hop_median_ms")
    row["single_hop_median_ms"] = base
    row["vs_single"] = row["hop_median_ms"] / base if base and row.get("hop_median_ms") is not None else None


def _slot_counts(p, names) -> tuple[int, int]:
    """(outputs made in a slot, requests served) summed over these blocks, from their pings."""
    pings = [p.command(nm, "ping") for nm in names]
    return sum(q.get("outputs_made_in_slot", 0) for q in pings), sum(q.get("served", 0) for q in pings)


#: A relay: the least a Python process on a PUSH/PULL hop can do (receive, send the same parts on).
RELAY = """
import struct, sys, time, zmq
ctx = zmq.Context()
pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
pull.bind(sys.argv[1])
push.connect(sys.argv[2])
sys.stdout.write("ready\\n"); sys.stdout.flush()
while True:
    frames = pull.recv_multipart(copy=False)
    if frames[0].bytes == b"stop":
        push.send_multipart(frames)
        break
    frames.append(struct.pack("<d", time.perf_counter()))  # its t_out: CLOCK_MONOTONIC, like a block's
    push.send_multipart(frames, copy=False)
"""


def _floor_header(shape, chain: int, shapes=None) -> bytes:
    """A header as long as the blocks' own at that point of a chain: the floor sends the same parts
    (``shapes``: a bundle's members, one descriptor each under ``xs``)."""
    from blockflow.tensormq.wire import contiguous_stride, dumps

    def describe(s):
        return {"dtype": "float32", "shape": list(s), "stride": list(contiguous_stride(s)), "loc": "shm",
                "seg": "dispatcher-0.123456.1", "gen": 123456, "off": 0, "nbytes": math.prod(s) * 4}
    value = {"x": describe(shape)} if shapes is None else {"xs": [describe(m) for m in shapes]}
    hop = {"b": "i0", "wait": 0.123456789, "deser": 0.0123456789, "dev": 0.000123456, "inf": 0.0123456789,
           "share": 0.00123456, "t_in": 123456.123456, "t_out": 123456.123456}
    path = [[f"i{k}", f"ipc:///tmp/bfs-abcdefgh/sock/i{k}-0.sock"] for k in range(1, chain)]
    return dumps({"v": 1, "t": "data", "rid": 1234567890123456789, "task": "identity-long",
                  "path": path + [["@return", "ipc:///tmp/bfs-abcdefgh/sock/dispatcher-0.sock"]], **value,
                  "hops": [hop] * (chain // 2)})


def _swept(shape):
    """Two copies of the tensor's bytes in the measuring process, as a BlockFlow round trip makes
    them outside the hops (the client's send and the dispatcher's copy into a slot, the result's
    way back): the ``floor-cold`` rows make them before each round trip, so that a relay wakes
    the way a block does in the chains: with what the copies evicted from the caches (32 MB of
    L3 on the 2-core VM) to fetch again. The copies come before the trip, so the relays' stamps,
    which give the hop, do not hold them; the round trips (``rtt*``) do."""
    nbytes = math.prod(shape) * 4
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)

    def sweep():
        dst.copy_(src)
        src.copy_(dst)
    return sweep


#: What a table prints for a figure that is not one (Note [Not measured]).
NOT_MEASURED = "not measured"
#: The rows of the floor (bare relays), not of blocks.
FLOOR_KINDS = ("floor", "floor-cold", "floor-bundle")


class Floor:
    """The floor of a hop on this machine, in the same run as the blocks: chains of 1 and K relay
    processes (pyzmq only) passing the parts a BlockFlow hop passes -- the header alone
    (tensormq), the header and the tensor's bytes (zeromq) -- over ipc:// PUSH/PULL sockets; at
    ``bundle_sizes`` also a bundle's parts (``floor-bundle``: three descriptors, and with zeromq
    three frames). The relays live as long as the object, so that ``measure`` samples the floor
    in each of its rounds, between the blocks' samples (Note [Not measured])."""

    def __init__(self, sizes: list[tuple], chain: int, bundle_sizes=()):
        import subprocess
        import zmq
        self.sizes, self.chain, self.bundle_sizes = sizes, chain, list(bundle_sizes)
        self.work = tempfile.mkdtemp(prefix="bf-hop-floor-")
        self.ctx = zmq.Context()
        self.back = self.ctx.socket(zmq.PULL)
        self.back.linger = 0
        self.back.bind(f"ipc://{self.work}/back")
        self.procs, self.heads = [], []
        #: (transport, kind, shape) -> one (short, long, stamps) per round
        self.samples: dict[tuple, list] = {}
        try:
            for k, tag in ((1, "s"), (chain, "l")):
                addrs = [f"ipc://{self.work}/{tag}{i}" for i in range(k)] + [f"ipc://{self.work}/back"]
                self.procs += [subprocess.Popen([sys.executable, "-c", RELAY, addrs[i], addrs[i + 1]],
                                                stdout=subprocess.PIPE) for i in range(k)]
                head = self.ctx.socket(zmq.PUSH)
                head.linger = 0
                head.connect(addrs[0])
                self.heads.append(head)
            for proc in self.procs:
                proc.stdout.readline()
            self.poller = zmq.Poller()
            self.poller.register(self.back, zmq.POLLIN)
            self.frames = {}
            for shape in sizes:
                self.frames["tensormq", "floor", shape] = [_floor_header(shape, chain)]
                self.frames["zeromq", "floor", shape] = [_floor_header(shape, chain),
                                                         torch.randn(*shape).view(torch.uint8).reshape(-1).numpy()]
            for shape in self.bundle_sizes:
                shapes = bundle_shapes(shape)
                self.frames["tensormq", "floor-bundle", shape] = [_floor_header(shape, chain, shapes)]
                self.frames["zeromq", "floor-bundle", shape] = [_floor_header(shape, chain, shapes)] + [
                    torch.randn(*m).view(torch.uint8).reshape(-1).numpy() for m in shapes]
        except BaseException:
            self.close()
            raise

    def trip(self, sock, frames):
        sock.send_multipart(frames, copy=False)
        if not self.poller.poll(30_000):
            raise TimeoutError("a relay of the floor measurement did not answer within 30 s")
        got = self.back.recv_multipart(copy=False)
        return [{"t_out": struct.unpack("<d", f.bytes)[0]} for f in got[len(frames):]]

    def sample_round(self, transport: str, n: int, budget: float, least: int) -> None:
        """One round of every floor row of ``transport`` (its sizes, the cold floor, bundles)."""
        short_sock, long_sock = self.heads
        todo = [("floor", s) for s in self.sizes] + [("floor-bundle", s) for s in self.bundle_sizes]
        for kind, shape in todo:
            frames = self.frames[transport, kind, shape]
            variants = [(kind, None)]
            if transport == "tensormq" and kind == "floor":
                variants.append(("floor-cold", _swept(shape)))
            for name, before in variants:
                def go(sock, before=before):
                    if before is not None:
                        before()
                    return self.trip(sock, frames)
                if (transport, name, shape) not in self.samples:
                    for _ in range(3):  # warm-up, once
                        go(short_sock)
                        go(long_sock)
                self.samples.setdefault((transport, name, shape), []).append(
                    _sample(lambda: go(short_sock), lambda: go(long_sock), n, budget, least))

    def rows(self, transport: str) -> list[dict]:
        out = []
        for (t, kind, shape), per_round in self.samples.items():
            if t == transport:
                row = _row(transport, kind, shape, "cpu", self.chain, per_round,
                           shapes=bundle_shapes(shape) if kind == "floor-bundle" else None)
                row.update({"hop_wait_ms": None, "hop_deser_ms": None, "hop_inf_ms": None, "hop_share_ms": None})
                row["transport_ms"] = row["hop_median_ms"]
                out.append(row)
        return out

    def close(self) -> None:
        import subprocess
        for head in self.heads:
            try:
                head.send_multipart([b"stop"])
            except Exception:
                pass
        for proc in self.procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for sock in (self.back, *self.heads):
            sock.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.work, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def summary(rows: list[dict]) -> str:
    """Per size: the floor, the identity hop (median / p99) and the copying hop's transport
    cost, both transports, measured in the blocks; the issue's two goals are identity <= 0.10 ms
    and copy tensormq/zeromq <= 0.5. The last column is the round-trip-difference cross-check
    of the identity TensorMQ hop."""
    def get(kind, transport, shape, key):
        for r in rows:
            if r["block"] == kind and r["transport"] == transport and r["shape"] == shape:
                return NOT_MEASURED if key in r.get("not_measured", {}) else r.get(key)
        return None

    def f(v, digits=3):
        return v if isinstance(v, str) else "-" if v is None else f"{v:.{digits}f}"

    def num(v):
        return v if isinstance(v, (int, float)) else None
    lines = ["| shape | MB | floor tmq | floor tmq after copies | identity tmq (p99) | identity tmq / floor (rounds) | "
             "floor zmq | identity zmq (p99) | copy transport tmq | "
             "copy transport zmq | copy tmq/zmq | identity tmq, round trips | identity cross-node (p99) | "
             "copy transport cross-node |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for shape in sorted({tuple(r["shape"]) for r in rows}, key=lambda s: (s[0], -math.prod(s))):
        shape = list(shape)
        ct, cz = num(get("copy", "tensormq", shape, "transport_ms")), num(get("copy", "zeromq", shape, "transport_ms"))
        ratio, spread = get("identity", "tensormq", shape, "vs_floor"), get("identity", "tensormq", shape, "vs_floor_spread")
        lines.append("| " + " | ".join([
            "x".join(map(str, shape)), f"{math.prod(shape) * 4 / 1e6:.1f}",
            f(get("floor", "tensormq", shape, "hop_median_ms")),
            f(get("floor-cold", "tensormq", shape, "hop_median_ms")),
            f"{f(get('identity', 'tensormq', shape, 'hop_median_ms'))} ({f(get('identity', 'tensormq', shape, 'hop_p99_ms'))})",
            "-" if ratio is None else f"{ratio:.2f}x ({spread[0]:.2f}-{spread[1]:.2f})",
            f(get("floor", "zeromq", shape, "hop_median_ms")),
            f"{f(get('identity', 'zeromq', shape, 'hop_median_ms'))} ({f(get('identity', 'zeromq', shape, 'hop_p99_ms'))})",
            f(ct), f(cz), "-" if ct is None or not cz else f"{ct / cz:.2f}",
            f(get("identity", "tensormq", shape, "per_hop_paired_median_ms")),
            f"{f(get('identity', CROSS_NODE, shape, 'hop_median_ms'))} ({f(get('identity', CROSS_NODE, shape, 'hop_p99_ms'))})",
            f(get("copy", CROSS_NODE, shape, "transport_ms"))]) + " |")
    bundles = bundle_summary(rows)
    return "\n".join(lines) + (("\n\n" + bundles) if bundles else "")


def bundle_summary(rows: list[dict]) -> str:
    """Per bundle row: the same bytes as one tensor and as three, hop medians side by side, and
    the floors of both messages."""
    def one(kind, r):
        return next((q for q in rows if q["block"] == kind and q["transport"] == r["transport"]
                     and q["shape"] == r["shape"]), None)

    def f(v, digits=3):
        return "-" if v is None else f"{v:.{digits}f}"
    found = [r for r in rows if r["block"] in BUNDLE_OF]
    if not found:
        return ""
    lines = ["| transport | block | shape (members) | MB | one tensor: hop median | three: hop median (p99) | "
             "three / one | floor one | floor three | result |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in found:
        fl1, fl3 = one("floor", r), one("floor-bundle", r)
        lines.append("| " + " | ".join([
            r["transport"], r["block"], "x".join(map(str, r["shape"])) + " (" + " + ".join(
                "x".join(map(str, m)) for m in r["shapes"]) + ")", f"{r['mbytes']:.1f}",
            f(r.get("single_hop_median_ms")), f"{_fig(r, 'hop_median_ms')} ({_fig(r, 'hop_p99_ms')})",
            f(r.get("vs_single"), 2), f(fl1 and fl1["hop_median_ms"]), f(fl3 and fl3["hop_median_ms"]),
            "ok" if r.get("result_ok") else "WRONG"]) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], out: str) -> None:
    """One panel per kind of block; in each, one line per transport and batch size, and the
    bundle rows of that kind as points beside them (same bytes, three tensors)."""
    from experiments.common import pyplot, save_fig
    plt = pyplot()
    # a figure that is not one is not drawn (Note [Not measured]): its transport_ms and hop_median_ms are None
    rows = [r for r in rows if r.get("transport_ms") is not None and r.get("hop_median_ms") is not None]
    kinds = [k for k in KINDS if k not in BUNDLE_OF and any(r.get("block", "identity") in (k, f"bundle-{k}")
                                                             for r in rows)]
    if not kinds:
        log.warning("no hop was measured (Note [Not measured]): no plot written")
        return
    fig, axes = plt.subplots(1, len(kinds), figsize=(7 * len(kinds), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for t in sorted({r["transport"] for r in rows}):
            for b in sorted({r["shape"][0] for r in rows}):
                rs = sorted((r for r in rows if r["transport"] == t and r["shape"][0] == b
                             and r.get("block", "identity") == kind), key=lambda r: r["mbytes"])
                three = sorted((r for r in rows if r["transport"] == t and r["shape"][0] == b
                                and r["block"] == f"bundle-{kind}"), key=lambda r: r["mbytes"])
                if three:  # the same bytes as three tensors in one message
                    ax.plot([r["mbytes"] for r in three], [max(r["transport_ms"], 1e-3) for r in three], "^",
                            ms=8, mfc="none", label=f"{t}, batch {b}, 3 tensors")
                if not rs:
                    continue
                key = "hop_median_ms" if kind == "identity" else "transport_ms"
                ax.plot([r["mbytes"] for r in rs], [max(r[key], 1e-3) for r in rs], "o-" if t == "tensormq" else "s--",
                        color=ax.lines[-1].get_color() if three else None, label=f"{t}, batch {b}")
                fl = sorted((r for r in rows if r["transport"] == t and r["shape"][0] == b and r["block"] == "floor"),
                            key=lambda r: r["mbytes"])
                color = ax.lines[-1].get_color()
                if fl:  # what two bare pyzmq processes need for the same parts, measured in the same run
                    ax.plot([r["mbytes"] for r in fl], [max(r["hop_median_ms"], 1e-3) for r in fl], ":",
                            color=color, label=f"floor ({t} parts), batch {b}")
                cold = sorted((r for r in rows if r["transport"] == t and r["shape"][0] == b
                               and r["block"] == "floor-cold"), key=lambda r: r["mbytes"])
                if cold and kind == "identity":
                    ax.plot([r["mbytes"] for r in cold], [max(r["hop_median_ms"], 1e-3) for r in cold], "-.",
                            color=color, lw=0.8, label=f"floor after the round trip's copies, batch {b}")
        if kind == "identity":
            ax.axhline(0.10, color="grey", lw=0.8, ls="--", label="goal 0.10 ms")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tensor size (MB)")
        ax.set_ylabel("per hop minus the block's compute, median (ms)")
        ax.set_title("identity blocks (handle forwarded)" if kind == "identity" else "copying blocks (x + 1)")
        ax.legend(fontsize=8)
    save_fig(fig, out, "hop_overhead.png")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.hop_overhead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer samples and sizes (smoke run)")
    ap.add_argument("--n", type=int, help="most samples per size, all rounds together (default 200, quick 20)")
    ap.add_argument("--rounds", type=int, help="interleaved rounds: each samples the floor and every kind of block at "
                                               "every size once (default 5, quick 2); a figure is the median of its "
                                               "rounds' medians, with their spread (Note [Not measured])")
    ap.add_argument("--budget", type=float, help="seconds of sampling per size once --least samples are in "
                                                 "(default 1.0, quick 0.3)")
    ap.add_argument("--least", type=int, help="fewest samples per size (default 10, quick 5)")
    ap.add_argument("--chain", type=int, help="blocks in the long chain (default 4, quick 3; at least 3: the "
                                              "first and the last block's hops are not counted)")
    ap.add_argument("--transports", default=",".join(TRANSPORTS),
                    help=f"default {','.join(TRANSPORTS)}; {CROSS_NODE}: TensorMQ blocks on two nodes in turn, every "
                         "hop between nodes as bytes over CURVE TCP (Ray mode's hop; here all on this machine)")
    ap.add_argument("--device", default="cpu", help="where the blocks run: cpu, cuda or cuda:N")
    ap.add_argument("--blocks", default="identity,copy,bundle-identity,bundle-copy",
                    help="kinds of block (default all): identity, copy, and bundle-identity, bundle-copy (three "
                         "tensors per message, the same bytes as one of the stage)")
    ap.add_argument("--bundle-stages", help="stages of the bundle rows: 'all' (those of --stages) or a list "
                                            "(default block1, or the first of --stages without it)")
    ap.add_argument("--no-floor", action="store_true", help="skip the floor rows (bare pyzmq relays)")
    ap.add_argument("--batches", help="batch sizes (default 1,32; quick 1)")
    ap.add_argument("--stages", help=f"ResNet50 stage outputs to send (default all; quick block1,block4): "
                                     f"{','.join(STAGES)}")
    ap.add_argument("--out", help="results directory (default experiments/results/<machine>)")
    args = ap.parse_args(argv)
    n = args.n or (20 if args.quick else 200)
    budget = args.budget if args.budget is not None else (0.3 if args.quick else 1.0)
    least = min(n, args.least or (5 if args.quick else 10))
    rounds = args.rounds or (2 if args.quick else 5)
    if rounds < 1:
        ap.error("--rounds must be at least 1")
    chain = args.chain or (3 if args.quick else 4)  # 4: two hops per request, as many as 3 gave when the last counted
    if chain < 3:
        ap.error("--chain must be at least 3 (a hop is measured between two consecutive blocks that both send to a "
                 "block; the last one sends to the dispatcher)")
    batches = [int(b) for b in args.batches.split(",")] if args.batches else ([1] if args.quick else [1, 32])
    stages = args.stages.split(",") if args.stages else (["block1", "block4"] if args.quick else list(STAGES))
    kinds = args.blocks.split(",")
    if args.bundle_stages == "all":
        bundle_stages = stages
    elif args.bundle_stages:
        bundle_stages = args.bundle_stages.split(",")
    else:
        bundle_stages = ["block1" if "block1" in stages else stages[0]]
    unknown = [s for s in stages + bundle_stages if s not in STAGES] + [k for k in kinds if k not in KINDS]
    if unknown:
        ap.error(f"unknown stage or block kind: {', '.join(unknown)}")
    sizes = [(b, *STAGES[s]) for b in batches for s in stages]
    bundled = any(k in BUNDLE_OF for k in kinds)
    bundle_sizes = [(b, *STAGES[s]) for b in batches for s in bundle_stages] if bundled else []
    transports = args.transports.split(",")
    started = time.monotonic()
    unknown = [t for t in transports if t not in TRANSPORTS]
    if unknown:
        ap.error(f"unknown transport: {', '.join(unknown)} (choose from {', '.join(TRANSPORTS)})")
    rows = []
    with contextlib.ExitStack() as stack:
        floor = None if args.no_floor else stack.enter_context(Floor(sizes, chain, bundle_sizes))
        for t in transports:
            # between nodes the one-tensor kinds say what the hop costs; bundles add nothing there
            mine = [k for k in kinds if t != CROSS_NODE or k not in BUNDLE_OF]
            # a relay has no notion of nodes: the cross-node rows have no floor
            mine_floor = floor if t != CROSS_NODE else None
            if mine:
                rows += measure(t, sizes, n, chain, args.device, mine, budget, least, bundle_sizes, rounds, mine_floor)
            elif mine_floor is not None:
                for _ in range(rounds):
                    mine_floor.sample_round(t, max(1, math.ceil(n / rounds)), budget / rounds,
                                            max(2, math.ceil(least / rounds)))
                rows += mine_floor.rows(t)
    print(summary(rows))
    print(f"took {time.monotonic() - started:.0f} s")
    from experiments.common import env_info, results_dir, write_json
    out = results_dir(args.out)
    write_json(out, "hop_overhead", {"env": env_info(),
                                     "settings": {"n": n, "budget_s": budget, "least": least, "chain": chain, "rounds": rounds,
                                                  "quick": args.quick, "device": args.device, "blocks": args.blocks,
                                                  "floor": not args.no_floor, "batches": batches, "stages": stages,
                                                  "bundle_stages": bundle_stages if bundled else [],
                                                  "bundle_split": list(SPLIT)},
                                     "rows": rows})
    try:
        plot(rows, out)
    except ImportError:  # matplotlib is in the [bench] extra
        log.warning("matplotlib is missing; no plot written")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
