"""What runs a request in a block: its model on its device, CUDA graphs, and the GPU clock.

``BlockRunner`` is the part of a block process that computes; ``blocks/process.py`` keeps the
sockets, threads and the request's way through them. Tests drive a runner without any socket.

On a CPU a runner calls the model, nothing more. On a GPU it

- replays a **CUDA graph** per input shape (``GraphCache``; for a block that takes several
  tensors, a transformer's hidden states and mask, per shape of every member: ``graph_key``):
  captured the first time the shape is seen (or before the block reports ready, for the shapes
  its update declares and its manifest's buckets of a dynamic dimension: ``warm_up``),
  at most ``max_graphs`` of them; a later shape runs eager. A capture that fails (an operation
  that synchronises, data-dependent control flow) is logged once with its reason and that shape
  runs eager from then on. The request's tensor is copied into the graph's static input (one
  device-to-device copy on the stream; the graph cannot be captured on slot addresses, which
  change with every message), and the graph's static output is what the block sends on: the
  transport copies it into the next hop's slot on the same stream, before the next replay can
  overwrite it.
- queues everything on **its own CUDA stream** (``on_stream``), so blocks sharing a process
  do not wait for one another's kernels.
- keeps the **GPU clock** of a request (``GpuClock``): CUDA events recorded on the stream
  between the stages (input ready, on the device, model done, output in its slot), read after
  the fact, once the block has synchronised on its last event *after* it sent the output on.

Note [GPU hand-over order]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Between two GPU blocks no host waits for the GPU before a handle is sent: the producer queues
the copy of its output into the consumer's slot and records that slot's inter-process event
(tensormq/cuda_ipc.py, ``CudaSlot.fill``), then sends at once; the consumer's stream waits on
the event (``CudaMapper.open``) and the consumer queues its own work behind it. A block
synchronises with its own stream once per request, *after* its send (``BlockRunner.finish``):
only then are its input slot released (the producer may then overwrite it: nothing queued here
still reads it) and its stage times read. So the host-side work of block b+1 (receive, open,
launch) overlaps the GPU work of block b, and the only wait on the critical path is the last
block's copy to the host. ``BLOCKFLOW_CUDA_HANDOVER=sync`` makes producers synchronise before
they send instead (the behaviour before stream ordering; kept to measure against).
"""
from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict

import torch

from blockflow.tensormq import bundle

log = logging.getLogger("blockflow.block")

#: CUDA graphs a block keeps at most (one per input shape); further shapes run eager.
MAX_GRAPHS = 16
#: Eager calls on a side stream before a capture: TorchScript's profiling executor specialises
#: a graph on its first calls, and cuDNN/cuBLAS pick their algorithms and workspaces then.
CAPTURE_WARM_CALLS = 3
#: Batch sizes warmed up for a batching block whose max_batch is at most this: every one of them.
WARM_ALL_BATCHES_UP_TO = 16

# Note [One block sets up CUDA at a time]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Blocks sharing a process (blocks/host.py) start on their own threads, all at once. Seen on an
# H100 (torch 2.11, cuDNN 9): seven ResNet18 blocks warming up together in one process failed
# with CUDNN_STATUS_BAD_PARAM_STREAM_MISMATCH in one block's eager convolution while the others
# warmed up and captured on their own streams; the same blocks in one process one after the
# other (experiments/memory_model.py's group) did not. So what sets CUDA up holds this lock: the
# context's stack limit (set once per device and process, not once per block: cuCtxSetLimit acts
# on the whole context), a block's warm-up (its eager calls and captures) and a capture at run
# time. Requests of the other blocks keep running meanwhile (captures are thread-local); a block
# of its own process takes the lock uncontended.
SETUP_LOCK = threading.RLock()


class GraphCache:
    """The model as one CUDA graph per (dtype, shape) of its input, eager where none fits."""

    def __init__(self, model, device: torch.device, name: str, max_graphs: int = MAX_GRAPHS,
                 probe_syncs: bool = True):
        self.model, self.device, self.name, self.max_graphs = model, device, name, max_graphs
        #: run the eager calls before a capture with torch's sync debug mode set to "error", so a
        #: model that synchronises (data-dependent control flow, .item()) is refused before a
        #: capture begins: a capture that fails half-way leaves the device's default RNG marked
        #: as capturing. The mode is process-wide, so a block sharing its process with others
        #: (whose threads synchronise) does not probe; its failed captures are still caught.
        self.probe_syncs = probe_syncs
        #: graph_key -> (graph, static input, static output, members handed on: _handed_on)
        self.graphs: OrderedDict[tuple, tuple] = OrderedDict()
        #: (dtype, shape) -> why it runs eager (its capture failed)
        self.refused: dict[tuple, str] = {}
        #: shapes whose output is a view of the input: eager, so the output keeps travelling by the
        #: input's handle (a graph would make it a copy out of the graph's static input)
        self.views: set[tuple] = set()
        self.replays = self.eager_calls = 0

    def __call__(self, x):
        key = graph_key(x)
        entry = self.graphs.get(key)
        if entry is None:
            if key in self.refused or key in self.views or len(self.graphs) >= self.max_graphs:
                self.eager_calls += 1
                return bundle.call(self.model, x)
            with SETUP_LOCK:  # Note [One block sets up CUDA at a time]
                entry = self.capture(x, key)
            if entry is None:
                self.eager_calls += 1
                return bundle.call(self.model, x)
        graph, static_in, static_out, through = entry
        if type(x) is torch.Tensor or isinstance(x, torch.Tensor):
            static_in.copy_(x)
        else:  # a bundle: each member into its own static input, in the bundle's order
            for dst, src in zip(_members(static_in), _members(x)):
                dst.copy_(src)
        graph.replay()
        self.replays += 1
        if through:  # members the model hands on as they came: the request's own, not the static copies
            members, keys = bundle.flatten(static_out, "the model's output")
            given = _members(x)
            for out_i, in_i in through:
                members[out_i] = given[in_i]
            return bundle.assemble(members, keys)
        return static_out

    def capture(self, x, key: tuple, eager_first: int = CAPTURE_WARM_CALLS):
        """Capture the model on a static copy of ``x`` (a tensor, or a bundle: a static copy of
        each member): the cache entry, or None (logged why). ``eager_first``: eager calls
        first (fewer where the model ran this shape before)."""
        stream = torch.cuda.current_stream(self.device)
        try:
            static_in = bundle.apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=self.device), x)
            for dst, src in zip(_members(static_in), _members(x)):
                dst.copy_(src)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(stream)
            before = torch.cuda.get_sync_debug_mode()
            try:
                if self.probe_syncs:
                    torch.cuda.set_sync_debug_mode("error")
                with torch.cuda.stream(side):
                    for _ in range(eager_first):
                        bundle.call(self.model, static_in)
            finally:
                torch.cuda.set_sync_debug_mode(before)
            stream.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread-local: another block's thread in this process may use CUDA meanwhile
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                static_out = bundle.call(self.model, static_in)
            through = _handed_on(static_in, static_out)
            if through is None:
                self.views.add(key)
                log.info("block %s: its output is a view of its input %s: no graph, the output travels by "
                         "the input's handle", self.name, key_text(key))
                return None
        except Exception as exc:  # the capture's reason, once per shape; the shape runs eager
            reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
            self.refused[key] = reason
            log.warning("block %s: no CUDA graph for input %s, it runs eager (%s)", self.name, key_text(key), reason)
            try:
                torch.cuda.synchronize(self.device)  # a failed capture leaves nothing queued behind
            except Exception:
                pass
            return None
        self.graphs[key] = (graph, static_in, static_out, through)
        log.info("block %s: captured a CUDA graph for input %s (%d of at most %d)", self.name, key_text(key),
                 len(self.graphs), self.max_graphs)
        return self.graphs[key]

    def stats(self) -> dict:
        return {"graphs": [key_json(k) for k in self.graphs],
                "refused": {key_text(k) if k[0] == BUNDLE else f"{_dtype_text(k[0])}{list(k[1])}": r
                            for k, r in self.refused.items()},
                "views": [key_json(k) for k in self.views],
                "replays": self.replays, "eager_calls": self.eager_calls}


#: The first item of a bundle's graph key (a tensor's is its dtype).
BUNDLE = "bundle"


def graph_key(x) -> tuple:
    """What a CUDA graph is captured for: a tensor's ``(dtype, shape)``; for a bundle
    (tensormq/bundle.py: a block that takes several tensors, as a transformer's hidden states
    and mask) ``(BUNDLE, its dict keys or None, each member's (dtype, shape))``."""
    if type(x) is torch.Tensor or isinstance(x, torch.Tensor):
        return (x.dtype, tuple(x.shape))
    members, keys = bundle.flatten(x, "the block's input")
    return (BUNDLE, None if keys is None else tuple(keys), tuple((t.dtype, tuple(t.shape)) for t in members))


def _handed_on(static_in, static_out) -> list[tuple[int, int]] | None:
    """How a captured model's output relates to its input: ``[(output member, input member)]``
    for the members of a bundle it returns as they came (BERT's middle block hands on the
    attention mask it was given): on replay those are the request's own tensors, which go on
    by the handle they came with. None where an output is any other view of the input (or a
    tensor model returns its input): no graph then, the shape runs eager."""
    ins = _members(static_in)
    outs = _members(static_out, "the model's output")  # a tensor, or a tuple or dict of them
    storages = {t.untyped_storage().data_ptr(): i for i, t in enumerate(ins)}
    through = []
    for out_i, t in enumerate(outs):
        in_i = storages.get(t.untyped_storage().data_ptr())
        if in_i is None:
            continue
        same = ins[in_i]
        if isinstance(static_out, torch.Tensor) or not (t.data_ptr() == same.data_ptr() and t.shape == same.shape
                                                        and t.stride() == same.stride() and t.dtype == same.dtype):
            return None
        through.append((out_i, in_i))
    return through


def _members(value, what: str = "the block's input") -> list:
    return [value] if isinstance(value, torch.Tensor) else bundle.flatten(value, what)[0]


def _dtype_text(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def key_json(key: tuple) -> list:
    """A graph key as GET /blocks/NAME/ping shows it: [dtype, shape], or a bundle's list of them."""
    if key[0] == BUNDLE:
        return [[_dtype_text(d), list(s)] for d, s in key[2]]
    return [_dtype_text(key[0]), list(key[1])]


def key_text(key: tuple) -> str:
    """A graph key for a log line: ``float32 [1, 3]``, a bundle's ``(bool [1, 1, 8, 8], float32 [1, 8, 256])``."""
    if key[0] == BUNDLE:
        return "(" + ", ".join(f"{_dtype_text(d)} {list(s)}" for d, s in key[2]) + ")"
    return f"{_dtype_text(key[0])} {list(key[1])}"


def zeros_for_key(key: tuple, device) -> torch.Tensor | tuple | dict:
    """A zero input the graph of ``key`` takes (what ``BlockRunner.recapture`` captures on)."""
    if key[0] == BUNDLE:
        members = [torch.zeros(s, dtype=d, device=device) for d, s in key[2]]
        return bundle.assemble(members, None if key[1] is None else list(key[1]))
    return torch.zeros(key[1], dtype=key[0], device=device)


class GpuClock:
    """CUDA events between a request's stages on the block's stream, read after the fact.

    Marks, in order: ``queued`` (before the stream waits for the input's producer), ``ready``
    (the input is there), ``on_device`` (moved to this device / into the graph's input),
    ``inferred`` (the model ran), ``shared`` (the output is in the next hop's slot). One request
    at a time: the block reads them (``ms``) after it synchronised, before the next request."""

    MARKS = ("queued", "ready", "on_device", "inferred", "shared")

    def __init__(self, device: torch.device):
        with torch.cuda.device(device):
            self.events = {m: torch.cuda.Event(enable_timing=True) for m in self.MARKS}
        self.device = device
        self.marked: set[str] = set()

    def mark(self, name: str, stream=None) -> None:
        self.events[name].record(stream if stream is not None else torch.cuda.current_stream(self.device))
        self.marked.add(name)

    def between(self, a: str, b: str) -> float:
        """Milliseconds from mark ``a`` to mark ``b`` on the GPU (0.0 where either is missing)."""
        if a not in self.marked or b not in self.marked:
            return 0.0
        return max(0.0, self.events[a].elapsed_time(self.events[b]))

    def reset(self) -> None:
        self.marked.clear()


def direct_forward(model):
    """What a request calls: a TorchScript module's compiled ``forward`` itself, else the module.

    Note [The model's own forward]: ``module(x)`` enters ``nn.Module._call_impl`` (hook lookups,
    a few Python frames) before the compiled method, on every request. Warm that is ~2 us; in a
    block, which sleeps between requests with its caches taken by other processes, the same
    frames cost ~40 us a call (the 2-core VM: an identity TorchScript block, cold, 160 us as
    ``module(x)`` against 120 us as ``module.forward(x)``, medians of 300). A TorchScript module
    runs no Python hooks of its own (hooks are compiled in, or refused at scripting), so its
    ``forward`` is the same call; any other module keeps its hooks and is called whole."""
    if isinstance(model, torch.jit.ScriptModule) and not (torch.nn.modules.module._global_forward_hooks or
                                                           torch.nn.modules.module._global_forward_pre_hooks):
        return model.forward
    return model


class BlockRunner:
    """A block's model on its device: eager or CUDA graphs, warm-up, and the GPU seam.

    ``cuda_graphs`` only matters on a GPU (on a CPU a runner calls the model). ``stream_ordered``
    is True on a GPU: the block sends before it waits for the GPU (Note [GPU hand-over order])."""

    def __init__(self, model, device: torch.device | str, name: str = "block", cuda_graphs: bool = True,
                 max_graphs: int = MAX_GRAPHS, shared_process: bool = False):
        self.model, self.name = model, name
        self.forward = direct_forward(model)
        self.device = torch.device(device)
        self.on_gpu = self.device.type == "cuda"
        self.graphs = (GraphCache(model, self.device, name, max_graphs, probe_syncs=not shared_process)
                       if self.on_gpu and cuda_graphs else None)
        self.clock = GpuClock(self.device) if self.on_gpu else None
        self.stream_ordered = self.on_gpu
        #: the block's own CUDA stream: blocks sharing a process (blocks/host.py) queue their
        #: work apart, and a block's sync waits for its own work only
        self.stream = torch.cuda.Stream(self.device) if self.on_gpu else None
        #: (dtype, input shape) -> bytes of the one new tensor the warm-up made from such an
        #: input; 0 where it made a view of its input or several tensors (a bundle)
        self.outputs: dict[tuple, int] = {}
        #: the shapes whose graphs a park dropped, captured again when the weights come back
        self.dropped: list[tuple] = []

    def on_stream(self):
        """Context in which the block's thread queues its GPU work (nothing to do on a CPU)."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def __call__(self, x):
        if self.graphs is not None:
            return self.graphs(x)  # a graph per input shape, a bundle's (every member's) too
        if type(x) is not torch.Tensor and not isinstance(x, torch.Tensor):
            return bundle.call(self.forward, x)  # a bundle (tensormq/bundle.py): its members as the arguments
        return self.forward(x)

    def to_device(self, x):
        """``x`` (a tensor or a bundle) on this block's device. From host memory the copy is
        queued without waiting: CUDA copies pageable memory to its staging buffer before the
        call returns, so the host slot may be released as soon as this returns (nothing later
        reads it)."""
        if not isinstance(x, torch.Tensor):
            return bundle.apply(self.to_device, x)
        if x.device == self.device:
            return x
        return x.to(self.device, non_blocking=self.on_gpu and x.device.type == "cpu")

    def mark(self, name: str) -> None:
        """A GPU clock mark on the block's stream (the current one inside ``on_stream``)."""
        if self.clock is not None:
            self.clock.mark(name, self.stream)

    def finish(self) -> None:
        """Wait for everything this request queued on the GPU (after its output was sent on)."""
        if self.on_gpu:
            torch.cuda.current_stream(self.device).synchronize()

    def warm_up(self, shapes: list, dtype: torch.dtype | list[torch.dtype] = torch.float32) -> int:
        """Run the model (capturing its graphs on a GPU) per shape, before the block is ready,
        so no request pays a first call, TorchScript's optimisation or a capture; returns how
        many shapes ran. ``outputs`` then holds what each made (Note [Ready to serve] in
        blocks/process.py)."""
        n = 0
        # a graph's capture makes its own eager calls first (CAPTURE_WARM_CALLS)
        calls = 1 if self.graphs is not None else warm_calls()
        with SETUP_LOCK, torch.inference_mode(), self.on_stream():  # Note [One block sets up CUDA at a time]
            for shape in shapes:
                x = zeros_like_shape(shape, dtype, self.device)
                for _ in range(calls):
                    y = self(x)
                if _key(x) is not None:
                    self.outputs[_key(x)] = _made_bytes(x, y)
                n += 1
            self.finish()
        return n

    def drop_graphs(self) -> None:
        """The block was parked (blocks/cache.py): its graphs replay the freed weights'
        addresses, so they go, with their static buffers and memory pools; ``recapture`` makes
        them again for the same shapes once the weights are back."""
        if self.graphs is None:
            return
        self.dropped = list(self.graphs.graphs) + [k for k in self.dropped if k not in self.graphs.graphs]
        self.graphs.graphs.clear()

    def recapture(self) -> None:
        """Capture again the graphs ``drop_graphs`` dropped (the block's thread, its stream current)."""
        if self.graphs is None:
            return
        keys, self.dropped = self.dropped, []
        with SETUP_LOCK, torch.inference_mode():  # Note [One block sets up CUDA at a time]
            for key in keys:
                if key not in self.graphs.graphs:
                    # one eager call: TorchScript and cuDNN settled on this shape before the park
                    self.graphs.capture(zeros_for_key(key, self.device), key, 1)

    def stats(self) -> dict:
        if self.graphs is None:
            return {"cuda_graphs": False}
        return {"cuda_graphs": True, **self.graphs.stats()}


def trim_cuda_context(device: torch.device, stack_bytes: int | None = None) -> dict:
    """Lower the CUDA context's per-thread stack reservation once CUDA is initialised on
    ``device`` (``stack_bytes``, default ``BLOCKFLOW_CUDA_STACK_BYTES``, 256; 0 leaves the
    driver's 1 KiB). The driver reserves stack x resident threads of every SM (1 KiB x 132 SMs
    x 2048 threads = 264 MB on an H200) and raises the limit by itself for a kernel that needs
    more; experiments/vram.py measured 964 -> 766 MB per process with no slower inference.
    Returns what was done, for the block's log."""
    from blockflow.core import settings
    want = settings.CUDA_STACK_BYTES if stack_bytes is None else stack_bytes
    if want <= 0 or device.type != "cuda":
        return {"stack_bytes": "driver default"}
    with SETUP_LOCK:  # once per device and process: Note [One block sets up CUDA at a time]
        done = _TRIMMED.get((device, want))
        if done is None:
            done = _TRIMMED[(device, want)] = _set_stack_limit(device, want)
        return done


#: (device, stack bytes) -> what ``trim_cuda_context`` did, in this process
_TRIMMED: dict[tuple, dict] = {}


def _set_stack_limit(device: torch.device, want: int) -> dict:
    import ctypes
    try:
        with torch.cuda.device(device):
            torch.cuda.init()
            torch.zeros(1, device=device)  # the primary context is current on this thread
            cuda = ctypes.CDLL("libcuda.so.1")
            before = ctypes.c_size_t(0)
            cuda.cuCtxGetLimit(ctypes.byref(before), ctypes.c_int(0))  # CU_LIMIT_STACK_SIZE
            rc = cuda.cuCtxSetLimit(ctypes.c_int(0), ctypes.c_size_t(want))
        return {"stack_bytes": want, "was": int(before.value)} if rc == 0 else {"stack_bytes_error": f"CUresult {rc}"}
    except OSError as exc:  # no libcuda (cannot happen where torch found a GPU): nothing to trim
        return {"stack_bytes_error": str(exc)}


def warm_calls() -> int:
    """Calls of the model per shape before a block is ready, without a CUDA graph: TorchScript's
    profiling executor records the first ``num_profiled_runs`` calls and optimises the graph on
    the next one, which costs about as much as a call again (experiments/first_request.py
    measures what a first request pays without it). Other models run as often: a call more
    costs one warm-up call, not a request's."""
    profiled = getattr(torch._C, "_jit_get_num_profiled_runs", None)
    return (profiled() if profiled is not None else 1) + 1


def _key(x) -> tuple | None:
    return (x.dtype, x.shape) if isinstance(x, torch.Tensor) else None


def _made_bytes(x, y) -> int:
    """Bytes of ``y`` when it is one new contiguous tensor (not a view of the input ``x``), else 0."""
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor) or not y.is_contiguous():
        return 0
    if y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        return 0
    return y.numel() * y.element_size()


def zeros_like_shape(shape: list, dtype: torch.dtype | list[torch.dtype], device):
    """A zero input of ``shape``: one tensor for a list of ints, a tuple of tensors for a list
    of shapes (a block that takes several tensors: its manifest's ``input_shapes``), each of
    ``dtype`` or of its own where ``dtype`` is a list (the manifest's ``input_dtypes``)."""
    if shape and all(isinstance(s, (list, tuple)) for s in shape):
        dtypes = dtype if isinstance(dtype, list) else [dtype] * len(shape)
        return tuple(torch.zeros(s, dtype=d, device=device) for s, d in zip(shape, dtypes))
    if isinstance(dtype, list):
        dtype = dtype[0]
    return torch.zeros(shape, dtype=dtype, device=device)


def bucket_shapes(entry: dict, most: int = MAX_GRAPHS) -> list[list] | None:
    """The input shapes of a block's declared buckets (its manifest's ``input_dims`` with every
    dynamic dimension at each of its ``dim_buckets``, blocks/split.py ``buckets``): at most
    ``most`` of them, the smallest first, each a shape or, for a block that takes several
    tensors, a list of its members' shapes. None where the manifest has no buckets or a member
    has a size computed from others (then the manifest's own input shape is warmed up)."""
    dims, sizes = entry.get("input_dims"), entry.get("dim_buckets")
    if not dims or not sizes or any(d is None or (isinstance(d, str) and d not in sizes) for m in dims for d in m):
        return None
    names = list(dict.fromkeys(d for m in dims for d in m if isinstance(d, str)))
    combos = [{}]
    for name in names:
        combos = [dict(c, **{name: size}) for c in combos for size in sizes[name]]
    combos.sort(key=lambda c: [c[n] for n in reversed(names)])  # the smallest shapes first
    shapes = [[[c[d] if isinstance(d, str) else d for d in m] for m in dims] for c in combos[:most]]
    return shapes if len(dims) > 1 else [s[0] for s in shapes]


def warmup_shapes(input_shape: list | None, declared: list | None, batching) -> list[list]:
    """The input shapes a block runs before it reports ready: those its update declares
    (``warmup_shapes``), else the manifest's input shape -- a list of shapes where the block
    takes several tensors (``input_shapes``); a batching block adds its batch sizes (every
    size up to ``WARM_ALL_BATCHES_UP_TO``, else 1, its preferred sizes and max_batch), to
    every member of a bundle alike."""
    shapes = [list(s) for s in declared] if declared else ([list(input_shape)] if input_shape else [])

    def batched(shape: list, b: int) -> list:
        if shape and all(isinstance(m, (list, tuple)) for m in shape):
            return [batched(list(m), b) for m in shape]
        return [b, *shape[1:]] if shape else shape

    if batching is not None and shapes and all(len(s) >= 1 for s in shapes):
        mb = batching.max_batch
        sizes = (range(1, mb + 1) if mb <= WARM_ALL_BATCHES_UP_TO
                 else sorted({1, mb, *getattr(batching, "preferred", ())}))
        shapes = [batched(s, b) for s in shapes for b in sizes]
    seen, out = set(), []
    for s in shapes:
        key = repr(s)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out
