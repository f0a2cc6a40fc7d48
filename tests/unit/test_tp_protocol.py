"""The --tp message protocol without a model or a second process: what rank 0's runner sends for each
call, and that the follower replays exactly those calls, in order, with the same arguments."""

import mlx.core as mx

from mlxb.cache.kv_plan import KVPlan, KVScheme
from mlxb.distributed import follower as tp_follower, leader as tp
from mlxb.engine.runner import FAULTS


class FakeLink:
    """Rank 0's messages land in a list; the follower reads them back from it."""

    rank, size = 0, 2

    def __init__(self):
        self.sent: list[list[int]] = []
        self.busy_since = None
        self.busy_kind = "work"
        self.messages = self.words = 0
        self.channel = "test"

    def send(self, words):
        self.sent.append(list(words))

    def recv(self):
        return self.sent.pop(0)

    def share(self, a):
        return a


class Row:
    def __init__(self, key):
        self.tp_key = key


class Recorder:
    """Stands in for the follower's Runner: records every call."""

    kv = None
    kinds = ["full", "full"]

    def __init__(self):
        self.calls = []

    def setup_sharing(self, share_min, agree=None):
        self.sharing_min = share_min

    def new_row(self, req):
        self.calls.append(("new", req.prompt_ids, req.adapter))
        return ("row", len(self.calls))

    def prefill_chunk(self, row, start, end, is_last):
        self.calls.append(("chunk", row, start, end, is_last))

    def first_token(self, row):
        self.calls.append(("first", row))

    def prefill_cohort(self, rows, starts, snapshot=None):
        self.calls.append(("cohort", rows, list(starts)))
        return ("cohort-caches", [])

    def join_cohort(self, caches, rows, tokens, keep):
        self.calls.append(("join_cohort", caches, rows, list(tokens), list(keep)))

    def join(self, row, token):
        self.calls.append(("join", row, token))

    def decode_step(self):
        self.calls.append(("decode",))

    def filter(self, keep):
        self.calls.append(("filter", list(keep)))

    def drop_all(self):
        self.calls.append(("drop",))


def test_plan_words_round_trip():
    plan = KVPlan([KVScheme(4, 64, 16), None, KVScheme(8, 32, 16)], 16)
    words = tp._plan_words(plan, 3)
    back, used = tp_follower._plan_from(words + [99, 98], 3)
    assert used == len(words) == 7
    assert [None if s is None else (s.bits, s.group_size, s.start) for s in back.layers] == [(4, 64, 16), None, (8, 32, 16)]
    assert back.start == 16
    assert tp_follower._plan_from(tp._plan_words(None, 3), 3) == (None, 1)


def test_follower_replays_rank0_calls_in_order(monkeypatch):
    link = FakeLink()
    # rank 0's side of one engine's life, as TPRunner words (what _flush would send)
    faults = sum(1 << i for i, f in enumerate(FAULTS) if f == "scalar_rope")
    engine = [tp.ENGINE, tp.JOIN_MODES.index("merge"), faults, 0, *tp._plan_words(None, 2), -1]  # 0: no LoRA recipes; -1: no sharing
    link.send(engine)
    link.send([tp.NEW, 0, -1, 3, 5, 6, 7, tp.NEW, 1, 2, 2, 8, 9, tp.CHUNK, 0, 0, 2, 1])
    link.send([tp.FIRST, 0])
    link.send([tp.JOIN, 0, 42, tp.COHORT, 1, 1, 0, 0])  # 0: no cohort snapshots
    link.send([tp.JOIN_COHORT, 1, 1, 43, 1, 0, tp.DECODE])
    link.send([tp.FILTER, 1, 1, tp.FORGET, 1, 0, tp.DECODE])
    link.send([tp.PING])
    link.send([tp.DROP, tp.STOP])
    made = {}

    import mlxb.cache.protocol as protocol

    monkeypatch.setattr(protocol, "layer_kinds", lambda model: ["full", "full"])
    monkeypatch.setattr(protocol, "kv_projection", lambda model, kinds, kv: made.setdefault("projection", kinds))

    def fake_runner(model, kinds, join_full, faults, kv_scheme):
        made["args"] = (join_full, faults, kv_scheme)
        made["runner"] = Recorder()
        return made["runner"]

    monkeypatch.setattr(tp_follower, "Runner", fake_runner)
    monkeypatch.setattr(mx, "synchronize", lambda *a: None)
    assert tp_follower.follow(None, link) == 0
    assert made["args"] == ("merge", frozenset(["scalar_rope"]), None) and not link.sent
    assert made["projection"] == ["full", "full"] and made["runner"].sharing_min is None  # -1: no sharing
    r0, r1 = ("row", 1), ("row", 2)
    assert made["runner"].calls == [
        ("new", [5, 6, 7], -1), ("new", [8, 9], 2), ("chunk", r0, 0, 2, True), ("first", r0), ("join", r0, 42),
        ("cohort", [r1], [0]), ("join_cohort", "cohort-caches", [r1], [43], [0]), ("decode",),
        ("filter", [1]), ("decode",), ("drop",), ("drop",),
    ]


def test_tprunner_batches_row_moves_into_the_next_message():
    link = FakeLink()
    sent_calls = []

    class Base:
        """Runner's methods, recorded (no model)."""

        def __init__(self, model, kinds, **kw):
            self.join_mode = {"full": kw.get("join_full", "extend")}
            self.faults = kw.get("faults", frozenset())
            self.kv = None
            self.proposer = None  # no --spec

        def setup_sharing(self, share_min, agree=None):
            assert share_min is None  # (not given to this runner: no probe, no agreement)

        def new_row(self, req):
            return Row(None)

        def prefill_chunk(self, *a):
            sent_calls.append("chunk")

        def first_token(self, row):
            sent_calls.append("first")

        def join(self, row, token):
            sent_calls.append("join")

        def decode_step(self):
            sent_calls.append("decode")
            return []

        def filter(self, keep):
            sent_calls.append("filter")

        def drop_all(self):
            pass

    orig = tp.TPRunner.__bases__
    tp.TPRunner.__bases__ = (Base,)  # the mirroring alone, over recorded Runner methods
    try:
        _drive(link, sent_calls)
    finally:
        tp.TPRunner.__bases__ = orig


def _drive(link, sent_calls):
    r = tp.TPRunner(None, ["full", "full"], link=link, join_full="extend")
    assert link.sent[0] == [tp.ENGINE, 0, 0, 0, -1, -1]  # announced at once: the KV projection forward follows

    class Req:
        prompt_ids = [5, 6, 7]
        adapter = 1

    row = r.new_row(Req())
    assert link.sent[-1][0] == tp.ENGINE  # a new row rides along with the next call, not alone
    r.prefill_chunk(row, 0, 2, True)
    assert link.sent[-1] == [tp.NEW, row.tp_key, 1, 3, 5, 6, 7, tp.CHUNK, row.tp_key, 0, 2, 1]
    r.join(row, 42)
    r.filter([0])
    r.decode_step()
    assert link.sent[-1] == [tp.JOIN, row.tp_key, 42, tp.FILTER, 1, 0, tp.DECODE]
    assert sent_calls == ["chunk", "join", "filter", "decode"]
    assert len(link.sent) == 3  # engine, chunk, decode: one message per model call


def test_engine_message_with_lora_recipes_reloads_the_shard_once(monkeypatch):
    import mlxb.cache.protocol as protocol

    monkeypatch.setattr(protocol, "layer_kinds", lambda model: ["full"])
    monkeypatch.setattr(protocol, "kv_projection", lambda *a: None)
    class R:
        kv = None

        def __init__(self, model, kinds, **kw):
            self.model = model

        def setup_sharing(self, share_min, agree=None):
            assert share_min is None

    monkeypatch.setattr(tp_follower, "Runner", R)
    loads = []

    def reload(recipes):
        loads.append(recipes)
        return f"model{len(loads)}"

    plan = tp._plan_words(KVPlan([KVScheme(4, 64, 0)], 0), 1)
    w = [tp.ENGINE, 0, 0, 2, 1, 8, -1, 2, 4, 1, *plan, -1, tp.DECODE]
    want = [{"seed": 1, "rank": 8, "num_layers": -1}, {"seed": 2, "rank": 4, "num_layers": 1}]
    runner, model, recipes, i = tp_follower._engine("base", w, 0, reload, None, FakeLink())
    assert (runner.model, model, recipes, w[i]) == ("model1", "model1", want, tp.DECODE)
    _, model, recipes, _ = tp_follower._engine(model, w, 0, reload, recipes, FakeLink())  # same recipes: no reload
    assert model == "model1" and len(loads) == 1
    _, model, recipes, _ = tp_follower._engine(model, [tp.ENGINE, 0, 0, 0, -1, -1], 0, reload, recipes, FakeLink())  # none: base again
    assert recipes is None and loads == [want, None]


def test_prompt_cache_words_name_each_entry_and_free_it_after_the_iteration():
    """Rank 0's cache: a new entry is one PUT naming its source; a repeat of the same tokens is none; an
    entry covered by a longer one is freed with the next decode step (rank 0 may still lend from it)."""
    from mlx_lm.models.cache import KVCache

    from mlxb.distributed.cache import SRC_EXTRACT, SRC_ROW, FollowerStore, MirroredPromptCache
    from mlxb.models import load_model

    class Rank0:
        def __init__(self):
            self.words, self.later, self.names = [], [], {}

        def cache_source(self, layers):
            return self.names.get(id(layers))

        def queue_cache_op(self, *w):
            self.words += list(w)

        def queue_cache_free_later(self, eid):
            self.later.append(eid)

    def layers(n):
        out = []
        for _ in range(2):
            c = KVCache()
            c.update_and_fetch(mx.ones((1, 2, n, 4)) * n, mx.ones((1, 2, n, 4)))
            out.append(c)
        return out

    model = load_model("tiny-llama")[0]
    r0 = Rank0()
    pc = MirroredPromptCache(model, ["full", "full"], max_bytes=1 << 30, runner=r0)
    a, b = layers(5), layers(9)
    r0.names = {id(a): (SRC_ROW, 7), id(b): (SRC_EXTRACT, 0)}
    e = pc.put(list(range(5)), a)
    assert r0.words == [tp.PUT, e.tp_id, SRC_ROW, 7, 5]
    pc.put(list(range(5)), a)  # already stored: no word
    assert len(r0.words) == 5 and not r0.later
    pc.put(list(range(9)), b)  # covers the 5-token entry, which leaves the index
    assert r0.words[5:] == [tp.PUT, e.tp_id + 1, SRC_EXTRACT, 0, 9] and r0.later == [e.tp_id]
    # the follower's side: the same snapshot from its own caches, lent back trimmed
    st = FollowerStore(["full", "full"])
    st.extracted = [layers(10)]
    st.put(3, SRC_EXTRACT, 0, 9, rows={})  # a finished row's lookahead token trimmed first
    lent = st.lend(3, 4)
    assert st.entries[3][0].offset == 9 and lent[0].offset == 4 and lent[0].keys.shape[2] >= 4
