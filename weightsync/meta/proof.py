"""The plan's proof at the MetaServer: each pair's two hashes compared as they are posted.

Every participant posts the hash of each pair it is an end of; the job starts once every pair's two
ends agree. The comparison is kept up to date as posts come (:meth:`Proof.post`: work in the pairs of the
participant that posted, not in the job's), so a check answers in O(1) whatever the job's size, and a
check's answer holds counts and the first few pairs that disagree or wait, never every pair: a job of
2,048 + 256 participants has half a million pairs, and every participant asks.
"""

from __future__ import annotations

import heapq
from collections import Counter
from typing import Any

#: pairs listed in a check's answer, of those that disagree and of those that wait (the counts are whole)
LISTED = 20

_PENDING, _MISMATCH, _OK = 1, 2, 3


def _ends(key: str) -> tuple[str, str]:
    s, i, r = key.split(",")
    return f"train:{s}", f"infer:{i}:{r}"


def _order(key: str) -> tuple[int, ...]:
    return tuple(int(x) for x in key.split(","))


class Proof:
    """The comparison of one job's posted pair hashes (``posted``: name -> ``{"plan_hash", "pairs": {"s,i,r":
    hash}}``, the job's stored form, which :meth:`post` changes)."""

    def __init__(self) -> None:
        self.compared = 0  # pairs both of whose ends posted
        self.pending: dict[str, None] = {}  # pairs one end posted and the other has not posted at all
        self.mismatched: dict[str, None] = {}  # pairs both ends posted, with other hashes (or one lacks it)
        self.plan: Counter[str] = Counter()  # job-level plan hashes posted, by value
        #: keys the other end listed and this participant (posted or not) does not: its post may settle them
        self.one_sided: dict[str, set[str]] = {}

    @classmethod
    def of(cls, posted: dict[str, dict]) -> "Proof":
        """The comparison of what was posted (a restart, a reload): as if posted one by one."""
        proof, items = cls(), list(posted.items())
        posted.clear()
        for name, value in items:
            proof.post(posted, name, value)
        return proof

    def post(self, posted: dict[str, dict], name: str, new: dict | None) -> None:
        """Set ``posted[name]`` to ``new`` (None: drop it, as a re-registration does) and compare again the
        pairs that change can touch."""
        old = posted.get(name)
        keys = set(old["pairs"] if old else ()) | set(new["pairs"] if new else ()) | self.one_sided.get(name, set())
        before = {k: _state(posted, k) for k in keys}
        if old is not None and old.get("plan_hash"):
            self.plan[old["plan_hash"]] -= 1
            if not self.plan[old["plan_hash"]]:
                del self.plan[old["plan_hash"]]
        if new is None:
            posted.pop(name, None)
        else:
            posted[name] = new
            if new.get("plan_hash"):
                self.plan[new["plan_hash"]] += 1
        for k in keys:
            was, now = before[k], _state(posted, k)
            self.compared += (now in (_OK, _MISMATCH)) - (was in (_OK, _MISMATCH))
            for state, kept in ((_PENDING, self.pending), (_MISMATCH, self.mismatched)):
                if now == state:
                    kept[k] = None
                elif was == state:
                    del kept[k]
            self._one_sided(posted, k)

    def _one_sided(self, posted: dict[str, dict], key: str) -> None:
        train, infer = _ends(key)
        listed = [key in posted[n]["pairs"] if n in posted else False for n in (train, infer)]
        for n, mine, theirs in ((train, listed[0], listed[1]), (infer, listed[1], listed[0])):
            if theirs and not mine:
                self.one_sided.setdefault(n, set()).add(key)
            elif n in self.one_sided:
                self.one_sided[n].discard(key)
                if not self.one_sided[n]:
                    del self.one_sided[n]

    def settled(self, wait_for: int, posted: dict[str, dict]) -> bool:
        """Whether a wait for ``wait_for`` participants' proof may answer: a pair disagrees, or that many
        posted and no pair waits for its other end."""
        return bool(self.mismatched) or (len(posted) >= wait_for and not self.pending)

    def answer(self, posted: dict[str, dict]) -> dict[str, Any]:
        """The check: counts, and the first :data:`LISTED` pairs that disagree or wait, naming both ends."""
        mismatches = []
        for k in heapq.nsmallest(LISTED, self.mismatched, key=_order):
            train, infer = _ends(k)
            mismatches.append({"pair": list(_order(k)), "train": train, "train_hash": posted[train]["pairs"].get(k),
                               "infer": infer, "infer_hash": posted[infer]["pairs"].get(k)})
        pending = []
        for k in heapq.nsmallest(LISTED, self.pending, key=_order):
            train, infer = _ends(k)
            by, waiting = (train, infer) if train in posted else (infer, train)
            pending.append({"pair": list(_order(k)), "reported_by": by, "waiting_for": waiting})
        agree = len(self.plan) <= 1
        return {"ok": not self.mismatched and agree, "complete": not self.pending, "compared": self.compared,
                "posted": len(posted), "mismatches": mismatches, "mismatch_count": len(self.mismatched),
                "pending": pending, "pending_count": len(self.pending), "plan_hash_counts": dict(self.plan),
                "plan_hashes_agree": agree}


def _state(posted: dict[str, dict], key: str) -> int | None:
    """A pair's state: None (no end lists it), pending (an end has not posted), agreeing or not."""
    train, infer = _ends(key)
    t, f = posted.get(train), posted.get(infer)
    if not ((t is not None and key in t["pairs"]) or (f is not None and key in f["pairs"])):
        return None
    if t is None or f is None:
        return _PENDING
    return _OK if t["pairs"].get(key) == f["pairs"].get(key) else _MISMATCH
