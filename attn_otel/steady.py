"""Steady decoders: the running requests whose step the host need not look at one by one.

Under online load most steps are decode steps, and in most of them a request takes one token into a block it
already holds: its tracked token count and its stream record (pending rows, next position) each go up by one,
no block is new, nothing is uploaded.  Doing that by a Python loop over every running request cost most of
attn-otel's host time before each forward (``bench/step_track.py``: about 0.3 ms a step at 100 requests).

:class:`Steady` keeps those requests as members counted by one step counter (``epoch``) instead: a member's
true counts are its record's plus the steps since it joined (``epoch - joined``), applied (:meth:`Steady.settle`)
only where something reads them, and the host's per-step work on members is a few set operations.  A request
joins after a step it took through the ordinary path with one token (not planned for maps: the map tap points
its rows a block at a time from the items); it leaves (its counts applied) the step it is not scheduled, is
scheduled with more than one token, is given new blocks in a step its token does not start one, or would write
the first token of a block it was not given that step; and when it finishes or is preempted.  A member whose token
starts a block that the step gives it (the common case: every decoder crosses a block every ``block_size`` steps,
and requests of one length all cross in the same step) stays: the split lists it in ``crossed``, and the adapter
extends its block table, records the block's writer and guards the block for it in one pass, instead of walking it
through the tracker, the stream's schedule, the map tap and the guards one by one.
vLLM-free: the adapter feeds it the scheduler's output."""

from __future__ import annotations

from itertools import compress, filterfalse, repeat
from operator import is_not
from typing import Any, Sequence


class Steady:
    """Members by request id: ``[joined epoch, tracked record, stream record or None, epoch it crosses a block]``."""

    def __init__(self, block_size: int) -> None:
        self.block_size = int(block_size)
        self.epoch = 0
        self._m: dict[str, list] = {}
        self._cross: dict[int, list[str]] = {}  # epoch -> members whose token of that step starts a block
        self.joins = 0
        self.kept = 0  # members kept across a block boundary (Steady.keep)
        self.back: list[int] = []  # indices (in its ``ids``) of the members the last split sent back
        self.crossed: list[int] = []  # indices of the members whose token of the step starts a block it is given
        self.due = False  # a split was made and its bump not yet (see Steady.bump)

    def __len__(self) -> int:
        return len(self._m)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._m

    @staticmethod
    def _apply(m: list, epoch: int) -> None:
        d = epoch - m[0]
        if d:
            m[1].written += d
            live = m[2]
            if live is not None:
                live.count += d
                live.next += d
            m[0] = epoch

    def settle(self, req_id: str) -> None:
        """Apply a member's counts (it stays a member)."""
        m = self._m.get(req_id)
        if m is not None:
            self._apply(m, self.epoch)

    def settle_all(self) -> None:
        e = self.epoch
        for m in self._m.values():
            self._apply(m, e)

    def unsettled(self) -> int:
        """Stream rows the members took and :meth:`settle` has not applied yet, without applying them: for readers
        on other threads (the stats file), which must not change the counts the engine loop updates."""
        e = self.epoch
        return sum(e - m[0] for m in list(self._m.values()) if m[2] is not None)

    def leave(self, req_id: str) -> None:
        """Apply its counts and stop counting it (finished, preempted, or back to the ordinary path)."""
        m = self._m.pop(req_id, None)
        if m is not None:
            self._apply(m, self.epoch)

    def split(self, ids: Sequence[str], new_blocks: Sequence[Any], ones: bool, scheduled: dict) -> list[int]:
        """This step's scheduled running requests (``ids``, with their new blocks): the indices of those the
        ordinary path takes (not members, or members leaving: see the module).  Members not scheduled leave.
        ``ones``: every request of ``ids`` is scheduled one token (else ``scheduled`` says which is not).
        (Set and C-level operations: a Python step per request is what this saves.)"""
        m = self._m
        e1 = self.epoch + 1
        crossing = self._cross.pop(e1, ())
        self.back = []
        self.crossed = []
        self.due = True
        if not m:
            return list(range(len(ids)))
        outside = list(filterfalse(m.__contains__, ids))
        if len(ids) - len(outside) != len(m):  # a member not scheduled this step (it waits, or a step of new
            for r in m.keys() - set(ids):  # requests only)
                self.leave(r)
        cross = list(dict.fromkeys(r for r in crossing if r in m and m[r][3] == e1))  # (once each: see keep)
        if cross or outside:
            pos = dict(zip(ids, range(len(ids))))
            picks = set(map(pos.__getitem__, outside))
        else:
            picks = set()
        stay = []
        for r in cross:  # its token starts a block: it stays where the step gives it that block, one token
            i = pos[r]
            if new_blocks[i] is not None and (ones or scheduled.get(r) == 1):
                stay.append(i)
            else:
                picks.add(i)
        given = len(new_blocks) - new_blocks.count(None)  # requests given new blocks: found among those above,
        if given and sum(new_blocks[i] is not None for i in picks) + len(stay) != given:  # else looked for
            staying = set(stay)
            picks.update(i for i in compress(range(len(ids)), map(is_not, new_blocks, repeat(None)))
                         if i not in staying)
        if not ones:
            picks.update(i for i, r in enumerate(ids) if scheduled.get(r) != 1)
        self.crossed = stay
        self.back = [i for i in picks if ids[i] in m]  # members back to the ordinary path
        for i in self.back:
            self.leave(ids[i])
        return sorted(picks)

    def keep(self, req_ids: Sequence[str]) -> list[list]:
        """The members of :attr:`crossed` (by id) stay: each one's counts applied (the tracked record's ``written``
        and the stream record's position are then this step's first position), its next crossing a block on.
        Returns each one's ``[joined epoch, tracked, stream record, crossing epoch]``; :meth:`leave` still sends
        one back after."""
        apply, e, bs = self._apply, self.epoch, self.block_size
        out = list(map(self._m.__getitem__, req_ids))
        for m in out:
            apply(m, e)
            m[3] += bs
        if out:
            self._cross.setdefault(out[0][3], []).extend(req_ids)  # (they all crossed this step: one epoch on)
            self.kept += len(out)
        return out

    def bump(self) -> None:
        """Every member took one token this step (after the stream counted the step's other rows).  Where the
        step's bookkeeping failed after :meth:`split`, the adapter bumps anyway: the members took their token."""
        self.epoch += 1
        self.due = False

    def join(self, req_id: str, tracked: Any, live: Any, next_pos: int) -> None:
        """After :meth:`bump`: a request whose counts are up to date and whose next token is ``next_pos``."""
        ahead = (-int(next_pos)) % self.block_size  # steps until its token starts a block
        if ahead == 0 or req_id in self._m:
            return
        cross = self.epoch + 1 + ahead
        self._m[req_id] = [self.epoch, tracked, live, cross]
        self._cross.setdefault(cross, []).append(req_id)
        self.joins += 1
