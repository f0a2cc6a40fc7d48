"""Constrained decoding with llguidance: one matcher per row, a token bitmask applied before sampling.

``Grammars`` is built once per model (the llguidance tokenizer from the model's Hugging Face fast
tokenizer, ~1 s); ``compile`` turns a request's format (JSON Schema, regex, Lark, choice) into a
grammar string and validates it, raising ``ValidationError`` with llguidance's message before any row
is admitted. Each request then gets its own ``Constraint`` (an ``llguidance.LLMatcher``).
Compiled grammars are kept (``Grammars.KEEP``, least recently used out): a fleet resends the same
schema or tool list with every request, and a kept grammar is validated once and its matcher copied
(``LLMatcher.deep_copy``) instead of compiled again (~17 ms of CPU a request for an agent's tools);
the Lark text of forced calls is kept by its tools, choice and format too.

The mask is applied on the device, backend-neutral (llguidance's own ``llguidance.mlx`` helper is a
Metal kernel): the int32 bitmask ([V/32] words) is expanded with shifts into a boolean row and
disallowed logits become -inf. Logprobs reported for a constrained row are those of the masked
distribution.

Tokens reach the matcher in order, once: ``advance(tokens)`` consumes every output token it has not
seen yet, so the batch lane (which emits a token before it builds the next masked step) and
mlx-lm's ``generate_step`` on the serial path (whose logits processor sees the token history
first) share one rule.
"""

from __future__ import annotations

import json
import re
import os
import threading
from collections import OrderedDict
from typing import Optional

import mlx.core as mx
import numpy as np

from mlxb.errors import ValidationError

_BITS = None


def _bits() -> mx.array:
    global _BITS
    if _BITS is None:
        _BITS = mx.arange(32, dtype=mx.uint32)
    return _BITS


def apply_bitmask(logits: mx.array, bitmask: np.ndarray) -> mx.array:
    """``logits`` [n, V]; ``bitmask`` int32 [n, ceil(V'/32)] (bit ``t`` of word ``t // 32`` allows
    token ``t``). Tokens past the mask (vocabulary padding) are disallowed."""
    n, V = logits.shape
    words = mx.array(bitmask.view(np.uint32))
    allowed = ((words[:, :, None] >> _bits()) & 1).reshape(n, -1)
    w = allowed.shape[1]
    if w >= V:
        allowed = allowed[:, :V]
    else:
        allowed = mx.concatenate([allowed, mx.zeros((n, V - w), dtype=allowed.dtype)], axis=1)
    return mx.where(allowed.astype(mx.bool_), logits, mx.array(-mx.inf, dtype=logits.dtype))


_EXECUTOR: list = []


def grammar_threads() -> Optional[int]:
    """Threads of llguidance's pool that fills a step's masks (``MLXB_GRAMMAR_THREADS``; unset: llguidance's
    default, 80% of the CPUs up to 32)."""
    v = os.environ.get("MLXB_GRAMMAR_THREADS", "").strip()
    if not v:
        return None
    if not v.isdigit() or int(v) < 1:
        raise ValueError(f"MLXB_GRAMMAR_THREADS must be a positive integer, not {v!r}")
    return int(v)


def batch_bitmask(constraints: list["Constraint"]) -> np.ndarray:
    """The next-token bitmasks of several rows, [n, words]: live matchers are filled together by
    llguidance's thread pool (Rust, without the GIL); completed or failed ones allow only the end."""
    words = (constraints[0].n_vocab + 31) // 32
    out = np.zeros((len(constraints), words), dtype=np.int32)
    live = []
    for i, c in enumerate(constraints):
        if c.matcher.is_error() or c.matcher.is_stopped():
            out[i] = c.bitmask()
        else:
            live.append((c.matcher, i))
    if len(live) == 1:
        i = live[0][1]
        out[i] = constraints[i].bitmask()
    elif live:
        import llguidance
        from llguidance.numpy import fill_next_token_bitmask_par

        if not _EXECUTOR:
            _EXECUTOR.append(llguidance.LLExecutor(grammar_threads()))
        fill_next_token_bitmask_par(_EXECUTOR[0], live, out)
    return out


def _placed(n: int, V: int, masks: dict) -> np.ndarray:
    """Bitmask words [n, ceil(V / 32)]: row ``i`` under ``masks[i]`` (one row's words; tokens past them, the
    vocabulary padding, disallowed), every other row all-ones (untouched)."""
    words = (V + 31) // 32
    full = np.full((n, words), -1, dtype=np.int32)
    for i, m in masks.items():
        w = min(m.shape[-1], words)
        full[i, w:] = 0
        full[i, :w] = m[:w]
    return full


def apply_row_masks(logits: mx.array, constraints: list, rows: list[int]) -> mx.array:
    """Mask batch ``logits`` [B, V]: row ``rows[j]`` under ``constraints[j]``, every other row untouched
    (an all-ones mask), in one device op."""
    bm = batch_bitmask(constraints)
    B, V = logits.shape
    if len(rows) < B:
        bm = _placed(B, V, dict(zip(rows, bm)))
    return apply_bitmask(logits, bm)


def apply_position_masks(logits: mx.array, masks: dict) -> mx.array:
    """Mask a verify step's logits [B, T, V]: row ``i`` in ``masks`` at its first ``len(masks[i])`` positions by
    those masks ([n, words], ``Constraint.draft_masks``), everything else untouched, in one device op."""
    B, T, V = logits.shape
    flat = {i * T + j: m[j] for i, m in masks.items() for j in range(min(len(m), T))}
    return apply_bitmask(logits.reshape(B * T, V), _placed(B * T, V, flat)).reshape(B, T, V)


class Constraint:
    """One row's matcher. ``mask()`` for the next token, ``advance()`` with the row's output so far."""

    def __init__(self, matcher, n_vocab: int, eos_ids: list[int], kind: str):
        self.matcher = matcher
        self.n_vocab = n_vocab
        self.eos_ids = list(eos_ids)
        self.kind = kind
        self.consumed = 0  # output tokens fed to the matcher

    def advance(self, tokens: list[int]) -> None:
        for t in tokens[self.consumed:]:
            self.consumed += 1
            if self.matcher.is_stopped():
                continue  # a completed grammar ignores what follows (the row finishes with it)
            self.matcher.consume_token(int(t))

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing but the end may follow."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> Optional[str]:
        return self.matcher.get_error() if self.matcher.is_error() else None

    def bitmask(self) -> np.ndarray:
        words = (self.n_vocab + 31) // 32
        if self.matcher.is_error() or self.matcher.is_stopped():
            m = np.zeros(words, dtype=np.int32)  # only the end of sequence remains
            for t in self.eos_ids:
                if t < self.n_vocab:
                    m[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
            return m
        raw = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.int32)
        out = np.zeros(words, dtype=np.int32)
        out[: min(words, raw.size)] = raw[:words]
        return out

    def apply(self, logits: mx.array) -> mx.array:
        return apply_bitmask(logits, self.bitmask()[None])

    def _walk(self, drafts: list[int], masks: Optional[list]) -> int:
        """Consume the drafts the grammar allows, in order, up to and including one that completes it (nothing
        may follow that one but the end, which the row never emits); then roll the matcher back. ``masks``
        receives the mask after each consumed draft. Returns how many drafts were allowed."""
        m = self.matcher
        if m.is_error() or m.is_stopped() or not drafts:
            return 0
        n = m.validate_tokens([int(t) for t in drafts])
        done = 0
        for t in drafts[:n]:
            if not m.consume_token(int(t)):
                break
            done += 1
            if masks is not None:
                masks.append(self.bitmask())
            if m.is_stopped():
                break
        if done:
            m.rollback(done)
        return done

    def allowed_drafts(self, drafts: list[int]) -> int:
        """How many leading ``drafts`` could be kept at all: the grammar allows them in order, and none follows
        the one that completes it. The matcher is left as it was."""
        return self._walk(drafts, None)

    def draft_masks(self, drafts: list[int]) -> np.ndarray:
        """The masks of a verify step's positions for a row that feeds ``drafts`` after its last token: row ``j``
        is the mask after the first ``j`` drafts, for every position the allowed drafts reach ([n + 1, words]).
        Positions past a forbidden draft are never read (that draft is rejected before them). The matcher is
        left as it was."""
        masks = [self.bitmask()]
        self._walk(drafts, masks)
        return np.stack(masks)


class Grammars:
    """The llguidance tokenizer of one model, and request formats compiled against it."""

    def __init__(self, tokenizer, n_vocab: int, eos_ids: list[int]):
        grammar_threads()  # a bad MLXB_GRAMMAR_THREADS fails at start, not at the first constrained step
        import llguidance
        import llguidance.hf

        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        eos = list(eos_ids) or [hf.eos_token_id]
        self.ll = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=n_vocab, eos_token=eos[0])
        self.n_vocab = n_vocab
        self.eos_ids = eos
        self.hf = hf
        self._specials: Optional[frozenset] = None
        self._lock = threading.Lock()  # requests are built on several threads (--prep-threads)
        self._matchers: OrderedDict = OrderedDict()  # grammar -> an unused matcher of it, validated
        self._lark: OrderedDict = OrderedDict()  # (tools, choice, format, parallel) -> forced-call Lark text

    KEEP = 64

    def _kept(self, table: OrderedDict, key):
        with self._lock:
            v = table.get(key)
            if v is not None:
                table.move_to_end(key)
            return v

    def _keep(self, table: OrderedDict, key, value) -> None:
        with self._lock:
            table[key] = value
            while len(table) > self.KEEP:
                table.popitem(last=False)

    # ---- request formats -> grammar strings ----------------------------------------------------
    def from_schema(self, schema, param: str) -> str:
        if not isinstance(schema, dict):
            raise ValidationError("the JSON schema must be an object", param=param)
        try:
            return self.ll.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        except (ValueError, TypeError) as e:
            raise ValidationError(f"invalid JSON schema: {e}", param=param) from None

    def from_regex(self, regex, param: str) -> str:
        if not isinstance(regex, str) or not regex:
            raise ValidationError("regex must be a non-empty string", param=param)
        return self.ll.LLMatcher.grammar_from_regex(regex)

    def from_lark(self, lark, param: str) -> str:
        if not isinstance(lark, str) or not lark.strip():
            raise ValidationError("grammar must be a non-empty Lark grammar string", param=param)
        return self.ll.LLMatcher.grammar_from_lark(lark)

    def from_choice(self, choices, param: str) -> str:
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValidationError("choice must be a non-empty list of non-empty strings", param=param)
        return self.ll.LLMatcher.grammar_from_regex("|".join(f"(?:{re.escape(c)})" for c in choices))

    @property
    def specials(self) -> frozenset:
        """The text of every special token (a forced call's tags are matched as those tokens)."""
        if self._specials is None:
            added = getattr(self.hf, "added_tokens_decoder", {}) or {}
            self._specials = frozenset(t.content for i, t in added.items()
                                       if i < self.n_vocab and self.tokenizer.is_special_token(i) and t.content)
        return self._specials

    def tool_calls(self, tools: list[dict], fmt, name: Optional[str], parallel: bool, param: str) -> str:
        """Forced calls of ``tools`` (only ``name`` when given) in tool format ``fmt``
        (``mlxb.constrain.tools.ToolFormat`` with a writer; ``mlxb.constrain.forced``)."""
        from mlxb.constrain.forced import forced_calls

        if name is not None and name not in [t["function"]["name"] for t in tools]:
            raise ValidationError(f"tool_choice names {name!r}, which is not among the declared tools", param=param)
        key = (json.dumps(tools, sort_keys=True), name, fmt.writer, fmt.start, fmt.end, fmt.keep_start, parallel)
        lark = self._kept(self._lark, key)
        if lark is None:
            lark = forced_calls(tools, name, fmt.writer, "" if fmt.keep_start else fmt.start, fmt.end, parallel,
                                self.specials)
            if lark is None:
                raise ValidationError(f"no forced-call grammar for the {fmt.name} format", param=param)
            self._keep(self._lark, key, lark)
        return self.ll.LLMatcher.grammar_from_lark(lark)

    def validate(self, grammar: str, param: str) -> str:
        if self._kept(self._matchers, grammar) is not None:
            return grammar
        err = self.ll.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if err and not err.startswith("WARNING"):
            raise ValidationError(f"invalid grammar: {err}", param=param)
        return grammar

    def constraint(self, grammar: str, kind: str) -> Constraint:
        kept = self._kept(self._matchers, grammar)
        if kept is not None:
            return Constraint(kept.deep_copy(), self.n_vocab, self.eos_ids, kind)
        m = self.ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise ValidationError(f"invalid grammar: {m.get_error()}", param="response_format")
        self._keep(self._matchers, grammar, m.deep_copy())
        return Constraint(m, self.n_vocab, self.eos_ids, kind)
