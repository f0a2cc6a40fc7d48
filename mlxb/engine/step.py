"""One iteration's decode step on the engine thread, and the retirement of the rows it finished: their tokens
delivered, finished rows stored in the prompt cache and filtered out, the scheduler told. A function of the engine
(``eng``), as ``mlxb.engine.prefill``'s are; it runs inside an iteration under the device lock."""

from __future__ import annotations

import time

from mlxb.errors import EngineFailure
from mlxb.request import RequestStatus


def decode_and_retire(eng) -> None:
    """Decode the running rows one step (a verify step where speculation drafts) and retire what finished."""
    s, r = eng.scheduler, eng.runner
    if r.capture is not None:  # parity drivers compare this with the plan; not on the serving path
        eng.last_forward = [row.req.request_id for row in r.rows]
    try:
        emitted = r.decode_step()
        eng.trace.mark("decode")
    except Exception as e:  # cannot be attributed to a row: the whole batch fails
        failed = [row.req.request_id for row in r.rows]
        r.drop_all()
        for rid in failed:
            s.on_finished(rid, RequestStatus.FINISHED_ERROR)
            eng.delivery.finish(eng._live[rid], RequestStatus.FINISHED_ERROR, error=EngineFailure(f"decode step failed: {e}"))
        eng.reuse.after_device_error(e, whole=True)
        eng.device_health.failed(e)
        return
    eng.device_health.ok()
    eng.counters["steps"] += 1
    if len(r.rows) > 1:
        eng.counters["batched_steps"] += 1
    t_deliver = time.perf_counter()
    done: dict[str, RequestStatus] = {}
    for em in emitted:
        if em.row.req.request_id in done:  # a verify step's tokens after the row's last one
            continue
        status = eng.delivery.deliver(em)
        if status is not None:
            done[em.row.req.request_id] = status
    if done:
        # the finished rows' last outputs leave now, before their caches are stored (tens of ms for a turn's
        # rows on a GPU): an agent sends its next turn that much sooner
        eng.delivery.flush()
        keep = [i for i, row in enumerate(r.rows) if row.req.request_id not in done]
        gone = [i for i, row in enumerate(r.rows) if eng.reuse.keeps(row.req, done.get(row.req.request_id))]
        if gone:
            eng.reuse.put_finished_many([(row.req.prompt_ids + row.tokens, layers, fed, row.req.adapter)
                                         for row, layers, fed in r.extract_rows(gone)])
        r.filter(keep)
        for rid, status in done.items():
            s.on_finished(rid, status)
        eng.trace.mark("retire")
    r.timing["deliver_s"] += time.perf_counter() - t_deliver
