"""Scheduler with a prompt cache, on plain data: cached starts, shared-prefix followers, one ceiling."""

from mlxb.engine.scheduler import Scheduler, common_prefix
from mlxb.request import Request


def test_cached_start_skips_the_cached_prefix_and_counts_it():
    s = Scheduler(max_batch=4, prefill_chunk=100, prefix_lookup=lambda r: 30)
    r = Request("a", list(range(50)), 4)
    s.add(r)
    out = s.schedule()
    ch = out.prefills[0]
    assert (ch.start, ch.end, ch.is_last) == (30, 49, True) and r.cached_tokens == 30


def test_lookup_is_capped_below_the_last_token_and_opt_out_skips_it():
    s = Scheduler(max_batch=4, prefill_chunk=100, prefix_lookup=lambda r: 10_000)
    a = Request("a", list(range(50)), 4)
    b = Request("b", list(range(100, 150)), 4, cache_prompt=False)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [(c.request_id, c.start) for c in out.prefills] == [("a", 49), ("b", 0)]
    assert b.cached_tokens == 0


def test_burst_sharing_a_prefix_prefills_it_once():
    shared = list(range(1000, 1040))
    s = Scheduler(max_batch=4, prefill_chunk=200, prefix_lookup=lambda r: 0, min_shared=32)
    rows = [Request(f"r{i}", shared + [i, i + 1, i + 2], 4) for i in range(3)]
    for r in rows:
        s.add(r)
    out = s.schedule()
    got = [(c.request_id, c.start, c.end, c.is_last, c.shared) for c in out.prefills]
    # the leader's chunk is split at the shared length; followers start there
    assert got == [("r0", 0, 40, False, True), ("r0", 40, 42, True, False),
                   ("r1", 40, 42, True, False), ("r2", 40, 42, True, False)]
    # the followers' suffixes run as one cohort, after the leader's snapshot
    assert [c.request_id for c in out.cohort] == ["r1", "r2"] and [r.cached_tokens for r in rows] == [0, 40, 40]
    assert s.num_shared == 2


def test_short_common_prefix_keeps_the_cohort():
    s = Scheduler(max_batch=4, prefill_chunk=200, prefix_lookup=lambda r: 0, min_shared=32)
    for i in range(2):
        s.add(Request(f"r{i}", [7, 7, 7] + [i] * 20, 4))  # a 3-token template header in common
    out = s.schedule()
    assert len(out.cohort) == 2 and all(c.start == 0 for c in out.prefills)


def test_cache_bytes_give_way_to_a_live_row_before_it_waits():
    held = {"bytes": 900}

    def evict(n):
        freed = min(n, held["bytes"])
        held["bytes"] -= freed
        return freed

    s = Scheduler(max_batch=4, prefill_chunk=100, kv_budget=1000, row_bytes=lambda n: 10 * n,
                  cache_bytes=lambda: held["bytes"], evict_cache=evict)
    s.add(Request("a", list(range(20)), 10))  # 300 projected bytes
    assert s.has_work() and held["bytes"] == 900  # asking does not evict
    out = s.schedule()
    assert out.admitted == ["a"] and held["bytes"] == 700  # exactly the overflow was evicted
    s.add(Request("b", list(range(60)), 10))  # 700 more: live rows 1000, cache must go to 0
    out = s.schedule()
    assert out.admitted == ["b"] and held["bytes"] == 0
    s.add(Request("c", list(range(5)), 1))  # no room even with an empty cache: it waits
    assert s.schedule().admitted == []


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4], 10) == 2
    assert common_prefix([1, 2, 3], [1, 2, 3], 2) == 2
    assert common_prefix([], [1], 5) == 0


def test_common_prefix_bisection_equals_a_token_walk():
    import random

    rng = random.Random(7)
    for _ in range(3000):
        a = [rng.randint(0, 2) for _ in range(rng.randint(0, 40))]
        b = a[:rng.randint(0, len(a))] + [rng.randint(0, 2) for _ in range(rng.randint(0, 6))]
        limit = rng.randint(0, 50)
        n, i = min(limit, len(a), len(b)), 0
        while i < n and a[i] == b[i]:
            i += 1
        assert common_prefix(a, b, limit) == i, (a, b, limit)


def test_cached_rows_form_a_cohort_and_a_lone_joiner_restarts_it():
    from mlxb.engine.outputs import PrefillChunk as C, SchedulerOutput

    out = SchedulerOutput(prefills=[C("a", 10, 20, True, first=True), C("b", 0, 30, True, first=True)])
    assert [c.request_id for c in out.cohort] == ["a", "b"]  # different cached starts: one left-padded batch
    out = SchedulerOutput(prefills=[C("a", 10, 20, True, first=True), C("x", 64, 70, True),  # x continues alone
                                    C("b", 0, 30, True, first=True), C("c", 5, 9, True, first=True)])
    assert [c.request_id for c in out.cohort] == ["b", "c"]
    out = SchedulerOutput(prefills=[C("b", 0, 30, True, first=True), C("c", 0, 20, False, first=True)])
    assert out.cohort == []  # c is still prefilling: b joins alone
