"""The peer, measured beside BlockFlow: the same ResNet50 blocks served by Ray Serve (issue 16).

One run, one machine, the same TorchScript files (model_repo/resnet50/*.pt) and the same torch
threads per serving process (``--threads``, default 1), six systems:

  blockflow        ``blockflow serve``, block1..block4 + head as five block processes over
                   TensorMQ, a synchronous ``blockflow.client.Client`` (ZeroMQ) as the client;
  blockflow_fused  the same server after an update to one fused block chaining the five files;
  ray_composed     Ray Serve, one deployment per block, composed the idiomatic way: an ingress
                   deployment holds the five handles and passes each DeploymentResponse to the
                   next handle (the tensors go through Ray's object store, not the ingress);
  ray_single       Ray Serve, one deployment running the five files in sequence;
  *_r2             the fused block and the single deployment again, each as two replicas
                   (BlockFlow's ``replicas: 2``, Ray's ``num_replicas=2``; issue 28).

The Ray client is a ``DeploymentHandle`` in this process (no HTTP proxy is started: Ray's
fastest path from Python). Ray runs locally with ``ray.init(num_cpus=2, include_dashboard=False)``
in a private temporary directory that is removed after ``ray.shutdown()``; every Ray replica asks
for 0 CPUs so that six of them fit on a 2-core machine (Ray does not pin them; BlockFlow does not
pin its blocks either). Each replica and each block warms its model once at start-up.

Both systems are up side by side and every row is measured with them taking turns (chunks of
requests, throughput windows, per-hop pairs; the order flips every round), so that both see the
same background load: on a shared machine the load moves more than the difference between them.
What an idle system costs the other is reported as its idle CPU. Rows:

  latency     p50/p99 of a synchronous client at batch 1 (``--warm`` requests first, not kept);
  throughput  requests/s with 4 synchronous clients (threads of this process), answers counted
              inside ``--duration`` s of windows;
  per hop     chains of identity (``return x``) and copying (``x + 1``) TorchScript blocks, 1 and
              ``--chain`` (4) long, behind the same entry point as the pipeline (BlockFlow's
              dispatcher; Ray's composing ingress): per hop = (RTT_K - RTT_1) / (K - 1), median
              and p99 over paired samples, at 3.2 MB (block1's output at batch 1) and 103 MB
              (batch 32; not in --quick); a difference below zero, or one whose thirds of the
              samples (``HOP_ROUNDS``, in the order taken) spread over more than itself, is
              reported as not measured (hop_overhead's Note [Not measured]), never as a figure;
  memory      RSS and USS summed over every process of the system (psutil): ``blockflow serve``,
              its manager, blocks and dispatcher; Ray's GCS, raylet, agents, idle workers, Serve
              controller and replicas. This process (the client of both) is left out;
  start-up    seconds from starting the system (``blockflow serve`` / ``ray.init``) to the first
              answer of the 5-block pipeline (cold; BlockFlow starts first, alone), and from a
              running system to the first answer of a newly deployed configuration (deploy);
  idle CPU    % of one core the system's processes burn over a few seconds with nothing sent.

Before each pair's rows the five blocks run back to back in this process (``compute ref``): how
fast the machine was then. Without Ray (``pip install -e '.[peers]'``) the script writes a JSON
with ``skipped`` and a reason, and exits 0.

    python -m experiments.peers [--quick] [--n N] [--duration S] [--threads T] [--out DIR]
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings

from experiments import common

log = logging.getLogger("experiments.peers")

NAME = "peers"
SYSTEMS = ("blockflow", "blockflow_fused", "blockflow_fused_r2", "ray_composed", "ray_single", "ray_single_r2")
LABELS = {"blockflow": "BlockFlow, 5 blocks (tensormq)", "blockflow_fused": "BlockFlow, 1 fused block",
          "blockflow_fused_r2": "BlockFlow, 1 fused block, 2 replicas",
          "ray_composed": "Ray Serve, 5 deployments composed", "ray_single": "Ray Serve, 1 deployment",
          "ray_single_r2": "Ray Serve, 1 deployment, 2 replicas"}
#: like for like: (BlockFlow system, Ray system)
PAIRS = (("blockflow", "ray_composed"), ("blockflow_fused", "ray_single"), ("blockflow_fused_r2", "ray_single_r2"))
#: ResNet50's block1 output at batch 1 and 32: 3.2 MB and 103 MB of float32.
HOP_SIZES = {"3.2MB": (1, 256, 56, 56), "103MB": (32, 256, 56, 56)}
HOP_KINDS = ("identity", "copy")
#: Consecutive parts of a per-hop series whose medians decide whether the difference is measured
#: (hop_overhead's Note [Not measured]): at 103 MB a BlockFlow hop is a few ms inside round trips
#: of 100-200 ms, whose noise made the median of the differences negative in three runs of three.
HOP_ROUNDS = 3
FUSED = "f"
#: where the identity and copying blocks are written, inside the model repository
TOYS = "_peers"
RAY_CPUS = 2
# Ray on the loopback only: with this (read when ray is imported), Ray 2.60 gives its node and
# GCS 127.0.0.1 instead of this machine's interface address
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def ray_missing() -> str | None:
    """Why Ray Serve cannot run here, or None."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as exc:
        return (f"Ray Serve is not installed ({exc}); install the optional extra with "
                f"`pip install -e '.[peers]'` (ray[serve]) to measure the peer")
    return None


# -- load loops shared by both systems -----------------------------------------------------
def timed(call) -> float | None:
    """One call's round trip in ms, or None when it failed (logged; the rows count failures)."""
    t0 = time.perf_counter()
    try:
        call()
    except Exception as exc:
        log.warning("request failed: %s", exc)
        return None
    return (time.perf_counter() - t0) * 1e3


def interleaved_latency(calls: dict, n: int, warm: int, rounds: int) -> dict[str, list]:
    """``n`` synchronous requests per system, in ``rounds`` chunks taken in turn (the order flips
    every round), so that every system sees the same background load of a shared machine."""
    for call in calls.values():
        for _ in range(warm):
            timed(call)
    out: dict[str, list] = {k: [] for k in calls}
    names = list(calls)
    with common.Progress(n * len(calls), "latency") as bar:
        for r in range(rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                for _ in range(n // rounds + (1 if r < n % rounds else 0)):
                    out[name].append(timed(calls[name]))
                    bar.update()
    return out


def closed_loop(open_caller, clients: int, duration: float) -> dict:
    """``clients`` synchronous clients (threads of this process) for ``duration`` s;
    ``open_caller()`` is a context manager giving one client its call function."""
    rtts: list[list[float]] = [[] for _ in range(clients)]
    errors = [0] * clients
    window = [0.0, 0.0]

    def start_clock() -> None:  # run once, when every client (and this thread) is ready
        window[0] = time.monotonic()
        window[1] = window[0] + duration
    ready = threading.Barrier(clients + 1, action=start_clock)

    def client(i: int) -> None:
        with open_caller() as call:
            timed(call)  # each client's own connection is up before the clock starts
            ready.wait()
            while time.monotonic() < window[1]:
                ms = timed(call)
                if ms is None:
                    errors[i] += 1
                elif time.monotonic() <= window[1]:
                    rtts[i].append(ms)

    threads = [threading.Thread(target=client, args=(i,), daemon=True, name=f"client-{i}") for i in range(clients)]
    for t in threads:
        t.start()
    ready.wait(timeout=300)
    for t in threads:
        t.join(duration + 300)
    return {"answers": sum(len(r) for r in rtts), "errors": sum(errors), "rtts": [v for r in rtts for v in r]}


def interleaved_throughput(open_callers: dict, clients: int, duration: float, rounds: int) -> dict[str, dict]:
    """Requests/s with ``clients`` clients: ``rounds`` windows per system, taken in turn."""
    acc = {k: {"answers": 0, "errors": 0, "rtts": []} for k in open_callers}
    names = list(open_callers)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            res = closed_loop(open_callers[name], clients, duration / rounds)
            for k in acc[name]:
                acc[name][k] += res[k]
            log.info("%s: %d answers in %.1f s with %d clients", name, res["answers"], duration / rounds, clients)
    return {k: {"clients": clients, "duration_s": duration, "answers": a["answers"], "errors": a["errors"],
                "throughput_rps": a["answers"] / duration, "rtt_ms": common.describe(a["rtts"])}
            for k, a in acc.items()}


def interleaved_hops(calls: dict, kind: str, sizes: dict, n_of: dict, chain: int, warm: int) -> list[dict]:
    """Per-hop cost from paired round trips through chains of 1 and ``chain`` blocks, the
    systems in turn; ``calls[system](x, long)`` sends ``x`` through the short or the long chain."""
    import torch
    rows = []
    for size, shape in sizes.items():
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
        for call in calls.values():
            for _ in range(warm):
                call(x, False)
                call(x, True)
        pairs: dict[str, list] = {k: [] for k in calls}
        names = list(calls)
        with common.Progress(n_of[size] * len(calls), f"{kind} {size}") as bar:
            for i in range(n_of[size]):
                for name in (names if i % 2 == 0 else names[::-1]):
                    short = timed(lambda: calls[name](x, False))
                    long_ = timed(lambda: calls[name](x, True))
                    if short is not None and long_ is not None:
                        pairs[name].append((short, long_))
                    bar.update()
        for name, ps in pairs.items():
            per_hop = [(lg - s) / (chain - 1) for s, lg in ps]
            row = {"system": name, "block": kind, "size": size, "shape": list(shape),
                   "mbytes": x.numel() * x.element_size() / 1e6, "n": len(ps), "chain": chain,
                   "rtt1_median_ms": statistics.median(s for s, _ in ps) if ps else None,
                   "rttK_median_ms": statistics.median(lg for _, lg in ps) if ps else None}
            row.update(per_hop_figure(per_hop))
            rows.append(row)
            log.info("%s %s %s: per hop %s ms%s", name, kind, size, row["per_hop_median_ms"],
                     f" (not measured: {row['not_measured']})" if row.get("not_measured") else "")
    return rows


def per_hop_figure(per_hop: list[float]) -> dict:
    """The median and p99 of per-hop differences taken in this order, or None for both with the
    reason under ``not_measured`` where they are noise (hop_overhead's Note [Not measured]: below
    zero, or ``HOP_ROUNDS`` consecutive parts whose medians spread over more than the figure)."""
    from experiments.hop_overhead import rounds_figure
    if not per_hop:
        return {"per_hop_median_ms": None, "per_hop_p99_ms": None, "per_hop_spread_ms": [None, None],
                "not_measured": "no samples"}
    k = min(HOP_ROUNDS, len(per_hop))
    parts = [per_hop[i * len(per_hop) // k:(i + 1) * len(per_hop) // k] for i in range(k)]
    fig = rounds_figure([statistics.median(p) for p in parts])
    med = statistics.median(per_hop)
    why = fig["why"] or (f"below zero ({med:.3f} ms): the noise of what is subtracted is larger than the hop"
                         if med < 0 else None)
    out = {"per_hop_median_ms": None if why else med, "per_hop_p99_ms": None if why else common.pct(per_hop, 0.99),
           "per_hop_spread_ms": [fig["low"], fig["high"]]}
    if why:
        out["not_measured"] = why
    return out


# -- what the processes cost ---------------------------------------------------------------
def tree_pids(root: int) -> set[int]:
    import psutil
    try:
        p = psutil.Process(root)
        return {root} | {c.pid for c in p.children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def memory(pids: set[int]) -> dict:
    """RSS and USS (MB) summed over ``pids``, and how many processes of each name."""
    import psutil
    rss = uss = 0
    names: dict[str, int] = {}
    for pid in pids:
        try:
            p = psutil.Process(pid)
            with p.oneshot():
                info = p.memory_full_info()
                name = p.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        rss += info.rss
        uss += info.uss
        names[name] = names.get(name, 0) + 1
    return {"rss_mb": rss / 2**20, "uss_mb": uss / 2**20, "processes": sum(names.values()), "names": names}


def idle_cpu(groups: dict[str, set[int]], seconds: float) -> dict[str, float]:
    """CPU % (100 = one core) each group of processes burns while no request is sent."""
    import psutil

    def cpu(pids):
        total = 0.0
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                t = psutil.Process(pid).cpu_times()
                total += t.user + t.system
        return total
    before = {k: cpu(v) for k, v in groups.items()}
    time.sleep(seconds)  # the measurement itself: a window with nothing sent
    return {k: 100 * (cpu(v) - before[k]) / seconds for k, v in groups.items()}


def compute_ref(mods: list, n: int) -> dict:
    """The five blocks back to back in this process: how fast the machine is right now (ms)."""
    import torch
    x = common.input_tensor(1)

    def run():
        with torch.inference_mode():
            y = x
            for m in mods:
                y = m(y)
    for _ in range(2):
        run()
    return common.describe([timed(run) for _ in range(n)])


def write_toys(repo: str) -> None:
    """The identity and copying TorchScript blocks, in ``<repo>/_peers/`` (git-ignored with the
    repository, as common.traced_repo keeps its files)."""
    import torch

    from experiments.hop_overhead import KINDS  # the same identity and x + 1 modules hop_overhead serves

    os.makedirs(os.path.join(repo, TOYS), exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for kind, cls in KINDS.items():
            torch.jit.save(torch.jit.script(cls()), os.path.join(repo, TOYS, f"{kind}.pt"))


# -- BlockFlow -----------------------------------------------------------------------------
class BlockFlowSide:
    """``blockflow serve`` with the three configurations: 5 blocks, 1 fused block, hop chains."""

    def __init__(self, repo: str, threads: int, chain: int, stack: contextlib.ExitStack):
        from blockflow.client import Client
        self.Client, self.threads, self.chain = Client, threads, chain
        self.x = common.input_tensor(1)
        # The TensorMQ slots go to a directory of our own: the tests of other checkouts on a
        # shared machine sweep /dev/shm/blockflow-* (their leak check) and would delete ours.
        shm = tempfile.mkdtemp(prefix="bfbench-peers-", dir="/dev/shm")
        stack.callback(shutil.rmtree, shm, ignore_errors=True)
        os.environ["BLOCKFLOW_SHM_DIR"] = shm  # for the server this starts (read there, at import)
        t0 = time.monotonic()
        self.server = stack.enter_context(common.blockflow_server(repo))
        self.client = stack.enter_context(Client(self.server.dispatcher, timeout=120))
        t_sys = time.monotonic()
        self.startup = {"system_s": t_sys - t0, "cold_s": None}
        self.startup["deploy_s"] = self.deploy(common.pipeline_update("tensormq", threads=threads, device="cpu"))
        self.startup["cold_s"] = time.monotonic() - t0

    def deploy(self, update: dict, task: str = common.TASK, x=None) -> float:
        """Seconds from the update to the first answer."""
        t0 = time.monotonic()
        self.server.update(update)
        self.client.infer(task, self.x if x is None else x)
        return time.monotonic() - t0

    def pids(self) -> set[int]:
        return tree_pids(self.server.proc.pid)

    def call(self):
        return self.client.infer(common.TASK, self.x)

    @contextlib.contextmanager
    def open_caller(self):
        with self.Client(self.server.dispatcher, timeout=120) as c:
            yield lambda: c.infer(common.TASK, self.x)

    def deploy_fused(self, replicas: int = 1) -> float:
        files = [f"resnet50/{stem}.pt" for _, stem in common.PIPELINE]
        return self.deploy({"transport": "tensormq", "protocol": "ipc",
                            "blocks": [{"name": FUSED, "model": files, "device": "cpu", "threads": self.threads,
                                        "replicas": replicas}],
                            "tasks": [{"id": common.TASK, "path": [FUSED]}]})

    def deploy_hops(self) -> None:
        blocks, tasks = [], []
        for kind in HOP_KINDS:
            names = [f"{kind[0]}{k}" for k in range(self.chain)]
            blocks += [{"name": nm, "model": f"{TOYS}/{kind}.pt", "device": "cpu", "threads": self.threads}
                       for nm in names]
            tasks += [{"id": f"{kind}-1", "path": names[:1]}, {"id": f"{kind}-{self.chain}", "path": names}]
        self.deploy({"transport": "tensormq", "protocol": "ipc", "blocks": blocks, "tasks": tasks},
                    f"{HOP_KINDS[0]}-1", common.input_tensor(1))

    def hop_call(self, kind: str):
        return lambda x, long_: self.client.infer(f"{kind}-{self.chain if long_ else 1}", x)


# -- Ray Serve -----------------------------------------------------------------------------
def ray_deployments():
    """The two Ray Serve deployments, defined here so that Ray pickles them by value (the worker
    processes need not import this module). ``TorchBlock`` runs TorchScript files in sequence;
    ``Compose`` is the ingress that chains block handles by passing DeploymentResponses."""
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class TorchBlock:
        def __init__(self, paths: list, threads: int, warm_shape=None):
            import torch
            torch.set_num_threads(threads)
            self.torch = torch
            self.mods = [torch.jit.load(p, map_location="cpu").eval() for p in paths]
            if warm_shape:  # as a BlockFlow block does at start-up
                self(torch.zeros(warm_shape))

        def __call__(self, x):
            with self.torch.inference_mode():
                for m in self.mods:
                    x = m(x)
            return x

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Compose:
        def __init__(self, *blocks):
            self.blocks = blocks

        async def __call__(self, x, start: int = 0, k: int = 0):
            r = x
            for b in self.blocks[start:start + k if k else None]:
                r = b.remote(r)  # a DeploymentResponse goes to the next block without a stop here
            return await r

    return TorchBlock, Compose


class RaySide:
    """A local Ray with Serve (no HTTP proxy) in a private temp dir, and the same three
    configurations. ``close()`` shuts it down and checks that nothing it started is left."""

    def __init__(self, repo: str, threads: int, chain: int, stack: contextlib.ExitStack, others):
        import ray
        from ray import serve
        self.serve, self.threads, self.chain = serve, threads, chain
        self.x = common.input_tensor(1)
        self.files = {stem: os.path.join(os.path.abspath(repo), "resnet50", f"{stem}.pt")
                      for _, stem in common.PIPELINE}
        self.shapes = {e["name"]: e["input_shape"] for e in common.manifest_entries(repo).values()}
        self.toys = os.path.join(os.path.abspath(repo), TOYS)
        self.others = others  # () -> the processes under this script that are not Ray's, now
        self.tmp = tempfile.mkdtemp(prefix="rayp-", dir="/tmp")  # short: socket paths must fit 107 chars
        self.report = {"temp_dir": self.tmp, "leftover_processes": []}
        stack.callback(self.close)
        # the workers import nothing of this checkout; keep it importable for them all the same
        os.environ["PYTHONPATH"] = common.ROOT + (os.pathsep + os.environ["PYTHONPATH"]
                                                  if os.environ.get("PYTHONPATH") else "")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        t0 = time.monotonic()
        ray.init(num_cpus=RAY_CPUS, include_dashboard=False, _temp_dir=self.tmp, log_to_driver=False,
                 logging_level=logging.WARNING)
        serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING"})
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
        t_sys = time.monotonic()
        self.TorchBlock, self.Compose = ray_deployments()
        self.startup = {"system_s": t_sys - t0, "cold_s": None}
        blocks = [self.TorchBlock.options(name=stem).bind([self.files[stem]], threads, self.shapes[stem])
                  for _, stem in common.PIPELINE]
        self.startup["deploy_s"] = self.deploy(self.Compose.bind(*blocks), "pipeline")
        self.startup["cold_s"] = time.monotonic() - t0

    def deploy(self, app, name: str) -> float:
        """Seconds from serve.run (the previous application deleted first) to the first answer."""
        if getattr(self, "app", None):
            self.serve.delete(self.app)
        t0 = time.monotonic()
        self.handle = self.serve.run(app, name=name, route_prefix=None)
        self.app = name
        if name != "hops":
            self.handle.remote(self.x).result()
        else:
            self.handle.remote(common.input_tensor(1), 0, 1).result()
        return time.monotonic() - t0

    def pids(self) -> set[int]:
        return tree_pids(os.getpid()) - {os.getpid()} - self.others()

    def call(self):
        return self.handle.remote(self.x).result()

    @contextlib.contextmanager
    def open_caller(self):
        yield self.call  # one DeploymentHandle shared by the client threads, as Ray intends

    def deploy_single(self, replicas: int = 1) -> float:
        return self.deploy(self.TorchBlock.options(name="single", num_replicas=replicas).bind(
            list(self.files.values()), self.threads, self.shapes["block1"]), "single")

    def deploy_hops(self) -> None:
        blocks = [self.TorchBlock.options(name=f"{kind}{k}").bind([os.path.join(self.toys, f"{kind}.pt")],
                                                                  self.threads)
                  for kind in HOP_KINDS for k in range(self.chain)]
        self.deploy(self.Compose.options(name="hop-ingress").bind(*blocks), "hops")

    def hop_call(self, kind: str):
        start = HOP_KINDS.index(kind) * self.chain
        return lambda x, long_: self.handle.remote(x, start, self.chain if long_ else 1).result()

    def close(self) -> None:
        """Serve's controller and replicas first (serve.shutdown), then the cluster; then wait
        for every process Ray started to be gone, kill (and report) any that is not."""
        import psutil
        import ray
        with contextlib.suppress(Exception):
            self.serve.shutdown()
        ray.shutdown()
        deadline = time.monotonic() + 20
        left = []
        others = self.others()  # BlockFlow is still up: it stops after Ray (the exit stack's order)
        while time.monotonic() < deadline:
            left = [p for p in psutil.Process().children(recursive=True) if p.pid not in others]
            if not left:
                break
            time.sleep(0.2)
        for p in left:
            with contextlib.suppress(psutil.NoSuchProcess):
                self.report["leftover_processes"].append(f"{p.pid} {p.name()}")
                p.kill()
        if self.report["leftover_processes"]:
            log.warning("Ray left processes behind after shutdown (killed): %s", self.report["leftover_processes"])
        shutil.rmtree(self.tmp, ignore_errors=True)


# -- the run -------------------------------------------------------------------------------
def run(repo: str, cfg: dict) -> tuple[dict, list[dict], dict]:
    """Both systems up side by side; every row measured with the systems taking turns."""
    from blockflow.blocks.repository import load_block
    import torch
    torch.set_num_threads(cfg["threads"])
    ref_mods = [load_block(repo, f"resnet50/{stem}.pt") for _, stem in common.PIPELINE]
    write_toys(repo)
    systems: dict[str, dict] = {}
    with contextlib.ExitStack() as stack:
        bf = BlockFlowSide(repo, cfg["threads"], cfg["chain"], stack)
        log.info("blockflow: cold start %.1f s", bf.startup["cold_s"])
        bf_pids = bf.pids()
        bf_mem = memory(bf_pids)
        ray = RaySide(repo, cfg["threads"], cfg["chain"], stack, bf.pids)
        log.info("ray: cold start %.1f s", ray.startup["cold_s"])
        idle = idle_cpu({"blockflow": bf.pids(), "ray_composed": ray.pids()}, cfg["idle_s"])
        configs = [(("blockflow", bf.startup, bf_mem), ("ray_composed", ray.startup, memory(ray.pids())))]

        def rows(pair):
            (b, b_start, b_mem), (r, r_start, r_mem) = pair
            ref = compute_ref(ref_mods, cfg["ref_n"])
            lat = interleaved_latency({b: bf.call, r: ray.call}, cfg["n"], cfg["warm"], cfg["rounds"])
            thr = interleaved_throughput({b: bf.open_caller, r: ray.open_caller}, cfg["clients"], cfg["duration"],
                                         cfg["rounds"])
            for name, start, mem in ((b, b_start, b_mem), (r, r_start, r_mem)):
                ok = [v for v in lat[name] if v is not None]
                systems[name] = {"label": LABELS[name], "latency_ms": common.describe(ok),
                                 "latency_errors": len(lat[name]) - len(ok), "throughput": thr[name],
                                 "memory": mem, "startup": start, "compute_ref_ms": ref,
                                 "idle_cpu_pct": idle.get(name), "loadavg": [round(v, 2) for v in os.getloadavg()]}
                log.info("%s: p50 %.1f ms, %.2f req/s, RSS %.0f MB", name, systems[name]["latency_ms"].get("p50", 0),
                         thr[name]["throughput_rps"], mem["rss_mb"])
        rows(configs[0])

        b_start = {"deploy_s": bf.deploy_fused()}
        r_start = {"deploy_s": ray.deploy_single()}
        idle = idle_cpu({"blockflow_fused": bf.pids(), "ray_single": ray.pids()}, cfg["idle_s"])
        rows((("blockflow_fused", b_start, memory(bf.pids())), ("ray_single", r_start, memory(ray.pids()))))

        b_start = {"deploy_s": bf.deploy_fused(replicas=2)}
        r_start = {"deploy_s": ray.deploy_single(replicas=2)}
        idle = idle_cpu({"blockflow_fused_r2": bf.pids(), "ray_single_r2": ray.pids()}, cfg["idle_s"])
        rows((("blockflow_fused_r2", b_start, memory(bf.pids())), ("ray_single_r2", r_start, memory(ray.pids()))))

        bf.deploy_hops()
        ray.deploy_hops()
        hops = []
        for kind in HOP_KINDS:
            hops += interleaved_hops({"blockflow": bf.hop_call(kind), "ray_composed": ray.hop_call(kind)}, kind,
                                     cfg["hop_sizes"], cfg["hop_n"], cfg["chain"], min(cfg["warm"], 2))
    return systems, hops, ray.report


# -- results -------------------------------------------------------------------------------
def verdicts(systems: dict, hops: list[dict]) -> list[dict]:
    """Each row, BlockFlow's value beside its like-for-like Ray value, and who is ahead."""
    rows = []

    def add(row, bf, ray, a, b, lower_better=True):
        if a is None or b is None:
            return
        rows.append({"row": row, "blockflow": bf, "ray": ray, "blockflow_value": a, "ray_value": b,
                     "lower_is_better": lower_better, "blockflow_ahead": a < b if lower_better else a > b})

    for bf, ray in PAIRS:
        if bf not in systems or ray not in systems:
            continue
        s, r = systems[bf], systems[ray]
        add("latency p50 ms", bf, ray, s["latency_ms"]["p50"], r["latency_ms"]["p50"])
        add("latency p99 ms", bf, ray, s["latency_ms"]["p99"], r["latency_ms"]["p99"])
        add("throughput req/s", bf, ray, s["throughput"]["throughput_rps"], r["throughput"]["throughput_rps"], False)
        add("RSS MB", bf, ray, s["memory"]["rss_mb"], r["memory"]["rss_mb"])
        add("USS MB", bf, ray, s["memory"]["uss_mb"], r["memory"]["uss_mb"])
        add("start-up to first answer s (cold)", bf, ray, s["startup"].get("cold_s"), r["startup"].get("cold_s"))
        add("deploy to first answer s", bf, ray, s["startup"]["deploy_s"], r["startup"]["deploy_s"])
        add("idle CPU %", bf, ray, s.get("idle_cpu_pct"), r.get("idle_cpu_pct"))
    for h in hops:
        if h["system"] != "blockflow":
            continue
        other = next((o for o in hops if o["system"] == "ray_composed" and o["block"] == h["block"]
                      and o["size"] == h["size"]), None)
        if other:
            add(f"per hop, {h['block']} {h['size']}, median ms", "blockflow", "ray_composed",
                h["per_hop_median_ms"], other["per_hop_median_ms"])
    return rows


def _f(v, digits: int = 1) -> str:
    return "–" if v is None else f"{v:,.{digits}f}"


def table(d: dict) -> str:
    """The markdown table experiments/report.py puts between ``<!-- table:peers -->`` markers."""
    s = d["systems"]
    cols = [k for k in SYSTEMS if k in s]
    head = ["row", *(LABELS[k] for k in cols)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def line(label, values):
        lines.append("| " + " | ".join([label, *values]) + " |")
    line("latency p50 ms (1 client, batch 1)", [_f(s[k]["latency_ms"]["p50"]) for k in cols])
    line("latency p99 ms", [_f(s[k]["latency_ms"]["p99"]) for k in cols])
    line(f"throughput req/s ({d['settings']['clients']} clients)", [_f(s[k]["throughput"]["throughput_rps"], 2)
                                                                    for k in cols])
    line("RSS MB, all processes", [_f(s[k]["memory"]["rss_mb"], 0) for k in cols])
    line("USS MB, all processes", [_f(s[k]["memory"]["uss_mb"], 0) for k in cols])
    line("processes", [str(s[k]["memory"]["processes"]) for k in cols])
    line("idle CPU % of one core", [_f(s[k].get("idle_cpu_pct")) for k in cols])
    line("failed requests (latency + throughput rows)",
         [str(s[k].get("latency_errors", 0) + s[k]["throughput"]["errors"]) for k in cols])
    line("start-up to first answer s (cold)", [_f(s[k]["startup"].get("cold_s")) for k in cols])
    line("deploy to first answer s (running system)", [_f(s[k]["startup"]["deploy_s"]) for k in cols])
    line("compute ref ms (5 blocks in this process, before the rows)", [_f(s[k]["compute_ref_ms"]["p50"]) for k in cols])
    for kind in HOP_KINDS:
        for size in HOP_SIZES:
            vals = {h["system"]: h for h in d["hops"] if h["block"] == kind and h["size"] == size}
            if vals:
                line(f"per hop, {kind} block, {size}: median (p99) ms",
                     [("not measured" if vals[k].get("not_measured") else
                       f"{_f(vals[k]['per_hop_median_ms'], 2)} ({_f(vals[k]['per_hop_p99_ms'], 2)})") if k in vals
                      else "–" for k in cols])
    out = "\n".join(lines)
    behind = [f"{v['row']} ({LABELS[v['blockflow']]} {_f(v['blockflow_value'], 2)} vs {_f(v['ray_value'], 2)})"
              for v in d["verdicts"] if not v["blockflow_ahead"]]
    ahead = sum(v["blockflow_ahead"] for v in d["verdicts"])
    out += (f"\n\nBlockFlow ahead of its like-for-like Ray Serve system on {ahead} of {len(d['verdicts'])} rows"
            + (f"; behind on: {'; '.join(behind)}." if behind else "."))
    clean = d.get("ray_cleanup", {})
    out += (f" Ray left {len(clean.get('leftover_processes', []))} process(es) after `ray.shutdown()`; "
            f"Ray {d.get('ray_version', '?')}.")
    return out


def plot(d: dict, out: str) -> None:
    plt = common.pyplot()
    s = d["systems"]
    cols = [k for k in SYSTEMS if k in s]
    colors = {"blockflow": "tab:orange", "blockflow_fused": "tab:red", "blockflow_fused_r2": "tab:brown",
              "ray_composed": "tab:blue", "ray_single": "tab:cyan", "ray_single_r2": "tab:purple"}
    short = {"blockflow": "BF 5 blocks", "blockflow_fused": "BF fused", "blockflow_fused_r2": "BF fused x2",
             "ray_composed": "Ray 5 depl.", "ray_single": "Ray 1 depl.", "ray_single_r2": "Ray 1 depl. x2"}
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    cold = [k for k in cols if s[k]["startup"].get("cold_s") is not None]
    panels = [
        (axes[0][0], "latency p50 (ms)", cols, lambda k: s[k]["latency_ms"]["p50"], lambda k: s[k]["latency_ms"]["p99"]),
        (axes[0][1], f"throughput, {d['settings']['clients']} clients (req/s)", cols,
         lambda k: s[k]["throughput"]["throughput_rps"], None),
        (axes[1][0], "RSS of all processes (MB)", cols, lambda k: s[k]["memory"]["rss_mb"], None),
        (axes[1][1], "start-up to first answer, cold (s)", cold, lambda k: s[k]["startup"]["cold_s"], None),
    ]
    for ax, ylabel, ks, val, p99 in panels:
        bars = ax.bar([short[k] for k in ks], [val(k) for k in ks], color=[colors[k] for k in ks])
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
        if p99:
            ax.scatter([short[k] for k in ks], [p99(k) for k in ks], marker="_", s=300, color="black",
                       label="p99", zorder=3)
            ax.legend(fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_xlabel("system")
        ax.tick_params(axis="x", labelsize=8)
    ax = axes[0][2]
    keys = [(kind, size) for kind in HOP_KINDS for size in HOP_SIZES
            if any(h["block"] == kind and h["size"] == size for h in d["hops"])]
    width = 0.4
    for j, system in enumerate(("blockflow", "ray_composed")):
        vals = []
        for kind, size in keys:
            h = next((h for h in d["hops"] if h["system"] == system and h["block"] == kind and h["size"] == size), None)
            vals.append(h["per_hop_median_ms"] if h else None)  # None: absent, or not measured (no bar)
        bars = ax.bar([i + (j - 0.5) * width for i in range(len(keys))],
                      [float("nan") if v is None else v for v in vals], width, label=short[system],
                      color=colors[system])
        ax.bar_label(bars, labels=["not\nmeasured" if v is None else f"{v:.2g}" for v in vals], fontsize=8)
    ax.set_xticks(range(len(keys)), [f"{k}\n{s_}" for k, s_ in keys], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("per hop, median (ms, log)")
    ax.set_xlabel("block kind and tensor size")
    ax.set_ylim(top=ax.get_ylim()[1] * 3)  # room for the labels and the legend
    ax.legend(fontsize=8, loc="upper left")
    ax = axes[1][2]
    ax.bar([short[k] for k in cols], [s[k]["startup"]["deploy_s"] for k in cols], color=[colors[k] for k in cols])
    ax.set_ylabel("deploy to first answer (s)")
    ax.set_xlabel("system")
    ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"BlockFlow beside Ray Serve, ResNet50 on {d['env']['machine']}, {d['settings']['threads']} "
                 f"torch thread(s) per process", fontsize=10)
    common.save_fig(fig, out, f"{NAME}.png")


def _ray_files() -> set[str]:
    """Names in /dev/shm and /tmp that Ray could have made (to check it made none that stayed)."""
    found = set()
    for d in ("/dev/shm", "/tmp"):
        with contextlib.suppress(OSError):
            found |= {os.path.join(d, n) for n in os.listdir(d)
                      if n == "ray" or n.startswith(("rayp-", "plasma", "ray_spilled_objects", "ray-"))}
    return found


def main(argv=None) -> int:
    ap = common.parser(NAME, __doc__)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per serving process (default 1)")
    ap.add_argument("--duration", type=float, help="seconds of the 4-client throughput run (default 6, quick 2)")
    ap.add_argument("--clients", type=int, default=4, help="clients of the throughput row (default 4)")
    ap.add_argument("--chain", type=int, default=4, help="blocks in the long chain of the per-hop rows (default 4)")
    args = ap.parse_args(argv)
    common.setup_logging(args.verbose)
    quick = args.quick
    cfg = {"threads": args.threads, "clients": args.clients, "chain": args.chain,
           "n": args.n or (6 if quick else 30), "warm": 2 if quick else 5, "ref_n": 3 if quick else 8,
           "duration": args.duration or (2.0 if quick else 6.0), "rounds": 1 if quick else 2,
           "idle_s": 1.0 if quick else 3.0,
           "hop_sizes": {"3.2MB": HOP_SIZES["3.2MB"]} if quick else dict(HOP_SIZES),
           "hop_n": {"3.2MB": 4, "103MB": 3} if quick else {"3.2MB": 20, "103MB": 6}}
    settings = {**{k: v for k, v in cfg.items() if k != "hop_sizes"}, "hop_sizes": list(cfg["hop_sizes"]),
                "quick": quick, "batch": 1, "device": "cpu", "ray_num_cpus": RAY_CPUS,
                "ray_client": "DeploymentHandle in the bench process, no HTTP proxy",
                "blockflow_client": "blockflow.client.Client (ZeroMQ) in the bench process"}
    env = common.env_info(settings)
    reason = ray_missing()
    if reason:
        log.warning("%s; writing a skipped result", reason)
        common.write_json(args.out, NAME, {"env": env, "settings": settings, "skipped": True, "reason": reason})
        return 0
    import ray
    repo = common.ensure_repo(args.repo)
    files_before = _ray_files()
    systems, hops, cleanup = run(repo, cfg)
    cleanup["new_files"] = sorted(_ray_files() - files_before)
    if cleanup["new_files"]:
        log.warning("files Ray left in /dev/shm or /tmp: %s", cleanup["new_files"])
    data = {"env": env, "settings": settings, "ray_version": ray.__version__, "systems": systems, "hops": hops,
            "verdicts": verdicts(systems, hops), "ray_cleanup": cleanup}
    common.write_json(args.out, NAME, data)
    plot(data, args.out)
    print()
    print(table(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
