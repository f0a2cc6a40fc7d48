"""Delivery: turn sampled tokens into per-request output on the engine thread.

EOS and ``max_tokens``, stop strings (held back until they cannot match), the final output with
usage and timings, and eviction of a row whose consumer raised. The engine owns admission;
``finish`` is the one place a request leaves ``live``.

Text: a request with stop strings or an engine-thread callback is detokenized here (the engine
needs its text); any other request's text is made by its consumer (``OutputStream`` fills
``text=None`` records in), which keeps that work off the engine thread's critical path.
"""

from __future__ import annotations

import time
from typing import Optional

from mlxb.engine.runner import Emitted, Row
from mlxb.engine.stop import StopMatcher
from mlxb.engine.stream import OutputStream, Outbox
from mlxb.request import FINISH_REASON, Request, RequestOutput, RequestStatus


class Live:
    """Per-request delivery state kept on the engine thread."""

    def __init__(self, req: Request, stream: OutputStream, detok):
        self.req, self.stream, self.detok = req, stream, detok
        self.stop = StopMatcher(req.stop)
        self.cancelled = False
        self.row: Optional[Row] = None
        self.defer_text = not req.stop and req.on_output is None
        if self.defer_text:
            stream.detok = detok  # the consumer turns token ids into text


class Delivery:
    def __init__(self, eos_ids: set, counters: dict):
        self.eos_ids = eos_ids
        self.counters = counters
        self.live: dict[str, Live] = {}
        self.outbox: Optional[Outbox] = None  # set during an engine iteration: one wake-up per loop
        self.on_reply = None  # called with a chat row's generated ids when it ends on EOS or max_tokens

    def flush(self) -> None:
        if self.outbox is not None:
            self.outbox.flush()

    def deliver(self, em: Emitted) -> Optional[RequestStatus]:
        """Turn one sampled token into output; return a finished status if the row ends here."""
        live = self.live[em.row.req.request_id]
        req = live.req
        if req.timings.first_token is None:
            req.timings.first_token = time.perf_counter()
        self.counters["tokens"] += 1
        if em.token in self.eos_ids and (not req.ignore_eos or em.grammar_done):
            last = None
            if not live.defer_text:  # flush what the detokenizer and the stop matcher still hold
                live.detok.finalize()
                text, hit = live.stop.feed(live.detok.last_segment)
                last = RequestOutput(req.request_id, None, text if hit else text + live.stop.flush())
            return self.finish(live, RequestStatus.FINISHED_STOPPED, last=last)
        req.num_generated += 1
        if req.reply_ids is not None:
            req.reply_ids.append(em.token)
        status = RequestStatus.FINISHED_LENGTH if req.num_generated >= req.max_tokens else None
        if em.grammar_done:  # the grammar is complete: nothing may follow (ignore_eos included)
            status = RequestStatus.FINISHED_STOPPED
        text = None  # deferred: the consumer makes the text
        if not live.defer_text:
            live.detok.add_token(em.token)
            if status is not None:
                live.detok.finalize()
            text, hit = live.stop.feed(live.detok.last_segment)
            if hit:
                status = RequestStatus.FINISHED_STOPPED
            elif status is not None:
                text += live.stop.flush()
        out = RequestOutput(req.request_id, em.token, text, em.logprob)
        if status is not None:
            return self.finish(live, status, last=out)
        if not self.send(live, out):
            return self.finish(live, RequestStatus.FINISHED_ABORTED)
        return None

    def send(self, live: Live, out: RequestOutput) -> bool:
        live.stream.put(out, self.outbox)
        if live.req.on_output is not None:
            try:
                live.req.on_output(out)
            except Exception:  # a consumer that raises evicts only its own row
                return False
        return True

    def finish(self, live: Live, status: RequestStatus, last: Optional[RequestOutput] = None,
               error: Optional[Exception] = None) -> RequestStatus:
        req = live.req
        req.status = status
        req.timings.finished = time.perf_counter()
        if req.timings.first_token is None:
            req.timings.first_token = req.timings.finished
        out = last or RequestOutput(req.request_id, None, None if live.defer_text else "")
        out.finish_reason = FINISH_REASON[status]
        out.error = error
        out.stop_sequence = live.stop.hit
        out.usage = {
            "prompt_tokens": req.num_prompt_tokens,
            "completion_tokens": req.num_generated,
            "total_tokens": req.num_prompt_tokens + req.num_generated,
            "cached_tokens": req.cached_tokens,
        }
        if req.spec_drafted is not None:  # --spec: this row's drafts and how many the target kept
            out.usage["draft_tokens"], out.usage["accepted_tokens"] = req.spec_drafted, req.spec_accepted
        out.timings = req.timings.as_dict(req.num_generated)
        if (req.reply_ids and self.on_reply is not None and live.stop.hit is None
                and status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)):
            self.on_reply(req.reply_ids)
        self.send(live, out)
        self.live.pop(req.request_id, None)
        return status
