"""The prefix cache's radix tree (`mdjax.serve.prefix_cache.PrefixCache`): exact lookups by
whole blocks, least recently used entries dropped past the byte budget, nodes pruned with
their last entry, a lane's entries forgotten with it. Host arrays stand in for caches (the
served hits: tests/serve/test_cached_decoders.py)."""

import numpy as np

from mdjax.serve.prefix_cache import PrefixCache


def entry(value: int, size: int = 100):
  return {"keys": np.full(size // 4, value, np.float32)}  # `size` bytes


def test_a_hit_needs_every_whole_block_and_counts_how_far_misses_got():
  cache = PrefixCache(max_bytes=1000)
  blocks = PrefixCache.blocks(np.arange(8), 4)
  assert blocks == [(0, 1, 2, 3), (4, 5, 6, 7)]
  assert cache.lookup("lane", blocks) is None  # empty: a miss at depth 0
  assert cache.insert("lane", blocks, entry(1))
  assert cache.lookup("lane", blocks)["keys"][0] == 1
  assert cache.lookup("lane", blocks[:1]) is None  # a shorter prompt: its node holds nothing
  assert cache.lookup("lane", blocks + [(9, 9, 9, 9)]) is None  # a longer one lacks a block
  assert cache.lookup("other lane", blocks) is None
  assert (cache.hits, cache.misses, cache.matched_blocks) == (1, 4, 1 + 2)
  assert cache.insert("lane", [], entry(2))  # no whole block: the root's entry
  assert cache.lookup("lane", [])["keys"][0] == 2


def test_least_recently_used_entries_leave_past_the_budget_and_their_nodes_with_them():
  cache = PrefixCache(max_bytes=250)
  a, b, c = [(1,), (2,)], [(1,), (3,)], [(4,)]
  assert cache.insert("lane", a, entry(1)) and cache.insert("lane", b, entry(2))
  assert cache.lookup("lane", a) is not None  # a is now the most recently used
  assert cache.insert("lane", c, entry(3))  # 300 bytes > 250: b (least recent) leaves
  assert cache.lookup("lane", b) is None and cache.lookup("lane", a) is not None
  assert (cache.entries, cache.bytes, cache.evicted) == (2, 200, 1)
  assert set(cache._roots["lane"].children[(1,)].children) == {(2,)}  # b's node pruned
  assert not cache.insert("lane", [(5,)], entry(5, size=400))  # alone past the budget
  assert cache.insert("lane", a, entry(9))  # the same blocks again: the held one stays
  assert cache.lookup("lane", a)["keys"][0] == 1 and cache.bytes == 200
  cache.drop_lane("lane")
  assert (cache.entries, cache.bytes) == (0, 0) and "lane" not in cache._roots
