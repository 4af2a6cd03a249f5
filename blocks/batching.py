"""Dynamic batching at a block, across tasks (issue 15; Rafiqi's adaptive batch size).

A block with a ``batching`` policy takes up to ``max_batch`` waiting requests whose tensors agree
in everything but the batch dimension (dtype, device, trailing shape), from any task, waits at
most the current delay for more, runs them as one batch and splits the output back to each
request's own remaining path. A request that carries several tensors (a bundle,
tensormq/bundle.py) batches with others of the same members: each member is concatenated
along dimension 0, and each member of the output split back.

How a batch is built and split, and where the bytes move (TensorMQ, shared memory)::

    request tensors, each a view of its own input slot (mapped: received without a copy)
         |  torch.cat(dim=0)              <- copy 1 (batches of two or more): every request's rows
         |                                   into one new tensor; then the input slots go back
         v
    model(batch)                          <- one inference; the model allocates its own output
         |  output.split(sizes, dim=0)    <- views of that output, no copy
         v
    each request's rows -> a slot of its next hop's window   <- copy 2, one per request

Slots and batches: once ``torch.cat`` has copied the inputs, nothing reads the input slots
again, so :func:`run_batch` calls ``inputs_copied`` right then and the block gives every slot of
the batch back to its producer before the inference. Holding them until each output was sent
(what a request alone does, where the output may be a view of its input) would keep a whole
window of the upstream edge (``BLOCKFLOW_WINDOW``, 8 slots) for a whole batch, and the upstream
block would wait, idle, for as long: two batching neighbours would run in turn instead of
together. On a GPU the block synchronizes before it gives the slots back, since the copy is only queued
when ``torch.cat`` returns. A batch of one is not copied and keeps its slot as an unbatched request does.

Copy 2 is the same copy an unbatched block makes for an output that is not a view of its input
(an unbatched identity-like block forwards its input's handle instead; in a batch its rows are
rows of the ``torch.cat`` copy, so they are copied). The split itself copies nothing, but the
rows cannot go on without a copy: the model, not the block, allocates the output (a TorchScript
module has no ``out=``), and every request needs a slot of its own, released on its own by the
consumer and often on another edge (the two tasks' paths part after the shared blocks). A slot
shared by a batch's requests would need a reference count across consumers that TensorMQ's
slot generations do not have. On a GPU both copies stay on the device (``torch.cat`` there, CUDA
slots for the outputs); over the ZeroMQ transport or to a TCP hop every output travels as bytes,
batched or not. For ResNet50 on the 2-core CPU copy 2 took 0.3-1 ms per image per block (p50 of
the ``share`` KPI, experiments/batching.py at 20 req/s) and copy 1 moves the same bytes once more,
against 30-80 ms of inference per image per block.

Requests that cannot join a batch (another shape or dtype) run in a batch of their own; a batch
whose inference raises is run again one request at a time, so one bad request fails only itself.

The delay (``max_queue_delay_us``) is either fixed or ``"auto"``. With a fixed delay the block
takes every compatible request waiting (up to ``max_batch``) and waits that long for more. With
``"auto"`` :class:`DelayController` keeps exponential moving averages of the gap between arrivals
and of the inference time per request at each batch size it has run, and decides two things:

- how many waiting requests to take (:meth:`DelayController.take`). A block that keeps up with its
  arrivals (gap >= inference time per request, and fewer than ``max_batch`` waiting) takes one
  request at a time, as an unbatched block does, unless batches of that size have been measured to
  pay for themselves in latency: ``k`` requests run as one batch all finish when the batch does,
  where one at a time the first finishes after one inference, so the batch only lowers their mean
  latency when it is at least ``2k / (k + 1)`` times cheaper per request (1.33x for 2, 1.6x for 4).
  On a CPU a batch is rarely that much cheaper (experiments/batching.py measures it), on a GPU it
  usually is. A block that does not keep up takes everything waiting, up to ``max_batch``, unless
  batches of that size (or of the nearest size measured) were measured no cheaper per request than
  one request alone: they would add latency and no throughput, so it runs one at a time again.
  Every ``EXPLORE_EVERY``-th decision under load takes the batch anyway, so that the estimate
  follows a load or a machine that changes.
- how long to wait for more (:meth:`DelayController.delay`). A block that keeps up never waits:
  a lone request at light load runs at once (its ``batch_wait`` KPI is 0). Under load it waits at
  most for the requests expected within half a batch's inference time (and never above
  ``AUTO_MAX_DELAY``), and a batch that took longer than the block's budget halves the delay.
"""
from __future__ import annotations

import torch

from blockflow.tensormq import bundle
# a block's `batching` object is part of the update schema, which the control plane checks without torch
from blockflow.core.schema import BatchPolicy

#: Longest wait ``auto`` ever chooses (seconds).
AUTO_MAX_DELAY = 0.005


class DelayController:
    """How many waiting requests to take and how long to wait for more (see the module note)."""

    ALPHA = 0.2   #: weight of the newest sample in the moving averages
    EXPLORE_EVERY = 64  #: under load, one decision in this many batches even where batching did not pay

    def __init__(self, policy: BatchPolicy, budget_s: float | None = None):
        self.policy = policy
        self.budget_s = budget_s           #: a batch slower than this halves the auto delay
        self.gap_s: float | None = None    #: EMA of the time between arrivals
        self.service_s: float | None = None  #: EMA of a batch's inference time
        self.per_request_s: float | None = None  #: EMA of inference time per request, any batch size
        self.cost_s: dict[int, float] = {}  #: batch size -> EMA of inference time per request
        self.last_arrival: float | None = None
        self.scale = 1.0                   #: halved on a budget miss, recovers slowly
        self.loaded_decisions = 0          #: decisions taken under load (paces the exploration)

    def arrived(self, now: float) -> None:
        if self.last_arrival is not None:
            self.gap_s = self._ema(self.gap_s, max(now - self.last_arrival, 0.0))
        self.last_arrival = now

    def served(self, batch_size: int, seconds: float) -> None:
        n = max(batch_size, 1)
        self.service_s = self._ema(self.service_s, seconds)
        self.per_request_s = self._ema(self.per_request_s, seconds / n)
        self.cost_s[n] = self._ema(self.cost_s.get(n), seconds / n)
        if self.budget_s is not None and seconds > self.budget_s:
            self.scale = max(self.scale / 2, 1 / 64)
        else:
            self.scale = min(self.scale * 1.05, 1.0)

    def _ema(self, old: float | None, sample: float) -> float:
        return sample if old is None else (1 - self.ALPHA) * old + self.ALPHA * sample

    def keeps_up(self, queued: int) -> bool:
        """The block serves requests faster than they arrive (nothing known yet counts as yes)."""
        if queued >= self.policy.max_batch:
            return False
        return self.gap_s is None or self.per_request_s is None or self.gap_s >= self.per_request_s

    def pays(self, k: int) -> bool:
        """A batch of ``k`` was measured cheap enough per request to lower the mean latency of
        ``k`` waiting requests against running them one after another (the module note)."""
        one, batch = self.cost_s.get(1), self.cost_s.get(k)
        return one is not None and batch is not None and batch * 2 * k <= one * (k + 1)

    def cheaper(self, k: int) -> bool | None:
        """A batch of ``k`` (or, never measured, of the nearest size measured above 1) was measured
        cheaper per request than one request alone; None: nothing measured yet."""
        one = self.cost_s.get(1)
        sizes = [n for n in self.cost_s if n > 1]
        if one is None or k <= 1 or not sizes:
            return None
        near = min(sizes, key=lambda n: (abs(n - k), -n))
        return self.cost_s[near] < one

    def take(self, queued: int) -> int:
        """How many of the ``queued`` waiting requests to run now (before grouping by shape)."""
        n = min(queued, self.policy.max_batch)
        if not self.policy.auto or n <= 1:
            return n
        if self.keeps_up(queued):
            return n if self.pays(n) else 1
        self.loaded_decisions += 1
        if self.cheaper(n) is False and self.loaded_decisions % self.EXPLORE_EVERY:
            return 1
        return n

    def delay(self, queued: int) -> float:
        """Seconds to wait for more requests when ``queued`` are waiting now."""
        p = self.policy
        if queued >= p.max_batch:
            return 0.0
        if not p.auto:
            return p.max_queue_delay_us / 1e6
        if self.keeps_up(queued) or self.service_s is None:
            return 0.0          # the block keeps up: waiting would only add latency
        expected = min(p.max_batch - queued, max(int(self.service_s / 2 / max(self.gap_s, 1e-6)), 0))
        if self.cheaper(queued + expected) is False:
            return 0.0          # that batch was measured no cheaper per request: not worth a wait
        return min(expected * self.gap_s, self.service_s / 2, AUTO_MAX_DELAY) * self.scale


def batch_key(t) -> tuple:
    """Inputs with equal keys can be concatenated along dimension 0: a tensor's dtype, device
    and trailing shape; a bundle's, member by member, with its keys (tensormq/bundle.py)."""
    if not isinstance(t, torch.Tensor):
        members, keys = bundle.flatten(t)
        if any(m.dim() == 0 for m in members) or len({m.shape[0] for m in members}) != 1:
            return ("alone", id(t))  # members that disagree on rows cannot be batched by rows
        return ("bundle", tuple(keys or ()), *(batch_key(m) for m in members))
    if t.dim() == 0:
        return ("scalar", id(t))    # a 0-d tensor has no batch dimension: it always runs alone
    return (t.dtype, t.device, tuple(t.shape[1:]))


def rows(t) -> int:
    """Rows of a request's input along dimension 0 (a bundle's: its members agree, batch_key)."""
    return bundle.first(t).shape[0]


def plan_batches(tensors: list, policy: BatchPolicy) -> list[list[int]]:
    """Group indexes of ``tensors`` into batches, oldest first, each at most ``max_batch`` and, where
    ``preferred`` sizes are given, cut to the largest preferred size that fits."""
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(batch_key(t), []).append(i)
    batches: list[list[int]] = []
    for idx in groups.values():
        while idx:
            n = min(len(idx), policy.max_batch)
            fitting = [p for p in policy.preferred if p <= n]
            if fitting:
                n = fitting[-1]
            batches.append(idx[:n])
            idx = idx[n:]
    batches.sort(key=lambda b: b[0])
    return batches


def concat(tensors: list):
    """One batch of the requests' inputs: a tensor, or a bundle whose members are each
    concatenated along dimension 0."""
    if len(tensors) == 1:
        return tensors[0]
    if isinstance(tensors[0], torch.Tensor):
        return torch.cat(tensors, dim=0)
    flat = [bundle.flatten(t) for t in tensors]
    keys = flat[0][1]
    return bundle.assemble([torch.cat([f[0][i] for f in flat], dim=0) for i in range(len(flat[0][0]))], keys)


def split(output, sizes: list[int]) -> list:
    """Views of ``output`` along dimension 0, one per request (a bundle: every member is split
    and each request gets a bundle of its rows)."""
    if len(sizes) == 1:
        return [output]
    if not isinstance(output, torch.Tensor):
        members, keys = bundle.flatten(output, "the model's output")
        parts = [split(m, sizes) for m in members]
        return [bundle.assemble([p[i] for p in parts], keys) for i in range(len(sizes))]
    if output.dim() == 0 or output.shape[0] != sum(sizes):
        raise ValueError(f"the model returned batch dimension {tuple(output.shape)[:1]} for {sum(sizes)} rows: "
                         "a block with batching must keep dimension 0 as the batch")
    return list(output.split(sizes, dim=0))


def run_batch(model, tensors: list[torch.Tensor], inputs_copied=None) -> list[torch.Tensor | Exception]:
    """Run ``tensors`` (each a tensor or a bundle) as one batch; if that fails, run each alone so one bad request fails only itself.

    With more than one tensor the batch is a copy (``torch.cat``): ``inputs_copied()`` is called
    right after it, before the inference, so the caller can give the requests' input slots back
    to the block upstream at once (see "Slots and batches" in the module note). The fallback then
    runs each request on its rows of that copy, never on the released inputs."""
    if len(tensors) == 1:
        try:
            return [model(tensors[0])]
        except Exception as exc:
            return [exc]
    batch = concat(tensors)
    if inputs_copied is not None:
        inputs_copied()
    sizes = [rows(t) for t in tensors]
    try:
        return split(model(batch), sizes)
    except Exception:
        pass
    out: list[torch.Tensor | Exception] = []
    for part in _row_parts(batch, sizes):
        try:
            out.append(model(part))
        except Exception as exc:
            out.append(exc)
    return out


def _row_parts(batch, sizes: list[int]) -> list:
    """Each request's rows of a batch (tensor or bundle), as views."""
    if isinstance(batch, torch.Tensor):
        return list(batch.split(sizes, dim=0))
    members, keys = bundle.flatten(batch)
    parts = [m.split(sizes, dim=0) for m in members]
    return [bundle.assemble([p[i] for p in parts], keys) for i in range(len(sizes))]
