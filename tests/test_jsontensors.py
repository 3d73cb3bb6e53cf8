"""Framework state with tensors in it survives the trip through JSON bit for bit, and a saved
tensor naming something that is not a torch dtype is refused (a checkpoint dir is untrusted)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_same

from ckptrun.errors import CheckpointMismatch
from ckptrun.worker.integrations.jsontensors import from_json, to_json


def test_tensors_come_back_bit_for_bit_through_json():
    state = {"score": torch.tensor(float("nan")), "rng": torch.get_rng_state(), "empty": torch.empty(0, 3),
             "half": torch.tensor([[-0.0, 1.5]], dtype=torch.bfloat16), "flags": torch.tensor([True, False]),
             "nested": [{"n": 3, "s": "x", "none": None}, 2.5]}
    back = from_json(json.loads(json.dumps(to_json(state))))
    assert_same(back, state)


def test_what_json_cannot_hold_is_refused():
    with pytest.raises(TypeError, match="a value of type object"):
        to_json({"ok": 1, "handle": object()})
    with pytest.raises(TypeError, match="non-string keys"):
        to_json({1: "a"})


@pytest.mark.parametrize("dtype", ["Tensor", "load", "__import__", None])
def test_a_saved_tensor_naming_no_dtype_is_refused(dtype):
    with pytest.raises(CheckpointMismatch, match="unknown dtype"):
        from_json({"__tensor__": "AAAAPw==", "dtype": dtype, "shape": []})
