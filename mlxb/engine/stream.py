"""A one-producer stream of RequestOutput records, consumable from a thread or an asyncio loop.

Two things keep per-token work off the engine thread (whose Python time is on the decode
critical path):

* **Consumer-side text.** For a request whose text the engine does not need (no stop strings,
  no engine-thread callback), the engine sends token ids with ``text=None`` and hands the
  request's streaming detokenizer to the stream; the consumer's iterator fills ``text`` in. The
  engine thread spends most of a step inside MLX with the GIL released, so this work overlaps it.
* **One wake-up per loop per iteration.** Outputs for asyncio consumers are collected in an
  ``Outbox`` during an engine iteration and handed to each event loop with a single
  ``call_soon_threadsafe`` (one self-pipe write) instead of one per token. Where a slow part of the
  iteration would hold outputs that are ready (joiners' first tokens before the decode step, finished
  rows' last outputs before their caches are stored) the engine flushes early: at most three a loop.
"""

from __future__ import annotations

import asyncio
import queue
from collections import defaultdict
from typing import Optional

from mlxb.request import RequestOutput

_END = object()


class OutputStream:
    """The engine thread ``put``s; a consumer iterates (blocking) or ``async for``s (never blocks the loop)."""

    def __init__(self, request_id: str, loop: Optional[asyncio.AbstractEventLoop] = None):
        self.request_id = request_id
        self._loop = loop
        self._aq: Optional[asyncio.Queue] = asyncio.Queue() if loop is not None else None
        self._q: queue.Queue = queue.Queue()
        self.closed = False
        self.detok = None  # set by the engine when the consumer side turns tokens into text

    def put(self, item: RequestOutput, outbox: Optional["Outbox"] = None) -> None:
        self._push(item, outbox)
        if item.finish_reason is not None:
            self._push(_END, outbox)

    def _push(self, item, outbox: Optional["Outbox"]) -> None:
        if self._aq is None:
            self._q.put(item)
        elif outbox is not None:
            outbox.add(self._loop, self._aq, item)
        else:
            try:
                self._loop.call_soon_threadsafe(self._aq.put_nowait, item)
            except RuntimeError:  # loop closed: the consumer is gone
                pass

    def _text(self, item: RequestOutput) -> RequestOutput:
        if item.text is None:
            d = self.detok
            if item.token is not None:
                d.add_token(item.token)
            if item.finish_reason is not None:
                d.finalize()
            item.text = d.last_segment
        return item

    def __iter__(self):
        while True:
            try:
                # NOTE: a bounded wait: a SIGINT/SIGTERM that Linux delivers to another thread only sets
                # Python's flag, and a main thread blocked without a timeout would never run its handler
                item = self._q.get(timeout=0.2)
            except queue.Empty:
                continue
            if item is _END:
                return
            yield self._text(item)

    def __aiter__(self):
        return self._agen()

    async def _agen(self):
        assert self._aq is not None, "create the stream with loop= to consume it asynchronously"
        while True:
            item = await self._aq.get()
            if item is _END:
                return
            yield self._text(item)


def _put_many(items: list) -> None:
    for aq, item in items:
        aq.put_nowait(item)


class Outbox:
    """Outputs for asyncio consumers, collected during one engine iteration and flushed per loop."""

    def __init__(self):
        self._by_loop: dict = defaultdict(list)

    def add(self, loop, aq, item) -> None:
        self._by_loop[loop].append((aq, item))

    def flush(self) -> None:
        if not self._by_loop:
            return
        pending, self._by_loop = self._by_loop, defaultdict(list)
        for loop, items in pending.items():
            try:
                loop.call_soon_threadsafe(_put_many, items)
            except RuntimeError:  # loop closed: its consumers are gone
                pass
