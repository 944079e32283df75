"""Active (in-flight) prompt blocks per endpoint, deduplicated by block hash.

Dynamo's active-sequence tracker counts a worker's active blocks as the *distinct* block hashes
of its in-flight requests (PROTOCOLS.md §4.3, ``--router-assume-kv-reuse``): two requests that
share a prefix on one worker hold the shared blocks once, and a new request adds only the
blocks of its chain that are not already active there.

kvplug's sequence hashes are chained (block i's hash commits to blocks 0..i), so each endpoint's
active set is prefix-closed: a request's blocks already active on an endpoint are exactly the
first ``depth`` of its chain. One compressed trie over every endpoint's active chains answers
``depth`` for all candidates in a single walk, and adding or releasing a request touches only
the trie nodes on its path, not every block:

* a node is a run of consecutive hashes (a numpy view of some request's chain, never copied
  per block) with ``holders``: endpoint -> number of active chains on it passing through;
* chains end on node boundaries (a node is split where a chain stops or diverges), so an
  endpoint holding a node holds all of its hashes;
* the unique active blocks of an endpoint change by the hashes of the nodes whose holder
  count for that endpoint goes 0 -> 1 (add) or 1 -> 0 (release).
"""

from __future__ import annotations

import numpy as np


class _Node:
    __slots__ = ("edge", "parent", "children", "holders", "_eps")

    def __init__(self, edge: np.ndarray, parent: _Node | None, holders: dict[int, int]) -> None:
        self.edge = edge  # uint64 hashes, chain order
        self.parent = parent
        self.children: dict[int, _Node] = {}  # keyed by the child's first hash
        self.holders = holders
        self._eps: np.ndarray | None = None  # holders' endpoint ids, cached for gathers

    def endpoints(self) -> np.ndarray:
        if self._eps is None:
            self._eps = np.fromiter(self.holders, np.int64, len(self.holders))
        return self._eps


# one step of a walk: (node, hashes of it matched by the request)
Walk = list[tuple[_Node, int]]


class ActiveBlocks:
    """Refcounted active chains of every endpoint; see the module docstring."""

    def __init__(self) -> None:
        self._roots: dict[int, _Node] = {}
        self.chains = 0  # active chains (requests) held

    def walk(self, hashes: np.ndarray) -> Walk:
        """The trie nodes along ``hashes``: an empty list when no endpoint holds its first
        block (the common cold case costs one dict lookup)."""
        n = len(hashes)
        if n == 0:
            return []
        node = self._roots.get(int(hashes[0]))
        out: Walk = []
        pos = 0
        while node is not None:
            edge = node.edge
            m = min(len(edge), n - pos)
            # chained hashes: equal at the probe end means equal all the way (k >= 1: the
            # first hash matched the dict key)
            if edge[m - 1] == hashes[pos + m - 1]:
                k = m
            else:
                lo, hi = 1, m - 1  # edge[lo-1] matches, edge[hi] does not
                while lo < hi:
                    mid = (lo + hi) // 2
                    if edge[mid] == hashes[pos + mid]:
                        lo = mid + 1
                    else:
                        hi = mid
                k = lo
            out.append((node, k))
            pos += k
            if k < len(edge) or pos == n:
                break
            node = node.children.get(int(hashes[pos]))
        return out

    @staticmethod
    def depths(walk: Walk, out: np.ndarray) -> np.ndarray:
        """Per endpoint id, how many leading blocks of the walked chain are active there
        (``out`` is zeroed and filled; deeper nodes' holders are subsets of shallower ones')."""
        out[:] = 0
        pos = 0
        for node, k in walk:
            pos += k
            out[node.endpoints()] = pos
        return out

    def add(self, ep: int, hashes: np.ndarray, walk: Walk) -> tuple[_Node | None, int]:
        """Hold ``hashes`` (its ``walk`` from this trie, unchanged since) on ``ep``. Returns
        (the chain's tail node, for ``release``; the number of blocks new to ``ep``)."""
        n = len(hashes)
        if n == 0:
            return None, 0
        pos = 0
        depth = 0  # blocks already active on ep
        parent: _Node | None = None
        for node, k in walk:
            if k < len(node.edge):
                node = self._split(node, k)
            held = node.holders.get(ep, 0)
            if held:
                depth = pos + k
            node.holders[ep] = held + 1
            node._eps = None
            pos += k
            parent = node
        tail = parent
        if pos < n:
            tail = _Node(hashes[pos:] if pos else hashes, parent, {ep: 1})
            key = int(hashes[pos])
            if parent is None:
                self._roots[key] = tail
            else:
                parent.children[key] = tail
        self.chains += 1
        return tail, n - depth

    def release(self, ep: int, tail: _Node | None) -> int:
        """Drop one chain (its tail node from ``add``) of ``ep``; returns how many blocks are
        no longer active on ``ep``."""
        if tail is None:
            return 0
        freed = 0
        node: _Node | None = tail
        while node is not None:
            held = node.holders.get(ep, 0) - 1
            if held > 0:
                node.holders[ep] = held
            else:
                node.holders.pop(ep, None)
                freed += len(node.edge)
            node._eps = None
            parent = node.parent
            if not node.holders:  # no chain passes here any more: unlink it
                siblings = self._roots if parent is None else parent.children
                key = int(node.edge[0])
                if siblings.get(key) is node:
                    del siblings[key]
            node = parent
        self.chains -= 1
        return freed

    def _split(self, node: _Node, k: int) -> _Node:
        """Cut ``node`` after its first ``k`` hashes; returns the new upper part (same holders).
        The lower part keeps its identity, so tails held by requests stay valid."""
        upper = _Node(node.edge[:k], node.parent, dict(node.holders))
        key = int(node.edge[0])
        siblings = self._roots if node.parent is None else node.parent.children
        siblings[key] = upper
        node.edge = node.edge[k:]
        node.parent = upper
        upper.children[int(node.edge[0])] = node
        return upper

    def nodes(self) -> int:
        """Number of trie nodes (introspection, tests)."""
        count, stack = 0, list(self._roots.values())
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count
