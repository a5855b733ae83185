"""The prefix cache of the block lanes: a prompt's keys and values, kept for the next prompt
with the same whole blocks.

A block lane's row starts by encoding its canvas (`BlockStepper.start`: one full pass over
[window, first block]). On a block-causal model (SDAR, Fast-dLLM v2, LLaDA2, BD3-LM) the
keys and values of the prompt's whole model blocks depend on those blocks alone, the canvas
starts at the row's first token, and the positions after the prompt are written by the first
block's passes before they are read (or masked), so that start cache serves any request whose
prompt has the same whole blocks, exactly: a hit skips the pass and gives the tokens a miss
gives (tests/serve/test_cached_decoders.py). The prompt's tail (its partial last block) and
the row's seed may differ.

`PrefixCache` is a radix tree over block-aligned prefixes: a node per model block of tokens,
an entry (one row's start cache, on the device) on the node that ends a cached prompt's
whole blocks; each node counts the entries under it (a node with none is pruned). A lookup
walks the prompt's blocks; it hits only where the walk ends on an entry (an entry of a
longer or shorter prompt cannot be reused: a shorter one lacks blocks, and computing them
by a window pass would not give the full pass's floating-point values; `matched_blocks`
counts how far misses got). Entries are dropped least recently used first to keep their
device bytes within `max_bytes`. A hit copies the entry into the row (the admit program's
output), so no row holds a reference to an entry and eviction frees it at once.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import jax
import numpy as np


class _Node:
  __slots__ = ("children", "entry", "entries_below", "parent", "block")

  def __init__(self, parent=None, block=None):
    self.children: dict[tuple, _Node] = {}
    self.entry: Any = None
    self.entries_below = 0  # entries on this node and its descendants
    self.parent, self.block = parent, block


def nbytes(tree) -> int:
  return int(sum(leaf.nbytes for leaf in jax.tree.leaves(tree)))


class PrefixCache:
  """Start caches by (lane key, the prompt's whole blocks), within `max_bytes` device bytes."""

  def __init__(self, max_bytes: int):
    self.max_bytes = int(max_bytes)
    self._roots: dict[Any, _Node] = {}
    self._lru: collections.OrderedDict[int, tuple[Any, _Node]] = collections.OrderedDict()
    self._lock = threading.Lock()  # /metrics reads the counts from the server's thread
    self.hits = self.misses = self.bytes = self.evicted = self.matched_blocks = 0

  @staticmethod
  def blocks(whole: np.ndarray, block: int) -> list[tuple]:
    """The prompt's whole blocks (`whole`: their tokens, a multiple of `block` long)."""
    whole = np.asarray(whole).reshape(-1)
    return [tuple(int(t) for t in whole[i:i + block]) for i in range(0, len(whole), block)]

  def lookup(self, lane_key, blocks: list[tuple]):
    """The entry of exactly these blocks (counted as a hit), else None (a miss)."""
    with self._lock:
      node, depth = self._roots.get(lane_key), 0
      for block in blocks:
        node = None if node is None else node.children.get(block)
        if node is None:
          break
        depth += 1
      if node is not None and node.entry is not None:
        self.hits += 1
        self._lru.move_to_end(id(node))
        return node.entry
      self.misses += 1
      self.matched_blocks += depth
      return None

  def insert(self, lane_key, blocks: list[tuple], entry) -> bool:
    """Keeps `entry` (a start cache) for these blocks, dropping the least recently used
    entries past the budget; False when it alone exceeds it."""
    size = nbytes(entry)
    if size > self.max_bytes:
      return False
    with self._lock:
      node = self._roots.setdefault(lane_key, _Node())
      path = [node]
      for block in blocks:
        node = node.children.setdefault(block, _Node(node, block))
        path.append(node)
      if node.entry is not None:  # the same blocks again: keep the one held
        self._lru.move_to_end(id(node))
        return True
      node.entry = entry
      for on_path in path:
        on_path.entries_below += 1
      self._lru[id(node)] = (lane_key, node)
      self.bytes += size
      while self.bytes > self.max_bytes:
        self._evict_oldest()
      return True

  def drop_lane(self, lane_key) -> None:
    """Forgets a dropped lane's entries."""
    with self._lock:
      for ident, (key, node) in list(self._lru.items()):
        if key == lane_key:
          self._remove(ident, node)
      self._roots.pop(lane_key, None)

  def _evict_oldest(self) -> None:
    ident, (_, node) = next(iter(self._lru.items()))
    self._remove(ident, node)
    self.evicted += 1

  def _remove(self, ident: int, node: _Node) -> None:
    self.bytes -= nbytes(node.entry)
    node.entry = None
    del self._lru[ident]
    while node is not None:  # prune the nodes left with no entry under them
      node.entries_below -= 1
      parent = node.parent
      if parent is not None and node.entries_below == 0:
        del parent.children[node.block]
      node = parent

  @property
  def entries(self) -> int:
    return len(self._lru)

  def counts(self) -> dict:
    """The `EngineStats` fields it fills."""
    with self._lock:
      return dict(prefix_hits=self.hits, prefix_misses=self.misses, prefix_bytes=self.bytes)
