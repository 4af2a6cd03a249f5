"""The floor BlockFlow's architecture allows on one GPU (issue 27, "GPU fast path").

    python -m experiments.gpu_floor [--device cuda] [--n 300] [--repo DIR] [--out DIR]

BlockFlow serves a model split into blocks, one process per block. On a GPU the question is not
only how far the served pipeline is from the monolithic model but how far it is from the best a
pipeline of separate processes could do at all. This script measures, with torch alone and the
same block files BlockFlow serves (``resnet50/block1.pt`` .. ``block4.pt``, ``head.pt`` and
``full.pt`` of the model repository, TorchScript, seeded weights), batch 1, fp32, one request
at a time (the next one leaves when the answer of the previous one is on the host):

  mono_eager   full.pt in this process, eager: the monolithic model as a user would run it;
  mono_graph   full.pt captured as one CUDA graph (its input copied into the graph's static
               input, the graph replayed): the fastest the monolithic model gets at batch 1;
  chain_graph  the five blocks, each captured as a CUDA graph of its own, replayed back to back
               in this process: the cost of the split alone, without any process boundary;
  floor        five processes (spawned), one block each, each block captured as a CUDA graph
               that reads its input from, and writes its output into, activation buffers this
               process allocated and shared once by CUDA IPC (torch.multiprocessing queues, at
               setup). Per request this process copies the input into the first buffer, records
               an inter-process CUDA event and writes a byte into a pipe; each stage reads its
               pipe, makes its stream wait on the upstream stage's event (opened once from its
               IPC handle), replays its graph, records its own inter-process event and signals
               the next stage through the next pipe, without waiting for the GPU (no host
               synchronisation between stages). The last stage copies the answer to the host
               and writes its bytes into the pipe back to this process, which times the round
               trip. This is the floor of "one process per block" on a GPU: what is left is the
               GPU work and the host's wake-ups along the chain.

Every row starts its timed requests after ``--warmup`` untimed ones and reports p50 and p90 (ms)
over ``--n`` requests; every row ends with the answer on the host. A row that fails records
``<row>_error`` and the others are still measured; the processes of the floor row are always
stopped (every wait has a timeout: setup ``--timeout`` s, a request 5 s). The floor's answers to
four different inputs are compared with the blocks run eagerly in this process
(``floor_check_max_abs_diff``): a hand-over out of order would show there.
``experiments/pipeline_latency.py`` runs :func:`measure` after its series on a GPU and reports
the served pipeline against these rows (goals: pipeline <= 1.0x mono_eager; stretch <= 1.5x
the floor). The script writes ``<out>/gpu_floor.json`` (``figures``: what :func:`measure`
returns) and prints the rows; it exits with status 0 when every row was measured, 1 when one
failed (its ``<row>_error`` says why) and 2, after one line saying so, without a CUDA GPU.
"""
from __future__ import annotations

import logging
import os
import queue
import sys
import time

log = logging.getLogger("experiments.gpu_floor")

NAME = "gpu_floor"
MODEL = "resnet50"
#: The block files of the pipeline, in order (the same files ``blockflow serve`` deploys).
STAGES = ("block1", "block2", "block3", "block4", "head")
#: The rows, in the order they are reported, with what each one measures.
ROWS = {
    "mono_eager": "full.pt eager in one process",
    "mono_graph": "full.pt as one CUDA graph in one process",
    "chain_graph": "the 5 blocks, each a CUDA graph, back to back in one process",
    "floor": "5 processes, one block each as a CUDA graph, handing over by inter-process CUDA event "
             "(buffers shared once by CUDA IPC, a pipe byte per hop, the last stage copies the answer to the host)",
}
#: The rows in the order they run: the floor before the in-process graphs, so that a capture
#: that leaves this process's CUDA context in a bad state cannot take the floor row with it.
RUN_ORDER = ("mono_eager", "floor", "mono_graph", "chain_graph")
DEFAULT_N = 300
QUICK_N = 30
WARMUP = 20
#: Eager calls on a side stream before a capture (TorchScript's profiling executor specialises
#: and fuses on its first calls: what is captured must be the optimised graph).
WARM_CALLS = 5
#: Seconds the floor row may spend starting its processes, loading and capturing the blocks.
SETUP_TIMEOUT_S = 60.0
#: Seconds one request through the floor row may take before the row is abandoned.
REQUEST_TIMEOUT_S = 5.0
#: Different inputs the floor row cycles through (and checks its answers against).
CHECK_INPUTS = 4
GO, QUIT = b"g", b"q"


def _describe_exc(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _capture(fn, stream):
    """``fn`` captured as a CUDA graph on ``stream`` after ``WARM_CALLS`` eager calls there:
    (graph, what ``fn`` returned during the capture: the graph's static output)."""
    import torch
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        for _ in range(WARM_CALLS):
            fn()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = fn()
    torch.cuda.synchronize(stream.device)
    return graph, out


def _time(request, n: int, warmup: int) -> list[float]:
    """``request()`` ``warmup`` times untimed, then ``n`` times timed (ms each)."""
    for _ in range(warmup):
        request()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        request()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def _figures(row: str, samples: list[float]) -> dict:
    from experiments import common
    return {f"{row}_p50_ms": common.pct(samples, 0.5), f"{row}_p90_ms": common.pct(samples, 0.9),
            f"{row}_mean_ms": sum(samples) / len(samples), f"{row}_min_ms": min(samples)}


# -- the rows in this process --------------------------------------------------------------
class _Setup:
    """What every row runs on: the loaded modules, the inputs and the settings."""

    def __init__(self, repo: str, device: str, full, blocks: list, inputs: list, n: int, warmup: int,
                 timeout: float):
        self.repo, self.device, self.full, self.blocks, self.inputs = repo, device, full, blocks, inputs
        self.n, self.warmup, self.timeout = n, warmup, timeout


def _mono_eager(s: _Setup) -> tuple[list, dict]:
    x = s.inputs[0]
    return _time(lambda: s.full(x).cpu(), s.n, s.warmup), {}


def _mono_graph(s: _Setup) -> tuple[list, dict]:
    import torch
    static_in = s.inputs[0].clone()
    graph, static_out = _capture(lambda: s.full(static_in), torch.cuda.Stream(s.device))

    def request():
        static_in.copy_(s.inputs[0])
        graph.replay()
        return static_out.cpu()
    return _time(request, s.n, s.warmup), {}


def _chain_graph(s: _Setup) -> tuple[list, dict]:
    import torch
    stream = torch.cuda.Stream(s.device)
    static_in = s.inputs[0].clone()
    graphs, y = [], static_in
    for m in s.blocks:
        g, y = _capture(lambda m=m, y=y: m(y), stream)
        graphs.append(g)
    static_out = y

    def request():
        static_in.copy_(s.inputs[0])
        for g in graphs:
            g.replay()
        return static_out.cpu()
    return _time(request, s.n, s.warmup), {}


# -- the floor row: five processes ---------------------------------------------------------
def _stage(idx: int, stem: str, repo: str, device: str, setup_q, report_q, conn_in, conn_out, last: bool,
           parent_pid: int, timeout: float) -> None:
    """One floor process: loads ``<MODEL>/<stem>.pt``, announces its event's IPC handle, takes its
    input and output buffers and the upstream event's handle, captures ``dst.copy_(block(src))``
    as a CUDA graph and then, per byte on ``conn_in``: its stream waits on the upstream event,
    the graph replays, its event is recorded and a byte goes to ``conn_out`` (the last stage
    instead copies the output to the host and sends its bytes). QUIT is passed on and ends it;
    so does the parent's death."""
    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        import torch

        from blockflow.blocks.repository import load_block
        dev = torch.device(device)
        torch.cuda.set_device(dev)
        torch.set_num_threads(1)
        mod = load_block(repo, f"{MODEL}/{stem}.pt", device)
        ev_out = torch.cuda.Event(interprocess=True)
        report_q.put(("event", idx, ev_out.ipc_handle()))
        src, dst, upstream = setup_q.get(timeout=timeout)
        ev_in = torch.cuda.Event.from_ipc_handle(dev, upstream)
        stream = torch.cuda.Stream(dev)
        with torch.inference_mode():
            graph, _ = _capture(lambda: dst.copy_(mod(src)), stream)
        host = torch.empty(dst.shape, dtype=dst.dtype, pin_memory=True) if last else None
        report_q.put(("ready", idx, None))
    except BaseException as exc:  # the parent reports it; nothing may hang here
        report_q.put(("error", idx, _describe_exc(exc)))
        return
    try:
        with torch.no_grad(), torch.cuda.stream(stream):
            while True:
                while not conn_in.poll(0.5):
                    if os.getppid() != parent_pid:
                        return
                msg = conn_in.recv_bytes()
                if msg == QUIT:
                    conn_out.send_bytes(QUIT)
                    return
                stream.wait_event(ev_in)
                graph.replay()
                if last:
                    host.copy_(dst, non_blocking=True)
                    stream.synchronize()
                    conn_out.send_bytes(host.numpy().tobytes())
                else:
                    ev_out.record(stream)
                    conn_out.send_bytes(GO)
    except BaseException as exc:
        report_q.put(("error", idx, _describe_exc(exc)))


class _Floor:
    """The floor's processes, pipes and queues; :meth:`close` always stops every process."""

    def __init__(self, repo: str, device: str, shapes: list[tuple], timeout: float):
        import torch
        import torch.multiprocessing as tmp
        self.timeout = timeout
        self.ctx = tmp.get_context("spawn")
        self.procs, self.setup_qs = [], []
        self.report_q = self.ctx.Queue()
        self.bufs = [torch.zeros(s, device=device) for s in shapes]
        # pipes[i] leads into stage i; pipes[-1] from the last stage back here. (recv end, send end)
        self.pipes = [self.ctx.Pipe(duplex=False) for _ in range(len(STAGES) + 1)]
        self.root = torch.cuda.Event(interprocess=True)
        self.repo, self.device = repo, device
        self.serving = False  # every stage is in its request loop (QUIT reaches them all)

    def start(self) -> None:
        for i, stem in enumerate(STAGES):
            q = self.ctx.Queue()
            self.setup_qs.append(q)
            p = self.ctx.Process(target=_stage, name=f"gpu-floor-{stem}", daemon=True,
                                 args=(i, stem, self.repo, self.device, q, self.report_q, self.pipes[i][0],
                                       self.pipes[i + 1][1], i == len(STAGES) - 1, os.getpid(), self.timeout))
            p.start()
            self.procs.append(p)
        deadline = time.monotonic() + self.timeout
        handles = {}
        while len(handles) < len(STAGES):
            kind, idx, payload = self._report(deadline, "loading the blocks")
            if kind == "event":
                handles[idx] = payload
        upstream = [self.root.ipc_handle()] + [handles[i] for i in range(len(STAGES) - 1)]
        for i, q in enumerate(self.setup_qs):
            q.put((self.bufs[i], self.bufs[i + 1], upstream[i]))
        ready = set()
        while len(ready) < len(STAGES):
            kind, idx, _ = self._report(deadline, "capturing the blocks' CUDA graphs")
            if kind == "ready":
                ready.add(idx)
        self.serving = True

    def _dead(self) -> list[str]:
        return [f"{STAGES[i]} (exit code {p.exitcode})" for i, p in enumerate(self.procs) if not p.is_alive()]

    def _errors(self) -> list[str]:
        out = []
        while True:
            try:
                kind, idx, payload = self.report_q.get_nowait()
            except (queue.Empty, OSError, ValueError):
                return out
            if kind == "error":
                out.append(f"{STAGES[idx]}: {payload}")

    def _report(self, deadline: float, what: str) -> tuple:
        """The next setup message of a stage; an error, a dead stage or the deadline raises."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"floor: {what} took more than {self.timeout:g} s")
            try:
                msg = self.report_q.get(timeout=min(0.5, left))
            except queue.Empty:
                dead = self._dead()
                if dead:
                    raise RuntimeError(f"floor: {what}: stage process(es) ended: {', '.join(dead)}; "
                                       f"{'; '.join(self._errors()) or 'no error reported'}")
                continue
            if msg[0] == "error":
                raise RuntimeError(f"floor: {what}: stage {STAGES[msg[1]]}: {msg[2]}")
            return msg

    def request(self, x) -> bytes:
        """One round trip: ``x`` into the first buffer, the root event, a byte down the chain;
        returns the answer's bytes from the last stage."""
        self.bufs[0].copy_(x)
        self.root.record()
        self.pipes[0][1].send_bytes(GO)
        recv = self.pipes[-1][0]
        t0 = time.monotonic()
        while not recv.poll(min(0.5, max(0.0, t0 + REQUEST_TIMEOUT_S - time.monotonic()))):
            dead, errors = self._dead(), self._errors()
            if dead or errors or time.monotonic() >= t0 + REQUEST_TIMEOUT_S:
                raise RuntimeError(f"floor: no answer after {time.monotonic() - t0:.1f} s (limit "
                                   f"{REQUEST_TIMEOUT_S:g} s); stage(s) ended: {', '.join(dead) or 'none'}; "
                                   f"errors: {'; '.join(errors) or 'none'}")
        return recv.recv_bytes()

    def close(self) -> None:
        try:
            self.pipes[0][1].send_bytes(QUIT)
        except (OSError, ValueError):
            pass
        end = time.monotonic() + (5 if self.serving else 0.5)
        for p in self.procs:
            p.join(max(0.0, end - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(2)
            if p.is_alive():
                p.kill()
                p.join(2)
        for q in (*self.setup_qs, self.report_q):
            q.cancel_join_thread()
            q.close()
        for r, s in self.pipes:
            r.close()
            s.close()


def _floor(s: _Setup) -> tuple[list, dict]:
    import torch
    inputs = s.inputs
    refs, shapes = [], []
    for x in inputs:  # the answers to check against, and the shapes of the activation buffers
        y, shapes = x, [tuple(x.shape)]
        for m in s.blocks:
            y = m(y)
            shapes.append(tuple(y.shape))
        refs.append(y.cpu())
    floor = _Floor(s.repo, s.device, shapes, s.timeout)
    try:
        floor.start()
        k = [0]

        def request():
            floor.request(inputs[k[0] % len(inputs)])
            k[0] += 1
        samples = _time(request, s.n, s.warmup)
        diff = 0.0
        for x, ref in zip(inputs, refs):
            got = torch.frombuffer(bytearray(floor.request(x)), dtype=ref.dtype).reshape(ref.shape)
            diff = max(diff, (got - ref).abs().max().item())
        spread = max((a - b).abs().max().item() for a in refs for b in refs)
        return samples, {"floor_processes": len(STAGES), "floor_check_max_abs_diff": diff,
                         "floor_check_inputs_max_abs_diff": spread}
    finally:
        floor.close()


ROW_FUNCS = {"mono_eager": _mono_eager, "mono_graph": _mono_graph, "chain_graph": _chain_graph, "floor": _floor}


def measure(repo: str | None = None, device: str = "cuda", n: int = DEFAULT_N, warmup: int = WARMUP,
            timeout: float = SETUP_TIMEOUT_S) -> dict:
    """Every row of the module docstring on ``device``: ``{"<row>_p50_ms", "<row>_p90_ms",
    "<row>_mean_ms", "<row>_min_ms"}`` per row measured, ``"<row>_error"`` per row that failed,
    and ``n``, ``warmup``, ``gpu``, ``seconds``; ``{"skipped": "no GPU"}`` without CUDA."""
    import torch
    if not torch.cuda.is_available():
        return {"skipped": "no GPU"}
    if not str(device).startswith("cuda"):
        return {"skipped": f"device {device!r} is not a CUDA device"}
    from experiments import common
    from blockflow.blocks.repository import load_block
    repo = os.path.abspath(common.ensure_repo(repo or common.DEFAULT_REPO))
    dev = torch.device(device)
    if dev.index is None:  # torch.cuda.set_device and the child processes want an index
        dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(dev)
    out = {"n": n, "warmup": warmup, "batch": 1, "dtype": "float32", "model": MODEL, "repo": repo,
           "device": str(dev), "gpu": torch.cuda.get_device_name(dev), "rows": ROWS,
           "timed": "one request at a time, answer on the host; input from a device tensor"}
    t0 = time.monotonic()
    results: dict = {}
    try:  # loaded and made outside inference mode: the floor row runs them under no_grad
        full = load_block(repo, f"{MODEL}/full.pt", str(dev))
        blocks = [load_block(repo, f"{MODEL}/{s}.pt", str(dev)) for s in STAGES]
        inputs = [common.input_tensor(1, seed=k).to(dev) for k in range(CHECK_INPUTS)]
        with torch.inference_mode():
            for _ in range(WARM_CALLS):
                full(inputs[0])
                y = inputs[0]
                for m in blocks:
                    y = m(y)
            torch.cuda.synchronize(dev)
    except Exception as exc:
        log.warning("gpu_floor: cannot load %s from %s: %s", MODEL, repo, exc)
        for row in ROWS:
            out[f"{row}_error"] = f"loading the model: {_describe_exc(exc)}"
        return out
    setup = _Setup(repo, str(dev), full, blocks, inputs, n, warmup, timeout)
    for row in RUN_ORDER:
        t_row = time.monotonic()
        try:
            # the floor's buffers are shared with its processes: normal tensors, not inference ones
            with torch.no_grad() if row == "floor" else torch.inference_mode():
                samples, extra = ROW_FUNCS[row](setup)
            results[row] = {**_figures(row, samples), **extra}
            log.info("gpu_floor %s: p50 %.3f ms (%.1f s)", row, results[row][f"{row}_p50_ms"],
                     time.monotonic() - t_row)
        except Exception as exc:  # one row's failure must not lose the others
            log.warning("gpu_floor %s failed: %s", row, exc)
            results[row] = {f"{row}_error": _describe_exc(exc)}
    for row in ROWS:  # reported in the ROWS order
        out.update(results.get(row, {}))
    out["seconds"] = time.monotonic() - t0
    return out


def format_rows(res: dict) -> list[str]:
    """The rows of a :func:`measure` result as lines: p50 and p90 (ms) or the row's error."""
    if "skipped" in res:
        return [f"GPU floor: skipped ({res['skipped']})"]
    if "error" in res:
        return [f"GPU floor: failed ({res['error']})"]
    out = [f"GPU floor on {res.get('gpu', '?')} ({res.get('device', '?')}), batch 1, fp32, "
           f"{res.get('n', '?')} requests after {res.get('warmup', '?')} untimed (experiments/gpu_floor.py):"]
    for row, what in ROWS.items():
        if res.get(f"{row}_p50_ms") is not None:
            out.append(f"  {row:12s} p50 {res[f'{row}_p50_ms']:8.3f} ms  p90 {res[f'{row}_p90_ms']:8.3f} ms   {what}")
        else:
            out.append(f"  {row:12s} failed: {res.get(f'{row}_error', 'not measured')}")
    if res.get("floor_check_max_abs_diff") is not None:
        out.append(f"  floor answers vs the blocks run eagerly here: max |diff| {res['floor_check_max_abs_diff']:.3g} "
                   f"(between different inputs: {res.get('floor_check_inputs_max_abs_diff', float('nan')):.3g})")
    return out


def main(argv: list[str] | None = None) -> int:
    from experiments import common
    ap = common.parser(NAME, __doc__)
    ap.add_argument("--device", default="cuda", help="the CUDA device (default cuda: the current one)")
    ap.add_argument("--warmup", type=int, default=WARMUP, help=f"untimed requests before each row's timed ones "
                                                               f"(default {WARMUP})")
    ap.add_argument("--timeout", type=float, default=SETUP_TIMEOUT_S,
                    help=f"seconds the floor's processes may take to load and capture their blocks "
                         f"(default {SETUP_TIMEOUT_S:g}); a request through them may take {REQUEST_TIMEOUT_S:g} s")
    ap._option_string_actions["--n"].help = f"timed requests per row (default {DEFAULT_N}; --quick {QUICK_N})"
    args = ap.parse_args(argv)
    common.setup_logging(args.verbose)
    import torch
    if not torch.cuda.is_available():
        print("gpu_floor needs a CUDA GPU and none is visible here (torch.cuda.is_available() is False); "
              "nothing measured", file=sys.stderr)
        return 2
    if not args.device.startswith("cuda"):
        print(f"gpu_floor needs a CUDA device, not --device {args.device}; nothing measured", file=sys.stderr)
        return 2
    n = args.n or (QUICK_N if args.quick else DEFAULT_N)
    repo = common.ensure_repo(args.repo)
    settings = {"device": args.device, "n": n, "warmup": args.warmup, "batch": 1, "dtype": "float32",
                "setup_timeout_s": args.timeout, "request_timeout_s": REQUEST_TIMEOUT_S, "quick": args.quick}
    env = common.env_info(settings)
    res = measure(repo, args.device, n, args.warmup, args.timeout)
    common.write_json(args.out, NAME, {"env": env, "settings": settings, "figures": res})
    print("\n".join(format_rows(res)))
    return 1 if any(k.endswith("_error") for k in res) else 0


if __name__ == "__main__":
    sys.exit(main())
