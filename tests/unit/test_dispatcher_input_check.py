"""What the dispatcher says when a request's tensor does not fit its task's declared input
(``Dispatcher.check_input``: the manifest's shape and dtype of the task's first block)."""
from __future__ import annotations

import pytest

from blockflow.dispatcher.process import Dispatcher
from blockflow.tensormq.wire import TensorDesc

SPEC = {"dtype": "float32", "shape": [None, 3, 224, 224]}


def _desc(shape, dtype="float32"):
    stride, step = [], 1
    for d in reversed(shape):
        stride.insert(0, step)
        step *= d
    return TensorDesc.parse({"dtype": dtype, "loc": "bytes", "shape": shape, "stride": stride})


def test_one_sample_without_its_batch_dimension_is_told_to_add_it():
    with pytest.raises(ValueError) as err:
        Dispatcher.check_input("classify", SPEC, _desc([3, 224, 224]))
    assert str(err.value) == ("task classify takes tensors of shape ['N', 3, 224, 224], got [3, 224, 224]; "
                              "add the batch dimension (tensor.unsqueeze(0))")


@pytest.mark.parametrize("shape", [[1, 3, 112, 112], [3, 112, 112], [224, 224]])
def test_another_wrong_shape_gets_no_batch_hint(shape):
    with pytest.raises(ValueError) as err:
        Dispatcher.check_input("classify", SPEC, _desc(shape))
    assert f"got {shape}" in str(err.value) and "unsqueeze" not in str(err.value), err.value


def test_a_fitting_tensor_passes():
    Dispatcher.check_input("classify", SPEC, _desc([4, 3, 224, 224]))
