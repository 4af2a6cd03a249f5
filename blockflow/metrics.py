"""``GET /metrics``: BlockFlow in Prometheus' text format (prometheus_client).

Where the numbers come from, read at scrape time by the REST process, so that no block or
dispatcher loop does anything for Prometheus:

- per block: the block's KPI log (``<run_dir>/<block>.latency.jsonl``, one record per
  inference or error; each scrape first asks every ready block to flush it with ``store``),
  tailed from where the last scrape stopped; ``ping`` for the queue length and the TensorMQ
  slots in flight; psutil on the block's pid for RSS and CPU; NVML for the GPUs;
- per task: the dispatcher's request log (``@dispatcher.requests.jsonl``, flushed every
  second: dispatcher/requestlog.py);
- restarts: the manager's snapshot.

How the per-stage times relate to the request time they are part of:

- per block, ``blockflow_block_inference_duration_seconds`` is the block's own arrival-to-departure
  time (the KPI record's ``total``: one clock read at arrival, one after the send), timed apart
  from the stages; ``blockflow_block_stage_seconds_total`` over the six eq. 4.1 stages
  (queue_wait, reconstruct, to_device, inference, share, forward) are the consecutive intervals
  between those two instants, so they sum to the duration's ``_sum`` up to the few microseconds
  between the model's return and the send's first clock read. A stage that goes missing or is
  counted twice shows as a difference (checked in tests/process/test_metrics.py);
- per task, the first five stages are the sums of what every block on the path reported in
  the hops of the reply, and ``forward`` is the rest of the end-to-end time (sending on, transit
  between processes, the dispatcher's own work); together they sum to
  ``blockflow_task_request_duration_seconds_sum`` (successful requests).

Prometheus scrape config: ``configs/prometheus.yml``; a Grafana dashboard over these families:
``configs/grafana/blockflow.json`` (README, "Dashboards"). In one line: ``scrape_configs:
[{job_name: blockflow, static_configs: [{targets: ["127.0.0.1:8080"]}]}]``.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque

import psutil
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from blockflow.core.protocol import DISPATCHER, Cmd

log = logging.getLogger("blockflow.metrics")

#: KPI record keys (milliseconds) and the stage names /metrics gives them, in the order they happen.
STAGES = (("wait", "queue_wait"), ("deser", "reconstruct"), ("dev", "to_device"), ("inf", "inference"),
          ("share", "share"), ("fwd", "forward"))
#: Histogram bucket bounds, seconds: from sub-millisecond hops to multi-second requests.
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: Bucket bounds of ``blockflow_block_batch_size``: the rows (first dimension) of the batch a request
#: ran in, its own rows without batching (the KPI record's ``batch``).
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
#: Seconds a scrape waits for one block's answer to ``store`` / ``ping`` before leaving it out.
COMMAND_TIMEOUT = 1.0
#: The labels of a per-process family: the declared block (``@dispatcher`` for the dispatcher) and
#: the replica ("0" unless the block has several: blockflow/core/schema.py, ``replicas``).
BLOCK_LABELS = ["block", "replica"]
#: Seconds of records behind the "last minute" figures of ``GET /status`` (``blockflow status``); a
#: process younger than that is measured over its own time (``_row``).
RECENT_S = 60.0


class _Histogram:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple = BUCKETS):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                break
        else:
            self.counts[-1] += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for bound, n in zip([*map(str, self.bounds), "+Inf"], self.counts):
            total += n
            out.append((bound, total))
        return out


class _Tail:
    """Reads the complete lines appended to a file since the last call (a cut line waits)."""

    def __init__(self, path: str):
        self.path, self.offset = path, 0

    def records(self):
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        self.offset += end
        for line in data[:end].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut by a crash: skip it, the next one starts clean
            if isinstance(rec, dict):
                yield rec


class _Series:
    """Cumulative counts of one block or one task, fed from its log, and its last RECENT_S
    seconds of records: (wall-clock arrival, milliseconds or None for an error)."""

    def __init__(self):
        self.requests = 0
        self.errors: dict[str, int] = {}
        self.duration = _Histogram()
        self.batch = _Histogram(BATCH_BUCKETS)  # blocks only: the dispatcher's records have no batch
        self.stages = {stage: 0.0 for _, stage in STAGES}
        self.recent: deque = deque()

    def remember(self, rec: dict, ms: float | None) -> None:
        ts = rec.get("ts")
        if isinstance(ts, (int, float)):
            self.recent.append((float(ts), ms))

    def last_minute(self, now: float, since: float | None = None) -> dict:
        """Requests, requests per second, error count and p50/p99 (ms) of the records that arrived
        in the last RECENT_S seconds and not before ``since``, and ``window_s``, the seconds they
        cover. ``since``: the wall-clock instant the process a row names began to be sent
        requests (``serving_since``), so that a respawned or replaced process counts only what
        it served itself, over the time it could serve; None: the whole window."""
        while self.recent and self.recent[0][0] < now - RECENT_S:
            self.recent.popleft()
        start = now - RECENT_S if since is None else min(max(now - RECENT_S, since), now)
        mine = [ms for ts, ms in self.recent if ts >= start]
        ok = sorted(ms for ms in mine if ms is not None)

        def pct(q: float) -> float | None:
            return round(ok[min(int(q * len(ok)), len(ok) - 1)], 3) if ok else None

        # a rate over less than a second says little: at most one request's worth per second
        return {"requests": len(mine), "requests_per_s": round(len(mine) / max(now - start, 1.0), 3),
                "errors": len(mine) - len(ok), "p50_ms": pct(0.50), "p99_ms": pct(0.99),
                "window_s": round(now - start, 1)}


class BlockFlowCollector:
    """A prometheus_client collector over one manager's run (see the module docstring)."""

    def __init__(self, manager):
        self.manager = manager
        self.lock = threading.Lock()
        self.blocks: dict[str, _Series] = {}
        self.tasks: dict[str, _Series] = {}
        self.tails: dict[str, _Tail] = {}
        #: process name -> its label values [block, replica] (a replica's process is ``name.rR``)
        self.who: dict[str, list[str]] = {DISPATCHER: [DISPATCHER, "0"]}
        self.nvml = _Nvml()

    # -- reading the logs --------------------------------------------------------------------
    def _tail(self, path: str):
        tail = self.tails.get(path)
        if tail is None:
            tail = self.tails[path] = _Tail(path)
        return tail.records()

    def _read_block(self, run_dir: str, name: str) -> None:
        series = self.blocks.setdefault(name, _Series())
        for rec in self._tail(os.path.join(run_dir, f"{name}.latency.jsonl")):
            series.requests += 1
            if "error" in rec:
                code = str(rec["error"])
                series.errors[code] = series.errors.get(code, 0) + 1
                series.remember(rec, None)
                continue
            if "total" not in rec:
                continue
            series.remember(rec, float(rec["total"]))
            for key, stage in STAGES:
                series.stages[stage] += float(rec.get(key, 0.0)) / 1e3
            # the block's own clock, not the stages' sum (see the module docstring)
            series.duration.observe(float(rec["total"]) / 1e3)
            if isinstance(rec.get("batch"), (int, float)):
                series.batch.observe(rec["batch"])

    def _read_dispatcher(self, run_dir: str) -> None:
        for rec in self._tail(os.path.join(run_dir, "@dispatcher.requests.jsonl")):
            task = str(rec.get("task"))
            series = self.tasks.setdefault(task, _Series())
            series.requests += 1
            code = str(rec.get("code"))
            if code != "ok":
                series.errors[code] = series.errors.get(code, 0) + 1
                series.remember(rec, None)
                continue
            ms = float(rec.get("ms", 0.0))
            inside = 0.0
            for key, stage in STAGES[:-1]:
                v = float((rec.get("stages") or {}).get(key, 0.0))
                series.stages[stage] += v / 1e3
                inside += v
            series.stages["forward"] += max(ms - inside, 0.0) / 1e3
            series.duration.observe(max(ms, inside) / 1e3)
            series.remember(rec, max(ms, inside))

    # -- one scrape --------------------------------------------------------------------------
    def collect(self):
        with self.lock:
            yield from self._collect()

    def _refresh(self) -> tuple[dict, list[dict], dict]:
        """Ask every ready block to flush its KPI log, read what the logs gained, and return
        the manager's snapshot, its blocks, and each answering block's ping."""
        system = self.manager.snapshot()
        run_dir = system.get("run_dir")
        blocks = [b for b in system.get("blocks", []) if isinstance(b, dict)]
        for b in blocks:
            self.who[b["name"]] = [str(b.get("block", b["name"])), str(b.get("replica", 0))]
        live = {}
        for b in blocks:
            if b.get("status") != "ready":
                continue
            try:
                self.manager.command(b["name"], Cmd.STORE, timeout=COMMAND_TIMEOUT)
                live[b["name"]] = self.manager.command(b["name"], Cmd.PING, timeout=COMMAND_TIMEOUT)
            except Exception as exc:  # busy, restarting or gone: its log is read next time
                log.debug("metrics: block %s did not answer (%s)", b["name"], exc)
        if run_dir:
            for b in blocks:
                self._read_block(run_dir, b["name"])
            self._read_dispatcher(run_dir)
        return system, blocks, live

    def status(self) -> list[dict]:
        """One row per process for ``GET /status`` (``blockflow status``): the dispatcher first,
        then the blocks; the last minute's rate and latency from the same logs as /metrics."""
        with self.lock:
            system, blocks, live = self._refresh()
        now = time.time()
        rows = []
        disp = system.get("dispatcher")
        if isinstance(disp, dict):
            answered = _Series()  # the dispatcher's rate: every task's answered requests
            for series in self.tasks.values():
                series.last_minute(now)
                answered.recent.extend(series.recent)
            rows.append(self._row(disp, DISPATCHER, None, now, answered))
        for b in blocks:
            rows.append(self._row(b, b["name"], live.get(b["name"]), now, self.blocks.get(b["name"]) or _Series()))
        return rows

    @staticmethod
    def _row(child: dict, name: str, ping: dict | None, now: float, series: _Series) -> dict:
        """The row of one process. Its figures count the records of its own incarnation: those
        that arrived since the manager began to route requests to it (``serving_since``); the
        records of the process it replaced share its log and name and are left out, but for the
        requests in flight when an update switched over (milliseconds). A process that was
        never routed to (still starting) has none. In Ray mode a block's records carry its
        node's clock and ``serving_since`` the manager's: the cut is as good as their agreement."""
        started = child.get("started") if child.get("status") == "ready" else None
        since = child.get("serving_since")
        row = {"process": name, "block": child.get("block", name), "replica": child.get("replica"),
               "group": child.get("process"),
               "status": child.get("status"), "pid": child.get("pid"), "node": child.get("node"),
               "next_hops": child.get("next_hops") or {}, "waiting_for_node": child.get("waiting_for_node"),
               "device": child.get("device", "cpu" if name != DISPATCHER else "-"),
               "restarts": child.get("restarts", 0), "uptime_s": round(now - started, 1) if started else None,
               "last_exit": child.get("last_exit"), **series.last_minute(now, now if since is None else since)}
        if isinstance(ping, dict):
            row["queue"] = ping.get("queue")
            if isinstance(ping.get("cache"), dict):  # a group with a memory budget (blocks/cache.py)
                row["cache"] = ping["cache"]
        return row

    def _collect(self):
        system, blocks, live = self._refresh()
        yield from self._families("block", self.blocks, "inferences a block ran (successful or not)",
                                  "inferences a block ran that ended in an error, by error code",
                                  "inference time in a block, arrival to departure")
        yield from self._families("task", self.tasks, "requests the dispatcher answered",
                                  "requests the dispatcher answered with an error, by error code",
                                  "end-to-end time of successful requests at the dispatcher")

        queue = GaugeMetricFamily("blockflow_block_queue_length", "messages waiting for the block's inference thread",
                                  labels=BLOCK_LABELS)
        slots = GaugeMetricFamily("blockflow_block_inflight_slots", "TensorMQ slots the block has in flight "
                                  "(sent, not yet released by the consumer)", labels=BLOCK_LABELS)
        for name, info in live.items():
            if isinstance(info, dict):
                if isinstance(info.get("queue"), (int, float)):
                    queue.add_metric(self.labels(name), info["queue"])
                if isinstance(info.get("in_flight"), (int, float)):
                    slots.add_metric(self.labels(name), info["in_flight"])
        yield queue
        yield slots
        yield from self._cache_families(live)

        restarts = CounterMetricFamily("blockflow_block_restarts", "respawns of the block (or the dispatcher) "
                                       "since it was declared", labels=BLOCK_LABELS)
        up = GaugeMetricFamily("blockflow_block_up", "1 when the block is ready, 0 otherwise",
                               labels=[*BLOCK_LABELS, "status"])
        rss = GaugeMetricFamily("blockflow_block_resident_memory_bytes", "resident set size of the block's process",
                                labels=BLOCK_LABELS)
        cpu = CounterMetricFamily("blockflow_block_cpu_seconds", "user and system CPU time of the block's process "
                                  "(starts again from 0 when it is respawned)", labels=BLOCK_LABELS)
        node = GaugeMetricFamily("blockflow_block_node", "1 for the node the block's process runs on (this host's "
                                 "name, or in Ray mode the Ray node id; empty while it waits for a node)",
                                 labels=[*BLOCK_LABELS, "node"])
        children = blocks + ([system["dispatcher"]] if isinstance(system.get("dispatcher"), dict) else [])
        here = (system.get("cluster") or {}).get("node")  # Ray mode: pids of other nodes mean nothing here
        pids = {}
        for b in children:
            name = b.get("name", DISPATCHER)
            restarts.add_metric(self.labels(name), b.get("restarts", 0))
            up.add_metric([*self.labels(name), str(b.get("status"))], 1 if b.get("status") == "ready" else 0)
            node.add_metric([*self.labels(name), str(b.get("node") or "")], 1)
            pid = b.get("pid")
            if not pid or (here is not None and b.get("node") != here):
                continue
            try:
                p = psutil.Process(pid)
                with p.oneshot():
                    rss.add_metric(self.labels(name), p.memory_info().rss)
                    t = p.cpu_times()
                    cpu.add_metric(self.labels(name), t.user + t.system)
                pids[pid] = self.labels(name)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        yield from (restarts, up, node, rss, cpu)
        yield from self.nvml.families(pids)

    def _cache_families(self, live: dict):
        """Residency, size, hits, misses, evictions and swap-in times of the blocks of shared
        processes with a memory budget (blocks/cache.py), from their pings."""
        resident = GaugeMetricFamily("blockflow_block_resident", "1 when the block's weights are on its device, 0 "
                                     "while parked (a shared process with memory_budget_mb)", labels=BLOCK_LABELS)
        weights = GaugeMetricFamily("blockflow_block_weight_bytes", "bytes of the block's weights, counted against "
                                    "its shared process's memory budget", labels=BLOCK_LABELS)
        budget = GaugeMetricFamily("blockflow_block_memory_budget_bytes", "the memory budget of the block's shared "
                                   "process", labels=BLOCK_LABELS)
        counters = {k: CounterMetricFamily(f"blockflow_block_cache_{k}", words, labels=BLOCK_LABELS) for k, words in (
            ("hits", "requests that found the block's weights resident"),
            ("misses", "requests that swapped the block's weights in first"),
            ("evictions", "times the block was parked to make room for another"))}
        swap = HistogramMetricFamily("blockflow_block_swap_in_seconds", "time a swap-in took (parking what made "
                                     "room, the weights' copy, and on a GPU the graphs' capture)", labels=BLOCK_LABELS)
        for name, info in live.items():
            cache = info.get("cache") if isinstance(info, dict) else None
            if not isinstance(cache, dict):
                continue
            labels = self.labels(name)
            resident.add_metric(labels, 1 if cache.get("state") == "resident" else 0)
            weights.add_metric(labels, cache.get("bytes", 0))
            budget.add_metric(labels, cache.get("budget_bytes", 0))
            for k, family in counters.items():
                family.add_metric(labels, cache.get(k, 0))
            hist = cache.get("swap_in_ms") or {}
            bounds, counts = hist.get("buckets") or [], hist.get("counts") or []
            if len(counts) == len(bounds) + 1:
                cumulative, buckets = 0, []
                for bound, n in zip([*[f"{b / 1e3:g}" for b in bounds], "+Inf"], counts):
                    cumulative += n
                    buckets.append((bound, cumulative))
                swap.add_metric(labels, buckets, (hist.get("sum") or 0.0) / 1e3)
        yield from (resident, weights, budget, *counters.values(), swap)

    def labels(self, name: str) -> list[str]:
        """The [block, replica] label values of process ``name``."""
        return self.who.get(name) or [name, "0"]

    def _families(self, kind: str, table: dict[str, _Series], what: str, errors_help: str, duration_help: str):
        label = BLOCK_LABELS if kind == "block" else [kind]
        key_of = self.labels if kind == "block" else (lambda key: [key])
        requests = CounterMetricFamily(f"blockflow_{kind}_requests", what, labels=label)
        errors = CounterMetricFamily(f"blockflow_{kind}_errors", errors_help, labels=[*label, "code"])
        name = "inference" if kind == "block" else "request"
        duration = HistogramMetricFamily(f"blockflow_{kind}_{name}_duration_seconds", duration_help, labels=label)
        stages = CounterMetricFamily(f"blockflow_{kind}_stage_seconds", "time spent in each eq. 4.1 stage; the "
                                     f"stages add up to blockflow_{kind}_{name}_duration_seconds_sum",
                                     labels=[*label, "stage"])
        batch = HistogramMetricFamily("blockflow_block_batch_size", "rows (first dimension) of the batch "
                                      "each successful request ran in; its own rows without batching", labels=label)
        for key, s in sorted(table.items()):
            values = key_of(key)
            requests.add_metric(values, s.requests)
            for code, n in sorted(s.errors.items()):
                errors.add_metric([*values, code], n)
            duration.add_metric(values, s.duration.buckets(), s.duration.sum)
            for stage, seconds in s.stages.items():
                stages.add_metric([*values, stage], seconds)
            if kind == "block":
                batch.add_metric(values, s.batch.buckets(), s.batch.sum)
        yield from (requests, errors, duration, stages)
        if kind == "block":
            yield batch


class _Nvml:
    """GPU figures through NVML when a driver is present; nothing otherwise."""

    def __init__(self):
        self.nv = None
        try:
            import pynvml
            pynvml.nvmlInit()
            self.count = pynvml.nvmlDeviceGetCount()
            self.nv = pynvml
        except Exception as exc:  # no driver, no GPU: CPU-only metrics
            log.debug("metrics: no NVML (%s); GPU metrics left out", exc)

    def families(self, pids: dict[int, str]):
        if self.nv is None:
            return
        nv = self.nv
        util = GaugeMetricFamily("blockflow_gpu_utilization_ratio", "fraction of the last sample period a kernel "
                                 "ran on the GPU (NVML)", labels=["gpu"])
        used = GaugeMetricFamily("blockflow_gpu_memory_used_bytes", "GPU memory in use, all processes", labels=["gpu"])
        power = GaugeMetricFamily("blockflow_gpu_power_watts", "GPU power draw", labels=["gpu"])
        energy = CounterMetricFamily("blockflow_gpu_energy_joules", "energy the GPU used since its driver loaded",
                                     labels=["gpu"])
        vram = GaugeMetricFamily("blockflow_block_gpu_memory_bytes", "GPU memory the block's process holds",
                                 labels=[*BLOCK_LABELS, "gpu"])
        for i in range(self.count):
            gpu = str(i)
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
                util.add_metric([gpu], nv.nvmlDeviceGetUtilizationRates(h).gpu / 100.0)
                used.add_metric([gpu], nv.nvmlDeviceGetMemoryInfo(h).used)
                power.add_metric([gpu], nv.nvmlDeviceGetPowerUsage(h) / 1e3)
                energy.add_metric([gpu], nv.nvmlDeviceGetTotalEnergyConsumption(h) / 1e3)
                for proc in nv.nvmlDeviceGetComputeRunningProcesses(h):
                    if proc.pid in pids and proc.usedGpuMemory is not None:
                        vram.add_metric([*pids[proc.pid], gpu], proc.usedGpuMemory)
            except nv.NVMLError as exc:  # a field this GPU does not support: leave it out
                log.debug("metrics: NVML on GPU %s: %s", gpu, exc)
        yield from (util, used, power, energy, vram)


class Metrics:
    """The registry ``GET /metrics`` renders: BlockFlow's collector plus the REST process's own."""

    def __init__(self, manager):
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = BlockFlowCollector(manager)
        self.registry.register(self.collector)
        ProcessCollector(registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
