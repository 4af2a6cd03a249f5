"""Dynamic batching, the pure parts: policy parsing, grouping, split, fallback, adaptive delay."""
from __future__ import annotations

import pytest
import torch

from blockflow.blocks.batching import (BatchPolicy, DelayController, PolicyError, plan_batches, run_batch,
                                       split)


def test_policy_parses_and_names_the_bad_field():
    p = BatchPolicy.parse({"max_batch": 8, "max_queue_delay_us": "auto", "preferred": [4, 2]})
    assert p.auto and p.max_batch == 8 and p.preferred == (2, 4)
    assert BatchPolicy.parse(p.to_json()) == p
    for bad, field in [({"max_batch": 0}, "batching.max_batch"),
                       ({"max_batch": True}, "batching.max_batch"),
                       ({"max_batch": 4, "max_queue_delay_us": -1}, "batching.max_queue_delay_us"),
                       ({"max_batch": 4, "preferred": [8]}, "batching.preferred"),
                       ({"max_batch": 4, "typo": 1}, "batching.typo")]:
        with pytest.raises(PolicyError) as err:
            BatchPolicy.parse(bad)
        assert err.value.field == field


def test_batches_group_compatible_tensors_across_requests_in_arrival_order():
    p = BatchPolicy.parse({"max_batch": 3})
    ts = [torch.zeros(1, 3, 8, 8), torch.zeros(1, 3, 4, 4), torch.zeros(2, 3, 8, 8), torch.zeros(1, 3, 8, 8),
          torch.zeros(1, 3, 8, 8, dtype=torch.float64), torch.zeros(1, 3, 8, 8), torch.tensor(1.0)]
    assert plan_batches(ts, p) == [[0, 2, 3], [1], [4], [5], [6]]
    pref = BatchPolicy.parse({"max_batch": 8, "preferred": [2, 4]})
    assert [len(b) for b in plan_batches([torch.zeros(1, 2)] * 7, pref)] == [4, 2, 1]


def test_split_returns_views_of_the_batched_output_and_refuses_a_lost_batch_dim():
    out = torch.arange(12.0).reshape(4, 3)
    parts = split(out, [1, 3])
    assert [tuple(x.shape) for x in parts] == [(1, 3), (3, 3)]
    assert parts[1].data_ptr() == out[1:].data_ptr()  # a view: no copy
    with pytest.raises(ValueError, match="batch dimension"):
        split(torch.zeros(3), [1, 3])


def test_one_bad_request_fails_only_itself():
    class Model(torch.nn.Module):
        def forward(self, x):
            if bool((x < 0).any()):
                raise RuntimeError("negative input")
            return x * 2

    xs = [torch.ones(1, 2), -torch.ones(1, 2), torch.full((2, 2), 3.0)]
    out = run_batch(Model(), xs)
    assert torch.equal(out[0], torch.full((1, 2), 2.0))
    assert isinstance(out[1], RuntimeError)
    assert torch.equal(out[2], torch.full((2, 2), 6.0))


def test_batched_results_equal_unbatched_ones():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 6 * 6, 5)).eval()
    xs = [torch.randn(1, 3, 8, 8) for _ in range(5)]
    with torch.inference_mode():
        alone = [model(x) for x in xs]
        together = run_batch(model, xs)
    for a, b in zip(alone, together):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_auto_delay_is_zero_when_the_block_keeps_up_and_bounded_under_load():
    d = DelayController(BatchPolicy.parse({"max_batch": 8, "max_queue_delay_us": "auto"}), budget_s=0.05)
    assert d.delay(1) == 0.0                       # nothing known yet
    for i in range(20):                            # arrivals every 100 ms, service 10 ms: light load
        d.arrived(i * 0.1)
        d.served(1, 0.010)
    assert d.delay(1) == 0.0
    for i in range(50):                            # arrivals every 1 ms, service 10 ms: overloaded
        d.arrived(2.0 + i * 0.001)
        d.served(4, 0.010)
    wait = d.delay(1)
    assert 0.0 < wait <= 0.005
    assert d.delay(8) == 0.0                       # a full batch never waits
    d.served(8, 0.2)                               # a budget miss halves it
    assert d.delay(1) < wait
    fixed = DelayController(BatchPolicy.parse({"max_batch": 4, "max_queue_delay_us": 250}))
    assert fixed.delay(1) == pytest.approx(0.00025) and fixed.delay(4) == 0.0
