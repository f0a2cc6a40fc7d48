"""Execute a parity case's plan with mlx-lm alone.

No mlxb engine code is imported here: the model is mlx-lm's, caches are mlx-lm's, and every row
operation is the cache class's own ``merge`` / ``extend`` / ``filter`` / ``extract`` (the calls
mlx-lm's ``BatchGenerator`` is built from). The loop is plain and unpipelined: each forward is
evaluated and read before the next one is built. The oracle sees the case's inputs and the plan's
row/step identities, never the engine's outputs.

Per row and step it records the greedy token, the sha256 of the float32 log-softmax vector over the
whole vocabulary (the logits normalized exactly as the engine normalizes them), and the top-5
(id, logprob) pairs for diagnostics.
"""

from __future__ import annotations

import copy
import os
import tempfile

import mlx.core as mx
import numpy as np
from mlx_lm.generate import PromptProcessingBatch
from mlx_lm.models.cache import (BatchKVCache, BatchRotatingKVCache, CacheList, KVCache, RotatingKVCache,
                                  load_prompt_cache, make_prompt_cache, save_prompt_cache, trim_prompt_cache)

from mlxb.parity.plan import Planner
from mlxb.parity.protocol import Case, step_record
from . import spec as spec_ref
from .quantized import QBatch, QRow, convert


class _Grammar:
    """Constrained rows of a ``grammar`` case: llguidance's matcher over the model's tokenizer (the
    library, not mlxb's wrapper), its bitmask unpacked with numpy, disallowed logits set to -inf before
    the log-softmax: the masked distribution, as a logits processor would give it."""

    def __init__(self, case: Case, tokenizer):
        self.rows = set(case.grammar["rows"]) if case.grammar else set()
        self.case, self.tokenizer, self.m = case, tokenizer, None

    def __contains__(self, r: int) -> bool:
        return r in self.rows

    def _matchers(self, V: int) -> dict:
        if self.m is None:  # the vocabulary is the model's logits width
            import llguidance
            import llguidance.hf

            hf = getattr(self.tokenizer, "_tokenizer", self.tokenizer)
            eos = sorted(getattr(self.tokenizer, "eos_token_ids", []) or []) or [hf.eos_token_id]
            lt = llguidance.hf.from_tokenizer(hf, n_vocab=V, eos_token=eos[0])
            spec = self.case.grammar
            g = (llguidance.LLMatcher.grammar_from_lark(spec["lark"]) if "lark" in spec
                 else llguidance.LLMatcher.grammar_from_regex(spec["regex"]))
            self.m = {r: llguidance.LLMatcher(lt, g, log_level=0) for r in self.rows}
        return self.m

    def pick(self, r: int, logits: mx.array) -> tuple[int, mx.array]:
        """Row ``r``'s [1, V] logits -> (greedy token under its mask, masked log-softmax); feeds the token."""
        V = logits.shape[-1]
        m = self._matchers(V)[r]
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")[:V]
        allowed = np.zeros(V, dtype=bool)
        allowed[: bits.size] = bits.astype(bool)
        logits = mx.where(mx.array(allowed)[None], logits, mx.array(-mx.inf, dtype=logits.dtype))
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        tok = int(mx.argmax(lp, axis=-1).item())
        assert m.consume_token(tok), m.get_error()
        return tok, lp


def _use_lora(model, case: Case, rows: list[int]) -> None:
    """``lora`` case: the adapter slot of each row of the next forward (oracle/lora.py)."""
    if case.lora:
        model.oracle_lora.slots = [case.lora["rows"][r] for r in rows]


def record(token: int, logprobs: mx.array, geo=None) -> dict:
    return step_record(token, np.array(logprobs.reshape(-1).astype(mx.float32)), geo)


def _geo_layer(caches: list):
    """Where the first plain full-attention (or latent) layer cache is, or None (quantized ones count):
    ``(layer, None)``, or ``(layer, part)`` inside an mlx-lm ``CacheList`` (Falcon-H1's SSM + KV layers)."""
    for i, c in enumerate(caches):
        for j, s in enumerate(c.caches) if isinstance(c, CacheList) else [(None, c)]:
            if type(s) in (KVCache, QRow):
                return i, j
    return None


def _at(caches: list, g: tuple):
    return caches[g[0]] if g[1] is None else caches[g[0]][g[1]]


def _geometry(c) -> list:
    if type(c) in (KVCache, QRow):
        return [(int(c.offset), 0)]
    return [(int(c._idx), int(p)) for p in c.left_padding.tolist()]


def _join(batch: list, solo: list, full_op: str) -> list:
    out = []
    for b, s in zip(batch, solo):
        if isinstance(s, RotatingKVCache) or (isinstance(s, (KVCache, QRow)) and full_op == "merge"):
            rows = [b.extract(i) for i in range(len(b.offset))]
            out.append(type(s).merge(rows + [s]))  # re-merge every row's temporal view
        else:  # full / latent extend, SSM state concatenation
            b.extend(type(s).merge([s]))
            out.append(b)
    return out


def _join_batch(batch: list, cohort: list, full_op: str) -> list:
    out = []
    for b, c in zip(batch, cohort):
        if isinstance(c, BatchRotatingKVCache) or (type(c) in (BatchKVCache, QBatch) and full_op == "merge"):
            rows = [x.extract(i) for x in (b, c) for i in range(len(x.offset))]
            out.append(type(c).merge(rows))
        else:
            b.extend(c)
            out.append(b)
    return out


def _cohort_prefill(model, case: Case, rows: list[int], prompts: dict, caches: dict, starts: dict,
                    it=None, store=None, grammar=None):
    """mlx-lm's own PromptProcessingBatch over the uncached prompt bodies (each row's caches hold its
    cached prefix, or nothing), then one [n, 1] step. Snapshots the plan asks for at the body end are
    the batch's own ``extract``."""
    _use_lora(model, case, rows)
    ppb = PromptProcessingBatch(model, list(rows), [caches[r] for r in rows], prefill_step_size=case.prefill_chunk)
    ppb.prompt([prompts[r][starts[r]:-1] for r in rows])
    if case.kv:  # every body has run: convert before the held-back step (the single-stream rule)
        ppb.prompt_cache = convert(ppb.prompt_cache, case.kv, min(len(prompts[r]) - 1 for r in rows))
    for i, r in enumerate(rows):
        n = len(prompts[r]) - 1
        if it is not None and [r, n] in it.snaps:
            store[(r, n)] = ppb.extract_cache(i)
    caches = ppb.prompt_cache
    last = mx.array([prompts[r][-1] for r in rows], dtype=mx.uint32)
    logits = model(last[:, None], cache=caches)[:, -1, :]
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    toks = mx.argmax(lp, axis=-1)
    mx.eval(toks, lp)
    toks, lps = toks.tolist(), [lp[i : i + 1] for i in range(len(rows))]
    for i, r in enumerate(rows):
        if grammar is not None and r in grammar:
            toks[i], lps[i] = grammar.pick(r, logits[i : i + 1])
    return caches, toks, lps


def _through_disk(store: dict) -> None:
    """The SSD tier, mlx-lm's way: every snapshot saved and loaded back."""
    with tempfile.TemporaryDirectory() as d:
        for i, key in enumerate(list(store)):
            path = os.path.join(d, f"{i}.safetensors")
            save_prompt_cache(path, store[key])
            store[key] = load_prompt_cache(path)
            mx.eval([c.state for c in store[key]])


def _seed(store: dict, src: list, model) -> list:
    """A deep copy of snapshot (row, length) trimmed to ``n`` tokens (mlx-lm's trim_prompt_cache)."""
    row, length, n = src
    caches = copy.deepcopy(store[(row, length)])
    if n < length:
        assert trim_prompt_cache(caches, length - n) == length - n, "plan trims an untrimmable snapshot"
    return caches


def _run_cohort(model, case: Case, it, store: dict, prompt, records: dict, last_tok: dict, gl, grammar=None):
    starts = {ch.row: ch.start for ch in it.prefills if ch.row in it.cohort}
    seeded = {r: _seed(store, it.seeds[r], model) if r in it.seeds else make_prompt_cache(model) for r in it.cohort}
    caches, toks, lp = _cohort_prefill(model, case, it.cohort, {r: prompt(r) for r in it.cohort}, seeded, starts,
                                       it, store, grammar)
    geo = [None] * len(it.cohort) if gl is None else _geometry(_at(caches, gl))
    for i, r in enumerate(it.cohort):
        records[r].append(record(toks[i], lp[i], geo[i]))
        last_tok[r] = toks[i]
    keep = [i for i, r in enumerate(it.cohort) if r in it.joins]
    if len(keep) < len(it.cohort) and keep:
        for c in caches:
            c.filter(keep)
    return caches


def run_case(model, case: Case, tokenizer=None) -> dict:
    """Returns ``{"records": {row: [step records]}, "forwards": n}``."""
    rows = case.rows
    grammar = _Grammar(case, tokenizer)
    prompts: dict[int, list] = {}  # resolved when a row first prefills (linked rows need outputs)
    store: dict[tuple, list] = {}  # prompt cache snapshots by (row, length)

    def prompt(r: int) -> list:
        if r not in prompts:
            prompts[r] = case.resolve(r, {b: [x["t"] for x in recs] for b, recs in records.items()})
        return prompts[r]

    solo: dict[int, list] = {}
    caches, merged, batch = None, False, []
    last_tok: dict[int, int] = {}
    records: dict[int, list] = {i: [] for i in range(len(rows))}
    n_fwd = 0
    gl = _geo_layer(make_prompt_cache(model))
    planner = Planner(case)
    while not planner.finished:
        it = planner.begin()
        if it.spill:
            _through_disk(store)
        cohort_caches = None
        for ch in it.prefills:
            r = ch.row
            if r in it.cohort:
                if r == it.cohort[0]:  # every snapshot its rows start from was taken before this point
                    cohort_caches = _run_cohort(model, case, it, store, prompt, records, last_tok, gl, grammar)
                continue
            if r not in solo:
                solo[r] = _seed(store, it.seeds[r], model) if r in it.seeds else make_prompt_cache(model)
            _use_lora(model, case, [r])
            if ch.end > ch.start:
                model(mx.array(prompt(r)[ch.start : ch.end])[None], cache=solo[r])
                if case.kv:  # generate_step converts after each prefill chunk
                    solo[r] = convert(solo[r], case.kv, ch.end)
                mx.eval([c.state for c in solo[r]])
            if [r, ch.end] in it.snaps:
                store[(r, ch.end)] = copy.deepcopy(solo[r])
            if ch.is_last:
                logits = model(mx.array(prompt(r)[-1:], dtype=mx.uint32)[None], cache=solo[r])[:, -1, :]
                if case.kv:
                    solo[r] = convert(solo[r], case.kv, len(prompt(r)))
                if r in grammar:
                    tok, lp = grammar.pick(r, logits)
                else:
                    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                    tok = int(mx.argmax(lp, axis=-1).item())
                g = _geo_layer(solo[r])
                records[r].append(record(tok, lp, None if g is None else _geometry(_at(solo[r], g))[0]))
                last_tok[r] = tok
                if [r, len(prompt(r))] in it.snaps:  # finished at token 0: the whole prompt is cached
                    store[(r, len(prompt(r)))] = copy.deepcopy(solo[r])
        cohort_joined = False
        for r in it.joins:
            if r in it.cohort:
                if cohort_joined:
                    continue
                cohort_joined = True
                rows_in = [x for x in it.cohort if x in it.joins]
                if not batch:
                    caches, merged = cohort_caches, True
                else:
                    if not merged:
                        caches = [type(c).merge([c]) for c in caches]
                        merged = True
                    caches = _join_batch(caches, cohort_caches, case.join_full)
                batch += rows_in
                continue
            if not batch:
                caches, merged = solo.pop(r), False  # adopted alone: plain single-row caches
            else:
                if not merged:
                    caches = [type(c).merge([c]) for c in caches]
                    merged = True
                caches = _join(caches, solo.pop(r), case.join_full)
            batch.append(r)
        props = None
        if it.forward and case.spec:  # prompt lookup over each row's prompt and every token it has so far
            produced = {r: len(records[r]) for r in batch}
            props = spec_ref.proposals(case, batch, lambda r: prompt(r) + [x["t"] for x in records[r]], produced)
            props = props if any(props) else None
        if props is not None:
            assert batch == it.forward, (batch, it.forward)
            lp, choice, kept, width = spec_ref.verify(model, caches, merged, [last_tok[r] for r in batch], props)
            n_fwd += 1
            geo = [None] * len(batch) if gl is None else _geometry(_at(caches, gl))
            gains = {}
            for i, r in enumerate(batch):
                room = rows[r].max_tokens - len(records[r])
                if room <= 0:
                    kept[i] = 0  # a row past its last token (its lookahead): nothing recorded
                    continue
                gains[r] = kept[i] + 1
                for j in range(kept[i] + 1):
                    records[r].append(record(choice[i][j], lp[i, j : j + 1], geo[i]))
                last_tok[r] = choice[i][kept[i]]
            spec_ref.rollback(caches, merged, [width - a for a in kept])
            planner.end(it, gains, verify=True)
        else:  # a plain step: one token per row
            planner.end(it)
        if it.forward and props is None:
            assert batch == it.forward, (batch, it.forward)
            inputs = mx.array([last_tok[r] for r in batch], dtype=mx.uint32)[:, None]
            _use_lora(model, case, batch)
            logits = model(inputs, cache=caches)[:, -1, :]
            if case.kv and not merged:  # a lone row converts after each step, as generate_step does
                caches = convert(caches, case.kv, next(int(c.offset) for c in caches if hasattr(c, "offset")))
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            toks = mx.argmax(lp, axis=-1)
            mx.eval(toks, lp)
            n_fwd += 1
            values = toks.tolist()
            geo = [None] * len(batch) if gl is None else _geometry(_at(caches, gl))
            for i, r in enumerate(batch):
                if r in it.emits:
                    assert it.emits[r] == len(records[r])
                    if r in grammar:  # the mask of this step follows every token the row emitted before
                        tok, lpr = grammar.pick(r, logits[i : i + 1])
                    else:
                        tok, lpr = values[i], lp[i : i + 1]
                    records[r].append(record(tok, lpr, geo[i]))
                    last_tok[r] = tok
        if it.forward:
            for i, r in enumerate(batch):  # retiring rows go back to the prompt cache: prompt + output
                m = rows[r].max_tokens
                if r in it.retire and [r, len(prompt(r)) + m] in it.snaps:
                    store[(r, len(prompt(r)) + m)] = [c.extract(i) for c in caches] if merged else caches
            if it.retire:
                keep = [i for i, r in enumerate(batch) if r not in it.retire]
                batch = [batch[i] for i in keep]
                if not batch:
                    caches, merged = None, False
                elif merged:
                    for c in caches:
                        c.filter(keep)
    for r, spec in enumerate(rows):
        assert len(records[r]) == spec.max_tokens, (r, len(records[r]), spec.max_tokens)
    return {"records": {str(r): v for r, v in records.items()}, "forwards": n_fwd}
