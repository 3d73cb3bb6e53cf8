"""What a checkpoint directory may contain, as strict pydantic models (DESIGN invariant 7).

A checkpoint directory is untrusted input: it may be damaged, hand-edited, copied from elsewhere
or crafted. Every field of a manifest and of a rank index is checked here (type, range and
consistency) before anything is allocated or read on its say-so. Checks that need the file
system (file sizes, which rank files exist) stay in `store_read.RecordReader`, the one
reader.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.dataclasses import dataclass

from ..errors import CorruptCheckpoint
from .layout import DTYPE_SIZES

FORMAT = 1
MAX_STEP = 2**40  # steps are optimizer steps: a trillion is far beyond any run
MAX_WORLD_SIZE = 2**16
MAX_DIFF_SPAN = 2**16  # steps in one differential record (LowDiff's batch B)
MAX_DEPENDS = 64
MAX_NDIM = 64
MAX_FILE_BYTES = 2**48
MAX_METADATA_BYTES = 64 << 20  # a manifest or index file larger than this is not read
MAX_SKELETON_DEPTH = 64
MANIFEST = "MANIFEST.json"  # a record's commit object: it exists for readers once this is published
MARKER = "ckptrun.json"  # what makes a folder a checkpoint directory (its format)

_NAME = r"^(step-[0-9]{8,13}|diff-[0-9]{8,13}-[0-9]{8,13})$"
RECORD_NAME = re.compile(_NAME.strip("^$"))  # for re.fullmatch

Step = Annotated[int, Field(ge=0, lt=MAX_STEP)]
RecordName = Annotated[str, Field(pattern=_NAME)]
Checksum = Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]
Nbytes = Annotated[int, Field(ge=0, le=MAX_FILE_BYTES)]
_STRICT = ConfigDict(strict=True, extra="forbid")


def checksum(data: memoryview | bytes) -> str:
    import xxhash

    return xxhash.xxh3_64_hexdigest(data)


def full_name(step: int) -> str:
    return f"step-{step:08d}"


def diff_name(first: int, last: int) -> str:
    return f"diff-{first:08d}-{last:08d}"


def rank_files(rank: int) -> tuple[str, str]:
    return f"rank-{rank:05d}.data", f"rank-{rank:05d}.json"


def is_record_name(name: str) -> bool:
    return RECORD_NAME.fullmatch(name) is not None


def record_step(name: str) -> int:
    """The step a record name ends at (the name must be a record name)."""
    return int(name.rsplit("-", 1)[1])


@dataclass(config=_STRICT)
class Manifest:
    """The commit record of one record directory (MANIFEST.json without format and checksum)."""

    name: RecordName
    kind: Literal["full", "diff"]
    step: Step
    first_step: Step
    world_size: Annotated[int, Field(ge=1, le=MAX_WORLD_SIZE)]
    bytes: Nbytes
    depends_on: Annotated[list[RecordName], Field(max_length=MAX_DEPENDS)] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    index_checksums: dict[str, Checksum] = field(default_factory=dict)
    committed_at: float = 0.0
    # Where the ranks' bytes lie: "records" (this record's directory: data + index per rank), "file"
    # (this record's directory: one self-describing file per rank, storage/rankfile.py) or "region"
    # (slots of the per-rank region files, storage/region.py; read from the slots, never a file).
    layout: Literal["records", "file", "region"] = "records"
    # Bytes of each rank's part (rank order; empty in manifests written before it was recorded).
    rank_bytes: Annotated[list[Nbytes], Field(max_length=MAX_WORLD_SIZE)] = field(default_factory=list)

    def to_json(self) -> dict:
        body = asdict(self)
        if self.layout == "records":  # (the layout manifests were written in before there were others)
            del body["layout"]
        if not self.rank_bytes:
            del body["rank_bytes"]
        body["format"] = FORMAT
        body["checksum"] = checksum(json.dumps(body, sort_keys=True).encode())
        return body

    @classmethod
    def from_json(cls, body: Any) -> Manifest:
        """The manifest a MANIFEST.json body describes, every field checked; CorruptCheckpoint if not."""
        if not isinstance(body, dict):
            raise CorruptCheckpoint("manifest is not a JSON object")
        body = dict(body)
        stored = body.pop("checksum", None)
        if stored != checksum(json.dumps(body, sort_keys=True).encode()):
            raise CorruptCheckpoint("manifest checksum mismatch")
        if body.pop("format", None) != FORMAT:
            raise CorruptCheckpoint(f"manifest format is not {FORMAT}")
        try:
            return cls(**body)
        except ValidationError as e:
            raise CorruptCheckpoint(f"manifest: {problem(e)}") from None

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        if self.first_step > self.step:
            raise ValueError(f"first_step {self.first_step} is after step {self.step}")
        if self.kind == "full":
            expect = full_name(self.step)
            if self.first_step != self.step:
                raise ValueError("a full record's first_step must equal its step")
        else:
            expect = diff_name(self.first_step, self.step)
            if self.step - self.first_step >= MAX_DIFF_SPAN:
                raise ValueError(f"diff record spans {self.step - self.first_step + 1} steps "
                                 f"(at most {MAX_DIFF_SPAN})")
            base = self.depends_on[0] if self.depends_on else ""
            if not base.startswith("step-") or record_step(base) >= self.first_step:
                raise ValueError("a diff record must depend first on an earlier full record")
        if self.name != expect:
            raise ValueError(f"name {short(self.name)} does not match kind {self.kind} and step {self.step}")
        if any(record_step(d) >= self.first_step for d in self.depends_on):
            raise ValueError("depends on a record that is not older than it")
        if self.rank_bytes and (len(self.rank_bytes) != self.world_size or sum(self.rank_bytes) != self.bytes):
            raise ValueError(f"rank_bytes do not add up to {self.world_size} ranks' {self.bytes} bytes")
        if set(self.index_checksums) != {str(r) for r in range(self.world_size)}:
            raise ValueError(f"index_checksums do not name ranks 0..{self.world_size - 1}")
        return self


class TensorEntry(BaseModel):
    """One tensor of a rank's data file: `nbytes` bytes at `offset`."""

    model_config = _STRICT
    dtype: str
    shape: Annotated[list[Annotated[int, Field(ge=0, le=MAX_FILE_BYTES)]], Field(max_length=MAX_NDIM)]
    offset: Nbytes
    nbytes: Nbytes
    xxh3: Checksum

    @model_validator(mode="after")
    def _sized(self) -> TensorEntry:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"unknown dtype {short(self.dtype)}")
        itemsize = DTYPE_SIZES[self.dtype]
        if math.prod(self.shape) * itemsize != self.nbytes:
            raise ValueError(f"shape {self.shape} of {self.dtype} is not {self.nbytes} bytes")
        if self.offset % itemsize:
            raise ValueError(f"offset {self.offset} is not a multiple of {itemsize} ({self.dtype})")
        return self


class OptimizerInfo(BaseModel):
    """What offline replay needs of an optimizer (index meta "optimizers"): its class, the
    state_dict keys of each of its parameters, and the device type they trained on (absent:
    several, or a record older than the field)."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    cls: Annotated[str, Field(alias="class", max_length=1000)]
    params: list[list[Annotated[list[str], Field(min_length=2, max_length=2)]]]
    device: Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]{0,15}$")] | None = None


class IndexMeta(BaseModel):
    """An index's "meta": free-form, but what restore reads of it is checked."""

    model_config = ConfigDict(strict=True, extra="allow")
    optimizers: dict[str, OptimizerInfo] = {}


class RankIndex(BaseModel):
    """`rank-NNNNN.json`: where each tensor of one rank lies, and the skeleton of the rest."""

    model_config = _STRICT
    format: Literal[1]
    record: RecordName
    rank: Annotated[int, Field(ge=0, lt=MAX_WORLD_SIZE)]
    data: str
    data_nbytes: Nbytes
    tensors: dict[str, TensorEntry]
    skeleton: Any
    meta: IndexMeta

    @model_validator(mode="after")
    def _confined(self) -> RankIndex:
        from .layout import ALIGN

        if self.data != rank_files(self.rank)[0]:
            raise ValueError(f"data file {short(self.data)} is not {rank_files(self.rank)[0]}")
        end = 0
        for key, t in sorted(self.tensors.items(), key=lambda item: item[1].offset):
            if t.offset + t.nbytes > self.data_nbytes:
                raise ValueError(f"tensor {short(key)} ({t.offset}+{t.nbytes}) lies beyond data_nbytes "
                                 f"{self.data_nbytes}")
            if t.nbytes and t.offset < end:  # (a reader may give each tensor storage of its own)
                raise ValueError(f"tensor {short(key)} ({t.offset}+{t.nbytes}) overlaps another one")
            end = max(end, t.offset + t.nbytes)
        if self.data_nbytes > -(-end // ALIGN) * ALIGN:
            raise ValueError(f"data_nbytes {self.data_nbytes} exceeds the extent of its tensors ({end})")
        return self


class _State(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StateSkeleton(_State):
    """The skeleton of a full record, as restore assembles a state from it (recovery, export)."""

    models: dict[str, dict[str, Any]]
    optimizers: dict[str, dict[str, Any]]
    schedulers: list[Any] = []
    scalers: list[Any] = []
    extra: dict[str, Any] = {}


class ParamGroup(_State):
    params: list[Annotated[int, Field(ge=0)]]


class SavedOptimizer(_State):
    """An optimizer's state_dict in a skeleton: what replay loads into the rebuilt optimizer."""

    state: Any
    param_groups: list[ParamGroup]


class DiffStep(_State):
    """One recorded step of a diff record: what replay applies and what finishes the state."""

    grads: list[Any]
    groups: list[dict[str, Any]]
    param_groups: dict[str, list[dict[str, Any]]]
    buffers: dict[str, dict[str, Any]]
    rng: Any
    schedulers: list[Any]
    scalers: list[Any]
    extra: dict[str, Any]


def short(value: Any, limit: int = 80) -> str:
    """repr(value) cut to `limit` characters: checkpoint strings in messages stay one short line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def problem(e: ValidationError) -> str:
    """One line naming the first failing field(s), without echoing the input."""
    parts = []
    for err in e.errors()[:2]:
        loc = ".".join(str(p) if str(p).isprintable() and len(str(p)) <= 80 else short(str(p)) for p in err["loc"])
        parts.append(f"{loc}: {err['msg']}" if loc else err["msg"])
    return "; ".join(parts).replace("Value error, ", "")
