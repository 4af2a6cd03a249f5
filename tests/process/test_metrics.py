"""GET /metrics on a real server, parsed with prometheus_client's own parser."""
from __future__ import annotations

import math
import time
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from blockflow.client import BlockFlowError, Client

TOY_UPDATE = {"blocks": [{"name": "a", "model": "toy/identity.pt"}, {"name": "d", "model": "toy/double.pt"}],
              "tasks": [{"id": "t", "path": ["a", "d"]}, {"id": "u", "path": ["d"]}]}
STAGES = {"queue_wait", "reconstruct", "to_device", "inference", "share", "forward"}


def scrape(url: str) -> dict:
    """{(sample name, frozenset of labels): value} of one scrape, checked to be valid text format."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float | None:
    if name.startswith("blockflow_block_") and "block" in labels:
        labels.setdefault("replica", "0")  # per-process families: block and replica (issue 28)
    return samples.get((name, frozenset(labels.items())))


#: How far a block's six stages may sum from its own clock: they meet end to end
#: (blocks/process.py, send_output), so what is left is the milliseconds' rounding.
STAGE_GAP_PER_REQUEST_S = 20e-6
STAGE_GAP_REL = 0.02


def stage_totals(samples: dict, kind: str, key: str) -> dict[str, float]:
    return {dict(labels)["stage"]: v for (sample, labels), v in samples.items()
            if sample == f"blockflow_{kind}_stage_seconds_total" and dict(labels)[kind] == key}


def assert_stages_add_up(samples: dict, block: str) -> None:
    """The block's six stages sum to its independently timed arrival-to-departure total, within
    the stated tolerance: a stage left out or counted twice does not."""
    stages = stage_totals(samples, "block", block)
    total = value(samples, "blockflow_block_inference_duration_seconds_sum", block=block)
    n = value(samples, "blockflow_block_inference_duration_seconds_count", block=block)
    assert set(stages) == STAGES and all(v >= 0 for v in stages.values()), stages
    assert total > 0 and n > 0 and stages["inference"] > 0, (block, stages, total, n)
    gap = total - sum(stages.values())
    allowed = STAGE_GAP_REL * total + STAGE_GAP_PER_REQUEST_S * n
    assert abs(gap) <= allowed, (f"block {block}: the stages sum to {sum(stages.values()) * 1e3:.3f} ms, its own "
                                 f"clock to {total * 1e3:.3f} ms over {n:.0f} requests (allowed "
                                 f"{allowed * 1e3:.3f} ms)", stages)


def wait_for_scrape(url: str, ready, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(url)
        if ready(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)


def test_metrics_count_the_requests_sent(server_factory, identity_repo):
    srv = server_factory(identity_repo)
    srv.call("POST", "/system/update", TOY_UPDATE, timeout=60)
    n_t, n_u, n_unknown = 7, 3, 2
    with Client(srv.dispatcher, timeout=15) as c:
        for i in range(n_t):
            assert torch.equal(c.infer("t", torch.full((4,), float(i))), torch.full((4,), 2.0 * i))
        for _ in range(n_u):
            c.infer("u", torch.ones(3))
        for _ in range(n_unknown):
            with pytest.raises(BlockFlowError):
                c.infer("nope", torch.ones(3))

    m = wait_for_scrape(srv.url, lambda m: value(m, "blockflow_task_requests_total", task="t") == n_t
                        and value(m, "blockflow_task_requests_total", task="_unknown") == n_unknown
                        and value(m, "blockflow_task_requests_total", task="u") == n_u)
    # per task: requests, errors by code, the end-to-end histogram
    assert value(m, "blockflow_task_requests_total", task="t") == n_t
    assert value(m, "blockflow_task_requests_total", task="u") == n_u
    assert value(m, "blockflow_task_errors_total", task="_unknown", code="unknown_task") == n_unknown
    assert value(m, "blockflow_task_request_duration_seconds_count", task="t") == n_t
    assert value(m, "blockflow_task_request_duration_seconds_bucket", task="t", le="+Inf") == n_t
    # per block: d ran for both tasks, a for t only
    assert value(m, "blockflow_block_requests_total", block="a") == n_t
    assert value(m, "blockflow_block_requests_total", block="d") == n_t + n_u
    assert value(m, "blockflow_block_inference_duration_seconds_count", block="d") == n_t + n_u
    # without batching a request's batch is its own rows: 4 for t's tensors, 3 for u's
    assert value(m, "blockflow_block_batch_size_count", block="d") == n_t + n_u
    assert value(m, "blockflow_block_batch_size_bucket", block="d", le="2") == 0
    assert value(m, "blockflow_block_batch_size_bucket", block="d", le="4") == n_t + n_u
    assert value(m, "blockflow_block_batch_size_sum", block="d") == 4 * n_t + 3 * n_u

    # per block, the stages add up to the block's own arrival-to-departure clock, timed apart
    # from them; per task, ``forward`` is the end-to-end time less what the blocks reported
    for b in ("a", "d"):
        assert_stages_add_up(m, b)
    for t in ("t", "u"):
        stages = stage_totals(m, "task", t)
        total = value(m, "blockflow_task_request_duration_seconds_sum", task=t)
        assert set(stages) == STAGES and all(v >= 0 for v in stages.values()), stages
        assert total > 0 and math.isclose(sum(stages.values()), total, rel_tol=1e-6), (t, stages, total)
        assert stages["inference"] > 0
    # the tasks' view and the blocks' view of the same inferences agree: the hops carry the
    # very numbers the blocks log
    for stage in ("queue_wait", "reconstruct", "to_device", "inference", "share"):
        by_task = sum(value(m, "blockflow_task_stage_seconds_total", task=t, stage=stage) for t in ("t", "u"))
        by_block = sum(value(m, "blockflow_block_stage_seconds_total", block=b, stage=stage) for b in ("a", "d"))
        assert math.isclose(by_task, by_block, rel_tol=1e-6, abs_tol=1e-9), (stage, by_task, by_block)
    # processes: restarts, memory, CPU, queue and slots, for both blocks and the dispatcher
    for b in ("a", "d"):
        assert value(m, "blockflow_block_restarts_total", block=b) == 0
        assert value(m, "blockflow_block_resident_memory_bytes", block=b) > 10 * 2**20
        assert value(m, "blockflow_block_cpu_seconds_total", block=b) > 0
        assert value(m, "blockflow_block_queue_length", block=b) == 0
        assert value(m, "blockflow_block_inflight_slots", block=b) is not None
    assert value(m, "blockflow_block_resident_memory_bytes", block="@dispatcher") > 0

    # counters only grow: more requests, higher counts
    with Client(srv.dispatcher, timeout=15) as c:
        c.infer("u", torch.ones(3))
    m2 = wait_for_scrape(srv.url, lambda m: value(m, "blockflow_task_requests_total", task="u") == n_u + 1)
    assert value(m2, "blockflow_task_requests_total", task="u") == n_u + 1
    assert value(m2, "blockflow_block_requests_total", block="d") == n_t + n_u + 1
    assert value(m2, "blockflow_block_requests_total", block="a") == n_t


def _block_samples(collector, block: str) -> dict:
    """The block families one collector renders, as scrape() gives them."""
    out = {}
    for family in collector._families("block", collector.blocks, "inferences", "errors", "arrival to departure"):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def test_a_lost_or_doubled_stage_fails_the_check(server_factory, identity_repo, monkeypatch):
    """The planted fault: /metrics built from the same real KPI logs, once with the largest stage's
    time lost (read from a key the records do not have) and once with it counted twice (a second
    stage reading it too). The stage set is unchanged both times; only the block's own clock,
    which no longer comes from the stages, can tell."""
    from blockflow import metrics

    srv = server_factory(identity_repo)
    srv.call("POST", "/system/update", TOY_UPDATE, timeout=60)
    with Client(srv.dispatcher, timeout=15) as c:
        for i in range(20):
            c.infer("t", torch.full((4,), float(i)))
    m = wait_for_scrape(srv.url, lambda m: value(m, "blockflow_block_requests_total", block="d") == 20)
    assert_stages_add_up(m, "d")  # the real collector passes
    run_dir = srv.call("GET", "/system")["run_dir"]
    stages = stage_totals(m, "block", "d")
    largest = max((st for st in stages if st != "inference"), key=stages.get)  # a lost inference fails sooner
    key = {stage: k for k, stage in metrics.STAGES}[largest]
    other = next(stage for _, stage in metrics.STAGES if stage != largest)
    print(f"\nblock d: stages {stages}, clock {value(m, 'blockflow_block_inference_duration_seconds_sum', block='d')}; "
          f"planting faults on {largest!r}")
    lost = tuple((("no-such-key" if stage == largest else k), stage) for k, stage in metrics.STAGES)
    doubled = tuple(((key if stage == other else k), stage) for k, stage in metrics.STAGES)
    for planted in (lost, doubled):
        monkeypatch.setattr(metrics, "STAGES", planted)
        collector = metrics.BlockFlowCollector(manager=None)
        collector._read_block(run_dir, "d")
        with pytest.raises(AssertionError, match="the stages sum to"):
            assert_stages_add_up(_block_samples(collector, "d"), "d")


def test_status_figures_count_from_when_the_process_was_first_sent_requests():
    """GET /status's per-process figures (issue 42 item 2): records before ``since`` (the process
    this one replaced, same log) are left out, and the rate is over the seconds since then."""
    from blockflow.metrics import _Series
    s = _Series()
    for ts in (100.0, 101.0, 102.0):
        s.remember({"ts": ts}, 50.0)  # the old process's, slow
    for ts in (110.0, 111.0):
        s.remember({"ts": ts}, 2.0)
    s.remember({"ts": 111.5}, None)  # an error
    assert s.last_minute(112.0, since=109.0) == {"requests": 3, "requests_per_s": 1.0, "errors": 1,
                                                 "p50_ms": 2.0, "p99_ms": 2.0, "window_s": 3.0}
    assert s.last_minute(112.0, since=112.0) == {"requests": 0, "requests_per_s": 0.0, "errors": 0,
                                                 "p50_ms": None, "p99_ms": None, "window_s": 0.0}
    whole = s.last_minute(112.0)
    assert (whole["requests"], whole["p99_ms"], whole["window_s"]) == (6, 50.0, 60.0), whole
    assert s.last_minute(171.2, since=109.0)["requests"] == 1  # a minute later: the last minute only
