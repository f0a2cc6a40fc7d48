"""A one-producer stream of RequestOutput records, consumable from a thread or an asyncio loop."""

from __future__ import annotations

import asyncio
import queue
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

    def put(self, item: RequestOutput) -> None:
        self._push(item)
        if item.finish_reason is not None:
            self._push(_END)

    def _push(self, item) -> None:
        if self._aq is not None:
            try:
                self._loop.call_soon_threadsafe(self._aq.put_nowait, item)
            except RuntimeError:  # loop closed: the consumer is gone
                pass
        else:
            self._q.put(item)

    def __iter__(self):
        while True:
            item = self._q.get()
            if item is _END:
                return
            yield item

    def __aiter__(self):
        return self._agen()

    async def _agen(self):
        assert self._aq is not None, "create the stream with loop= to consume it asynchronously"
        while True:
            item = await self._aq.get()
            if item is _END:
                return
            yield item
