"""Host-side bookkeeping of a paged KV cache: which block holds what, and who holds it.

No JAX here: the engine keeps the blocks' contents on the device (``KVPages``) and uses
these classes to decide which block ids a forward call reads and writes.

* ``BlockPool``: free list and reference counts of the ``num_blocks`` blocks.
* ``PrefixCache``: full blocks indexed by the tokens they hold *and* every token before
  them (a hash chain over blocks, as in vLLM's automatic prefix caching), so a sequence
  whose first ``k * block_size`` tokens equal another's reuses its ``k`` blocks instead of
  computing them again. Least recently used entries are evicted first.

A block may be referenced by several holders at once (running sequences, idle sessions,
the prefix cache); it returns to the free list when the last reference is dropped. A
block that more than one holder references is never written again.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Iterable, Sequence

import numpy as np


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Key of a full block: a digest of its parent block's key and its own token ids, so
    equal keys mean equal tokens from position 0 up to the end of the block."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return digest.digest()


ROOT_KEY = b""  # parent key of a sequence's first block


class BlockPool:
    """Reference-counted allocation of block ids ``0 .. num_blocks - 1``.

    Raises:
      ValueError: ``num_blocks`` is not positive.
    """

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"BlockPool: num_blocks must be positive, got {num_blocks}.")
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        self._free = collections.deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        """Blocks no one references."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks with at least one reference."""
        return self.num_blocks - len(self._free)

    def refs(self, block: int) -> int:
        """Number of holders of ``block``."""
        return self._refs[block]

    def allocate(self) -> int:
        """Takes one free block (reference count 1).

        Raises:
          RuntimeError: no block is free (callers evict first).
        """
        if not self._free:
            raise RuntimeError("BlockPool: no free KV block; evict before allocating.")
        block = self._free.popleft()
        self._refs[block] = 1
        return block

    def share(self, block: int) -> None:
        """Adds a holder to a block in use."""
        if self._refs[block] <= 0:
            raise RuntimeError(f"BlockPool: block {block} is free and cannot be shared.")
        self._refs[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drops one reference to each of ``blocks``; freed blocks go back to the pool."""
        for block in blocks:
            if self._refs[block] <= 0:
                raise RuntimeError(f"BlockPool: block {block} released more often than held.")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free.append(block)


@dataclasses.dataclass
class CachedBlock:
    """A prefix-cache entry: the block and the policy version whose weights computed it."""

    block: int
    version: int


class PrefixCache:
    """Full KV blocks by ``block_key``; holds one reference to each block it indexes.

    Args:
      pool: the ``BlockPool`` the blocks come from.
    """

    def __init__(self, pool: BlockPool):
        self._pool = pool
        self._entries: collections.OrderedDict[bytes, CachedBlock] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes, min_version: int | None = None) -> CachedBlock | None:
        """The entry for ``key`` (marked most recently used), or None; entries computed
        under a version older than ``min_version`` do not count."""
        entry = self._entries.get(key)
        if entry is None or (min_version is not None and entry.version < min_version):
            return None
        self._entries.move_to_end(key)
        return entry

    def put(self, key: bytes, block: int, version: int) -> None:
        """Indexes ``block`` under ``key`` unless the key is already indexed."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        self._pool.share(block)
        self._entries[key] = CachedBlock(block, version)

    def evict_one(self) -> bool:
        """Drops the least recently used entry whose block no one else holds, freeing
        that block; False when there is none."""
        for key, entry in self._entries.items():
            if self._pool.refs(entry.block) == 1:
                del self._entries[key]
                self._pool.release([entry.block])
                return True
        return False

    def clear(self) -> None:
        """Drops every entry (e.g. after a weight update that invalidates the KV)."""
        self._pool.release(entry.block for entry in self._entries.values())
        self._entries.clear()
