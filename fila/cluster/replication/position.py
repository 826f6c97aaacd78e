"""Where a replica of a queue stands: the last batch it holds, and the epoch history
that tells whether its log is a prefix of another's.

Every write batch of a replicated queue has a sequence number (one sequence per
queue, continued across leaders) and the epoch of the leader that wrote it. A new
leader starts its epoch at its own last sequence + 1 and records `(epoch, start)` in
its history. Within one epoch only one node writes, so two replicas that hold the
batch at sequence `s` with the same epoch hold the same batches up to `s` (each
replica applies batches contiguously, and a follower is only streamed batches after
its leader checked that the follower's log is a prefix of its own): the log
matching rule Kafka's leader epochs and Raft rely on. A replica whose last batch
disagrees with the leader's history at that sequence holds a divergent suffix (batches
an old leader wrote that nobody acknowledged) and is rebuilt from a snapshot.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Final

# Epoch history entries kept; older positions can no longer be checked (snapshot).
MAX_HISTORY: Final = 1000

History = tuple[tuple[int, int], ...]  # (epoch, first sequence of that epoch), ascending


@dataclass(frozen=True, slots=True)
class Position:
    """A replica's state: its last sequence, its epoch history, whether it is whole
    (False while a snapshot is being installed: such a replica holds part of the
    queue), and whether it may stand for the in-sync membership etcd records for this
    node (`eligible`: False for a replica rebuilt after its disk was lost while etcd
    still counted it in sync, until a leader has taken it out of the in-sync set;
    it may then earn its way back). Only a whole, eligible replica may lead."""

    seq: int = 0
    history: History = field(default=())
    complete: bool = True
    eligible: bool = True

    @property
    def whole(self) -> bool:
        return self.complete and self.eligible

    @property
    def epoch(self) -> int:
        """The epoch of the batch at `seq` (0 for an empty replica)."""
        return epoch_at(self.history, self.seq)

    def appended(self, epoch: int, seq: int) -> Position:
        """After applying batch `(epoch, seq)` (the next one)."""
        history = self.history
        if not history or history[-1][0] < epoch:
            history = (*history, (epoch, seq))[-MAX_HISTORY:]
        return Position(seq, history, self.complete, self.eligible)

    def started(self, epoch: int) -> Position:
        """A leader's position as it starts `epoch`: its batches begin after `seq`."""
        history = (*self.history, (epoch, self.seq + 1))[-MAX_HISTORY:]
        return Position(self.seq, history, self.complete, self.eligible)

    def encode(self) -> bytes:
        return json.dumps(
            {
                "seq": self.seq,
                "history": [list(h) for h in self.history],
                "complete": self.complete,
                "eligible": self.eligible,
            }
        ).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Position:
        doc = json.loads(raw)
        history = tuple((int(e), int(s)) for e, s in doc["history"])
        return cls(int(doc["seq"]), history, bool(doc["complete"]), bool(doc["eligible"]))


def epoch_at(history: History, seq: int) -> int:
    """The epoch of the batch at `seq` per `history`: the latest epoch starting at or
    before it; 0 when `seq` is 0 or older than the history reaches."""
    if seq <= 0:
        return 0
    found = 0
    for epoch, start in history:
        if start > seq:
            break
        found = epoch
    return found


def is_prefix(leader: Position, epoch: int, seq: int) -> bool:
    """Whether a replica whose last batch is `(epoch, seq)` holds a prefix of the log
    `leader` describes (see the module docstring). An empty replica always does."""
    if seq == 0:
        return True
    if seq > leader.seq or not leader.history or leader.history[0][1] > seq:
        return False
    return epoch_at(leader.history, seq) == epoch
