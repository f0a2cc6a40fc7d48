"""The ``draft`` proposer (``--spec draft --draft-model M``): a smaller model with the target's
tokenizer proposes each row's next tokens by its own greedy decoding, batched over the target's rows.

The draft keeps its own caches, one row per target row, in the target's row order. It follows the
target lazily: when it proposes, rows that left the batch are filtered out and rows that joined are
prefilled (their prompt and all but the last emitted token) and joined, through the same row
operations as the target (``ROW_OPS``). Per row it remembers how many emitted tokens its caches
hold (``seen``); the rest (the pending input, and tokens the target decided in plain steps or
accepted past the draft's own last input) are fed first, right-padded to the longest, and the padding
rolled back, as the verify step does. Then one [B, 1] step per further draft token. After the verify
step ``commit`` keeps the drafts the target accepted and rolls back the others (mlx-lm's
``speculative_generate_step`` keeps ``max(num_draft - accepted - 1, 0)`` fewer for the same reason:
the last draft token was never fed to the draft).

Greedy rows draft the draft model's argmax (a point mass). A sampled row (temperature > 0, no
penalties or grammar) draws its drafts from the draft model's distribution under the row's own
filters and temperature, with the row's key stream, and the verify step keeps a draft with
probability min(1, pi/q) (``accept_sampled`` with ``q``): the target's distribution exactly, with
more drafts kept than the point-mass rule when the two models agree.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlxb.cache.protocol import ROW_OPS, layer_kinds


def check_draft(target, target_tok, draft, draft_tok) -> None:
    """Refuse a draft model the verify step cannot use: another vocabulary, or caches that cannot roll back."""
    probe = "def add(a, b):\n    return a + b  # the quick brown fox 12345"
    tv = int(getattr(getattr(target, "args", None), "vocab_size", 0) or 0)
    dv = int(getattr(getattr(draft, "args", None), "vocab_size", 0) or 0)
    if tv and dv and tv != dv:
        raise ValueError(f"the draft model's vocabulary ({dv} tokens) differs from the target's ({tv}); "
                         "a draft model must share the target's tokenizer")
    if list(target_tok.encode(probe)) != list(draft_tok.encode(probe)):
        raise ValueError("the draft model's tokenizer encodes text differently from the target's; "
                         "a draft model must share the target's tokenizer")
    bad = sorted({str(k) for k in layer_kinds(draft) if k not in ("full", "latent")})
    if bad:
        raise ValueError(f"the draft model has {', '.join(bad)} layers, which cannot roll back rejected "
                         "drafts; choose a draft model with full-attention layers only")


class DraftProposer:
    name = "draft"

    def __init__(self, model, prefill_chunk: int = 2048):
        self.model, self.prefill_chunk = model, prefill_chunk
        self.kinds = layer_kinds(model)
        self.ids: list[str] = []  # request ids, in the target's row order
        self.seen: list[int] = []  # per row: emitted tokens the draft caches hold
        self.caches = None
        self.merged = False
        self._width = 0  # drafts generated in the last propose (for commit)
        self.q = None  # per row: the draft distributions of its sampled drafts (None: greedy row / no sampled row)

    # ---- following the target's rows ---------------------------------------------------------
    def _sync(self, rows) -> None:
        live = {r.req.request_id for r in rows}
        keep = [i for i, rid in enumerate(self.ids) if rid in live]
        if len(keep) < len(self.ids):
            if not keep:
                self.caches, self.merged, self.ids, self.seen = None, False, [], []
            elif self.merged:
                self.caches = [ROW_OPS[k].filter(c, keep) for k, c in zip(self.kinds, self.caches)]
                self.ids, self.seen = [self.ids[i] for i in keep], [self.seen[i] for i in keep]
            else:
                self.ids, self.seen = [self.ids[i] for i in keep], [self.seen[i] for i in keep]
        for row in rows[len(self.ids):]:
            self._join(row)
        assert self.ids == [r.req.request_id for r in rows], "draft rows out of step with the target's"

    def _join(self, row) -> None:
        ids = row.req.prompt_ids + row.tokens[:-1]
        solo = make_prompt_cache(self.model)
        for s in range(0, len(ids), self.prefill_chunk):
            self.model(mx.array(ids[s : s + self.prefill_chunk])[None], cache=solo)
            mx.eval([c.state for c in solo])
        if self.caches is None:
            self.caches, self.merged = solo, False
        else:
            if not self.merged:
                self.caches = [ROW_OPS[k].to_batch([c]) for k, c in zip(self.kinds, self.caches)]
                self.merged = True
            one = [ROW_OPS[k].to_batch([c]) for k, c in zip(self.kinds, solo)]
            self.caches = [ROW_OPS[k].join_batch(b, c, "extend") for k, b, c in zip(self.kinds, self.caches, one)]
        self.ids.append(row.req.request_id)
        self.seen.append(len(row.tokens) - 1)

    # ---- proposing ---------------------------------------------------------------------------
    def propose_rows(self, r, ks: list[int]) -> list[list[int]]:
        """Up to ``ks[i]`` drafts for row i (every row's caches advance alike; rows take their own k)."""
        from mlxb.spec.rows import rollback

        rows = r.rows
        K = max(ks)
        if K <= 0:
            self.q = None
            return [[] for _ in rows]
        self._sync(rows)
        behind = [row.tokens[s:] for row, s in zip(rows, self.seen)]
        W = max(len(b) for b in behind)
        x = mx.array([b + [b[-1]] * (W - len(b)) for b in behind], dtype=mx.uint32)
        logits = self.model(x, cache=self.caches)
        last = mx.array([len(b) - 1 for b in behind])
        sampled = [not row.sampler.greedy and not row.sampler.processors and row.sampler.constraint is None
                   for row in rows]
        self.q = [[] if s else None for s in sampled] if any(sampled) else None
        tok = self._pick(rows, mx.take_along_axis(logits, last[:, None, None], axis=1)[:, 0, :], sampled)
        rollback(self.caches, self.kinds, [W - len(b) for b in behind], self.merged)
        drafts = [tok]
        for _ in range(K - 1):
            tok = self._pick(rows, self.model(tok[:, None], cache=self.caches)[:, -1, :], sampled)
            drafts.append(tok)
        out = mx.stack(drafts, axis=1)
        mx.eval(out, [q for qs in self.q or [] if qs for q in qs])
        self.seen = [len(row.tokens) for row in rows]
        self._width = K
        return [d[:k] for d, k in zip(out.tolist(), ks)]

    def _pick(self, rows, logits: mx.array, sampled: list[bool]) -> mx.array:
        """Each row's next draft: the argmax, or for a sampled row a draw from the draft's distribution
        under the row's filters and temperature (kept in ``self.q`` for the verify step)."""
        tok = mx.argmax(logits, axis=-1)
        if self.q is None:
            return tok
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        out = []
        for i, row in enumerate(rows):
            if not sampled[i]:
                out.append(tok[i : i + 1])
                continue
            x = row.sampler.draw_logits(lp[i : i + 1])
            self.q[i].append(mx.softmax(x, axis=-1)[0])
            out.append(mx.random.categorical(x, key=row.sampler.next_key()).astype(tok.dtype))
        return mx.concatenate(out)

    def commit(self, r, kept: list[int]) -> None:
        """After the verify step: keep the accepted drafts the draft caches hold (at most K - 1 of
        them), roll the rest back."""
        from mlxb.spec.rows import rollback

        fed = [min(a, self._width - 1) for a in kept]
        rollback(self.caches, self.kinds, [self._width - 1 - f for f in fed], self.merged)
        self.seen = [s + f for s, f in zip(self.seen, fed)]
