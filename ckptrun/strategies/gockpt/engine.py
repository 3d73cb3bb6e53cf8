"""Engine side of `gockpt` (gockpt.txt §4.3): roll every block of a spread forward to version V.

Each step of a spread brings (one `Spread` message, one staging slot, copied out and freed at
once) the gradients that step consumed for the blocks already here, then the blocks sent at that
step. The blocks sent at one step form a cohort: an optimizer of the trainer's class over their
parameter slices, holding their optimizer-state slices; each step's gradients and
hyper-parameters step every cohort forward (`ckptrun.restore.replay.apply_diff`, the replay
lowdiff's restore and lowdiff+'s replica use), so when V's blocks arrive every cohort is at V.
V's message also holds the rest of V's state, shaped as a full snapshot with the blocks' places
empty: they are filled from the cohorts and the whole is written as an ordinary full record.
The updates of an elementwise optimizer on a slice equal the whole tensor's (split points at
multiples of 4096 elements, `blocks.py`): on CPU training the record is bit-exact.

Each byte is copied once on its way to the record: a message is read in its slot (the gradients
roll the cohorts from there), only blocks that must outlive the slot (those rolled at later
steps) are cloned, and V's record is laid out straight from the cohorts and V's slot into a
record buffer reused from one write to the next (a fresh one faulted in every page: a 55 MB
record cost more CPU than its write). The slot is freed once V's record is laid out; under a
disk slower than the spreads, the wait for a buffer whose write is done holds V's slot, and the
trainer, short of a slot, waits too (back-pressure, not a growing queue).

A spread is dropped, never half-written: when its worker goes (a flush: a new Hello or resume),
when a message does not fit it, or when a new spread starts.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from ...engine.handlers import EngineContext, EngineHandler
from ...ipc.messages import RecordSpec, StrategyMessage
from ...restore.recovery import optimizer_classes
from ...restore.replay import apply_diff, warm_up_in_background
from ...storage import writeonce
from ...storage.layout import Layout, TensorSpec, view
from ...storage.store import full_name
from ...storage.tree import unflatten
from .messages import Spread

# Records of this handler written at once at most: each holds a copy of the state, and the slots are
# freed before the write, so without this bound a disk slower than the steps grew a queue of them
# (the soak: +65 KB per step of native memory on a tiny model, 560 MB after 8,000 steps).
WRITES_QUEUED = 2
OWN_KEYS = ("grads", "hyper", "blocks", "rest", "block_hyper")  # a message's parts that are not the state of V


@dataclass
class Cohort:
    """The blocks sent at one step, stepped forward together."""

    version: int
    pieces: list[dict]  # {"i", "start", "stop", "shape"} per parameter slice, in the optimizer's order
    optimizer: torch.optim.Optimizer
    groups: list[int]  # the trainer's param group of each of its groups


@dataclass
class Rolling:
    start: int
    cls: type
    cohorts: list[Cohort] = field(default_factory=list)

    def roll(self, step: int, grads: list, hyper: list[dict]) -> None:
        """Step every cohort with the gradients and hyper-parameters step `step` consumed."""
        at = 0
        for c in self.cohorts:
            if c.version != step - 1:
                raise ValueError(f"blocks of step {c.version} got the gradients of step {step}")
            part, at = grads[at: at + len(c.pieces)], at + len(c.pieces)
            apply_diff(c.optimizer, {"grads": part, "groups": [hyper[g] for g in c.groups]})
            c.version = step
        if at != len(grads):
            raise ValueError(f"{len(grads)} gradients for {at} parameter slices")

    def add(self, step: int, blocks: list[dict], hyper: list[dict], *, keep: bool) -> None:
        """The blocks sent at `step` as a new cohort; `keep`: they are rolled at later steps, so
        they are copied out of the message's slot (else they are read there, until V's record is
        laid out)."""
        if not blocks:
            return
        if keep:
            blocks = [{**b, "param": b["param"].clone(),
                       "state": {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in b["state"].items()}}
                      for b in blocks]
        groups = list(dict.fromkeys(b["g"] for b in blocks))
        params = [b["param"] for b in blocks]
        if [b["g"] for b in blocks] != sorted(b["g"] for b in blocks):
            raise ValueError("blocks out of their param groups' order")
        opt = self.cls([{**hyper[g], "params": [p for p, b in zip(params, blocks, strict=True) if b["g"] == g]}
                        for g in groups])
        for p, b in zip(params, blocks, strict=True):
            opt.state[p] = dict(b["state"])
        pieces = [{k: b[k] for k in ("i", "start", "stop", "shape")} for b in blocks]
        self.cohorts.append(Cohort(step, pieces, opt, groups))

    def fill(self, state: dict, aliases: list[list[list[str]]], exact: bool) -> dict[int, list]:
        """Put a placeholder of each rolled tensor (its shape and dtype, no bytes) into the
        places V's state left empty (None); returns, by each placeholder's id, the (slice of its
        flattened elements, block tensor) pairs that fill it (`GoCkptHandler._lay_out`). With
        `exact`, the blocks' own scalar state (Adam's `step`) must equal V's: every block is at V."""
        version = {c.version for c in self.cohorts}
        if len(version) > 1:
            raise ValueError(f"blocks at steps {sorted(version)}")
        whole: dict[int, dict[str, list]] = {}
        scalars: dict[int, dict[str, torch.Tensor]] = {}
        saved = state["optimizers"]["optimizer"]["state"]
        for c in self.cohorts:
            for piece, p in zip(c.pieces, [q for g in c.optimizer.param_groups for q in g["params"]], strict=True):
                i, sl = piece["i"], slice(piece["start"], piece["stop"])
                for name, t in {"param": p, **c.optimizer.state.get(p, {})}.items():
                    if not isinstance(t, torch.Tensor):
                        continue
                    if name != "param" and (t.shape != p.shape or saved.get(i, {}).get(name, 0) is not None):
                        scalars.setdefault(i, {})[name] = t
                        continue
                    whole.setdefault(i, {}).setdefault(name, []).append((sl, t))
        fills: dict[int, list] = {}
        for i, parts in whole.items():
            shape = next(pc["shape"] for c in self.cohorts for pc in c.pieces if pc["i"] == i)
            covered = sum(pc["stop"] - pc["start"] for c in self.cohorts for pc in c.pieces if pc["i"] == i)
            if covered != int(torch.Size(shape).numel()):
                raise ValueError(f"parameter {i}: blocks cover {covered} of its elements")
            for name, t in scalars.get(i, {}).items() if exact else ():
                if name in saved.get(i, {}) and not torch.equal(t, saved[i][name]):
                    raise ValueError(f"parameter {i}: a block's {name} is not at step V")
            placed = {}
            for name, slices in parts.items():
                placed[name] = torch.empty((), dtype=slices[0][1].dtype).expand(shape)
                fills[id(placed[name])] = slices
            param = placed.pop("param")
            for model, key in aliases[i]:
                if state["models"][model][key] is not None:
                    raise ValueError(f"{model}.{key} is both a block and in the state of V")
                state["models"][model][key] = param
            for name, t in placed.items():
                saved[i][name] = t
        empty = [f"{m}.{k}" for m, sd in state["models"].items() for k, v in sd.items() if v is None]
        if empty:
            raise ValueError(f"no block holds {empty[0]}")
        return fills


class GoCkptHandler(EngineHandler):
    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        torch.set_num_threads(1)  # the roll-forward runs beside training: one core
        self.classes = optimizer_classes()
        warm_up_in_background()
        self.rolling: Rolling | None = None
        self.buffers: list[tuple[Future, torch.Tensor]] = []  # record buffers, each with its last write

    def handle(self, msg: StrategyMessage) -> None:
        if not isinstance(msg, Spread):
            super().handle(msg)
        step = msg.spec.step
        try:
            try:
                record = self._step(msg, self._read(msg))
            finally:
                self.ctx.free_slot(msg.slot)
            if record is not None:
                self._write(*record)
        except Exception as e:  # noqa: BLE001 - reported; the spread is dropped, the next one starts afresh
            self.rolling = None
            self.ctx.save_error(step, full_name(step), f"gockpt spread from step {msg.start} dropped "
                                                       f"({type(e).__name__}: {e})")

    def _read(self, msg: Spread) -> dict:
        """The message's tree, its tensors read in the slot (valid until the slot is freed)."""
        buf = torch.frombuffer(self.ctx.slot_view(msg.slot), dtype=torch.uint8)
        return unflatten(msg.spec.skeleton, {k: view(buf, TensorSpec.from_json(k, t))
                                             for k, t in msg.spec.tensors.items()})

    def _step(self, msg: Spread, tree: dict) -> tuple[RecordSpec, torch.Tensor, int, int] | None:
        """Roll and add this step's blocks; at V, the record laid out (see `_write`)."""
        step, meta = msg.spec.step, msg.spec.meta
        if step == msg.start:  # a new spread (one at a time: any other is dropped)
            self.rolling = Rolling(msg.start, self.classes[meta["optimizers"]["optimizer"]["class"]])
        r = self.rolling
        if r is None or r.start != msg.start:
            return None  # the rest of a spread already dropped
        if "grads" in tree:
            r.roll(step, tree["grads"], tree["hyper"])
        r.add(step, tree["blocks"] + tree.get("rest", []), tree["block_hyper"], keep=not msg.last)
        if not msg.last:
            return None
        self.rolling = None
        return self._lay_out(msg, {k: v for k, v in tree.items() if k not in OWN_KEYS}, r)

    def _lay_out(self, msg: Spread, state: dict, r: Rolling) -> tuple[RecordSpec, torch.Tensor, int, int]:
        """V's state with its blocks filled in, laid out as the ordinary full record of V (under
        DDP without the replicated tensors another rank writes: storage/writeonce.py): the
        record, its buffer, the bytes laid out in it, and the number of cohorts."""
        spec = msg.spec
        aliases = spec.meta["optimizers"]["optimizer"]["params"]
        fills = r.fill(state, aliases, msg.exact)
        skeleton, tensors = writeonce.split_state(state, msg.replicated, aliases, self.ctx.rank, self.ctx.world_size)
        layout = Layout.of(tensors)
        buf = self._buffer(layout.nbytes)
        with torch.no_grad():
            for s in layout.specs:
                into, t = view(buf, s), tensors[s.key]
                for sl, block in fills.get(id(t), [(slice(None), t)]):
                    into.view(-1)[sl] = block.reshape(-1)
        meta: dict[str, Any] = {**writeonce.with_shared_keys(spec.meta, state, msg.shared, aliases),
                                "gockpt": {"first_step": msg.start, "rolled_on": "cpu", "exact": msg.exact}}
        record = RecordSpec(record=full_name(spec.step), kind="full", step=spec.step, skeleton=skeleton,
                            tensors={s.key: s.to_json() for s in layout.specs}, meta=meta)
        return record, buf, layout.nbytes, len(r.cohorts)

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """A record buffer of at least `nbytes`: one whose write is done, taken out of `buffers`
        (at most WRITES_QUEUED writes at once, each holding one), else a new one."""
        self.ctx.wait_writes(WRITES_QUEUED)
        done = next((i for i, (write, _) in enumerate(self.buffers) if write.done()), None)
        buf = None if done is None else self.buffers.pop(done)[1]
        return buf if buf is not None and buf.numel() >= nbytes else torch.empty(max(1, nbytes), dtype=torch.uint8)

    def _write(self, record: RecordSpec, buf: torch.Tensor, nbytes: int, cohorts: int) -> None:
        """Hand the record laid out in `buf[:nbytes]` to the engine's writers; `buf` is reused
        once that write is done."""
        self.ctx.emit(type="gockpt_spread", rank=self.ctx.rank, first_step=record.meta["gockpt"]["first_step"],
                      step=record.step, cohorts=cohorts, nbytes=nbytes)
        self.buffers.append((self.ctx.write(record, memoryview(buf.numpy())[:nbytes]), buf))

    def flush(self) -> None:
        """A spread still rolling when the worker flushes (a restarted worker's Hello or resume
        question, or the end) cannot be finished: its worker is gone. Dropped."""
        if self.rolling is not None:
            self.ctx.emit(type="gockpt_dropped", rank=self.ctx.rank, first_step=self.rolling.start)
            self.rolling = None
