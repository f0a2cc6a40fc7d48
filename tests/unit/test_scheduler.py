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
    """Fake runner: run the scheduled prefill to its end and join the row."""
    while True:
        out = s.schedule()
        assert out.prefill is not None
        s.on_prefill_chunk(out.prefill)
        if out.prefill.is_last:
            s.on_joined(out.prefill.request_id)
            return out.prefill.request_id


def test_scheduler_imports_no_mlx():
    code = "import sys, mlxb.engine.scheduler, mlxb.engine.outputs, mlxb.request; print('mlx' in sys.modules or any(m.startswith('mlx.') for m in sys.modules))"
    assert subprocess.check_output([sys.executable, "-c", code], text=True).strip() == "False"


def test_fifo_and_cap():
    s = Scheduler(max_batch=2, prefill_chunk=100)
    for i in range(4):
        s.add(req(f"r{i}"))
    assert drive_prefill(s) == "r0"
    assert drive_prefill(s) == "r1"
    out = s.schedule()
    assert out.prefill is None and out.decode  # cap reached: r2 waits
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
        chunks.append((out.prefill.start, out.prefill.end, out.prefill.is_last))
        s.on_prefill_chunk(out.prefill)
        if out.prefill.is_last:
            s.on_joined("b")
            break
    assert chunks == [(0, 4, False), (4, 8, False), (8, 9, True)]  # position 9 is held back


def test_one_token_prompt_has_empty_last_chunk():
    s = Scheduler()
    s.add(req("a", n_prompt=1))
    out = s.schedule()
    assert (out.prefill.start, out.prefill.end, out.prefill.is_last) == (0, 0, True)


def test_context_limit_rejects_with_numbers():
    s = Scheduler(context_limit=100)
    with pytest.raises(ContextLimitError, match="90.*20.*110.*100"):
        s.add(req("a", n_prompt=90, max_tokens=20))
    s.add(req("b", n_prompt=80, max_tokens=20))


def test_budget_wait_vs_reject():
    s = Scheduler(max_batch=8, kv_budget=250, row_bytes=lambda n: n * 10)
    with pytest.raises(KVBudgetError, match="raise --kv-budget to at least 300"):
        s.add(req("big", n_prompt=20, max_tokens=10))
    s.add(req("a", n_prompt=10, max_tokens=5))  # 150 bytes
    s.add(req("b", n_prompt=5, max_tokens=5))  # 100 bytes -> 250 fits
    s.add(req("c", n_prompt=1, max_tokens=1))  # 20 bytes -> waits
    drive_prefill(s)
    drive_prefill(s)
    assert s.used_bytes == 250
    out = s.schedule()
    assert out.prefill is None and [r.request_id for r in s.waiting] == ["c"]
    s.on_finished("a", RequestStatus.FINISHED_STOPPED)
    assert drive_prefill(s) == "c"


def test_serial_waiter_drains_batch():
    s = Scheduler(max_batch=4)
    s.add(req("a"))
    drive_prefill(s)
    s.add(req("b"))
    s.hold_admission = True  # a serial request is waiting
    out = s.schedule()
    assert out.prefill is None and out.decode
    assert not s.is_idle
    s.on_finished("a", RequestStatus.FINISHED_LENGTH)
    assert s.is_idle  # the serial request may run now
    s.hold_admission = False
    assert drive_prefill(s) == "b"  # admission resumes: nobody starves


def test_cancel_pending_and_running():
    s = Scheduler(max_batch=4)
    for r in ("a", "b", "c"):
        s.add(req(r))
    drive_prefill(s)
    assert s.on_finished("c", RequestStatus.FINISHED_ABORTED).status == RequestStatus.FINISHED_ABORTED
    assert s.on_finished("a", RequestStatus.FINISHED_ABORTED) is not None
    assert s.running == [] and [r.request_id for r in s.waiting] == ["b"]
    assert s.on_finished("zzz", RequestStatus.FINISHED_ABORTED) is None


def test_containment_fail_all_running_keeps_queue():
    s = Scheduler(max_batch=4)
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
    assert s.prefilling is None and s.is_idle and not s.has_work()
