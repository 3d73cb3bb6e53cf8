"""The tags of a checkpoint's JSON skeleton (storage/tree.py writes them) and the check of a
stored one, without torch: every reader of an index runs it, the engine too (a --durable upload
or a partner's copy reads indexes), and the engine never imports torch."""

from __future__ import annotations

from typing import Any

from .layout import DTYPE_SIZES
from .schema import MAX_SKELETON_DEPTH, MAX_WORLD_SIZE, short
from .sharding import DTENSOR, check_meta

TENSOR = "__tensor__"
TUPLE = "__tuple__"
ITEMS = "__items__"
NDARRAY = "__ndarray__"
FLOAT = "__float__"
DTYPE = "__dtype__"
REMOTE = "__remote__"  # [rank, key]: a replicated tensor another rank wrote (storage/writeonce.py)
TAGS = (TENSOR, NDARRAY, FLOAT, TUPLE, ITEMS, DTYPE, DTENSOR, REMOTE)
_NOT_NUMPY = ("bfloat16", "float8_e4m3fn", "float8_e5m2")  # no numpy dtype: never an __ndarray__


def check_skeleton(skeleton: Any, specs: dict[str, dict]) -> None:
    """Raise ValueError unless `unflatten(skeleton, tensors)` succeeds for tensors of `specs`
    (key -> {"dtype", "shape"}, as an index has them): known, well-formed tags only, every tensor
    it names present, every dtype tag a known dtype, every sharded tensor's shard where its
    placements put it, bounded nesting. Iterative, so no input can exhaust the stack."""
    stack: list[tuple[Any, int, bool]] = [(skeleton, 0, False)]  # (node, depth, used as a dict key)
    seen: set[str] = set()  # `flatten` gives every place its own key: a shared one is crafted
    while stack:
        node, depth, as_key = stack.pop()
        if depth > MAX_SKELETON_DEPTH:
            raise ValueError(f"nested more than {MAX_SKELETON_DEPTH} levels deep")
        if isinstance(node, list):
            if as_key:
                raise ValueError("a list used as a dict key")
            stack.extend((v, depth + 1, False) for v in node)
        elif isinstance(node, dict):
            tags = [k for k in node if k.startswith("__")]
            if not tags:
                if as_key:
                    raise ValueError("a dict used as a dict key")
                stack.extend((v, depth + 1, False) for v in node.values())
                continue
            tag = tags[0]
            if len(node) != 1 or tag not in TAGS:
                raise ValueError(f"unknown tag {short(tag)}" if tag not in TAGS else f"tag {tag} with other keys")
            stack.extend(_tagged(tag, node[tag], depth, as_key, specs))
            if tag in (TENSOR, NDARRAY):
                if node[tag] in seen:
                    raise ValueError(f"refers to tensor {short(node[tag])} twice")
                seen.add(node[tag])
        elif node is not None and not isinstance(node, (bool, int, float, str)):
            raise ValueError(f"a {type(node).__name__} is not JSON")


def _tagged(tag: str, value: Any, depth: int, as_key: bool, specs: dict[str, dict]) -> list[tuple[Any, int, bool]]:
    """Check one tagged node; return its children to check."""
    if tag in (TENSOR, NDARRAY):
        if as_key:
            raise ValueError("a tensor used as a dict key")
        if not isinstance(value, str) or value not in specs:
            raise ValueError(f"refers to tensor {short(value)}, which the index does not hold")
        if tag == NDARRAY and specs[value]["dtype"] in _NOT_NUMPY:
            raise ValueError(f"numpy array {short(value)} of dtype {specs[value]['dtype']}")
        return []
    if tag == REMOTE:
        if as_key or not (isinstance(value, list) and len(value) == 2 and type(value[0]) is int
                          and 0 <= value[0] < MAX_WORLD_SIZE and isinstance(value[1], str)):
            raise ValueError(f"{REMOTE} {short(value)} is not [rank, key]")
        return []
    if tag == DTENSOR:
        local = value.get("local") if isinstance(value, dict) else None
        if as_key or not (isinstance(local, dict) and set(local) == {TENSOR} and local[TENSOR] in specs):
            raise ValueError(f"{DTENSOR} without a tensor of the index as its shard")
        check_meta(value, specs[local[TENSOR]])
        return [(local, depth + 1, False)]
    if tag == FLOAT:
        if value not in ("nan", "inf", "-inf"):
            raise ValueError(f"{FLOAT} {short(value)} is not nan or an infinity")
        return []
    if tag == DTYPE:
        if not isinstance(value, str) or value not in DTYPE_SIZES:
            raise ValueError(f"unknown dtype {short(value)}")
        return []
    if not isinstance(value, list):
        raise ValueError(f"{tag} is not a list")
    if tag == TUPLE:
        return [(v, depth + 1, as_key) for v in value]
    if as_key:
        raise ValueError("a dict used as a dict key")
    if not all(isinstance(kv, list) and len(kv) == 2 for kv in value):
        raise ValueError(f"{ITEMS} entries are not [key, value] pairs")
    return [(x, depth + 1, i == 0) for kv in value for i, x in enumerate(kv)]
