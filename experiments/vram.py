"""What a GPU block process's device memory is made of, and what can be cut (issue 27 item 6, issue 28).

    python -m experiments.vram [--device cuda:0] [--out DIR] [--n 100] [--budget 60]
                               [--configs default,cublas_ws_0,...] [--blocks block4,head] [--no-group]

A BlockFlow block process on a GPU holds about half a GB of device memory before its block does
anything useful. This script takes that figure apart. Every measurement runs in a fresh child
interpreter (``python -m experiments.vram --child``, one per configuration, each with its
environment set before Python starts, so nothing is inherited from a previous CUDA context) that
loads block files of the model repository (``resnet50/<stem>.pt``: TorchScript, torchvision
weights seeded, the files ``blockflow serve`` deploys) and reads its own memory at five stages:

  context      after ``torch.cuda.init()`` and a 1-element tensor: the bare CUDA context (driver
               state, the local-memory reservation for thread stacks, ``printf``/``malloc`` heaps,
               whatever kernels module loading brings in) plus the caching allocator's first
               2 MiB segment;
  load         the block file(s) loaded on the device: + the weights (allocator segments);
  first        the first eager inference at batch 1: + the kernels loaded lazily on first use, the
               cuDNN and cuBLAS handles, their workspaces and the activations (the latter two in
               allocator segments, kept by the caching allocator after the inference);
  cuda_graph   each block captured as a CUDA graph (``WARM_CALLS`` eager calls on a side stream
               first, as blocks/runner.py does): + each graph's private memory pool and executable;
  empty_cache  after ``torch.cuda.empty_cache()`` with the graphs alive: what a block that
               replays its graph needs; the segments released are the eager calls' cache;

and, after the timings, ``after_timing`` (the eager inferences grew the cache again). At every
stage it records ``process_mb``: the memory NVML charges to the child (``usedGpuMemory`` of
``nvmlDeviceGetComputeRunningProcesses``, found by the child's pid in any PID namespace, else as the
one compute process that appeared when the child created its context; where neither works, the
growth of the device's used memory since the child started, ``source`` says which), and torch's
``memory_allocated`` / ``memory_reserved`` (the allocator's share; ``process_mb - reserved`` is what
lives outside the allocator: context, kernels, library handles). ``breakdown`` derives from these:

  context_outside_allocator_mb         context stage, NVML minus reserved: the CUDA context itself;
  weights_mb                           reserved growth at load;
  first_inference_allocator_mb         reserved growth at the first inference (activations and
                                       the cuDNN/cuBLAS workspaces torch allocates for them);
  first_inference_outside_allocator_mb NVML growth outside the allocator at the first inference
                                       (lazily loaded kernels, library handles);
  cuda_graph_mb                        NVML growth at the capture;
  empty_cache_released_mb              NVML drop at empty_cache.

Each configuration also times ``--n`` eager inferences at batch 1 after the stages (median and
p90 in ms, ``torch.cuda.synchronize`` after each) and as many graph replays, so that a cut that
slows inference shows. The configurations (environment variables are set in the child only;
the ones below are removed from the child's environment unless the configuration sets them):

  default               torch's defaults: CUDA_MODULE_LOADING unset (torch sets LAZY), torch's
                        cuBLAS workspace (32 MiB per handle and stream on Hopper, ~8 MiB before),
                        torch.backends.cudnn.benchmark False (the only value measured: benchmark
                        mode tries algorithms with large workspaces);
  cublas_ws_0           CUBLAS_WORKSPACE_CONFIG=:0:0, no cuBLAS(Lt) workspace;
  cublas_ws_small       CUBLAS_WORKSPACE_CONFIG=:16:8, 128 KiB (NB :4096:8 is 32 MiB, Hopper's default);
  module_loading_eager  CUDA_MODULE_LOADING=EAGER: every kernel of every loaded library at once;
  module_loading_lazy   CUDA_MODULE_LOADING=LAZY set explicitly (expected equal to default);
  stack_small           the context's per-thread stack limit (cuCtxSetLimit CU_LIMIT_STACK_SIZE)
                        lowered to STACK_SMALL bytes right after the context is made: the driver
                        reserves stack x resident threads of every SM, and grows it again for a
                        kernel that needs more;
  lean                  cublas_ws_small and stack_small together;
  expandable_segments   PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the allocator maps 2 MiB
                        pages instead of 2/20 MiB+ segments; TensorMQ's shared slots switch it off
                        for their own buffers, tensormq/cuda_ipc.py).

PYTORCH_NO_CUDA_MEMORY_CACHING is not measured: without the cache every inference allocates from
the driver, which slows it. ``recommended`` is the configuration with the lowest ``process_mb`` at
the empty_cache stage whose eager median is within 5 % of default's (:func:`recommend`);
``per_process_mb`` gives the figure before (default at cuda_graph: what a block process holds
today after capturing its graph), default after empty_cache, and the recommended configuration
after empty_cache.

The unit measured per configuration is ``--blocks`` in one process, by default block4 with its
classification head (the thesis's b4, memory_model.py's "block4"): the largest block's weights,
cuDNN for its convolutions and cuBLAS for the head's fully connected layer (a convolution-only
block never creates a cuBLAS handle, so the cuBLAS settings would show nothing there).

``group`` (issue 28, the block field ``process``) measures, with the default configuration, the
5 blocks of the pipeline (block1..block4, head) as five child processes, one block each, against
one child holding all five (each block loaded, run once, captured): ``five_sum_mb`` (sum of the
five processes' figures), ``one_mb`` and ``ratio`` = one / five_sum, per stage; the issue's
question is the ``first`` stage (loaded and run once); cuda_graph and empty_cache are what a
block with CUDA graphs (the default) holds.

Children run one at a time (timings must not share the GPU, and the device-level fallback needs
it), in the order of ``RUN_ORDER`` (default, the group, then the other configurations), each with a
timeout; a child past ``--budget`` seconds of the whole run (the model export included, where the
repository lacks it) is not started (``skipped`` in its entry), so a run takes at most about the
budget plus 15 s. A child that fails records ``error`` (with the stages it finished) and the others
are still measured; the JSON is rewritten after every child (``"partial": true`` until the end), so
a run cut short from outside leaves what it measured. Without a CUDA GPU the script says so in one
line and exits with status 2.

``<out>/vram.json``: the provenance keys, ``env``, ``settings``, ``config_definitions`` and
``figures``: ``configs`` (name -> the child's result: ``stages`` {stage -> ``process_mb``,
``source``, ``nvml_mb``, ``device_delta_mb``, ``torch_allocated_mb``, ``torch_reserved_mb``, ``t_s``},
``breakdown``, ``eager_median_ms`` / ``eager_p90_ms``, ``graph_median_ms`` / ``graph_p90_ms``, the
driver's limits in bytes (``limits_default``, ``limits`` where stack_small set one, ``limits_end``),
``stack_reservation_estimate_mb``, ``import_torch_s``, ``context_s``, ``error`` or ``skipped``),
``group``, ``recommended``, ``per_process_mb``, ``nvml_index``, ``seconds``.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

log = logging.getLogger("experiments.vram")

NAME = "vram"
MODEL = "resnet50"
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MIB = 2**20

STAGES = ("context", "load", "first", "cuda_graph", "empty_cache", "after_timing")
#: The stage whose figure ``recommend`` compares: a block that replays its graph after empty_cache.
FIGURE_STAGE = "empty_cache"
#: The stage of the "before" figure: a block process today (graph captured, no empty_cache).
BEFORE_STAGE = "cuda_graph"
#: Stages at which the group is compared with five processes.
GROUP_STAGES = ("first", "cuda_graph", "empty_cache")
#: Input shapes (batch 1) of the ResNet50 block files.
INPUT_SHAPES = {"block1": (1, 3, 224, 224), "block2": (1, 256, 56, 56), "block3": (1, 512, 28, 28),
                "block4": (1, 1024, 14, 14), "head": (1, 2048, 7, 7), "full": (1, 3, 224, 224)}
PIPELINE_STEMS = ("block1", "block2", "block3", "block4", "head")
DEFAULT_BLOCKS = ("block4", "head")
#: Eager calls on a side stream before a capture (blocks/runner.py's CAPTURE_WARM_CALLS).
WARM_CALLS = 3
DEFAULT_N = 100
QUICK_N = 20
#: Untimed eager calls before the timed ones.
TIMING_WARMUP = 5
DEFAULT_BUDGET_S = 60.0
#: The most one child may take (import, context, load, capture, timings).
CHILD_TIMEOUT_S = 45.0
#: A child is not started with less than this many seconds of the budget left.
MIN_CHILD_S = 5.0
#: A configuration may be this much slower (eager median) than default and still be recommended.
TOLERANCE = 0.05
STACK_SMALL = 256
#: Environment variables a configuration controls: removed from every child's environment
#: unless the configuration sets them, so that "default" is torch's default.
CONTROLLED_ENV = ("CUDA_MODULE_LOADING", "CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE",
                  "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING",
                  "CUDA_LAUNCH_BLOCKING")
CONFIGS = {
    "default": {"env": {}, "what": "torch's defaults (LAZY module loading, torch's cuBLAS workspace, "
                                   "cudnn.benchmark False)"},
    "cublas_ws_0": {"env": {"CUBLAS_WORKSPACE_CONFIG": ":0:0"}, "what": "no cuBLAS/cuBLASLt workspace"},
    "cublas_ws_small": {"env": {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}, "what": "cuBLAS workspace 8 x 16 KiB"},
    "module_loading_eager": {"env": {"CUDA_MODULE_LOADING": "EAGER"},
                             "what": "every kernel loaded at context creation"},
    "module_loading_lazy": {"env": {"CUDA_MODULE_LOADING": "LAZY"}, "what": "LAZY set explicitly (torch's default)"},
    "stack_small": {"env": {}, "stack_bytes": STACK_SMALL,
                    "what": f"CU_LIMIT_STACK_SIZE {STACK_SMALL} B per thread (default 1024)"},
    "lean": {"env": {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}, "stack_bytes": STACK_SMALL,
             "what": "cublas_ws_small + stack_small"},
    "expandable_segments": {"env": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
                            "what": "the caching allocator's expandable segments"},
}
#: Run order: what the issue asks first, so that a short budget still answers it.
RUN_ORDER = ("default", "group", "cublas_ws_0", "cublas_ws_small", "module_loading_eager", "stack_small", "lean",
             "expandable_segments", "module_loading_lazy")


def _describe_exc(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}".rstrip(": ")


def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


# -- pure functions on results (tested on a CPU) ---------------------------------------------
def stage_mb(entry: dict, stage: str) -> float | None:
    """``process_mb`` of ``entry`` (a child's result) at ``stage``, or None."""
    if not isinstance(entry, dict):
        return None
    rec = (entry.get("stages") or {}).get(stage)
    return _num(rec.get("process_mb")) if isinstance(rec, dict) else None


def breakdown(stages: dict) -> dict:
    """The figures of the module docstring's ``breakdown`` from a child's ``stages`` (None where
    an input is missing)."""
    def get(stage, key):
        rec = stages.get(stage) if isinstance(stages, dict) else None
        return _num(rec.get(key)) if isinstance(rec, dict) else None

    def outside(stage):
        p, r = get(stage, "process_mb"), get(stage, "torch_reserved_mb")
        return None if p is None or r is None else p - r

    def diff(a, b):
        return None if a is None or b is None else a - b

    return {"context_outside_allocator_mb": outside("context"),
            "weights_mb": diff(get("load", "torch_reserved_mb"), get("context", "torch_reserved_mb")),
            "first_inference_allocator_mb": diff(get("first", "torch_reserved_mb"), get("load", "torch_reserved_mb")),
            "first_inference_outside_allocator_mb": diff(outside("first"), outside("load")),
            "cuda_graph_mb": diff(get("cuda_graph", "process_mb"), get("first", "process_mb")),
            "empty_cache_released_mb": diff(get("cuda_graph", "process_mb"), get("empty_cache", "process_mb"))}


def recommend(configs: dict, stage: str = FIGURE_STAGE, baseline: str = "default",
              tolerance: float = TOLERANCE) -> dict:
    """The configuration with the lowest ``process_mb`` at ``stage`` among those without an error
    whose eager median is at most ``(1 + tolerance)`` x the baseline's; a tie goes to the
    baseline, then to the earlier configuration. ``{"name": None, "reason": ...}`` when no
    configuration qualifies (the baseline has no timing, or none has the stage)."""
    base = configs.get(baseline) if isinstance(configs, dict) else None
    base_ms = _num(base.get("eager_median_ms")) if isinstance(base, dict) and not base.get("error") else None
    if base_ms is None:
        return {"name": None, "reason": f"no eager timing for the baseline {baseline!r}", "stage": stage}
    limit = base_ms * (1 + tolerance)
    candidates, too_slow, unusable = [], {}, {}
    for order, (name, entry) in enumerate(configs.items()):
        if not isinstance(entry, dict) or entry.get("error") or entry.get("skipped"):
            unusable[name] = "error or skipped"
            continue
        mb, ms = stage_mb(entry, stage), _num(entry.get("eager_median_ms"))
        if mb is None or ms is None:
            unusable[name] = f"no {stage} figure" if mb is None else "no eager timing"
            continue
        if ms > limit:
            too_slow[name] = ms
            continue
        candidates.append((mb, name != baseline, order, name, ms))
    if not candidates:
        return {"name": None, "reason": f"no configuration has a {stage} figure and a timing within "
                                        f"{100 * tolerance:g} % of {baseline!r}", "stage": stage,
                "too_slow_ms": too_slow, "unusable": unusable}
    mb, _, _, name, ms = min(candidates)
    base_mb = stage_mb(base, stage)
    return {"name": name, "stage": stage, "process_mb": mb, "eager_median_ms": ms, "baseline": baseline,
            "baseline_mb": base_mb, "saved_mb": None if base_mb is None else base_mb - mb,
            "slowdown_pct": 100.0 * (ms / base_ms - 1), "tolerance_pct": 100.0 * tolerance,
            "too_slow_ms": too_slow, "unusable": unusable}


def group_summary(five: dict, one: dict, stages=GROUP_STAGES) -> dict:
    """``five_sum_mb``, ``one_mb`` and ``ratio`` (one / five_sum) per stage; a stage lacking any
    figure gives None."""
    out = {"five_sum_mb": {}, "one_mb": {}, "ratio": {}}
    for s in stages:
        figures = [stage_mb(five.get(stem), s) for stem in PIPELINE_STEMS] if isinstance(five, dict) else [None]
        total = None if any(f is None for f in figures) else sum(figures)
        g = stage_mb(one, s)
        out["five_sum_mb"][s], out["one_mb"][s] = total, g
        out["ratio"][s] = g / total if g is not None and total else None
    return out


def _fmt(v, spec: str = ".0f", width: int = 8) -> str:
    v = _num(v)
    return f"{'-' if v is None else format(v, spec):>{width}s}"


def _problem(entry) -> str | None:
    if not isinstance(entry, dict):
        return "no result"
    for key in ("skipped", "error"):
        if entry.get(key):
            return f"{key}: {str(entry[key]).splitlines()[0][:90]}"
    return None


def format_table(configs: dict) -> list[str]:
    """One line per configuration: process_mb at each stage, reserved at cuda_graph, timings;
    a configuration with an error or skipped shows what it has and why it stopped."""
    head = (f"{'config':22s}" + "".join(f"{s:>13s}" for s in STAGES)
            + f"{'rsv@graph':>10s}{'eager ms':>10s}{'graph ms':>10s}  note")
    lines = [head]
    for name, raw in (configs or {}).items():
        entry = raw if isinstance(raw, dict) else {}
        cells = "".join(_fmt(stage_mb(entry, s), ".0f", 13) for s in STAGES)
        res = ((entry.get("stages") or {}).get("cuda_graph") or {}).get("torch_reserved_mb")
        note = _problem(raw) or ""
        if not note:
            src = {(rec or {}).get("source") for rec in (entry.get("stages") or {}).values()} - {None}
            note = "MB from " + ",".join(sorted(src)) if src else ""
            if entry.get("timing_error"):
                note += f"; timing: {entry['timing_error'][:60]}"
        lines.append(f"{name:22s}{cells}{_fmt(res, '.0f', 10)}{_fmt(entry.get('eager_median_ms'), '.3f', 10)}"
                     f"{_fmt(entry.get('graph_median_ms'), '.3f', 10)}  {note}".rstrip())
    return lines


def format_group(group: dict) -> list[str]:
    if not isinstance(group, dict) or not group:
        return ["group: not measured"]
    if group.get("skipped") or group.get("error"):
        return [f"group: {_problem(group)}"]
    lines = [f"{'group (MB)':22s}" + "".join(f"{s:>12s}" for s in GROUP_STAGES)]
    for stem in PIPELINE_STEMS:
        entry = (group.get("five") or {}).get(stem)
        lines.append(f"  {stem:20s}" + "".join(_fmt(stage_mb(entry, s), ".0f", 12) for s in GROUP_STAGES)
                     + (f"  {_problem(entry)}" if _problem(entry) else ""))
    one = group.get("one")
    lines.append(f"{'five processes (sum)':22s}" + "".join(_fmt(group.get("five_sum_mb", {}).get(s), ".0f", 12)
                                                    for s in GROUP_STAGES))
    lines.append(f"{'one process (all 5)':22s}" + "".join(_fmt(stage_mb(one, s), ".0f", 12) for s in GROUP_STAGES)
                 + (f"  {_problem(one)}" if _problem(one) else ""))
    lines.append(f"{'ratio one / five':22s}" + "".join(_fmt(group.get("ratio", {}).get(s), ".3f", 12)
                                                for s in GROUP_STAGES))
    return lines


# -- the child -----------------------------------------------------------------------------
class _Nvml:
    """The child's view of its NVML device: per-process memory and the device's used memory."""

    def __init__(self, index):
        self.error, self.handle, self.nv = None, None, None
        from blockflow.blocks.monitor import my_pids  # this process in every PID namespace
        self.pids = my_pids()
        self.own_pid = None
        try:
            import pynvml
            pynvml.nvmlInit()
            self.nv = pynvml
            if index is None:
                raise RuntimeError("the parent found no NVML device for the torch device")
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(int(index))
        except Exception as exc:
            self.error = _describe_exc(exc)
        self.pids_before = set(self.procs())
        self.used_before = self.used()

    def procs(self) -> dict:
        if self.handle is None:
            return {}
        try:
            return {p.pid: p.usedGpuMemory for p in self.nv.nvmlDeviceGetComputeRunningProcesses(self.handle)}
        except Exception as exc:
            self.error = _describe_exc(exc)
            return {}

    def used(self) -> int | None:
        if self.handle is None:
            return None
        try:
            return int(self.nv.nvmlDeviceGetMemoryInfo(self.handle).used)
        except Exception as exc:
            self.error = _describe_exc(exc)
            return None

    def read(self) -> dict:
        procs, used = self.procs(), self.used()
        rec = {"device_used_mb": None if used is None else used / MIB,
               "device_delta_mb": None if used is None or self.used_before is None else (used - self.used_before) / MIB,
               "nvml_mb": None, "source": None}
        mine = [p for p in procs if p in self.pids]
        if mine:  # our pid as NVML names it (the host's pid is in NSpid where /proc shows it)
            self.own_pid, how = mine[0], "nvml_pid"
        else:  # a PID namespace hiding the host's pid: the one compute process that appeared with us
            if self.own_pid is None:
                new = [p for p in procs if p not in self.pids_before]
                if len(new) == 1:
                    self.own_pid = new[0]
            how = "nvml_new_pid"
        if self.own_pid is not None and procs.get(self.own_pid) is not None:
            rec["nvml_mb"] = procs[self.own_pid] / MIB
            rec["process_mb"], rec["source"] = rec["nvml_mb"], how
        else:
            rec["process_mb"] = rec["device_delta_mb"]
            rec["source"] = "device_delta" if rec["device_delta_mb"] is not None else None
        if self.error:
            rec["nvml_error"] = self.error
        return rec


def _driver_limits(set_stack: int | None = None) -> dict:
    """The current context's limits (CU_LIMIT_STACK_SIZE, PRINTF_FIFO_SIZE, MALLOC_HEAP_SIZE, in
    bytes) through the driver API; with ``set_stack``, the stack limit is set first."""
    import ctypes
    out = {}
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        if set_stack is not None:
            rc = cuda.cuCtxSetLimit(ctypes.c_int(0), ctypes.c_size_t(int(set_stack)))
            out["set_stack_rc"] = int(rc)
        for name, limit in (("stack_bytes", 0), ("printf_fifo_bytes", 1), ("malloc_heap_bytes", 2)):
            v = ctypes.c_size_t(0)
            rc = cuda.cuCtxGetLimit(ctypes.byref(v), ctypes.c_int(limit))
            out[name] = int(v.value) if rc == 0 else f"CUresult {rc}"
    except Exception as exc:
        out["error"] = _describe_exc(exc)
    return out


def child_main(spec_path: str, out_path: str) -> int:
    """One configuration in this fresh process: the stages, then the timings; the result is
    written to ``out_path`` after every stage, so a crash or a timeout keeps what was done."""
    t0 = time.monotonic()
    with open(spec_path) as f:
        spec = json.load(f)
    res: dict = {"name": spec.get("name"), "pid": os.getpid(), "blocks": spec.get("stems"),
                 "env": {k: os.environ.get(k) for k in CONTROLLED_ENV if os.environ.get(k) is not None},
                 "stages": {}}

    def save():
        tmp = out_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f, default=str)
        os.replace(tmp, out_path)

    if spec.get("sleep_s"):  # tests: a child that overruns its timeout
        time.sleep(float(spec["sleep_s"]))
    nv = _Nvml(spec.get("nvml_index"))
    phase = "import torch"
    try:
        import torch
        res["import_torch_s"] = time.monotonic() - t0
        res["torch"], res["torch_cuda"] = torch.__version__, torch.version.cuda
        phase = "context"
        dev = torch.device(spec.get("device", "cuda"))
        if dev.type != "cuda":
            raise RuntimeError(f"device {dev} is not a CUDA device")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.backends.cudnn.benchmark = False
        res["cudnn_benchmark"] = False
        t = time.monotonic()
        torch.cuda.set_device(dev)
        torch.cuda.init()
        alive = [torch.ones(1, device=dev)]  # held to the end: the allocator's first segment
        torch.cuda.synchronize(dev)
        res["limits_default"] = _driver_limits()
        if spec.get("stack_bytes") is not None:
            res["limits"] = _driver_limits(set_stack=spec["stack_bytes"])
            torch.cuda.synchronize(dev)
        res["context_s"] = time.monotonic() - t
        props = torch.cuda.get_device_properties(dev)
        res["gpu"] = props.name
        sms = getattr(props, "multi_processor_count", None)
        threads = getattr(props, "max_threads_per_multi_processor", None)
        res["sms"], res["max_threads_per_sm"] = sms, threads
        stack = res["limits_default"].get("stack_bytes")
        if isinstance(stack, int) and sms and threads:  # what the driver reserves for thread stacks
            res["stack_reservation_estimate_mb"] = stack * sms * threads / MIB
        # torch sets LAZY when the variable is unset: read after the context is made, default says LAZY
        res["module_loading"] = os.environ.get("CUDA_MODULE_LOADING")

        def stage(name):
            torch.cuda.synchronize(dev)
            rec = {"t_s": time.monotonic() - t0, "torch_allocated_mb": torch.cuda.memory_allocated(dev) / MIB,
                   "torch_reserved_mb": torch.cuda.memory_reserved(dev) / MIB}
            rec.update(nv.read())
            res["stages"][name] = rec
            save()

        stage("context")
        phase = "load"
        from blockflow.blocks.repository import load_block
        stems = list(spec["stems"])
        modules = [load_block(spec["repo"], f"{spec.get('model', MODEL)}/{s}.pt", str(dev)) for s in stems]
        gen = torch.Generator().manual_seed(0)
        inputs = [torch.randn(INPUT_SHAPES[s], generator=gen).to(dev) for s in stems]
        stage("load")
        phase = "first"
        with torch.inference_mode():
            for m, x in zip(modules, inputs):
                m(x)
        stage("first")
        res["cudnn"] = torch.backends.cudnn.version()
        phase = "cuda_graph"
        graphs = []
        with torch.inference_mode():
            for m, x in zip(modules, inputs):
                static_in = x.clone()
                side = torch.cuda.Stream(dev)
                side.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(side):
                    for _ in range(int(spec.get("warm_calls", WARM_CALLS))):
                        m(static_in)
                torch.cuda.current_stream(dev).wait_stream(side)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    static_out = m(static_in)
                graphs.append((g, static_in, static_out))
        stage("cuda_graph")
        phase = "empty_cache"
        torch.cuda.empty_cache()
        stage("empty_cache")
        res["limits_end"] = _driver_limits()
    except Exception as exc:
        res["error"] = f"{phase}: {_describe_exc(exc)}"
        res["seconds"] = time.monotonic() - t0
        save()
        return 1
    n = int(spec.get("n", 0))
    if n > 0:
        try:
            def eager():
                for m, x in zip(modules, inputs):
                    m(x)

            def replay():
                for g, _, _ in graphs:
                    g.replay()

            with torch.inference_mode():
                for label, fn in (("eager", eager), ("graph", replay)):
                    for _ in range(TIMING_WARMUP):
                        fn()
                    torch.cuda.synchronize(dev)
                    times = []
                    for _ in range(n):
                        t = time.perf_counter()
                        fn()
                        torch.cuda.synchronize(dev)
                        times.append((time.perf_counter() - t) * 1e3)
                    times.sort()
                    res[f"{label}_median_ms"] = statistics.median(times)
                    res[f"{label}_p90_ms"] = times[min(len(times) - 1, int(0.9 * len(times)))]
                    res[f"{label}_n"] = n
            stage("after_timing")
        except Exception as exc:
            res["timing_error"] = _describe_exc(exc)
    res["seconds"] = time.monotonic() - t0
    res["held_tensors"] = len(alive)
    save()
    return 0


# -- the parent ----------------------------------------------------------------------------
def child_env(config_env: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CONTROLLED_ENV}
    env.update({k: str(v) for k, v in (config_env or {}).items()})
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


def _kill(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, OSError):
        try:
            proc.kill()
        except OSError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        log.warning("child %d did not die after SIGKILL", proc.pid)


def run_child(spec: dict, env: dict | None = None, timeout: float = CHILD_TIMEOUT_S) -> dict:
    """Run one child (``python -m experiments.vram --child``) with ``env`` (the whole environment)
    and wait at most ``timeout`` s: its result, with ``error`` when it failed, was killed or
    wrote nothing; its temporary files are removed and it is never left running."""
    tmp = tempfile.mkdtemp(prefix="bf-vram-")
    spec_path, out_path, log_path = (os.path.join(tmp, n) for n in ("spec.json", "out.json", "child.log"))
    t0 = time.monotonic()
    result: dict = {}
    rc, timed_out, proc = None, False, None
    try:
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        with open(log_path, "wb") as logf:
            proc = subprocess.Popen([sys.executable, "-m", "experiments.vram", "--child", spec_path, out_path],
                                    cwd=ROOT, env=env if env is not None else child_env({}), stdin=subprocess.DEVNULL,
                                    stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill(proc)
        try:
            with open(out_path) as f:
                result = json.load(f)
        except (OSError, ValueError):
            result = {}
        if timed_out or rc != 0 or not result:
            tail = ""
            try:
                with open(log_path, errors="replace") as f:
                    lines = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
                tail = lines[-1][:300] if lines else ""
            except OSError:
                pass
            why = (f"timed out after {timeout:.0f} s" if timed_out else f"exited with status {rc}"
                   if rc != 0 else "wrote no result")
            result.setdefault("error", f"child {why}" + (f": {tail}" if tail else ""))
            if timed_out and "timed out" not in result["error"]:
                result["error"] += f" (then timed out after {timeout:.0f} s)"
            if tail:
                result.setdefault("log_tail", tail)
    except Exception as exc:
        result.setdefault("error", f"parent: {_describe_exc(exc)}")
    finally:
        if proc is not None and proc.poll() is None:
            _kill(proc)
        shutil.rmtree(tmp, ignore_errors=True)
    result["wall_s"] = time.monotonic() - t0
    return result


def _nvml_index(device) -> tuple[int | None, str]:
    """The NVML index of torch's ``device`` (by UUID, else by PCI bus id), and how it was found."""
    import torch
    try:
        import pynvml
        pynvml.nvmlInit()
        props = torch.cuda.get_device_properties(device)
        want = str(getattr(props, "uuid", "") or "").lower().removeprefix("gpu-")
        pci = None
        if all(hasattr(props, k) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
            pci = (int(props.pci_domain_id), int(props.pci_bus_id), int(props.pci_device_id))
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            uuid = (uuid.decode() if isinstance(uuid, bytes) else str(uuid)).lower().removeprefix("gpu-")
            if want and uuid == want:
                return i, "uuid"
            if pci:
                bus = pynvml.nvmlDeviceGetPciInfo(h).busId
                bus = bus.decode() if isinstance(bus, bytes) else str(bus)
                d, b, rest = bus.split(":")
                if (int(d, 16), int(b, 16), int(rest.split(".")[0], 16)) == pci:
                    return i, "pci_bus_id"
        if not os.environ.get("CUDA_VISIBLE_DEVICES"):
            return torch.device(device).index or 0, "torch index (no UUID or bus id matched)"
        return None, "no NVML device matched torch's UUID or PCI bus id"
    except Exception as exc:
        return None, f"NVML: {_describe_exc(exc)}"


def measure(device: str = "cuda:0", repo: str | None = None, n: int = DEFAULT_N, budget: float = DEFAULT_BUDGET_S,
            configs: list[str] | None = None, group: bool = True, blocks=DEFAULT_BLOCKS,
            on_update=None) -> dict:
    """Every configuration (``configs``: names of CONFIGS, default all) and the group, each in its
    own child, in RUN_ORDER, within ``budget`` seconds; ``{"skipped": "no GPU"}`` without CUDA.
    ``on_update(result so far)`` is called after every child (main writes the JSON then, so a run
    cut short from outside still leaves what it measured)."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch
        if not torch.cuda.is_available():
            return {"skipped": "no GPU"}
    if not str(device).startswith("cuda"):
        return {"skipped": f"device {device!r} is not a CUDA device"}
    from experiments import common
    t0 = time.monotonic()
    names = list(configs) if configs else list(CONFIGS)
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown configuration(s) {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    blocks = list(blocks)
    bad = [b for b in blocks if b not in INPUT_SHAPES]
    if bad:
        raise ValueError(f"unknown block(s) {', '.join(bad)}; choose from {', '.join(INPUT_SHAPES)}")
    out: dict = {"device": device, "blocks": blocks, "n": n, "budget_s": budget, "configs": {}, "group": {}}
    try:
        repo = os.path.abspath(common.ensure_repo(repo or common.DEFAULT_REPO, model=MODEL))
    except Exception as exc:
        out["error"] = f"model repository: {_describe_exc(exc)}"
        return out
    out["repo"] = repo
    index, how = _nvml_index(device)
    out["nvml_index"], out["nvml_index_from"] = index, how
    out["inherited_env"] = {k: os.environ[k] for k in CONTROLLED_ENV if k in os.environ}

    def spec(name, stems, config, timed):
        return {"name": name, "device": device, "nvml_index": index, "repo": repo, "model": MODEL,
                "stems": list(stems), "n": n if timed else 0, "warm_calls": WARM_CALLS,
                "stack_bytes": config.get("stack_bytes")}

    def run(label, s, config):
        left = budget - (time.monotonic() - t0)
        if left < MIN_CHILD_S:
            return {"skipped": f"budget: {budget:.0f} s spent before it started"}
        res = run_child(s, child_env(config.get("env", {})), timeout=min(CHILD_TIMEOUT_S, max(left, 10.0)))
        msg = (f"vram {label}: " + (f"ERROR {res['error']}" if res.get("error") else
               f"{_fmt(stage_mb(res, FIGURE_STAGE), '.0f', 0)} MB at {FIGURE_STAGE}")
               + f" ({res.get('wall_s', 0):.1f} s)")
        (log.warning if res.get("error") else log.info)(msg)
        return res

    def update():
        if on_update is not None:
            try:
                on_update(out)
            except Exception as exc:  # a failed partial write must not stop the measurement
                log.warning("vram: partial result not written: %s", exc)

    for item in RUN_ORDER:
        if item == "group":
            if not group:
                continue
            base = CONFIGS["default"]
            five = {stem: run(f"group {stem}", spec(f"group:{stem}", [stem], base, False), base)
                    for stem in PIPELINE_STEMS}
            one = run("group one process", spec("group:one", PIPELINE_STEMS, base, False), base)
            out["group"] = {"config": "default", "five": five, "one": one, **group_summary(five, one)}
            update()
            continue
        if item not in names:
            continue
        config = CONFIGS[item]
        res = run(item, spec(item, blocks, config, True), config)
        res["what"], res["config_env"] = config["what"], config.get("env", {})
        if config.get("stack_bytes") is not None:
            res["stack_bytes_set"] = config["stack_bytes"]
        if "stages" in res:
            res["breakdown"] = breakdown(res["stages"])
        out["configs"][item] = res
        update()
    rec = recommend(out["configs"])
    out["recommended"] = rec
    default = out["configs"].get("default", {})
    out["per_process_mb"] = {
        "before": stage_mb(default, BEFORE_STAGE), "before_stage": f"default, {BEFORE_STAGE}",
        "default_after_empty_cache": stage_mb(default, FIGURE_STAGE),
        "after": rec.get("process_mb"),
        "after_stage": f"{rec.get('name')}, {FIGURE_STAGE}" if rec.get("name") else None}
    out["seconds"] = time.monotonic() - t0
    return out


def summary_lines(res: dict) -> list[str]:
    blocks = "+".join(res.get("blocks") or [])
    lines = [f"VRAM per process (MB; NVML per process) on {res.get('device')}, blocks {blocks}:"]
    lines += ["  " + ln for ln in format_table(res.get("configs", {}))]
    for name, entry in (res.get("configs") or {}).items():
        b = entry.get("breakdown") if isinstance(entry, dict) else None
        if name == "default" and b:
            lines.append("  default: " + ", ".join(f"{k.removesuffix('_mb')} {_fmt(v, '.0f', 0)}" for k, v in b.items())
                         + (f"; stack reservation estimate {entry['stack_reservation_estimate_mb']:.0f} MB"
                            if _num(entry.get("stack_reservation_estimate_mb")) is not None else ""))
    lines.append("")
    lines += ["  " + ln for ln in format_group(res.get("group"))]
    rec = res.get("recommended") or {}
    lines.append("")
    if rec.get("name"):
        lines.append(f"recommended: {rec['name']}: {rec['process_mb']:.0f} MB at {rec['stage']} "
                     f"(default {_fmt(rec.get('baseline_mb'), '.0f', 0)} MB), "
                     f"eager median {rec['eager_median_ms']:.3f} ms "
                     f"({rec['slowdown_pct']:+.1f} % vs default, tolerance {rec['tolerance_pct']:.0f} %)")
    else:
        lines.append(f"recommended: none ({rec.get('reason', 'not computed')})")
    p = res.get("per_process_mb") or {}
    lines.append(f"per-process figure: before {_fmt(p.get('before'), '.0f', 0)} MB ({p.get('before_stage')}), "
                 f"default after empty_cache {_fmt(p.get('default_after_empty_cache'), '.0f', 0)} MB, "
                 f"after {_fmt(p.get('after'), '.0f', 0)} MB ({p.get('after_stage')})")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        if len(argv) != 3:
            print("usage: python -m experiments.vram --child SPEC.json OUT.json", file=sys.stderr)
            return 2
        return child_main(argv[1], argv[2])
    from experiments import common
    ap = common.parser(NAME, __doc__)
    ap.add_argument("--device", default="cuda:0", help="the CUDA device (default cuda:0)")
    ap.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                    help=f"seconds for all children together (default {DEFAULT_BUDGET_S:g}); a child is not "
                         f"started with less than {MIN_CHILD_S:g} s left, one child may take {CHILD_TIMEOUT_S:g} s")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma-separated configurations (default all: {','.join(CONFIGS)}; --quick: "
                         "default,cublas_ws_0)")
    ap.add_argument("--blocks", default=",".join(DEFAULT_BLOCKS),
                    help=f"block files (stems) in the process measured per configuration (default "
                         f"{','.join(DEFAULT_BLOCKS)}; any of {','.join(INPUT_SHAPES)})")
    ap.add_argument("--no-group", action="store_true", help="skip the group measurement (5 processes vs 1)")
    ap._option_string_actions["--n"].help = (f"timed eager inferences (and graph replays) per configuration "
                                             f"(default {DEFAULT_N}; --quick {QUICK_N})")
    args = ap.parse_args(argv)
    common.setup_logging(args.verbose)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch
        gpu = torch.cuda.is_available()
    if not gpu:
        print("vram needs a CUDA GPU and none is visible here (torch.cuda.is_available() is False); nothing measured",
              file=sys.stderr)
        return 2
    if not args.device.startswith("cuda"):
        print(f"vram needs a CUDA device, not --device {args.device}; nothing measured", file=sys.stderr)
        return 2
    n = args.n or (QUICK_N if args.quick else DEFAULT_N)
    configs = [c for c in args.configs.split(",") if c]
    if args.quick and args.configs == ",".join(CONFIGS):
        configs = ["default", "cublas_ws_0"]
    blocks = [b for b in args.blocks.split(",") if b]
    settings = {"device": args.device, "n": n, "budget_s": args.budget, "configs": configs, "blocks": blocks,
                "group": not args.no_group, "batch": 1, "dtype": "float32", "warm_calls": WARM_CALLS,
                "timing_warmup": TIMING_WARMUP, "tolerance_pct": 100 * TOLERANCE, "quick": args.quick,
                "child_timeout_s": CHILD_TIMEOUT_S, "figure_stage": FIGURE_STAGE,
                "memory": "NVML usedGpuMemory of each child process; torch memory_allocated/memory_reserved"}
    env = common.env_info(settings)

    def write_partial(partial: dict) -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            common.write_json(args.out, NAME, {"env": env, "settings": settings, "config_definitions": CONFIGS,
                                               "figures": {**partial, "partial": True}})

    try:
        res = measure(args.device, args.repo, n, args.budget, configs, not args.no_group, blocks, write_partial)
    except ValueError as exc:
        print(f"vram: {exc}", file=sys.stderr)
        return 2
    common.write_json(args.out, NAME, {"env": env, "settings": settings, "config_definitions": CONFIGS,
                                         "figures": res})
    print("\n".join(summary_lines(res)))
    failed = res.get("error") or any(isinstance(c, dict) and c.get("error") for c in res.get("configs", {}).values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
