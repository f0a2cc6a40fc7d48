"""A parity case as data, and the iteration plan both sides must follow.

A case fixes the inputs (model, dtype, the cap B, each row's prompt ids, max_tokens and arrival
iteration, the prefill chunk size and the join op for full-attention layers). ``plan()`` (``mlxb.parity.plan``) turns it
into the exact event timeline of the continuous-batching protocol, one entry per iteration:

1. rows whose ``arrive`` equals the iteration enter the FIFO queue (in row order);
2. joiner prefill spends at most ``prefill_chunk`` tokens (the held-back last prompt token's L=1
   step counts as one; an iteration that starts idle, with no batch and no prefill in flight, may spend eight chunks' worth,
   the engine's default ``prefill_burst``, but one chunk is never longer than ``prefill_chunk``): continue the prefill in flight, then admit the queue head while running +
   prefilling rows stay under B; a row whose last chunk runs samples token 0 alone and joins at
   the end of the batch (a row with ``max_tokens == 1`` ends there and never joins); when two or more
   rows prefill their whole prompt in this iteration they form a cohort: one right-padded batched
   prefill rolled to left padding (mlx-lm's ``PromptProcessingBatch``), one [n, 1] step for their
   held-back tokens, and they join together (rows that ended at token 0 are filtered out first);
3. if the batch is not empty, one forward over every batch row, in batch order;
4. decode is pipelined: the tokens a forward produces are read during the next iteration, after
   that iteration's forward is launched, so a row's last forward is a lookahead whose output is
   dropped; rows whose generated count reached ``max_tokens`` are retired after it.

With the prompt cache on (the ``prefix`` case), the plan also models the cache on token *symbols*
(a later row's prompt is an earlier row's prompt + output + new tokens, ``Case.prefix["links"]``):
at admission a row starts from the longest usable cached prefix (any stored key's common prefix when
every layer can be trimmed, else a stored key that is a prefix of the prompt), or from a leader's
snapshot in the same iteration when it shares at least ``MIN_SHARED`` more tokens (the leader's
chunk is split there); snapshots are taken at solo chunk ends (every end for exact-only kinds, the
prompt body and shared points otherwise), at a token-0 finish and at retirement (prompt + output);
a row marked ``ssd`` arrives after every snapshot went through the SSD tier. ``Iteration.seeds``
and ``snaps`` tell the oracle which snapshot each row starts from and when snapshots are taken.

The oracle executes this plan with mlx-lm; the engine under test runs its own scheduler and the
parity driver checks that the engine's actual timeline equals the plan before comparing logits.
Greedy decoding, EOS ignored: every row produces exactly ``max_tokens`` tokens.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np

CASES = ("static", "join", "leave", "extend", "merge", "burst", "ring", "ssm", "latent", "prefix", "grammar", "quant",
         "lora", "spec", "tools", "shared")
# grammar: the join case's rows, with rows 0 and 2 constrained by this regex (llguidance). Its mask depends on
# where the row is in the pattern (a mask one token late breaks it), and it allows no end of sequence before
# 180 characters, so every row still produces exactly max_tokens tokens and the plan is the join case's; the
# constrained rows' logprobs are those of the masked distribution.
GRAMMAR_REGEX = "(ab |cd ){60,}"
GRAMMAR_ROWS = (0, 2)
# tools: the join case's rows, rows 1 and 3 forced to call one of these tools on a template without tools: the
# grammar mlxb writes for that (JSON in <tool_call> tags, mlxb.constrain.forced), frozen into the case as
# Lark text. A long minimum string keeps the call open through every row's tokens, so the plan is join's.
TOOLS_ROWS = (1, 3)
PARITY_TOOLS = [{"type": "function", "function": {"name": "open_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string", "minLength": 400, "maxLength": 800},
                                     "line": {"type": "integer"}}, "required": ["path"]}}},
    {"type": "function", "function": {"name": "run", "parameters": {
        "type": "object", "properties": {"cmd": {"type": "string", "minLength": 400}}, "required": ["cmd"]}}}]
# shared (shared-prefix KV, mlxb.cache.shared): rows whose prompts open with one SHARED_PREFIX-token prefix join in
# pairs and alone mid-decode and retire at different steps, with one unrelated row; the engine shares prefixes of
# at least SHARED_MIN tokens. Its full-attention layers then hold each sharing row's own tokens only, so their
# buffer geometry is not mlx-lm's by design: the case compares tokens and logits, not geometry. The cascade sums
# the attention output as two products instead of one, so logits may differ from mlx-lm's in the last bits:
# steps that are not bit-equal pass within SHARED_ENVELOPE (per dtype; docs/shared-prefix.md), tokens must agree.
SHARED_PREFIX, SHARED_MIN = 48, 16
SHARED_ENVELOPE = {"float32": {"max_abs_logprob": 1e-4, "kl_top5": 1e-7},
                   "bfloat16": {"max_abs_logprob": 0.0625, "kl_top5": 1e-3},
                   "float16": {"max_abs_logprob": 0.0078, "kl_top5": 1e-4}}
# prefix: every tiny preset; True where every layer is full attention / latent (reuse at any length)
PREFIX_TRIMMABLE = {"tiny-llama": True, "tiny-minicpm": True, "tiny-glm-mla": True,
                    "tiny-gemma3": False, "tiny-gemma4": False, "tiny-qwen3.5": False}
# lora: the join case's rows, each with adapter 0, none, 1, 0, ... (random-weight adapters built from LORA_ADAPTERS)
LORA_ADAPTERS = [{"seed": 1, "rank": 8, "num_layers": -1}, {"seed": 2, "rank": 4, "num_layers": 1}]
# ring, ssm and latent run where the model has such layers, quant where every layer is full attention
# (``skip_reason``); the rest run on every batchable model.
# quant (--kv-bits; presets whose every layer is full attention): the join case's rows with quantized KV,
# KV4 at odd B and KV8 at even B, group 32, converted from the first chunk. mlx-lm has no batched
# quantized cache, so the oracle keeps the batch's layout with three mlx-lm BatchKVCache lanes (packed
# values, scales, biases; oracle/quantized.py); the cache geometry is compared.
QUANT_GROUP = 32
# spec (prompt-lookup speculation; models whose every layer is full attention or latent): staggered rows whose
# prompts repeat a segment, each with its own draft length (0: the row does not speculate), K fixed (no
# adaptation). In an iteration whose batch holds a speculating row that may still draft, each such row proposes
# ``lookup(prompt + its tokens so far, min(k, max_tokens - produced - 1))``: the latest earlier occurrence of the
# history's last n tokens (n = ngram down to 1), preferring one followed by k tokens, and the tokens after it.
# If any row proposed, the forward is a verify step over [B, 1 + W] (W: the longest proposal; each row feeds its
# last token, its drafts, then its last token again as padding); a row keeps the longest prefix of its drafts
# that equals the argmax at each position, plus the argmax after it, and the other W - kept entries leave its
# caches: a lone row trims them; in a batch they stay as masked holes (the row's position goes back) that are
# compacted into the left padding before rows join or leave, and when a row holds more than
# max(SPEC_HOLE_MIN, width // SPEC_HOLE_FRACTION) of them. Otherwise it is a plain (pipelined) step.
SPEC_HOLE_MIN, SPEC_HOLE_FRACTION = 32, 8
MIN_SHARED = 32  # the engine's default --prompt-cache min shared tokens for a follower
SCHEMA = 2  # 2: whole prompts admitted in one iteration are prefilled together as a cohort


@dataclass
class RowSpec:
    prompt: list[int]
    max_tokens: int
    arrive: int  # iteration at which the request is submitted


@dataclass
class Case:
    model: str
    dtype: str
    case: str
    b: int
    seed: int
    rows: list[RowSpec]
    prefill_chunk: int = 2048
    join_full: str = "extend"  # extend | merge (full and latent layers)
    schema: int = SCHEMA
    # prompt cache on: {"trimmable": bool, "links": {row: {"base": earlier row, "ssd": bool}}}; a linked
    # row's prompt is its base row's prompt + output + its own ``prompt`` tokens
    prefix: Optional[dict] = None
    # constrained decoding: {"regex": str, "rows": [row, ...]} or {"lark": str, ...}; those rows sample under
    # the grammar's token mask
    grammar: Optional[dict] = None
    # quantized KV: {"bits": int, "group_size": int, "start": int} (mlx-lm's kv_bits, kv_group_size, quantized_kv_start)
    kv: Optional[dict] = None
    # LoRA adapters per row: {"adapters": [{"seed", "rank", "num_layers"}, ...], "rows": [slot per row, -1: base]}
    lora: Optional[dict] = None
    # prompt-lookup speculation: {"ngram": int, "rows": [draft tokens per row, 0: off]} (see SPEC_HOLE_MIN)
    spec: Optional[dict] = None

    @property
    def key(self) -> str:
        return f"{self.case}-b{self.b}"

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["prefix"] is None:
            del d["prefix"]  # cases without the prompt cache keep their digests
        if d["grammar"] is None:
            del d["grammar"]
        if d["kv"] is None:
            del d["kv"]
        if d["lora"] is None:
            del d["lora"]
        if d["spec"] is None:
            del d["spec"]
        return d

    def regex(self, r: int) -> Optional[str]:
        """The regex constraining row ``r``, or None."""
        g = self.grammar or {}
        return g.get("regex") if r in g.get("rows", ()) else None

    def constraint(self, r: int) -> Optional[tuple[str, str]]:
        """("regex" | "lark", text) constraining row ``r``, or None."""
        g = self.grammar or {}
        if r not in g.get("rows", ()):
            return None
        return ("lark", g["lark"]) if "lark" in g else ("regex", g["regex"])

    def link(self, r: int) -> Optional[dict]:
        return (self.prefix or {}).get("links", {}).get(str(r))

    def prompt_len(self, r: int) -> int:
        ln = self.link(r)
        own = len(self.rows[r].prompt)
        return own if ln is None else self.prompt_len(ln["base"]) + self.rows[ln["base"]].max_tokens + own

    def symbols(self, r: int) -> tuple:
        """Row ``r``'s prompt with each generated token as a symbol ("o", row, step)."""
        ln = self.link(r)
        if ln is None:
            return tuple(self.rows[r].prompt)
        b = ln["base"]
        return self.symbols(b) + tuple(("o", b, k) for k in range(self.rows[b].max_tokens)) + tuple(self.rows[r].prompt)

    def resolve(self, r: int, outputs: dict) -> list[int]:
        """Row ``r``'s real prompt ids, given earlier rows' generated tokens ``outputs[row]``."""
        ln = self.link(r)
        if ln is None:
            return list(self.rows[r].prompt)
        b = ln["base"]
        return self.resolve(b, outputs) + list(outputs[b]) + list(self.rows[r].prompt)

    @classmethod
    def from_dict(cls, d: dict) -> "Case":
        d = dict(d)
        d["rows"] = [RowSpec(**r) for r in d["rows"]]
        return cls(**d)

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

def skip_reason(case: str, kinds) -> Optional[str]:
    """Why ``case`` does not apply to a model with these layer kinds (``mlxb.cache.protocol.layer_kinds``),
    or None when it does. The case list adapts to the model instead of failing on it."""
    kinds = set(kinds)
    if None in kinds:
        return "the model has a layer cache the batch cannot hold (it is served on the serial lane only)"
    if case == "ring" and "rotating" not in kinds:
        return "no sliding-window layers"
    if case == "ssm" and "ssm" not in kinds:
        return "no recurrent (SSM) layers"
    if case == "latent" and "latent" not in kinds:
        return "no latent (MLA) attention layers"
    if case == "quant" and kinds != {"full"}:
        return "the quant oracle covers models whose every layer is full attention"
    if case == "shared" and "full" not in kinds:
        return "no full-attention layers (only those share a prefix)"
    if case == "spec" and not kinds <= {"full", "latent"}:
        return "speculation rolls back full-attention and latent layers only (this model decodes plainly with --spec)"
    return None

TOPK = 5


def step_record(token: int, vec: np.ndarray, geo=None) -> dict:
    """One row-step as both sides record it: token, sha256 of the float32 logprob vector, top-5,
    and ``g``: the first full-attention layer's (key buffer width, this row's left padding) right
    after the forward that produced the step (None without such a layer). The geometry is part of
    exactness: backends whose attention reduction depends on the buffer shape (Metal) change
    logits when padding is kept that mlx-lm trims, even where this backend's numbers do not move."""
    vec = np.ascontiguousarray(vec.reshape(-1), dtype=np.float32)
    top = np.argsort(-vec, kind="stable")[:TOPK]
    return {"t": int(token), "h": hashlib.sha256(vec.tobytes()).hexdigest(),
            "top": [[int(i), float(vec[i])] for i in top], "g": list(geo) if geo is not None else None}
