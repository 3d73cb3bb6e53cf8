"""flatten/unflatten (DESIGN invariant 4): nested state goes to a JSON skeleton plus raw tensor
bytes and comes back with the same structure, types and bits, without pickling anything."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch
from conftest import assert_same, pack, unpack

from ckptrun.storage.tree import flatten, tensor_keys, unflatten
from ckptrun.worker import discovery


def roundtrip(obj):
    """Through everything a checkpoint goes through: strict JSON for the skeleton, raw bytes for tensors."""
    skeleton, data, specs = pack(obj)
    return unpack(json.loads(json.dumps(skeleton, allow_nan=False)), data, specs)


CASES = {
    "tuples": {"betas": (0.9, 0.999), "nested": ((1, (2, "x")), [(), (None,)])},
    "int-keys": {"state": {0: {"step": torch.tensor(3.0)}, 7: {}, -1: "neg"}},
    "mixed-keys": {1: "int", "1": "str", 2.5: "float", None: "none", (2, 3): "tuple"},
    "bool-keys": {True: "yes", False: "no"},
    "reserved-str-keys": {"__tensor__": "not a tensor", "__tuple__": [1], "a": 1},
    "specials": {"inf": math.inf, "ninf": -math.inf, "nan": math.nan, "negzero": -0.0, "big": 2**70},
    "scalars": [None, True, False, 0, -5, 1.5, "text", ""],
    "dtypes": {"bf16": torch.randn(5, 3).bfloat16(), "fp16": torch.randn(4).half(), "f64": torch.randn(2, 2).double(),
               "i8": torch.tensor([-128, 0, 127], dtype=torch.int8), "bool": torch.tensor([True, False]),
               "u8": torch.arange(7, dtype=torch.uint8), "c64": torch.randn(3, dtype=torch.complex64),
               "dtype": torch.bfloat16},
    "tensor-shapes": {"scalar": torch.tensor(2.5), "empty": torch.empty(0, 4), "big-dim": torch.randn(1, 1, 3, 1),
                      "non-contiguous": torch.randn(4, 6).t(), "slice": torch.arange(20.0)[3:17:2]},
    "tensor-specials": torch.tensor([math.inf, -math.inf, math.nan, -0.0, 1e-45]),
    "numpy": {"u32": np.arange(6, dtype=np.uint32).reshape(2, 3), "f64": np.array([1.5, np.nan]),
              "zero-d": np.array(3, dtype=np.int64)},
    "numpy-rng": np.random.RandomState(5).get_state(),
    "python-rng": random.Random(5).getstate(),
    "optimizer": None,  # filled below: a real Adam state_dict after two steps
}


def _adam_state() -> dict:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.8, 0.9))
    for _ in range(2):
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
    return opt.state_dict()


CASES["optimizer"] = _adam_state()


@pytest.mark.parametrize("name", list(CASES))
def test_roundtrip_is_exact(name):
    obj = CASES[name]
    assert_same(roundtrip(obj), obj)


def test_numpy_scalars_become_python_numbers():
    assert_same(roundtrip({"f": np.float64(1.25), "i": np.int32(-3)}), {"f": 1.25, "i": -3})


def test_colliding_paths_keep_distinct_tensors():
    a, b = torch.ones(2), torch.zeros(2)
    obj = {"a": {"b": a}, "a/b": b}
    skeleton, tensors = flatten(obj)
    assert len(tensors) == 2 and list(tensor_keys(skeleton)) == list(tensors)
    assert_same(roundtrip(obj), obj)


def test_rng_states_restore_the_same_draws():
    np.random.seed(11)
    random.seed(12)
    torch.manual_seed(13)
    saved = roundtrip(discovery.rng_state())
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    discovery.set_rng_state(saved)
    assert_same((random.random(), np.random.rand(), torch.rand(3)), expected)


@pytest.mark.parametrize("bad, where", [
    ({"model": {"fn": print}}, "model/fn"),
    ({"obj": [object()]}, "obj.0"),
    ({"sparse": torch.eye(3).to_sparse()}, "sparse"),
])
def test_unsupported_values_are_refused_with_their_path(bad, where):
    with pytest.raises(TypeError, match=where.replace(".", r"\.")):
        flatten(bad)


def test_unflatten_takes_tensors_by_key():
    skeleton, tensors = flatten({"w": torch.ones(2), "n": 3})
    replaced = unflatten(skeleton, {k: torch.full_like(t, 7.0) for k, t in tensors.items()})
    assert_same(replaced, {"w": torch.full((2,), 7.0), "n": 3})
