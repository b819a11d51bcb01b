"""The durable-prefix ledger: which records a sink holds for good, and how far its cursor may move.

A follower reads records in seq order; each is then taken by the sink (written, but maybe only buffered: in
flight), durable (flushed, or written by a sink whose writes are durable, or dead-lettered, or taken by no call),
or neither yet. The cursor moves past the longest prefix of what was read that is durable; durable seqs above it
are kept in ``ahead`` (a batch that failed midway), so a replay from the cursor skips them.

Together with :mod:`rllog.delivery.calls` it keeps the re-send rule: a sink is never handed a record its cursor
lists as durable (:meth:`DurableLedger.untaken`), nor, in one follower's session, one it took (a call that returned,
or a record it acknowledged in a call that then raised: :class:`rllog.sink.Batch`). It sees a record again only
when its deliverer was killed (or stopped) while the record was in flight: taken, not yet flushed, so behind the
cursor; the next deliverer sends it once more. A sink that must not store it twice then recognises it by its
storage (parquet's store knows the highest seq it holds).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from typing import Any


class DurableLedger:
    """One follower's book of the records it read: in flight, durable, and the cursor's prefix.

    Args:
        seq: the cursor's seq (every readable record at or below it is durable).
        ahead: durable seqs above ``seq``.

    Example:
        >>> ledger = DurableLedger(0, [])
        >>> ledger.read([1, 2, 3])
        >>> ledger.took([1, 2], durable=False); ledger.durable([3]); ledger.advance(), ledger.ahead
        (0, {3})
        >>> ledger.flushed(); ledger.advance(), ledger.seq
        (3, 3)
    """

    def __init__(self, seq: int, ahead: Iterable[int]):
        self.seq = seq
        self.ahead: set[int] = set(ahead)
        self._outstanding: collections.deque[int] = collections.deque()  # read, not yet durable, in read order
        self._durable: set[int] = set()  # outstanding seqs that are durable (or dead-lettered)
        self._in_flight: set[int] = set()  # taken by a sink that buffers, waiting for its flush

    def read(self, seqs: Iterable[int]) -> None:
        """Records were read from the journal, in seq order."""
        self._outstanding.extend(seqs)

    def untaken(self, records: Sequence[Any]) -> list[Any]:
        """``records`` less those the sink holds durably already (``ahead``): what may be handed to it. Those it holds
        are booked durable here."""
        self._durable.update(r.seq for r in records if r.seq in self.ahead)
        return [r for r in records if r.seq not in self.ahead]

    def took(self, seqs: Iterable[int], durable: bool) -> None:
        """The sink took these records: durable at once (``durable``), or in flight until its flush."""
        seqs = set(seqs)
        if durable:
            self._durable |= seqs
        else:
            self._in_flight |= seqs

    def durable(self, seqs: Iterable[int]) -> None:
        """These records need nothing more from the sink (dead-lettered, or no call of the sink takes them)."""
        self._durable.update(seqs)

    @property
    def has_in_flight(self) -> bool:
        return bool(self._in_flight)

    def flushed(self) -> None:
        """The sink's flush (or close) returned: what it had taken is durable."""
        self._durable |= self._in_flight
        self._in_flight = set()

    def advance(self) -> int:
        """Move ``seq`` past the durable prefix of what was read; keep later durable seqs in ``ahead``. Returns how
        many records the cursor moved past."""
        moved = 0
        while self._outstanding and self._outstanding[0] in self._durable:
            self.seq = self._outstanding.popleft()
            self._durable.discard(self.seq)
            moved += 1
        self.ahead = {s for s in self.ahead | self._durable if s > self.seq}
        return moved
