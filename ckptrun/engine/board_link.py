"""What this engine tells the round's board (--node-local-dir; engine/nodecommit.py): it joins
the round's commit keys at each Hello, reports the parts it wrote, the records that failed and
the steps it holds partners' copies of, and (global rank 0) announces each commit. A board gone
with its round (its host, rank 0's worker, died) is a save error in the log: what it was told
does not commit, and nothing here raises."""

from __future__ import annotations

import json
from collections.abc import Callable

from ..storage.schema import Manifest
from .engine_state import EngineState
from .nodecommit import Board


class BoardLink:
    """The engine's side of `state.board` (None: no --node-local-dir, or its store not reached)."""

    def __init__(self, state: EngineState) -> None:
        self.state = state

    def join(self, spec: dict | None, forget: Callable[[], None]) -> None:
        """Meet the round's commit keys (a new round: new keys; what the old round left
        uncommitted, `forget`, is written again by the re-run, or, below a step resumed from
        memory, never: it is no longer waited for)."""
        state = self.state
        if spec is None or (state.board is not None and state.board.key == spec["prefix"]):
            return
        forget()
        try:
            state.board = Board.connect(spec)
        except (RuntimeError, ValueError) as e:  # no commit this round: the previous step stays
            state.board = None
            state.save_error(-1, "", f"the job store is not reachable ({e}); nothing commits this round")

    def tell(self, what: Callable[[Board], None]) -> None:
        """Tell the board `what`, if there is one; its failure is logged as a save error."""
        state = self.state
        if state.board is None:
            return
        try:
            what(state.board)
        except (RuntimeError, OSError) as e:
            state.log.emit(type="save_error", rank=state.rank, step=-1, record="", error=f"job store: {e}")

    def announce(self, m: Manifest) -> None:
        """Rank 0 committed `m` in its own --dir: the other nodes publish it now."""
        rank = self.state.rank

        def say(board: Board) -> None:
            board.announce(m.name, json.dumps(m.to_json()).encode())
            board.ack(rank, m.step)

        self.tell(say)
