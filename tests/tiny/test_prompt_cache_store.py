"""What the engine stores in and restores from the prompt cache around a step: rows that end together stored in
one evaluation, and the SSD tier's files checked ahead of admission after a restart."""

from mlxb.cache.prompt_cache import PromptCache
from mlxb.engine.engine import Engine
from mlxb.engine.stream import OutputStream
from mlxb.request import Request
from tests.tiny.test_prompt_cache_engine import serve


def test_after_a_restart_arriving_requests_have_their_ssd_files_checked_ahead(tiny_models, tmp_path):
    """Submitting a request whose prefix is only on the SSD tier queues that file's checksum on the reader
    thread (``Engine.submit``); the restored rows give the same tokens as without the cache."""
    model, tok, *_ = tiny_models("tiny-llama")
    plain, _ = serve(model, tok, 3, cache=False)
    first, eng = serve(model, tok, 3, cache=True, tmp_path=tmp_path)
    eng.reuse.cache.close()  # graceful shutdown: RAM entries written to disk
    again, eng2 = serve(model, tok, 3, cache=True, tmp_path=tmp_path)
    disk = eng2.reuse.cache.disk
    assert [t for t, _ in again] == [t for t, _ in plain] == [t for t, _ in first]
    assert disk.counters["prefetched"] >= 1 and disk.counters["restores"] >= 1
    assert again[0][1] > 0  # the first request after the restart already starts from the disk
    eng2.reuse.cache.close()


def test_rows_ending_on_one_step_are_stored_together(tiny_models):
    """Rows that finish on the same step go into the prompt cache in one ``put_many`` (one evaluation of
    their snapshots), not one evaluation per row (an H100 step retiring 15 agents spent 124 ms that way)."""
    model, tok, *_ = tiny_models("tiny-llama")
    eng = Engine(model, tok, max_batch=4)
    pc = PromptCache(model, eng.kinds, max_bytes=1 << 30)
    eng.attach_prompt_cache(pc)
    calls, real = [], pc.put_many
    pc.put_many = lambda items, **k: calls.append(len(items)) or real(items, **k)
    reqs = [Request(f"r{i}", list(range(100 * i + 5, 100 * i + 45)), 6, ignore_eos=True) for i in range(3)]
    streams = [OutputStream(r.request_id) for r in reqs]
    for r, st in zip(reqs, streams):  # handed in before the thread starts: admitted together, so they end together
        r.mechanism = "continuous"
        eng.accept(r, st)
    eng.start()
    try:
        outs = [list(st) for st in streams]
    finally:
        eng.shutdown()
    assert all(o[-1].error is None for o in outs)
    assert 3 in calls and len(pc.ram.entries()) == 3  # the three rows, stored by one call
