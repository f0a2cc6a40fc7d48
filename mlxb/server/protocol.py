"""OpenAI request parsing (strict, naming the field) and response/chunk shaping."""

from __future__ import annotations

import time
import uuid
from typing import Any, Optional

from mlxb.engine.gateway import GenerationInput
from mlxb.errors import MlxbError, ValidationError
from mlxb.request import RequestOutput, SamplingParams

UNSUPPORTED = {  # field -> what it would do (the 400 names it and says to remove the field)
    "draft_model": "a per-request draft model (start the server with "
    "--draft-model)", "functions": "legacy functions (use tools)", "function_call": "legacy function_call (use "
    "tool_choice)", "best_of": "best_of (several candidates, the best returned; n returns them all)",
    "suffix": "suffix (fill-in-the-middle insertion)", "guided_json": "guided_json (use response_format or structured_outputs)", "guided_regex": "guided_regex (use "
    "structured_outputs.regex)", "guided_grammar": "guided_grammar (use structured_outputs.grammar)",
    "guided_choice": "guided_choice (use structured_outputs.choice)"}
MAX_N = 16  # choices per request (each is a row of the batch)

NUM = (int, float)


def _get(body: dict, key: str, types, default=None, *, allow_none=True):
    if key not in body or (body[key] is None and allow_none):
        return default
    v = body[key]
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ValidationError(f"{key} must be {_tname(types)}, got a boolean", param=key)
    if not isinstance(v, types):
        raise ValidationError(f"{key} must be {_tname(types)}, got {type(v).__name__}", param=key)
    return v


def _tname(types) -> str:
    types = types if isinstance(types, tuple) else (types,)
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", list: "a list", dict: "an object"}
    return " or ".join(names.get(t, t.__name__) for t in types)


def parse(body: Any, *, chat: bool, default_max_tokens: int) -> tuple[GenerationInput, dict]:
    """Return the gateway input and the response options (stream, include_usage, logprobs shape)."""
    if not isinstance(body, dict):
        raise ValidationError("the request body must be a JSON object")
    for key, what in UNSUPPORTED.items():
        v = body.get(key)
        if v not in (None, [], {}, False) and not (key == "best_of" and v == 1):
            raise MlxbError(f"{key}: {what} is not supported by mlxb; remove the field", param=key,
                            code="unsupported_field")
    n = _get(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise ValidationError(f"n must be between 1 and {MAX_N} (choices per request), got {n}", param="n")
    if chat:
        messages = _get(body, "messages", list)
        if messages is None:
            raise ValidationError("messages is required", param="messages")
        prompt = None
    else:
        prompt = body.get("prompt")
        if prompt is None:
            raise ValidationError("prompt is required", param="prompt")
        messages = None
    prompts = [(None, None)]  # per prompt of a batch: (text, token ids); chat has one, from messages
    if not chat:
        prompts = _prompts(prompt, n)
        prompt, prompt_ids = prompts[0]
    else:
        prompt_ids = None

    max_tokens = _get(body, "max_completion_tokens", int, None)
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", int, default_max_tokens)
    echo = _get(body, "echo", bool, False)
    if echo and chat:
        raise ValidationError("echo belongs to /v1/completions (the prompt repeated before the completion)", param="echo")
    score_only = echo and max_tokens == 0  # scoring: the prompt and its logprobs, nothing generated
    if score_only:
        max_tokens = 1  # never submitted; 1 passes the gateway's checks of the request
    if chat:
        want_lp = _get(body, "logprobs", bool, False)
        top = _get(body, "top_logprobs", int, 0)
        if top and not want_lp:
            raise ValidationError("top_logprobs needs logprobs: true", param="top_logprobs")
    else:
        top = _get(body, "logprobs", int, None)
        want_lp = top is not None
        top = top or 0
    bias = _get(body, "logit_bias", dict, None)
    if bias is not None:
        try:
            bias = {int(k): v for k, v in bias.items()}
        except (TypeError, ValueError):
            raise ValidationError("logit_bias keys must be token ids", param="logit_bias") from None
    sp = SamplingParams(
        temperature=_get(body, "temperature", NUM, 0.0),
        top_p=_get(body, "top_p", NUM, 1.0),
        top_k=_get(body, "top_k", int, 0),
        min_p=_get(body, "min_p", NUM, 0.0),
        xtc_probability=_get(body, "xtc_probability", NUM, 0.0),
        xtc_threshold=_get(body, "xtc_threshold", NUM, 0.1),
        repetition_penalty=_get(body, "repetition_penalty", NUM, None),
        repetition_context_size=_get(body, "repetition_context_size", int, 20),
        presence_penalty=_get(body, "presence_penalty", NUM, None),
        presence_context_size=_get(body, "presence_context_size", int, 20),
        frequency_penalty=_get(body, "frequency_penalty", NUM, None),
        frequency_context_size=_get(body, "frequency_context_size", int, 20),
        logit_bias=bias,
        seed=_get(body, "seed", int, None),
        logprobs=want_lp,
        top_logprobs=top,
    )
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, (str, list)):
        raise ValidationError("stop must be a string or a list of strings", param="stop")
    stream_opts = _get(body, "stream_options", dict, {}) or {}
    inp = GenerationInput(messages=messages, prompt=prompt, prompt_ids=prompt_ids, max_tokens=max_tokens,
                          sampling=sp, stop=[stop] if isinstance(stop, str) else stop,
                          chat_template_kwargs=_get(body, "chat_template_kwargs", dict, None),
                          ignore_eos=_get(body, "ignore_eos", bool, False),
                          cache_prompt=_get(body, "cache_prompt", bool, True),
                          num_draft_tokens=_get(body, "num_draft_tokens", int, None),
                          response_format=_get(body, "response_format", dict, None),
                          structured_outputs=_get(body, "structured_outputs", dict, None))
    if chat:
        inp.tools = _get(body, "tools", list, None)
        inp.tool_choice = body.get("tool_choice")
        inp.parallel_tool_calls = _get(body, "parallel_tool_calls", bool, True)
    elif body.get("tools") or body.get("tool_choice"):
        raise ValidationError("tools belong to /v1/chat/completions", param="tools")
    opts = {
        "stream": _get(body, "stream", bool, False),
        "n": n,
        "prompts": prompts,  # /v1/completions: every prompt of a batch (choice index = prompt * n + choice)
        "adapters": _get(body, "adapters", str, None),  # mlx-lm's field: a loaded adapter's name or folder
        "include_usage": bool(stream_opts.get("include_usage", False)),
        "model": _get(body, "model", str, None),
        "logprobs": want_lp,
        "top": top,
        "echo": echo,
        "score_only": score_only,
        # tool calls are parsed out of the text unless tool_choice is "none"
        "tools": inp.tools if chat and inp.tools and inp.tool_choice != "none" else None,
        "parallel_tool_calls": inp.parallel_tool_calls if chat else True,
    }
    return inp, opts


PROMPT_SHAPE = ("prompt must be a string, a list of token ids, or a list of those (a batch of prompts: "
                "choices come back prompt by prompt)")


def _prompts(prompt: Any, n: int) -> list[tuple[Optional[str], Optional[list[int]]]]:
    """OpenAI's completions ``prompt``: a string, token ids, or a batch of either."""
    def one(p, where):
        if isinstance(p, str):
            return p, None
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return None, p
        raise ValidationError(f"{where}: {PROMPT_SHAPE}", param="prompt")

    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) * n > MAX_N:
            raise ValidationError(f"{len(prompt)} prompts x n={n} makes {len(prompt) * n} choices; at most {MAX_N} "
                                  "per request (each is a row of the batch): split the batch", param="prompt")
        return [one(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [one(prompt, "prompt")]


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


MIN_LOGPROB = -9999.0  # what OpenAI reports for tokens with no probability (JSON has no -Infinity)


def _lp(x: float) -> float:
    """A logprob for JSON: a grammar-masked token's -inf becomes MIN_LOGPROB."""
    return x if x > MIN_LOGPROB else MIN_LOGPROB


def _tok_text(tokenizer, t: int) -> str:
    return tokenizer.decode([t])


def logprobs_chat(tokenizer, outs: list[RequestOutput]) -> Optional[dict]:
    content = []
    for o in outs:
        if o.logprob is None:
            continue
        s = _tok_text(tokenizer, o.logprob.token)
        content.append({
            "token": s, "logprob": _lp(o.logprob.logprob), "bytes": list(s.encode()),
            "top_logprobs": [{"token": _tok_text(tokenizer, t), "logprob": _lp(lp), "bytes": list(_tok_text(tokenizer, t).encode())}
                             for t, lp in o.logprob.top],
        })
    return {"content": content}


def logprobs_completion(tokenizer, outs: list[RequestOutput], start: int = 0) -> Optional[dict]:
    """OpenAI's legacy logprobs block; ``start``: the completion text's length before these tokens (a stream)."""
    toks, lps, tops = [], [], []
    for o in outs:
        if o.logprob is None:
            continue
        toks.append(_tok_text(tokenizer, o.logprob.token))
        lps.append(_lp(o.logprob.logprob))
        tops.append({_tok_text(tokenizer, t): _lp(lp) for t, lp in o.logprob.top})
    return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": _offsets(toks, start)}


def _offsets(toks: list[str], start: int = 0) -> list[int]:
    """Each token's offset in the text they make, which starts at ``start``."""
    offsets, at = [], start
    for t in toks:
        offsets.append(at)
        at += len(t)
    return offsets


def echo_logprobs(tokenizer, ids: list[int], scores: list) -> dict:
    """The legacy logprobs block of an echoed prompt: the first token has none (nothing precedes it)."""
    toks = [_tok_text(tokenizer, t) for t in ids]
    return {"tokens": toks, "token_logprobs": [None] + [_lp(lp) for lp, _ in scores],
            "top_logprobs": [None] + [{_tok_text(tokenizer, t): _lp(v) for t, v in top} for _, top in scores],
            "text_offset": _offsets(toks)}


def echo_gap(tokenizer, token: Optional[int], text: str) -> str:
    """The space mlx-lm's streaming detokenizers drop before a completion's first token: kept after an
    echoed prompt, so the text reads as the tokens (and their ``text_offset``) say."""
    if token is None or text.startswith(" ") or not _tok_text(tokenizer, token).startswith(" "):
        return ""
    return " "


def join_logprobs(a: Optional[dict], b: Optional[dict]) -> Optional[dict]:
    """Two legacy logprobs blocks one after the other (``b``'s offsets already count ``a``'s text)."""
    if a is None or b is None:
        return a or b
    return {k: a[k] + b[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def usage(u: dict) -> dict:
    out = {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
           "total_tokens": u["total_tokens"], "prompt_tokens_details": {"cached_tokens": u.get("cached_tokens", 0)}}
    if "draft_tokens" in u:  # --spec: this request's draft tokens and how many the model kept
        out["draft_tokens"], out["accepted_tokens"] = u["draft_tokens"], u["accepted_tokens"]
    return out


def finish(reason: Optional[str]) -> Optional[str]:
    return {"cancelled": "stop", "error": "stop"}.get(reason, reason)


def chunk(cid: str, model: str, chat: bool, text: str, reason: Optional[str], lp: Optional[dict] = None,
          first: bool = False, tool_calls: Optional[list[dict]] = None, index: int = 0) -> dict:
    now = int(time.time())
    if chat:
        delta = {"role": "assistant", "content": text} if (text or first) else {}
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        return {"id": cid, "object": "chat.completion.chunk", "created": now, "model": model, "choices": [choice]}
    return {"id": cid, "object": "text_completion", "created": now, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": lp, "finish_reason": reason}]}


def choice(chat: bool, index: int, text: Optional[str], reason: str, lp: Optional[dict],
           tool_calls: Optional[list[dict]] = None) -> dict:
    if chat:
        message = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {"index": index, "message": message, "logprobs": lp, "finish_reason": reason}
    return {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}


def full(cid: str, model: str, chat: bool, choices: list[dict], u: dict) -> dict:
    return {"id": cid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage(u)}


def total_usage(us: list[dict], n: int = 1) -> dict:
    """Usage of a request with several choices (``n`` per prompt, prompt by prompt): each prompt once,
    every choice's completion tokens."""
    out = dict(us[0])
    for k in ("completion_tokens", "draft_tokens", "accepted_tokens"):
        if k in out:
            out[k] = sum(u.get(k, 0) for u in us)
    for k in ("prompt_tokens", "cached_tokens"):
        if k in out:
            out[k] = sum(u.get(k, 0) for u in us[::n])
    out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    return out


def error_body(e: MlxbError) -> dict:
    return {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}}
