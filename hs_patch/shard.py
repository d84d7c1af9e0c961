"""A stable shard of a dataset: which GPU host of a fleet extracts which sample.

Sample ``s`` belongs to shard ``i`` of ``n`` when ``int(sha256(sample_id)) % n == i``. The
sample id is ``<file name>:<line>`` (``hs_patch.host.driver.dataset``), so a line appended to a
file never moves another sample to another shard, and every sample is in exactly one
shard. ``hs-extract drive --shard i/n`` takes one; ``fab extract --hosts GROUP`` gives
each host of the group its own (``hs_patch.control.fleet``). Standard library only.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

_SPEC = re.compile(r"^(\d{1,6})/(\d{1,6})$")


class ShardError(ValueError):
    """A shard given as something other than ``i/n`` with ``0 <= i < n``."""


@dataclass(frozen=True)
class Shard:
    index: int
    count: int

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ShardError(f"shard {self.index}/{self.count}: the index must be 0..{self.count - 1} "
                             f"(shards of {self.count} hosts are 0/{self.count} to {self.count - 1}/{self.count})")

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def owns(self, sample_id: str) -> bool:
        """Whether ``sample_id`` belongs to this shard."""
        return self.count == 1 or shard_of(sample_id, self.count) == self.index


def shard_of(sample_id: str, count: int) -> int:
    """The shard index (0..count-1) of a sample id."""
    return int.from_bytes(hashlib.sha256(sample_id.encode("utf-8", "surrogateescape")).digest(), "big") % count


def parse(spec: str) -> Shard:
    """``"i/n"`` as a :class:`Shard`; anything else raises ShardError saying what to give."""
    m = _SPEC.match(spec.strip())
    if not m:
        raise ShardError(f"shard {spec!r} is not INDEX/COUNT (e.g. 0/3 for the first of three hosts)")
    count = int(m.group(2))
    if count < 1:
        raise ShardError(f"shard {spec!r}: the count must be at least 1")
    return Shard(int(m.group(1)), count)
