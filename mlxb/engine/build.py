"""Assemble model + engine + gateway from user-facing options (what serve/generate/bench share)."""

from __future__ import annotations

from typing import Optional

from mlxb.engine.engine import Engine, freeze_heap
from mlxb.engine.gateway import Gateway, context_limit
from mlxb.engine.warmup import warm_up
from mlxb.models import load_model


def build_gateway(model: Optional[str] = None, *, dtype: Optional[str] = None, batch: int = 8,
                  prefill_chunk: int = 2048, kv_budget: Optional[int] = None, default_max_tokens: int = 512,
                  chat_template: Optional[str] = None, warmup: bool = True, **engine_kw) -> Gateway:
    m, tok, spec, path = load_model(model, dtype)
    engine = Engine(m, tok, max_batch=batch, prefill_chunk=prefill_chunk, kv_budget=kv_budget,
                    context_limit=context_limit(m), **engine_kw)
    engine.warmup = warm_up(engine) if warmup else None  # before traffic: first-use kernel compiles
    engine.start()
    gw = Gateway(engine, tok, model_name=spec.name, default_max_tokens=default_max_tokens, chat_template=chat_template)
    gw.spec, gw.path = spec, path
    freeze_heap()
    return gw
