"""Assemble model + engine + gateway from user-facing options (what serve/generate/bench share)."""

from __future__ import annotations

from typing import Optional

from mlxb.engine.engine import Engine
from mlxb.engine.gateway import Gateway, context_limit
from mlxb.engine.warmup import freeze_heap, warm_up
from mlxb.models import load_model


def device_memory() -> int:
    """The allocator's memory limit (MLX's own: the working set on Metal, device memory on CUDA)."""
    import mlx.core as mx

    from mlxb.doctor import memory_bytes

    try:
        return int(mx.get_memory_limit()) or memory_bytes()
    except Exception:
        return memory_bytes()


def default_cache_bytes(kv_budget: Optional[int], weights_bytes: int = 0) -> int:
    """RAM tier cap when --prompt-cache-bytes is not given: the whole --kv-budget (entries give way
    to live rows at admission), else a quarter of the device memory the weights leave free. An eighth was
    too small for 32 agents on an 8B model on an H100 80GB (8 GB against ~10.5 GB of live conversations): the
    tier evicted the agents' last turns in the order their next turns came, so 13 and then 30 of 32 turns
    (two turns of one measured run) prefilled their whole conversation again (``reports/h100/session55``). Entries still give way to live rows (admission)
    and to device memory pressure (``memory_limit``)."""
    if kv_budget is not None:
        return kv_budget
    return max((device_memory() - weights_bytes) // 4, 64 << 20)


def build_prompt_cache(engine: Engine, *, kv_budget: Optional[int], max_bytes: Optional[int] = None,
                       max_entries: Optional[int] = None, disk_dir: Optional[str] = None,
                       disk_bytes: Optional[int] = None, mirrored: bool = False):
    """``mirrored`` (--tp): rank 0's cache tells the other ranks what to keep (RAM and SSD tiers)."""
    from functools import partial

    from mlxb.cache.prompt_cache import PromptCache
    from mlxb.models.synth import mlxb_home

    if not engine.batchable:
        return None
    from mlx.utils import tree_flatten

    cls = PromptCache
    if mirrored:
        from mlxb.distributed.cache import MirroredPromptCache

        cls = partial(MirroredPromptCache, runner=engine.runner)
    weights = sum(a.nbytes for _, a in tree_flatten(engine.model.parameters()))
    ram = default_cache_bytes(kv_budget, weights) if max_bytes is None else max_bytes
    return cls(engine.model, engine.kinds,
                       max_bytes=ram,
                       memory_limit=int(0.75 * device_memory()),
                       max_entries=max_entries,
                       disk_dir=disk_dir or (mlxb_home() / "prompt-cache"),
                       # NOTE: a tier smaller than the RAM tier holds nothing the RAM tier would not: a fleet whose
                       # conversations outgrow RAM is evicted in the order its turns come back, and only a larger
                       # SSD tier catches them
                       disk_bytes=max(8 << 30, 2 * ram) if disk_bytes is None else disk_bytes,
                       kv_scheme=engine.kv_scheme.name if engine.kv_scheme is not None else "none")


CUDNN_SDPA_ENV = "MLX_CUDA_USE_CUDNN_SDPA"


def choose_attention_kernels(cudnn: Optional[bool] = None) -> str:
    """On CUDA, MLX runs prefill attention through cuDNN graphs that it builds once per (shape,
    strides, mask) key: 0.7-1.0 s for each never-seen key on an H200 (scripts/shape_cost.py), and
    a server's cohorts, tails and cached contexts are new shapes all the time. MLX's own attention
    path costs nothing per shape (same speed for a 2k solo prefill, 10-20% slower on small padded
    cohorts), so a server turns cuDNN attention off unless asked (``cudnn=True``) or the user set
    the variable. Backend-neutral: elsewhere the variable means nothing. Returns what is in effect."""
    import os

    import mlx.core as mx

    if not (hasattr(mx, "cuda") and mx.cuda.is_available()):
        return "n/a (not CUDA)"
    if cudnn is None:
        if CUDNN_SDPA_ENV in os.environ:
            return f"{CUDNN_SDPA_ENV}={os.environ[CUDNN_SDPA_ENV]} (from the environment)"
        cudnn = False
    os.environ[CUDNN_SDPA_ENV] = "1" if cudnn else "0"
    return f"{CUDNN_SDPA_ENV}={os.environ[CUDNN_SDPA_ENV]}"


def cuda_graph_env() -> str:
    """What MLX's CUDA graph-cache check is set to here (``mlxb.doctor.graph_check_env``, which sets it);
    "n/a (not CUDA)" elsewhere."""
    import os

    import mlx.core as mx

    from mlxb.doctor import graph_check_env

    if not (hasattr(mx, "cuda") and mx.cuda.is_available()):
        return "n/a (not CUDA)"
    return graph_check_env(os.environ)


def spec_method(spec: Optional[str], draft_model: Optional[str]) -> Optional[str]:
    """``--spec``: None (the default) is prompt lookup on the batch lane (a draft model's ``draft`` when one
    is given); ``off`` turns speculation off. Lookup costs no device memory and its adaptive controller keeps
    a batch plain where drafts would not pay (docs/speculation.md)."""
    from mlxb.errors import ValidationError

    if spec == "off":
        if draft_model is not None:
            raise ValidationError("--draft-model drafts for speculation, which --spec off turns off: give one of them",
                                  param="spec")
        return None
    if spec is None:
        return "draft" if draft_model is not None else "lookup"
    return spec


def build_spec(model, tok, method: str, num_draft_tokens: int, lookup_ngram: int, draft_model: Optional[str],
               dtype: Optional[str], max_batch: int = 1, adaptive: bool = True, pipeline: str = "off"):
    """--spec / --draft-model as a SpecConfig; a draft model is loaded and checked against the target."""
    from mlxb.spec.verify import SpecConfig
    from mlxb.errors import ValidationError

    draft = name = None
    try:
        if draft_model is not None:
            from mlxb.spec.draft import check_draft

            draft, dtok, dspec, _ = load_model(draft_model, dtype)
            check_draft(model, tok, draft, dtok)
            name = dspec.name
        return SpecConfig(method, num_draft_tokens, lookup_ngram, draft_model=draft, draft_name=name, max_batch=max_batch,
                          adaptive=adaptive, pipeline=pipeline)
    except ValueError as e:
        raise ValidationError(str(e), param="draft_model" if draft_model else "spec") from None


def build_gateway(model: Optional[str] = None, *, dtype: Optional[str] = None, batch: int = 8,
                  prefill_chunk: int = 2048, kv_budget: Optional[int] = None, default_max_tokens: int = 512,
                  chat_template: Optional[str] = None, warmup: bool = True, prompt_cache: bool = True,
                  prompt_cache_bytes: Optional[int] = None, prompt_cache_size: Optional[int] = None,
                  prompt_cache_dir: Optional[str] = None, prompt_cache_disk_bytes: Optional[int] = None,
                  cudnn_attention: Optional[bool] = None, kv_bits: Optional[int] = None, kv_group_size: int = 64,
                  quantized_kv_start: int = 0, kv_config: Optional[str] = None, spec: Optional[str] = None,
                  num_draft_tokens: int = 4, lookup_ngram: int = 3, draft_model: Optional[str] = None,
                  spec_max_batch: Optional[int] = None, spec_fixed: bool = False, spec_pipeline: str = "off", adapters: Optional[dict] = None, max_loras: Optional[int] = None,
                  max_lora_rank: Optional[int] = None, lora_path: Optional[str] = None, tp: int = 1, tp_timeout: float = 60.0,
                  compile_decode: bool = False, compile_batch: bool = False, skinny_matmul: bool = False,
                  fuse_projections: bool = False, tool_prompt: bool = True, share_prefix: bool = True,
                  share_min_tokens: int = 256, share_f32_values: bool = False, prep_threads: int = 4,
                  **engine_kw) -> Gateway:
    attention = choose_attention_kernels(cudnn_attention)  # before the first forward (the warm-up)
    graphs = cuda_graph_env()  # before the first GPU operation (the model's load)
    link = tp_link(tp, batch=batch) if tp > 1 else None
    scheme = None
    if kv_bits is not None:
        from mlxb.cache.kv_plan import KVScheme

        try:
            scheme = KVScheme(kv_bits, kv_group_size, quantized_kv_start)
        except ValueError as e:
            from mlxb.errors import ValidationError

            raise ValidationError(str(e), param="kv_bits") from None
    m, tok, spec_, path = load_model(model, dtype, lazy=link is not None)
    if link is not None:  # each rank keeps its shard of the weights (and of every KV row)
        from mlxb.distributed.leader import shard_model
        from mlxb.distributed.follower import run_follower

        shard_model(m, link.group, spec_.name)
    if adapters:  # {name: folder}: every adapter over the shared base, chosen per row
        from mlxb.adapters.lora import install, read_adapter
        from mlxb.errors import ValidationError

        if max_loras is not None and len(adapters) > max_loras:
            raise ValidationError(f"{len(adapters)} adapters given, above --max-loras {max_loras}", param="adapters")
        install(m, [read_adapter(n, p) for n, p in adapters.items()], max_lora_rank, lora_path=lora_path)
    if fuse_projections:
        use_fused_projections(m, adapters=bool(adapters), tp=link is not None, compiled=compile_decode or compile_batch)
    method = spec_method(spec, draft_model)
    if method is not None and (link is None or link.rank == 0):  # proposers: rank 0
        engine_kw["spec"] = build_spec(m, tok, method, num_draft_tokens, lookup_ngram, draft_model, dtype,
                                       spec_max_batch or batch, adaptive=not spec_fixed, pipeline=spec_pipeline)
    if skinny_matmul:  # after the adapters (their base products take it too) and the draft model
        use_skinny_matmul(m, engine_kw.get("spec"))
    if kv_config is not None:
        from mlx_lm.models.cache import make_prompt_cache

        from mlxb.cache.kv_plan import KVPlan
        from mlxb.errors import ValidationError

        if kv_bits is not None:
            raise ValidationError("give --kv-bits or --kv-config, not both (the file has its own default bits)",
                                  param="kv_config")
        try:
            from mlxb.cache.protocol import layer_kinds

            scheme = KVPlan.from_file(kv_config, len(make_prompt_cache(m)), layer_kinds(m))
        except ValueError as e:
            raise ValidationError(str(e), param="kv_config") from None
    if compile_decode or compile_batch:  # --compile-batch implies --compile-decode
        check_compile_decode(m, batch=batch, lora=adapters, tp=link is not None)
        engine_kw["compile_decode"] = "all" if compile_batch else "lone"
    if share_min_tokens < 1:
        from mlxb.errors import ValidationError

        raise ValidationError(f"--share-min-tokens {share_min_tokens}: give at least 1 (or --no-share-prefix to turn "
                              "sharing off)", param="share_min_tokens")
    # under --tp too: every rank runs the start-up probe after ENGINE and shares only where all ranks can
    engine_kw.setdefault("share_min", share_min_tokens if share_prefix else None)
    engine_kw.setdefault("share_f32_values", share_f32_values)
    if link is not None and link.rank != 0:  # no HTTP here: replay rank 0's runner calls until it stops
        from mlxb.models.synth import mlxb_home

        ssd = prompt_cache and prompt_cache_disk_bytes != 0  # as rank 0's build_prompt_cache decides
        raise SystemExit(run_follower(m, link, disk_dir=(prompt_cache_dir or str(mlxb_home() / "prompt-cache"))
                                      if ssd else None))
    if link is not None:
        from functools import partial

        from mlxb.cache.protocol import layer_kinds
        from mlxb.distributed.leader import TPRunner
        from mlxb.errors import ValidationError

        if any(k is None for k in layer_kinds(m)):  # the serial lane (mlx-lm's generate_step) is one process
            raise ValidationError(f"{spec_.name} has cache layers the batch lane does not know, so it runs on the "
                                  "serial lane, which --tp does not mirror; run it without --tp", param="tp")
        engine_kw["runner_cls"] = partial(TPRunner, link=link)
    try:
        engine = Engine(m, tok, max_batch=batch, prefill_chunk=prefill_chunk, kv_budget=kv_budget,
                        context_limit=context_limit(m), kv_scheme=scheme, **engine_kw)
    except ValueError as e:
        if scheme is None:
            raise
        from mlxb.errors import ValidationError

        raise ValidationError(str(e), param="kv_group_size") from None
    pc = build_prompt_cache(engine, kv_budget=kv_budget, max_bytes=prompt_cache_bytes, max_entries=prompt_cache_size,
                            disk_dir=prompt_cache_dir, disk_bytes=prompt_cache_disk_bytes,
                            mirrored=link is not None) if prompt_cache else None
    engine.attach_prompt_cache(pc)  # NOTE: the warm-up runs the cache paths too, then empties the RAM tier
    engine.warmup = warm_up(engine) if warmup else None  # before traffic: first-use kernel compiles
    engine.start()
    if link is not None:
        from mlxb.distributed.leader import watchdog

        watchdog(engine, link, tp_timeout)
    gw = Gateway(engine, tok, model_name=spec_.name, default_max_tokens=default_max_tokens, chat_template=chat_template,
                 tool_prompt=tool_prompt, prep_threads=prep_threads)
    gw.spec, gw.path = spec_, path
    engine.attention_kernels = attention
    engine.cuda_graphs = graphs
    freeze_heap()
    return gw


def use_fused_projections(model, adapters: bool = False, tp: bool = False, compiled: bool = False) -> int:
    """--fuse-projections: q/k/v and gate/up as one product each (``mlxb.models.fuse``). Refused where it is
    not combined yet (adapters, --tp, compiled steps) and where no group qualifies."""
    from mlxb.errors import ValidationError
    from mlxb.models.fuse import fuse

    for on, what in ((adapters, "--adapters (the adapters wrap the separate projections; --lora-path concat, CUDA's "
                                "default, fuses the adapted groups itself)"),
                     (tp, "--tp (each rank shards the separate projections)"),
                     (compiled, "--compile-decode / --compile-batch")):
        if on:
            raise ValidationError(f"--fuse-projections is not combined with {what} yet; leave one of them off",
                                  param="fuse_projections")
    n = fuse(model)
    if n == 0:
        raise ValidationError("--fuse-projections: no block of this model has q/k/v or gate/up projections of one "
                              "kind and input width to fuse; leave it off", param="fuse_projections")
    return n


def use_skinny_matmul(model, spec=None) -> int:
    """--skinny-matmul: products of 2..8 rows over weights up to 4096x4096 (a batch's decode step, a speculative
    verify; ``mlxb.kernels.skinny.applies``) through one custom CUDA kernel that reads each weight once. Refused off CUDA and where nothing takes it;
    checked against mlx's matmul on this device first. The draft model, if any, takes it too."""
    from mlxb.errors import ValidationError
    from mlxb.kernels import skinny

    if not skinny.available():
        raise ValidationError("--skinny-matmul is a CUDA kernel and this device is not a CUDA GPU; leave it off "
                              "(MLX's own matmul runs here)", param="skinny_matmul")
    try:
        skinny.self_check()
    except ValueError as e:
        raise ValidationError(str(e), param="skinny_matmul") from None
    n = skinny.install(model)
    if n == 0:
        raise ValidationError("--skinny-matmul found no plain Linear layer in this model (quantized or sharded "
                              "weights keep MLX's own kernels); leave it off", param="skinny_matmul")
    if spec is not None and getattr(spec, "draft_model", None) is not None:
        n += skinny.install(spec.draft_model)
    return n


def check_compile_decode(model, *, batch: int, lora=None, tp: bool = False) -> None:
    """--compile-decode: refuse what it cannot serve, then compare it with the plain step on this model
    (bit for bit over a few steps) before any request reaches it."""
    from mlxb.cache.protocol import layer_kinds
    from mlxb.engine.compiled import self_check, why_not
    from mlxb.errors import ValidationError

    if batch <= 1:
        raise ValidationError("--compile-decode compiles the batch lane's lone row; --batch 1 is mlx-lm's own serial "
                              "generate_step: use --batch 2 or more", param="compile_decode")
    why = why_not(model, layer_kinds(model), lora=lora or None, tp=tp) or self_check(model)
    if why is not None:
        raise ValidationError(why if why.startswith("--compile-decode") else f"--compile-decode refused: {why}",
                              param="compile_decode")


def tp_link(tp: int, *, batch: int):
    """``--tp N``: refuse what is not mirrored across ranks, then join the ``mlx.launch`` group."""
    from mlxb.errors import ValidationError

    if batch <= 1:
        raise ValidationError("--tp runs on the batch lane; --batch 1 (the strict serial path) is one process only: "
                              "use --batch 2 or more with --tp", param="tp")
    from mlxb.distributed.leader import Link, init_group

    return Link(init_group(tp))
