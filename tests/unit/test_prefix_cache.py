"""The prefix trie (no mlx): lookup rules per namespace, byte-accounted LRU eviction, integrity."""

import pytest

from mlxb.cache.prefix import PrefixCache


def cache(max_bytes=1000, trimmable=True, **kw):
    c = PrefixCache(max_bytes, **kw)
    c.add_namespace("m", trimmable)
    return c


def test_trimmable_namespace_serves_any_common_prefix_and_drops_redundant_keys():
    c = cache()
    a = c.insert("m", [1, 2, 3, 4, 5], "A", 50)
    m = c.match("m", [1, 2, 3, 9, 9], limit=4)
    assert m.entry is a and m.num_tokens == 3
    assert c.match("m", [1, 2, 3, 4, 5, 6, 7], limit=6).num_tokens == 5
    assert c.match("m", [1, 2, 3, 4, 5, 6], limit=2).num_tokens == 2  # the limit caps reuse
    assert c.insert("m", [1, 2, 3], "B", 30) is a  # a prefix of a stored key is already covered
    b = c.insert("m", [1, 2, 3, 4, 5, 6, 7], "C", 70)  # extends A: A is now redundant
    assert c.entries() == [b] and c.total_bytes == 70
    assert c.match("m", [2, 1]) is None
    c.check_integrity()


def test_exact_namespace_serves_only_whole_stored_keys_that_prefix_the_query():
    c = cache(trimmable=False)
    a = c.insert("m", [1, 2, 3, 4, 5], "A", 50)
    assert c.match("m", [1, 2, 3, 9, 9]) is None  # a ring or a state cannot be trimmed to 3
    b = c.insert("m", [1, 2, 3], "B", 30)  # kept next to A: different exact lengths
    assert c.match("m", [1, 2, 3, 9]).entry is b
    m = c.match("m", [1, 2, 3, 4, 5, 6], limit=5)
    assert m.entry is a and m.num_tokens == 5
    assert c.match("m", [1, 2, 3, 4, 5, 6], limit=4).entry is b
    assert c.num_entries == 2 and c.total_bytes == 80
    c.check_integrity()


def test_namespaces_never_share():
    c = cache()
    c.add_namespace("other", True)
    c.insert("m", [1, 2, 3], "A", 10)
    assert c.match("other", [1, 2, 3, 4]) is None
    assert c.match("missing", [1, 2, 3, 4]) is None


def test_lru_eviction_is_byte_accounted_and_reported():
    gone = []
    c = cache(max_bytes=100, on_evict=gone.append)
    a = c.insert("m", [1, 1], "A", 40)
    b = c.insert("m", [2, 2], "B", 40)
    c.match("m", [1, 1, 5])  # A is now the most recently used
    d = c.insert("m", [3, 3], "D", 40)  # over 100: B (least recently used) leaves
    assert gone == [b] and c.entries() == [a, d] and c.total_bytes == 80 and c.num_evictions == 1
    assert c.evict(1) == 40 and gone[-1] is a  # frees at least what was asked
    assert c.evict(10_000) == 40 and c.total_bytes == 0 and c.num_entries == 0
    c.check_integrity()


def test_oversized_entry_goes_straight_to_on_evict_and_count_cap_holds():
    gone = []
    c = cache(max_bytes=100, max_entries=2, on_evict=gone.append)
    assert c.insert("m", [9], "BIG", 101) is None and gone[0].layers == "BIG"
    for i in range(4):
        c.insert("m", [i, i], str(i), 1)
    assert c.num_entries == 2 and [e.layers for e in c.entries()] == ["2", "3"]
    c.check_integrity()


def test_remove_prunes_the_trie_and_integrity_catches_drift():
    c = cache()
    a = c.insert("m", [1, 2, 3], "A", 10)
    c.insert("m", [1, 5], "B", 10)
    assert c.remove(a) and not c.remove(a)
    assert c.match("m", [1, 2, 3, 4]).num_tokens == 1  # only the shared first token is left
    c.check_integrity()
    c.total_bytes += 1
    with pytest.raises(AssertionError, match="byte count"):
        c.check_integrity()


@pytest.mark.parametrize("trimmable", [True, False])
def test_random_operations_agree_with_a_brute_force_model(trimmable):
    """The radix trie against the rules stated over the set of stored keys, on random keys over a small alphabet
    (so keys share, split and end inside each other's edges); the structure is checked after every operation."""
    import random

    rnd = random.Random(7 + trimmable)
    c = cache(max_bytes=10**9, trimmable=trimmable)
    stored: dict[tuple, object] = {}  # key -> entry

    def lcp(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    def key(lo=1, hi=9):
        return tuple(rnd.randrange(3) for _ in range(rnd.randint(lo, hi)))

    for step in range(3000):
        op = rnd.random()
        if op < 0.4:
            k = key()
            got = c.insert("m", list(k), step, 1)
            covering = [e for kk, e in stored.items() if kk[:len(k)] == k] if trimmable else [stored.get(k)] * (k in stored)
            if covering:
                assert got in covering and got.tokens[:len(k)] == k  # already covered: no new entry
            else:
                assert got.tokens == k
                if trimmable:  # stored keys that are prefixes of the new one leave
                    stored = {kk: e for kk, e in stored.items() if k[:len(kk)] != kk}
                stored[k] = got
        elif op < 0.5 and stored:
            k = rnd.choice(sorted(stored))
            assert c.remove(stored.pop(k))
        else:
            q, limit = key(0, 12), rnd.choice([None, rnd.randint(0, 12)])
            qq = q if limit is None else q[:limit]
            depth = max((lcp(qq, kk) for kk in stored), default=0)
            assert c.shared_depth("m", list(q), limit) == depth
            m = c.match("m", list(q), limit)
            if trimmable:
                assert (m is None) == (depth == 0)
                if m is not None:
                    assert m.num_tokens == depth and lcp(m.entry.tokens, qq) >= depth and m.entry.tokens in stored
            else:
                whole = [kk for kk in stored if qq[:len(kk)] == kk]
                if not whole:
                    assert m is None
                else:
                    assert m.entry is stored[max(whole, key=len)] and m.num_tokens == len(max(whole, key=len))
        assert {e.tokens for e in c.entries()} == set(stored)
        c.check_integrity()
