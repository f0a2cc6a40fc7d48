"""Scheduler decisions on plain data, with a scripted fake runner (no MLX anywhere)."""

import subprocess
import sys

import pytest

from mlxb.engine.scheduler import Scheduler
from mlxb.errors import ContextLimitError, KVBudgetError
from mlxb.request import Request, RequestStatus


def req(rid, n_prompt=10, max_tokens=5):
    return Request(rid, list(range(1, n_prompt + 1)), max_tokens)


def drive_prefill(s):
    """Fake runner: run the scheduled prefill to its end and join the row (tests that use it set
    ``prefill_burst`` to the chunk, so an idle iteration admits one joiner as a busy one does)."""
    while True:
        out = s.schedule()
        assert len(out.prefills) == 1
        ch = out.prefills[0]
        s.on_prefill_chunk(ch)
        if ch.is_last:
            s.on_joined(ch.request_id)
            return ch.request_id


def test_scheduler_imports_no_mlx():
    code = "import sys, mlxb.engine.scheduler, mlxb.engine.outputs, mlxb.request; print('mlx' in sys.modules or any(m.startswith('mlx.') for m in sys.modules))"
    assert subprocess.check_output([sys.executable, "-c", code], text=True).strip() == "False"


def test_fifo_and_cap():
    s = Scheduler(max_batch=2, prefill_chunk=10, prefill_burst=10)
    for i in range(4):
        s.add(req(f"r{i}"))
    assert drive_prefill(s) == "r0"
    assert drive_prefill(s) == "r1"
    out = s.schedule()
    assert not out.prefills and out.decode  # cap reached: r2 waits
    assert [r.request_id for r in s.waiting] == ["r2", "r3"]
    s.on_finished("r0", RequestStatus.FINISHED_LENGTH)
    assert drive_prefill(s) == "r2"  # FIFO head, never reordered
    assert [r.request_id for r in s.running] == ["r1", "r2"]


def test_chunked_prefill_holds_back_last_token_and_interleaves_decode():
    s = Scheduler(max_batch=4, prefill_chunk=4)
    s.add(req("a", n_prompt=3))
    drive_prefill(s)
    s.add(req("b", n_prompt=10))
    chunks = []
    while True:
        out = s.schedule()
        assert out.decode  # running row "a" steps every iteration: stalls at most one chunk
        (ch,) = out.prefills
        chunks.append((ch.start, ch.end, ch.is_last))
        s.on_prefill_chunk(ch)
        if ch.is_last:
            s.on_joined("b")
            break
    assert chunks == [(0, 4, False), (4, 8, False), (8, 9, True)]  # position 9 is held back


def test_one_token_prompt_has_empty_last_chunk():
    s = Scheduler()
    s.add(req("a", n_prompt=1))
    (ch,) = s.schedule().prefills
    assert (ch.start, ch.end, ch.is_last) == (0, 0, True)


def test_context_limit_rejects_with_numbers():
    s = Scheduler(context_limit=100)
    with pytest.raises(ContextLimitError, match="90.*20.*110.*100"):
        s.add(req("a", n_prompt=90, max_tokens=20))
    s.add(req("b", n_prompt=80, max_tokens=20))


def test_budget_wait_vs_reject():
    s = Scheduler(max_batch=8, prefill_chunk=10, prefill_burst=10, kv_budget=250, row_bytes=lambda n: n * 10)
    with pytest.raises(KVBudgetError, match="raise --kv-budget to at least 300"):
        s.add(req("big", n_prompt=20, max_tokens=10))
    s.add(req("a", n_prompt=10, max_tokens=5))  # 150 bytes
    s.add(req("b", n_prompt=5, max_tokens=5))  # 100 bytes -> 250 fits
    s.add(req("c", n_prompt=1, max_tokens=1))  # 20 bytes -> waits
    drive_prefill(s)
    drive_prefill(s)
    assert s.used_bytes == 250
    out = s.schedule()
    assert not out.prefills and [r.request_id for r in s.waiting] == ["c"]
    s.on_finished("a", RequestStatus.FINISHED_STOPPED)
    assert drive_prefill(s) == "c"


def test_serial_waiter_drains_batch():
    s = Scheduler(max_batch=4)
    s.add(req("a"))
    drive_prefill(s)
    s.add(req("b"))
    s.hold_admission = True  # a serial request is waiting
    out = s.schedule()
    assert not out.prefills and out.decode
    assert not s.is_idle
    s.on_finished("a", RequestStatus.FINISHED_LENGTH)
    assert s.is_idle  # the serial request may run now
    s.hold_admission = False
    assert drive_prefill(s) == "b"  # admission resumes: nobody starves


def test_cancel_pending_and_running():
    s = Scheduler(max_batch=4, prefill_chunk=10, prefill_burst=10)
    for r in ("a", "b", "c"):
        s.add(req(r))
    drive_prefill(s)
    assert s.on_finished("c", RequestStatus.FINISHED_ABORTED).status == RequestStatus.FINISHED_ABORTED
    assert s.on_finished("a", RequestStatus.FINISHED_ABORTED) is not None
    assert s.running == [] and [r.request_id for r in s.waiting] == ["b"]
    assert s.on_finished("zzz", RequestStatus.FINISHED_ABORTED) is None


def test_containment_fail_all_running_keeps_queue():
    s = Scheduler(max_batch=4, prefill_chunk=10, prefill_burst=10)
    for r in ("a", "b", "c"):
        s.add(req(r))
    drive_prefill(s)
    drive_prefill(s)
    failed = s.fail_all_running()
    assert {r.request_id for r in failed} == {"a", "b"}
    assert all(r.status == RequestStatus.FINISHED_ERROR for r in failed)
    assert drive_prefill(s) == "c"  # the engine keeps serving


def test_cancel_while_prefilling():
    s = Scheduler(prefill_chunk=2)
    s.add(req("a", n_prompt=10))
    s.schedule()
    s.on_finished("a", RequestStatus.FINISHED_ABORTED)
    assert s.prefilling == [] and s.is_idle and not s.has_work()


def test_burst_of_short_joiners_shares_one_chunk_budget():
    s = Scheduler(max_batch=3, prefill_chunk=25, prefill_burst=25)  # no idle burst
    for i in range(5):
        s.add(req(f"r{i}", n_prompt=10))
    out = s.schedule()
    # 10 + 10 tokens (9 prefill + the held-back L=1 step each) then 5 of r2: 25 in all
    assert [(c.request_id, c.start, c.end, c.is_last) for c in out.prefills] == [
        ("r0", 0, 9, True), ("r1", 0, 9, True), ("r2", 0, 5, False)]
    assert out.admitted == ["r0", "r1", "r2"] and not out.decode
    for c in out.prefills:
        s.on_prefill_chunk(c)
        if c.is_last:
            s.on_joined(c.request_id)
    out = s.schedule()  # cap 3: r3 is not admitted while r2 is still prefilling
    assert [(c.request_id, c.start, c.end, c.is_last) for c in out.prefills] == [("r2", 5, 9, True)]
    assert out.decode and out.admitted == []


def test_idle_burst_takes_whole_prompts_past_one_chunk_but_never_a_longer_chunk():
    s = Scheduler(max_batch=8, prefill_chunk=25)  # default burst: 8 chunks = 200 tokens
    assert s.prefill_burst == 200
    for i in range(5):
        s.add(req(f"r{i}", n_prompt=10))
    s.add(req("long", n_prompt=60))
    out = s.schedule()
    # idle: five whole prompts (50 tokens) and then one chunk of the long prompt, capped at 25
    assert [(c.request_id, c.start, c.end, c.is_last) for c in out.prefills] == [
        (f"r{i}", 0, 9, True) for i in range(5)] + [("long", 0, 25, False)]
    for c in out.prefills:
        s.on_prefill_chunk(c)
        if c.is_last:
            s.on_joined(c.request_id)
    out = s.schedule()  # rows decode now: back to one chunk per iteration
    assert [(c.request_id, c.start, c.end, c.is_last) for c in out.prefills] == [("long", 25, 50, False)]
    assert out.decode


def test_idle_burst_never_applies_with_a_prefill_in_flight():
    s = Scheduler(max_batch=8, prefill_chunk=25)
    s.add(req("long", n_prompt=60))
    out = s.schedule()
    assert [(c.start, c.end) for c in out.prefills] == [(0, 25)]
    s.on_prefill_chunk(out.prefills[0])
    for i in range(3):
        s.add(req(f"r{i}", n_prompt=10))
    out = s.schedule()  # not idle (the long prompt is in flight): one chunk's budget for everyone
    assert [(c.request_id, c.start, c.end, c.is_last) for c in out.prefills] == [("long", 25, 50, False)]


def test_max_joiners_caps_admissions_per_iteration():
    s = Scheduler(max_batch=8, prefill_chunk=1000, max_joiners=2)
    for i in range(4):
        s.add(req(f"r{i}"))
    assert s.schedule().admitted == ["r0", "r1"]


def test_a_turn_boundary_prefills_a_chunk_per_running_rows_share_of_the_queue():
    """Issue 46: when more agents wait than decode, one iteration admits ceil(queued / running) chunks of them
    (at most a burst), not one chunk's worth; while the running rows outnumber the queue, one chunk."""
    from mlxb.engine.scheduler import iteration_budget

    assert iteration_budget(3, 4, 100, 800) == 100 and iteration_budget(4, 4, 100, 800) == 100
    assert iteration_budget(5, 4, 100, 800) == 200 and iteration_budget(12, 2, 100, 800) == 600
    assert iteration_budget(3, 1, 100, 800) == 100  # a short queue fits a chunk: the plain rule
    assert iteration_budget(31, 1, 100, 800) == 800 and iteration_budget(5, 0, 100, 800) == 100

    s = Scheduler(max_batch=16, prefill_chunk=20, prefill_burst=160)
    s.add(req("run", n_prompt=5))
    drive_prefill(s)  # one row decodes
    for i in range(6):
        s.add(req(f"t{i}", n_prompt=10))  # six turns arrive together: 9 body tokens + the held-back one each
    out = s.schedule()
    assert out.decode and [c.request_id for c in out.prefills] == [f"t{i}" for i in range(6)]  # 6 x 10 <= 6 chunks
    assert all(c.is_last for c in out.prefills)

    s = Scheduler(max_batch=16, prefill_chunk=20, prefill_burst=160)
    for name in ("a", "b", "c"):
        s.add(req(name, n_prompt=5))
        drive_prefill(s)
    for i in range(3):
        s.add(req(f"t{i}", n_prompt=10))
    assert [c.request_id for c in s.schedule().prefills] == ["t0", "t1"]  # 3 waiting, 3 running: one chunk (20)
