"""What a refused update says about a field no schema declares (blockflow/core/schema.py)."""
from __future__ import annotations

import pytest

from blockflow.core.schema import UpdateError, validate_update


def _update(block=None, task=None, **top):
    return {"blocks": [{"name": "b", "model": "m/b.pt", **(block or {})}],
            "tasks": [{"id": "t", "path": ["b"], **(task or {})}], **top}


@pytest.mark.parametrize("body, field, near", [
    (_update(block={"replica": 2}), "blocks[0].replica", "replicas"),
    (_update(block={"batching": {"max_batch": 4, "max_delay_us": 100}}), "blocks[0].batching.max_delay_us",
     "max_queue_delay_us"),
    (_update(task={"paths": ["b"]}), "tasks[0].paths", "path"),
    (_update(transprot="zeromq"), "transprot", "transport"),
])
def test_a_typo_in_a_field_name_is_refused_naming_the_field_it_resembles(body, field, near):
    with pytest.raises(UpdateError) as err:
        validate_update(body)
    assert err.value.field == field, err.value
    assert f"unknown field; did you mean {near}?" in str(err.value), err.value
    assert near in str(err.value).split(" has ", 1)[1], err.value  # then every declared name


def test_a_field_like_no_declared_one_is_refused_without_a_guess():
    with pytest.raises(UpdateError) as err:
        validate_update(_update(block={"zzzz": 1}))
    assert err.value.field == "blocks[0].zzzz" and "did you mean" not in str(err.value), err.value
    assert "unknown field; a block has batching, cpus," in str(err.value), err.value
