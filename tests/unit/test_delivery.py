"""Delivery without a model: engine-side vs consumer-side text, EOS flushing, one wake-up per loop."""

import asyncio
import copy

import pytest

from mlxb.engine.delivery import Delivery, Live
from mlxb.engine.runner import Emitted, Row
from mlxb.engine.stream import OutputStream, Outbox
from mlxb.request import Request

TEXT = "héllo wörld ✓ — naïve café, ok"


@pytest.fixture(scope="module")
def tok(tiny_models):
    return tiny_models("tiny-llama")[1]


def _live(tok, req, loop=None):
    detok = copy.copy(tok._detokenizer)
    detok.reset()
    return Live(req, OutputStream(req.request_id, loop), detok)


def _run(tok, req, tokens):
    d = Delivery(set(tok.eos_token_ids), {"tokens": 0})
    live = _live(tok, req)
    d.live[req.request_id] = live
    row = Row(req, None)
    for t in tokens:
        if d.deliver(Emitted(row, t, None)) is not None:
            break
    outs = list(live.stream)
    return live, outs


def test_consumer_side_text_equals_engine_side_and_decode(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    eos = sorted(tok.eos_token_ids)[0]
    deferred, outs_d = _run(tok, Request("a", [1], 100), ids + [eos])
    # a stop string that never matches forces engine-side text through the stop matcher
    engine, outs_e = _run(tok, Request("b", [1], 100, stop=["\x00never"]), ids + [eos])
    assert deferred.defer_text and not engine.defer_text
    assert any(o.text is None for o in outs_d) is False  # the consumer filled every record in
    text_d = "".join(o.text for o in outs_d)
    text_e = "".join(o.text for o in outs_e)
    assert text_d == text_e == tok.decode(ids)
    assert [o.token for o in outs_d] == [o.token for o in outs_e] == ids + [None]


def test_length_finish_flushes_consumer_side_text(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    _, outs = _run(tok, Request("c", [1], len(ids)), ids)
    assert outs[-1].finish_reason == "length"
    assert "".join(o.text for o in outs) == tok.decode(ids)


def test_eos_releases_text_held_by_a_partial_stop_match(tok):
    # "... Q" could still become the stop string "QQQ": it is held back; EOS proves it was not one
    ids = tok.encode("abc Q", add_special_tokens=False)
    eos = sorted(tok.eos_token_ids)[0]
    _, outs = _run(tok, Request("d", [1], 100, stop=["QQQ"]), ids + [eos])
    assert outs[-1].finish_reason == "stop"
    assert "".join(o.text for o in outs) == tok.decode(ids)


class CountingLoop:
    """Stands in for an event loop: records each cross-thread hand-off."""

    def __init__(self):
        self.calls = []

    def call_soon_threadsafe(self, fn, *args):
        self.calls.append((fn, args))


def test_outbox_one_wakeup_per_loop_per_iteration_in_order(tok):
    loop = CountingLoop()
    streams = []
    for i in range(3):
        st = OutputStream(f"s{i}")
        st._loop, st._aq = loop, asyncio.Queue()  # as if made with loop=
        streams.append(st)
    from mlxb.request import RequestOutput

    box = Outbox()
    for step in range(2):
        for i, st in enumerate(streams):
            st.put(RequestOutput(st.request_id, 10 * step + i, "x"), box)
    assert loop.calls == []  # nothing crosses threads before the flush
    box.flush()
    assert len(loop.calls) == 1
    fn, args = loop.calls[0]
    fn(*args)  # what the loop would run
    for i, st in enumerate(streams):
        got = [st._aq.get_nowait().token for _ in range(2)]
        assert got == [i, 10 + i]
    box.flush()
    assert len(loop.calls) == 1  # an empty outbox wakes nobody
