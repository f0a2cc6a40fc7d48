"""A served composition run through the ``openai`` SDK: start ``mlxb serve`` with the flags given, send one
lone chat (a repetitive prompt, so lookup drafts), then six concurrent chats (rows cycle through the base and
each adapter ``/v1/models`` lists) sharing a long system prompt
(one with logprobs), a ``json_schema`` row, a forced tool call (``tool_choice: required``), then a lone one again; print finish reasons, the speculation and prompt-cache counters
of ``/stats`` and ``/health``. Exits non-zero if a request fails or ``/health`` is not ok.

    python3 scripts/serve_compose.py PORT --model M [serve flags ...]
    e.g. --fuse-projections --spec lookup --spec-pipeline on --spec-max-batch 8 [--kv-bits 8 --kv-group-size 32]
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import sys

import httpx
from openai import OpenAI

import served  # scripts/served.py


def main() -> int:
    port, args = int(sys.argv[1]), sys.argv[2:]
    model = args[args.index("--model") + 1]
    proc, base = served.start(port, args, wait_s=180)
    try:
        client = OpenAI(base_url=f"{base}/v1", api_key="unused")
        ids = [m.id for m in client.models.list().data]  # with --adapters: the base and each "base:adapter"
        print("models", ids)
        system = "You are a careful agent. " * 40

        def chat(i: int):
            r = client.chat.completions.create(
                model=ids[i % len(ids)], temperature=0, max_tokens=48, logprobs=i == 1, top_logprobs=2 if i == 1 else None,
                messages=[{"role": "system", "content": system}, {"role": "user", "content": "alpha beta gamma delta " * (10 + i)}])
            return r.choices[0].finish_reason, r.usage.completion_tokens

        print("lone", chat(0))
        with cf.ThreadPoolExecutor(6) as ex:
            print("fleet", list(ex.map(chat, range(1, 7))))
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
        r = client.chat.completions.create(model=model, max_tokens=40, messages=[{"role": "user", "content": "json"}],
                                           response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
        try:  # the schema allows extra keys, so a row cut at max_tokens may stop inside one
            print("json_schema row", json.loads(r.choices[0].message.content))
        except json.JSONDecodeError:
            print("json_schema row cut short:", r.choices[0].finish_reason, repr(r.choices[0].message.content[:80]))
            if r.choices[0].finish_reason != "length":
                raise
        tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                  "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
        r = client.chat.completions.create(model=model, max_tokens=60, tools=tools, tool_choice="required",
                                           messages=[{"role": "user", "content": "open the readme"}])
        calls = r.choices[0].message.tool_calls or []
        print("forced tool row", r.choices[0].finish_reason, [(c.function.name, c.function.arguments[:40]) for c in calls])
        print("lone again", chat(9))
        eng = httpx.get(f"{base}/stats").json()["engine"]
        sp = eng.get("speculation") or {}
        print("speculation", json.dumps({k: sp.get(k) for k in ("pipeline", "verify_steps", "drafted", "accepted", "pipelined_kept",
                                                                "pipelined_dropped", "pipelined_cancelled")}))
        if eng.get("lora"):
            print("lora_path", eng["lora"].get("lora_path"))
        pc = httpx.get(f"{base}/stats").json().get("prompt_cache") or {}
        print("prompt cache", json.dumps({k: pc.get(k) for k in ("lookups", "hits", "cached_tokens", "evictions", "ssd_restores",
                                                                 "ssd_hashed", "ssd_prefetched") if k in pc}))
        health = httpx.get(f"{base}/health").json()
        print("health", health)
        return 0 if health.get("status") == "ok" else 1
    finally:
        served.stop(proc)


if __name__ == "__main__":
    sys.exit(main())
