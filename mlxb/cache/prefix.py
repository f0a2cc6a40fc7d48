"""The prefix cache index: a radix trie of immutable KV snapshots with byte-accounted LRU eviction.

Pure Python (no mlx): an entry's ``layers`` are opaque to this module; the caller measures their
bytes. The same class indexes the RAM tier (layers are per-layer cache objects) and the SSD tier
(layers is a file path).

One trie per *namespace* (model fingerprint, dtype, KV scheme, adapter), so entries of different
models, precisions or adapters never meet. Entries are immutable once inserted; a row borrows a
prefix by copying (views) out of an entry, never by mutating it.

Reuse rule, decided per namespace when it is created:

* ``trimmable`` (every layer is full attention or latent): any entry whose key shares the first
  ``n`` tokens with the query serves ``n`` tokens (the borrower trims). A new key that is a prefix
  of a stored one is redundant and is not stored; stored keys that are prefixes of a new one are
  dropped.
* otherwise (a sliding-window ring or a recurrent state in some layer): an entry serves only its
  whole key, and only when that key is a prefix of the query (snapshots are exact).

Methods say what they mutate; ``check_integrity()`` verifies the byte count, the LRU order and
that every trie leaf leads to an entry.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional


@dataclass(eq=False)
class PrefixEntry:
    namespace: str
    tokens: tuple
    layers: Any  # per-layer caches (RAM) or a file path (SSD); never mutated after insert
    nbytes: int
    created: float = field(default_factory=time.monotonic)
    hits: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


class PrefixMatch(NamedTuple):
    entry: PrefixEntry
    num_tokens: int  # tokens of the query this entry serves (<= entry.num_tokens)


class _Node:
    """A radix trie node: the tokens on the edge from its parent (``edge``, empty at a root) and its children by
    their edge's first token. Every node but a root holds an entry or has two children or more, so a walk
    compares whole edges (slices, in C) instead of going token by token (a 2k-token agent turn took ~0.17 ms a
    lookup that way, three lookups a request across the tiers)."""

    __slots__ = ("children", "entry", "parent", "edge")

    def __init__(self, parent: Optional["_Node"] = None, edge: tuple = ()):
        self.children: dict[int, _Node] = {}
        self.entry: Optional[PrefixEntry] = None
        self.parent = parent
        self.edge = edge


def _agree(q: tuple, start: int, edge: tuple) -> int:
    """How many leading tokens of ``edge`` equal ``q[start:]``."""
    m = min(len(edge), len(q) - start)
    if m <= 0:
        return 0
    if q[start:start + m] == edge[:m]:
        return m
    lo, hi = 0, m  # q[start:start+lo] == edge[:lo], and not at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if q[start + lo:start + mid] == edge[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixCache:
    """Token-prefix trie of snapshots, capped by ``max_bytes`` (and optionally ``max_entries``).

    ``on_evict(entry)`` is called for every entry that leaves by eviction (the SSD tier spills it
    there); entries removed as redundant or by ``remove`` are not reported. ``on_remove(entry)`` is
    called for every entry that leaves the index, whatever the reason (``--tp`` frees the other
    ranks' copies).
    """

    on_remove: Optional[Callable[[PrefixEntry], None]] = None

    def __init__(self, max_bytes: int, max_entries: Optional[int] = None,
                 on_evict: Optional[Callable[[PrefixEntry], None]] = None):
        assert max_bytes >= 0
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.on_evict = on_evict
        self._roots: dict[str, _Node] = {}
        self._trimmable: dict[str, bool] = {}
        self._lru: OrderedDict[int, PrefixEntry] = OrderedDict()  # id(entry) -> entry, oldest first
        self._nodes: dict[int, _Node] = {}  # id(entry) -> its node
        self.total_bytes = 0
        self.num_evictions = 0

    # ---- namespaces --------------------------------------------------------------------------
    def add_namespace(self, namespace: str, trimmable: bool) -> None:
        """Declare a namespace's reuse rule (idempotent; the rule must not change)."""
        if namespace in self._trimmable:
            assert self._trimmable[namespace] == trimmable, namespace
            return
        self._trimmable[namespace] = trimmable
        self._roots[namespace] = _Node()

    def is_trimmable(self, namespace: str) -> bool:
        return self._trimmable[namespace]

    # ---- reads -------------------------------------------------------------------------------
    def match(self, namespace: str, tokens, limit: Optional[int] = None, touch: bool = True) -> Optional[PrefixMatch]:
        """Longest usable prefix of ``tokens[:limit]``; marks the entry recently used when ``touch``."""
        root = self._roots.get(namespace)
        if root is None:
            return None
        depth, best, below = self._walk(root, tokens, limit)
        if self._trimmable[namespace] and depth > 0 and (best is None or best.num_tokens < depth):
            best = PrefixMatch(self._entry_below(below), depth)
        if best is not None and touch:
            best.entry.hits += 1
            self._lru.move_to_end(id(best.entry))
        return best

    def shared_depth(self, namespace: str, tokens, limit: Optional[int] = None) -> int:
        """How many leading tokens of ``tokens[:limit]`` some stored key shares (whether or not an entry ends
        there); marks nothing used."""
        root = self._roots.get(namespace)
        return 0 if root is None else self._walk(root, tokens, limit)[0]

    @staticmethod
    def _walk(root: _Node, tokens, limit: Optional[int]) -> tuple[int, Optional[PrefixMatch], _Node]:
        """(tokens of ``tokens[:limit]`` on some stored key's path, the deepest entry whose whole key is among
        them, the node every entry below which shares them)."""
        n = len(tokens) if limit is None else min(limit, len(tokens))
        q = tuple(tokens[:n])
        node, depth, best = root, 0, None
        while depth < n:
            child = node.children.get(q[depth])
            if child is None:
                break
            k = _agree(q, depth, child.edge)
            depth += k
            if k < len(child.edge):  # the query leaves (or ends) inside this edge
                return depth, best, child
            node = child
            if child.entry is not None:
                best = PrefixMatch(child.entry, depth)
        return depth, best, node

    @staticmethod
    def _entry_below(node: _Node) -> PrefixEntry:
        # every node lies on the path of at least one stored key, so any child chain ends in one
        while node.entry is None:
            node = next(iter(node.children.values()))
        return node.entry

    def entries(self) -> list[PrefixEntry]:
        """Every entry, least recently used first."""
        return list(self._lru.values())

    @property
    def num_entries(self) -> int:
        return len(self._lru)

    # ---- writes ------------------------------------------------------------------------------
    def insert(self, namespace: str, tokens, layers: Any, nbytes: int) -> Optional[PrefixEntry]:
        """Store a snapshot of ``tokens``. Mutates the trie; may evict LRU entries to make room.

        Returns the stored entry, the existing entry that already covers ``tokens`` (trimmable
        namespaces), or None when the snapshot alone exceeds ``max_bytes`` (it is then handed to
        ``on_evict`` at once, so the SSD tier can still keep it)."""
        tokens = tuple(tokens)
        if not tokens:
            return None
        trimmable = self._trimmable[namespace]
        node, depth, L = self._roots[namespace], 0, len(tokens)
        on_path: list[PrefixEntry] = []
        while depth < L:
            child = node.children.get(tokens[depth])
            if child is None:  # the rest of the key is a new leaf
                leaf = _Node(node, tokens[depth:])
                node.children[tokens[depth]] = node = leaf
                break
            k = _agree(tokens, depth, child.edge)
            if k == len(child.edge):
                node, depth = child, depth + k
                if node.entry is not None:
                    on_path.append(node.entry)
                continue
            if depth + k == L and trimmable:  # a strict prefix of a stored key: already covered
                old = self._entry_below(child)
                self._lru.move_to_end(id(old))
                return old
            node, depth = self._split(child, k), depth + k
            if depth < L:
                leaf = _Node(node, tokens[depth:])
                node.children[tokens[depth]] = node = leaf
            break
        if node.entry is not None or (trimmable and node.children):
            old = node.entry or self._entry_below(node)  # already covered: keep the stored one
            self._lru.move_to_end(id(old))
            self._prune(node)
            return old
        entry = PrefixEntry(namespace, tokens, layers, int(nbytes))
        if entry.nbytes > self.max_bytes:
            self._prune(node)
            if self.on_evict is not None:
                self.num_evictions += 1
                self.on_evict(entry)
            return None
        node.entry = entry
        self._nodes[id(entry)] = node
        self._lru[id(entry)] = entry
        self.total_bytes += entry.nbytes
        if trimmable:  # shorter keys on this path are now redundant
            for e in on_path:
                self.remove(e)
        self._shrink(self.max_bytes, keep=entry)
        return entry

    @staticmethod
    def _split(child: _Node, k: int) -> _Node:
        """A new node ``k`` tokens into ``child``'s edge, between it and its parent; returns it."""
        parent, edge = child.parent, child.edge
        mid = _Node(parent, edge[:k])
        parent.children[edge[0]] = mid
        child.edge, child.parent = edge[k:], mid
        mid.children[child.edge[0]] = child
        return mid

    def __contains__(self, entry: PrefixEntry) -> bool:
        return id(entry) in self._nodes and self._lru.get(id(entry)) is entry

    def remove(self, entry: PrefixEntry) -> bool:
        """Drop ``entry`` from the index (not reported to ``on_evict``). Returns False if absent."""
        node = self._nodes.pop(id(entry), None)
        if node is None:
            return False
        del self._lru[id(entry)]
        self.total_bytes -= entry.nbytes
        node.entry = None
        self._prune(node)
        if self.on_remove is not None:
            self.on_remove(entry)
        return True

    def evict(self, num_bytes: int) -> int:
        """Evict least recently used entries until at least ``num_bytes`` are freed (or none is
        left). Mutates the trie; reports each to ``on_evict``. Returns the bytes freed."""
        target = max(0, self.total_bytes - num_bytes)
        before = self.total_bytes
        self._shrink(target)
        return before - self.total_bytes

    def clear(self) -> int:
        return self.evict(self.total_bytes)

    def _shrink(self, max_bytes: int, keep: Optional[PrefixEntry] = None) -> None:
        while self._lru and (self.total_bytes > max_bytes or
                             (self.max_entries is not None and len(self._lru) > self.max_entries)):
            victim = next(iter(self._lru.values()))
            if victim is keep:
                if len(self._lru) == 1:
                    break
                self._lru.move_to_end(id(keep))
                continue
            self.remove(victim)
            self.num_evictions += 1
            if self.on_evict is not None:
                self.on_evict(victim)

    @staticmethod
    def _prune(node: _Node) -> None:
        """Drop ``node`` if it holds nothing, and merge a node left with no entry and one child into that child."""
        while node.parent is not None and node.entry is None:
            if not node.children:
                parent = node.parent
                del parent.children[node.edge[0]]
                node = parent
                continue
            if len(node.children) == 1:
                (child,) = node.children.values()
                child.edge, child.parent = node.edge + child.edge, node.parent
                node.parent.children[node.edge[0]] = child
            return

    # ---- checks ------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError if the byte count, the LRU index or the trie disagree."""
        assert self.total_bytes == sum(e.nbytes for e in self._lru.values()), "byte count drifted"
        assert self.total_bytes <= self.max_bytes or len(self._lru) <= 1, "over the byte cap"
        seen = 0
        for ns, root in self._roots.items():
            stack = [(root, ())]
            while stack:
                node, path = stack.pop()
                if node is not root:
                    assert node.entry is not None or node.children, f"dangling trie node in {ns}"
                    assert node.entry is not None or len(node.children) > 1, f"unmerged trie node in {ns}"
                if node.entry is not None:
                    seen += 1
                    assert node.entry.tokens == path and node.entry.namespace == ns
                    assert self._nodes.get(id(node.entry)) is node
                for t, child in node.children.items():
                    assert child.parent is node and child.edge and child.edge[0] == t
                    stack.append((child, path + child.edge))
        assert seen == len(self._lru) == len(self._nodes), "trie and LRU disagree"
