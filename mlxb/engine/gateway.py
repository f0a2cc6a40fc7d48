"""The gateway: validates, tokenizes and places each request, then streams results back.

Placement is by capability only: ``continuous`` iff the concurrency cap is above 1, every cache
layer of the model has a row-operation implementation, and the request uses only features the
continuous mechanism implements (today: all of them, sampling, seeds and logprobs included).
Otherwise ``serial``. ``--batch 1`` is therefore the strict serial path.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

from mlxb.engine.engine import Engine
from mlxb.engine.replies import ReplyIds
from mlxb.engine.scheduler import common_prefix
from mlxb.constrain.toolprompt import TemplateTools
from mlxb.constrain.tools import ToolFormat, constraint_grammar, normalize_messages, tool_choice_mode, validate_tools
from mlxb.engine.stream import OutputStream
from mlxb.errors import ValidationError
from mlxb.request import Request, SamplingParams

MAX_TOP_LOGPROBS = 20
_ids = itertools.count(1)


@dataclass
class GenerationInput:
    """What a caller asks for, before validation (server and CLI build this)."""

    messages: Optional[list[dict]] = None
    prompt: Optional[str] = None
    prompt_ids: Optional[list[int]] = None
    max_tokens: Optional[int] = None
    sampling: Optional[SamplingParams] = None
    stop: Optional[list[str]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    request_id: Optional[str] = None
    ignore_eos: bool = False  # vLLM's extension: decode exactly max_tokens (benchmarks)
    cache_prompt: bool = True  # llama.cpp's field: False = this request neither reuses nor stores a prefix
    num_draft_tokens: Optional[int] = None  # speculation (--spec): this request's draft length, 0 = off
    tools: Optional[list[dict]] = None  # OpenAI function tools: rendered by the chat template
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool = True  # False: at most one call (a forced call's grammar allows exactly one)
    response_format: Optional[dict] = None  # {"type": "text" | "json_object" | "json_schema", ...}
    structured_outputs: Optional[dict] = None  # vLLM's extension: one of json / regex / grammar / choice
    adapter: Optional[str] = None  # a LoRA adapter loaded with --adapters (None: the base model)
    received: Optional[float] = None  # when the server's handler got it (time.perf_counter), for the trace


class Gateway:
    def __init__(self, engine: Engine, tokenizer, *, model_name: str, default_max_tokens: int = 512,
                 chat_template: Optional[str] = None, tool_prompt: bool = True, prep_threads: int = 0):
        self.engine, self.tokenizer = engine, tokenizer
        self._system_prefixes: OrderedDict = OrderedDict()  # system messages + template args -> their prefix tokens
        self._system_lock = threading.Lock()
        # requests are validated and tokenized on these threads, off the server's event loop (0: on the loop)
        self.prep_threads = max(0, int(prep_threads))
        self._prep = ThreadPoolExecutor(self.prep_threads, thread_name_prefix="mlxb-prep") if self.prep_threads else None
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.chat_template = chat_template
        # a prompt cache keeps finished rows by their generated ids: resent replies take those ids again
        self.replies = ReplyIds(tokenizer, getattr(engine, "eos_ids", None)) if self._prompt_cache() is not None else None
        if self.replies is not None:
            engine.delivery.on_reply = self.replies.finished
        self.vocab_size = _vocab_size(engine.model, tokenizer)
        # tools on a template that drops them go into the system turn, asking for JSON calls in tags
        self.template_tools = TemplateTools.probe(tokenizer, chat_template, tool_prompt)
        self.json_tools = ToolFormat.json_tools()
        self.tool_format = self.json_tools if self.template_tools.adds else ToolFormat.of(tokenizer)
        self._grammars = None
        self._grammars_lock = threading.Lock()

    @property
    def grammars(self):
        """llguidance over this model's tokenizer, built on first use (about a second) and kept."""
        with self._grammars_lock:
            if self._grammars is None:
                from mlxb.constrain.grammar import Grammars

                try:
                    self._grammars = Grammars(self.tokenizer, self.vocab_size,
                                              sorted(getattr(self.tokenizer, "eos_token_ids", []) or []))
                except ImportError:
                    raise ValidationError("structured outputs need the llguidance package (pip install llguidance)",
                                          param="response_format") from None
            return self._grammars

    # ---- validation ------------------------------------------------------------------------
    def validate_sampling(self, p: SamplingParams) -> None:
        def bad(param, msg):
            raise ValidationError(f"{param}: {msg}", param=param)

        for name in ("temperature", "top_p", "min_p", "xtc_probability", "xtc_threshold"):
            v = getattr(p, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                bad(name, "must be a finite number")
        if p.temperature < 0:
            bad("temperature", "must be >= 0")
        if not 0 < p.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not 0 <= p.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if not isinstance(p.top_k, int) or p.top_k < 0:
            bad("top_k", "must be an integer >= 0")
        if not 0 <= p.xtc_probability <= 1:
            bad("xtc_probability", "must be in [0, 1]")
        if not 0 <= p.xtc_threshold <= 0.5:
            bad("xtc_threshold", "must be in [0, 0.5]")
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(p, name)
            if v is not None and (not isinstance(v, (int, float)) or not math.isfinite(v)):
                bad(name, "must be a finite number")
        if p.repetition_penalty is not None and p.repetition_penalty <= 0:
            bad("repetition_penalty", "must be > 0")
        for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
            v = getattr(p, name)
            if not isinstance(v, int) or v < 1:
                bad(name, "must be an integer >= 1")
        if p.logit_bias:
            for k, v in p.logit_bias.items():
                if not isinstance(k, int) or not 0 <= k < self.vocab_size:
                    bad("logit_bias", f"token id {k!r} is outside the vocabulary [0, {self.vocab_size})")
                if not isinstance(v, (int, float)) or not math.isfinite(v):
                    bad("logit_bias", f"bias for token {k} must be a finite number")
        if p.seed is not None and (not isinstance(p.seed, int) or isinstance(p.seed, bool)):
            bad("seed", "must be an integer")
        if not isinstance(p.top_logprobs, int) or not 0 <= p.top_logprobs <= MAX_TOP_LOGPROBS:
            bad("top_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")

    def tokenize(self, inp: GenerationInput) -> list[int]:
        return self.tokenize_with_chat(inp)[0]

    def tokenize_with_chat(self, inp: GenerationInput, splice: bool = False) -> tuple[list[int], Optional[tuple]]:
        """The prompt's token ids, and for a chat its messages and template arguments (``chat``). With
        ``splice``, remembered replies take their generated ids back (``mlxb.engine.replies``); the ordinary
        tokenization is then made only where it is needed."""
        chat = None
        given = [x is not None for x in (inp.messages, inp.prompt, inp.prompt_ids)]
        if sum(given) != 1:
            raise ValidationError("give exactly one of messages, prompt or prompt token ids", param="messages")
        if inp.prompt_ids is not None:
            ids = list(inp.prompt_ids)
            if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
                raise ValidationError(f"prompt token ids must be integers in [0, {self.vocab_size})", param="prompt")
        elif inp.prompt is not None:
            if not isinstance(inp.prompt, str):
                raise ValidationError("prompt must be a string", param="prompt")
            ids = self.tokenizer.encode(inp.prompt)
        else:
            chat = msgs, kwargs = self.chat(inp)

            def ordinary() -> list[int]:
                try:
                    return list(self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, **kwargs))
                except Exception as e:
                    raise ValidationError(f"the chat template failed on these messages: {e}", param="messages") from None

            ids = self.replies.splice(msgs, kwargs, ordinary) if splice and self.replies is not None else ordinary()
        if not ids:
            raise ValidationError("the prompt is empty after tokenization", param="prompt")
        return list(ids), chat

    def chat(self, inp: GenerationInput) -> tuple[list, dict]:
        """The messages and the chat template's arguments (template override, tools, request kwargs)."""
        kwargs = dict(inp.chat_template_kwargs or {})
        if self.chat_template:
            kwargs["chat_template"] = self.chat_template
        tools = validate_tools(inp.tools)
        msgs = normalize_messages(inp.messages)
        msgs, shown = self.template_tools.prepare(msgs, tools if inp.tool_choice != "none" else None)
        if tools and (shown or self.template_tools.renders_tools):
            kwargs["tools"] = tools
        return msgs, kwargs

    def _prompt_cache(self):
        return getattr(getattr(self.engine, "reuse", None), "cache", None)

    def system_mark(self, inp: GenerationInput, ids: list[int], chat: Optional[tuple] = None) -> list[int]:
        """Where the leading system (and developer) messages' tokens end, as far as the template shows it:
        the common prefix of this prompt with the same system part followed by another user message. Only
        for a prompt cache of exact snapshots (recurrent or sliding-window layers), whose prefill then
        snapshots there, so the next agent with that system prompt finds it from the first agent on."""
        pc = getattr(getattr(self.engine, "reuse", None), "cache", None)
        if inp.messages is None or pc is None or pc.trimmable or not inp.cache_prompt:
            return []
        msgs, kwargs = chat or self.chat(inp)
        n = next((i for i, m in enumerate(msgs) if m.get("role") not in ("system", "developer")), len(msgs))
        if n == 0 or n == len(msgs):
            return []
        key = json.dumps([msgs[:n], kwargs], sort_keys=True, default=str)
        with self._system_lock:
            prefix = self._system_prefixes.get(key)  # agents resend one system prompt: render it once
        if prefix is None or ids[:len(prefix)] != prefix:
            try:  # a stand-in user turn: many templates refuse a conversation without one
                other = self.tokenizer.apply_chat_template(msgs[:n] + [{"role": "user", "content": "\u2026"}],
                                                           add_generation_prompt=True, **kwargs)
            except Exception:
                return []
            prefix = list(ids[:common_prefix(ids, list(other), len(ids) - 1)])
        with self._system_lock:
            self._system_prefixes[key] = prefix
            self._system_prefixes.move_to_end(key)
            while len(self._system_prefixes) > 64:
                self._system_prefixes.popitem(last=False)
        k = min(len(prefix), len(ids) - 1)
        return [k] if k >= self.engine.scheduler.min_shared else []

    def build(self, inp: GenerationInput) -> Request:
        began = time.perf_counter()
        sampling = inp.sampling or SamplingParams()
        self.validate_sampling(sampling)
        max_tokens = self.default_max_tokens if inp.max_tokens is None else inp.max_tokens
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValidationError("max_tokens must be an integer >= 1", param="max_tokens")
        stop = inp.stop or []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 16:
            raise ValidationError("stop must be a string or a list of at most 16 strings", param="stop")
        k = inp.num_draft_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= 32):
            raise ValidationError("num_draft_tokens must be an integer from 0 (no speculation) to 32",
                                  param="num_draft_tokens")
        remember = inp.messages is not None and inp.cache_prompt and self.replies is not None
        ids, chat = self.tokenize_with_chat(inp, splice=remember)
        slot = self.adapter_slot(inp.adapter)
        req = Request(inp.request_id or f"req-{next(_ids)}", ids, max_tokens, sampling, stop,
                      ignore_eos=inp.ignore_eos, cache_prompt=inp.cache_prompt, num_draft_tokens=k, adapter=slot,
                      snapshot_at=self.system_mark(inp, ids, chat))
        req.reply_ids = [] if remember else None
        req.timings.received, req.timings.prepared = inp.received, began
        req.constraint, req.tool_format = self.constraint(inp)
        req.mechanism = self.place(req)
        self.engine.check_admissible(req)
        return req

    @property
    def adapters(self) -> list[str]:
        lora = getattr(self.engine.model, "mlxb_lora", None)
        return list(lora.names) if lora is not None else []

    def adapter_slot(self, name: Optional[str]) -> int:
        if name is None:
            return -1
        if name not in self.adapters:
            from mlxb.errors import ModelNotFoundError

            raise ModelNotFoundError(f"adapter {name!r} is not loaded here; loaded: {self.adapters or 'none'} "
                                     "(start the server with --adapters NAME=PATH)", param="model")
        return self.adapters.index(name)

    def constraint(self, inp: GenerationInput) -> tuple:
        """(the row's grammar matcher (``mlxb.constrain.grammar.Constraint``) or None, the format its tool
        calls are parsed in or None); a bad format is a 400. A forced call is written, and read, in the
        model's format where mlxb has a grammar writer for it, else as JSON in <tool_call> tags."""
        tools = validate_tools(inp.tools)
        choice = tool_choice_mode(inp.tool_choice, tools)
        fmt = None
        if tools and inp.tool_choice != "none" and inp.messages is not None:
            forced = choice[0] == "required" and not self.tool_format.forcible
            fmt = self.json_tools if forced else (self.tool_format if self.tool_format.on else None)
        if inp.response_format is None and inp.structured_outputs is None and choice[0] != "required":
            return None, fmt
        made = constraint_grammar(self.grammars, response_format=inp.response_format,
                                  structured=inp.structured_outputs, tools=tools, choice=choice,
                                  fmt=fmt or self.json_tools, parallel=inp.parallel_tool_calls is not False)
        return (None if made is None else self.grammars.constraint(*made)), fmt

    def tool_summary(self) -> str:
        """One line for the start-up banner: how tools reach the model and how its calls are read."""
        tf, tt = self.tool_format, self.template_tools
        if tt.adds:
            return ("the chat template drops tools, so their schemas go into the system turn and calls are asked "
                    "for as JSON in <tool_call> tags (json_tools parser; forced calls too; --no-tool-prompt turns "
                    "this off)")
        dropped = "" if tt.renders_tools else "; the chat template drops tools (left so: --no-tool-prompt)"
        if not tf.on:
            return ("no tool-call format is known for this chat template: auto calls come back as text; forced "
                    "calls (tool_choice required or named) are written as JSON in <tool_call> tags" + dropped)
        src = "mlx-lm's" if tf.source == "mlx-lm" else "mlxb's"
        forced = "in that format" if tf.forcible else "as JSON in <tool_call> tags"
        return f"parsed with {src} {tf.name} parser ({tf.start} ... {tf.end}); forced calls {forced}{dropped}"

    def tool_card(self) -> dict:
        """What /v1/models says about tools."""
        return {"tool_parser": self.tool_format.name if self.tool_format.on else None,
                "forced_tool_calls": self.tool_format.writer if self.tool_format.forcible else "json_tools",
                **self.template_tools.card()}

    def place(self, req: Request) -> str:
        # NOTE: placement reads capability only; sampling features never force the serial path.
        if self.engine.max_batch > 1 and self.engine.batchable:
            return "continuous"
        return "serial"

    # ---- submission ------------------------------------------------------------------------
    def submit(self, inp: GenerationInput | Request, loop: Optional[asyncio.AbstractEventLoop] = None) -> tuple[Request, OutputStream]:
        req = inp if isinstance(inp, Request) else self.build(inp)
        stream = OutputStream(req.request_id, loop)
        self.engine.submit(req, stream)
        return req, stream

    async def submit_async(self, inp: GenerationInput, loop: asyncio.AbstractEventLoop) -> tuple[Request, OutputStream]:
        """``submit`` from the server's event loop: the request is validated and tokenized on a prep thread
        (``prep_threads``), so a burst of long prompts is tokenized in parallel (the tokenizer releases the
        GIL) while the loop keeps streaming other requests' tokens; then submitted from the loop."""
        if self._prep is None:
            return self.submit(inp, loop)
        req = await loop.run_in_executor(self._prep, self.build, inp)
        return self.submit(req, loop)

    def close(self) -> None:
        if self._prep is not None:
            self._prep.shutdown(wait=False, cancel_futures=True)

    def cancel(self, request_id: str) -> None:
        self.engine.cancel(request_id)


def _vocab_size(model, tokenizer) -> int:
    args = getattr(model, "args", None)
    v = getattr(args, "vocab_size", None)
    if v is None and hasattr(args, "text_config"):
        v = args.text_config.get("vocab_size") if isinstance(args.text_config, dict) else None
    return int(v or len(tokenizer.vocab))


def context_limit(model) -> Optional[int]:
    args = getattr(model, "args", None)
    v = getattr(args, "max_position_embeddings", None)
    if v is None and hasattr(args, "text_config") and isinstance(args.text_config, dict):
        v = args.text_config.get("max_position_embeddings")
    return int(v) if v else None
