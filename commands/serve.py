"""`mlxb serve`: the OpenAI-compatible server over the engine."""

from __future__ import annotations

import os
import sys
from typing import Optional

import typer

from mlxb.commands._common import KV_ATTENTION_DEFAULT, KV_ATTENTION_HELP, DtypeOpt, ModelOpt, apply_kv_attention, cli_errors, console, status
from mlxb.engine.prefill import COHORT_SPLIT_MIN


@cli_errors
def serve(
    model: ModelOpt = None,
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8080, "--port"),
    batch: int = typer.Option(8, "--batch", "--decode-concurrency", min=1, help="Concurrency cap (rows decoding together); 1 = strict serial."),
    prompt_concurrency: Optional[int] = typer.Option(None, "--prompt-concurrency", min=1, help="Most joiners prefilled in one iteration (each alone, within one --prefill-step-size of tokens); default: --batch."),
    prefill_step_size: int = typer.Option(2048, "--prefill-step-size", min=1, help="Most prompt tokens of joiner prefill between two decode steps (the stall bound for running rows)."),
    prefill_burst: Optional[int] = typer.Option(None, "--prefill-burst", min=1, help="Prompt tokens one iteration may prefill when the engine is idle (nothing decodes, so nothing stalls); default: 8 x --prefill-step-size (mlx-lm's default prompt batch: 8 x 2048 tokens)."),
    cohort_split_min: int = typer.Option(COHORT_SPLIT_MIN, "--cohort-split-min", min=0, help="Prompts admitted together are prefilled as one batch padded to the longest; split them into groups of similar length when that saves at least this many padded tokens (0: never split, as mlx-lm's prompt batch)."),
    kv_budget: Optional[str] = typer.Option(None, "--kv-budget", help="KV byte budget for admission, e.g. 2GB, 512MiB, 100000."),
    max_tokens: int = typer.Option(512, "--max-tokens", min=1, help="Default max_tokens when a request gives none."),
    chat_template: Optional[str] = typer.Option(None, "--chat-template", help="A Jinja chat template string overriding the tokenizer's."),
    tool_prompt: bool = typer.Option(True, "--tool-prompt/--no-tool-prompt", help="When the chat template drops tools, "
                                     "put their schemas into the system turn (asking for JSON calls in <tool_call> tags)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="MLXB_API_KEY", help="Require 'Authorization: Bearer KEY'."),
    max_body: int = typer.Option(4 << 20, "--max-body-bytes", help="Request body size limit (413 above it)."),
    log_level: str = typer.Option("info", "--log-level"),
    dtype: DtypeOpt = None,
    prompt_cache: bool = typer.Option(True, "--prompt-cache/--no-prompt-cache", help="Reuse KV of shared prompt prefixes across requests (RAM trie + SSD tier)."),
    prompt_cache_bytes: Optional[str] = typer.Option(None, "--prompt-cache-bytes", help="RAM tier cap, e.g. 4GB (default: --kv-budget, else a quarter of the device memory the weights leave). Entries give way to live rows."),
    prompt_cache_size: Optional[int] = typer.Option(None, "--prompt-cache-size", min=1, help="Most RAM entries (default: no count cap, bytes decide)."),
    prompt_cache_dir: Optional[str] = typer.Option(None, "--prompt-cache-dir", help="SSD tier folder (default: $MLXB_HOME/prompt-cache)."),
    prompt_cache_disk_bytes: Optional[str] = typer.Option(None, "--prompt-cache-disk-bytes", help="SSD tier cap, e.g. 20GB (default twice the RAM tier, at least 8GiB; 0 turns the SSD tier off)."),
    cudnn_attention: Optional[bool] = typer.Option(None, "--cudnn-attention/--no-cudnn-attention", help="CUDA only: prefill attention through cuDNN graphs (built once per new shape, ~1 s each on an H200) or MLX's own kernels. Default: MLX's own, unless MLX_CUDA_USE_CUDNN_SDPA is set."),
    kv_bits: Optional[int] = typer.Option(None, "--kv-bits", help="Quantize the KV cache of full-attention layers to 4 or 8 bits (mlx-lm's name), also under batching; the prompt cache stores rows in that layout."),
    kv_group_size: int = typer.Option(64, "--kv-group-size", help="Quantization group size for --kv-bits (32, 64, 128)."),
    quantized_kv_start: int = typer.Option(0, "--quantized-kv-start", help="A row's KV converts once it holds this many tokens (mlx-lm's meaning); under batching at the latest when the row shares a batch."),
    kv_config: Optional[str] = typer.Option(None, "--kv-config", help='Per-layer KV quantization (JSON file), e.g. {"bits": 4, "layers": {"0": "none", "-1": "none"}}: first and last layers at full width, the others KV4. Batch lane only.'),
    kv_attention: str = typer.Option(KV_ATTENTION_DEFAULT, "--kv-attention", help=KV_ATTENTION_HELP),
    spec: Optional[str] = typer.Option(None, "--spec", help="Speculative decoding on the batch lane: 'lookup' (the default: prompt lookup, n-gram copy from the row's prompt and output; its controller keeps the batch plain where drafts do not pay), 'draft' (--draft-model) or 'off'. Models with sliding-window or recurrent layers decode plainly (see /stats)."),
    draft_model: Optional[str] = typer.Option(None, "--draft-model", help="A smaller model with the target's tokenizer (preset, folder or HF id) that drafts tokens; implies --spec draft."),
    num_draft_tokens: int = typer.Option(4, "--num-draft-tokens", min=1, max=32, help="Most draft tokens per row and step (adapted per row from its acceptance); a request's num_draft_tokens overrides it, 0 turns it off."),
    spec_max_batch: Optional[int] = typer.Option(None, "--spec-max-batch", min=1, help="Speculate only while the batch holds at most this many rows (default: --batch; the controller decides per step from measured costs)."),
    spec_pipeline: str = typer.Option("off", "--spec-pipeline", help="Launch a lone greedy row's next verify step before the current one is read, guessing that all its drafts hold (prompt lookup): on always, auto on a GPU backend once most verify steps keep every draft, off (default: on an H100 and an H200 it measured no gain; README)."),
    spec_fixed: bool = typer.Option(False, "--spec-fixed", help="Every speculating row drafts --num-draft-tokens each step (mlx-lm's fixed K; what the spec parity case runs) instead of adapting K and pausing on low acceptance."),
    lookup_ngram: int = typer.Option(3, "--lookup-ngram", min=1, max=16, help="Longest n-gram --spec lookup matches (it tries shorter ones down to 1)."),
    adapters: Optional[list[str]] = typer.Option(None, "--adapters", help="LoRA adapters (mlx-lm adapter folders) over the base, chosen per request: NAME=PATH[,NAME=PATH...] (repeatable). Requests pick one with model 'BASE:NAME' or mlx-lm's 'adapters' field; rows of different adapters decode in one batch."),
    max_loras: Optional[int] = typer.Option(None, "--max-loras", min=1, help="Refuse to start with more adapters than this."),
    max_lora_rank: Optional[int] = typer.Option(None, "--max-lora-rank", min=1, help="Refuse to start with an adapter of a higher rank."),
    lora_path: Optional[str] = typer.Option(None, "--lora-path", help="How per-row LoRA is computed: exact (mlx-lm's LoRALinear math, bit-exact), stacked (all adapters' factors side by side in the base's dtype: 3 ops per projection, not bit-exact), fused (CUDA only: two custom kernels per projection, float32 factors and sums), concat (q/k/v and gate/up as one product each with every adapter's shrink concatenated onto the weight, then one addmm: plain Linear layers only, not bit-exact) or auto (concat, else stacked, on CUDA; exact elsewhere). Default: $MLXB_LORA_PATH or auto."),
    tp: int = typer.Option(1, "--tp", min=1, help="Tensor parallel over N processes started by mlx.launch (ring on CPUs/Macs, nccl on CUDA GPUs); every rank runs this same command. See the README."),
    tp_timeout: float = typer.Option(60.0, "--tp-timeout", min=1.0, help="--tp: a mirrored step (a prefill chunk or a decode step) that takes longer than this marks the server failed (/health 503) and exits it (code 70): a rank died or hung. Above your slowest prefill chunk. An idle server notices within 3 s."),
    compile_decode: bool = typer.Option(False, "--compile-decode", help="Run a lone row's decode steps as one compiled graph (mx.compile, KV write inside): less host time per token on small models. Full-attention models only; refused on CUDA and with --adapters or --tp; checked bit for bit against the plain step at start-up."),
    compile_batch: bool = typer.Option(False, "--compile-batch", help="--compile-decode for the batch lane's steps too (one trace per row count and buffer size). Measured slower on a 2-core CPU at B=8 and 32 (the masked read over the whole buffer); see the README."),
    fuse_projections: bool = typer.Option(False, "--fuse-projections", help="Compute q/k/v and gate/up as one product each over concatenated weights (fewer launches: on CUDA a batch or verify step is bound by the host's cuBLAS launches). Not promised bit-exact with mlx-lm; see the README."),
    skinny_matmul: bool = typer.Option(False, "--skinny-matmul", help="CUDA only: run the products of 2 to 8 rows over weights of at most 4096x4096 (a batch's decode step, a speculative verify) through one kernel that reads each bf16/fp16 weight once, summing each row as MLX's one-row gemv does, instead of cuBLAS. Not bit-exact with mlx-lm's batch mode (cuBLAS); see the README."),
    share_prefix: bool = typer.Option(True, "--share-prefix/--no-share-prefix", help="Rows whose prompts open with the same long prefix (a fleet's system prompt and tools) read one copy of its KV instead of one copy each (full-attention layers; cascade attention, docs/shared-prefix.md)."),
    share_min_tokens: int = typer.Option(256, "--share-min-tokens", help="The fewest common prompt tokens worth sharing."),
    share_f32_values: bool = typer.Option(False, "--share-f32-values", help="A shared prefix of a half-precision model also keeps its values in float32 while requests are not waiting for KV budget: a faster decode step (about 9% at 32 rows over 6k tokens on an H100) for the prefix's values held twice. Off: the prefix is stored once and cast per step (the same bits)."),
    prep_threads: int = typer.Option(4, "--prep-threads", min=0, help="Threads that validate and tokenize requests off the event loop (a burst of long prompts is tokenized in parallel while other requests stream); 0 does it on the loop."),
    switch_interval_ms: Optional[float] = typer.Option(None, "--switch-interval-ms", min=0.01, help="How long a Python thread may hold the GIL before another thread that wants it gets it (sys.setswitchinterval, in ms); default Python's 5 ms. While the engine thread builds a step, the event loop and the tokenizing threads wait up to this long for each turn."),
    warmup: bool = typer.Option(True, "--warmup/--no-warmup", help="Run every batching path once with tiny prompts before serving, so first-use kernel compiles (seconds on CUDA) do not stall the first joiners."),
) -> None:
    """Serve MODEL (default: the embedded tiny-llama synthetic model) over an OpenAI-compatible API."""
    import uvicorn

    from mlxb.engine.build import build_gateway
    from mlxb.adapters.lora import LORA_PATHS
    from mlxb.errors import ValidationError
    from mlxb.server.app import create_app

    budget = parse_bytes(kv_budget, "--kv-budget") if kv_budget else None
    kv_attention = apply_kv_attention(kv_attention)  # 'auto' resolved (CUDA: fused when its self-checks pass)
    lora = parse_adapters(adapters)
    if lora_path is not None and lora_path not in LORA_PATHS:
        raise ValidationError(f"--lora-path {lora_path!r}: use one of {', '.join(LORA_PATHS)}", param="lora_path")
    pc_bytes = parse_bytes(prompt_cache_bytes, "--prompt-cache-bytes") if prompt_cache_bytes else None
    pc_disk = parse_bytes(prompt_cache_disk_bytes, "--prompt-cache-disk-bytes") if prompt_cache_disk_bytes else None
    with status("loading model ..."):
        gw = build_gateway(model, dtype=dtype, batch=batch, prefill_chunk=prefill_step_size, kv_budget=budget,
                           max_joiners=prompt_concurrency, prefill_burst=prefill_burst, cohort_split_min=cohort_split_min, default_max_tokens=max_tokens, chat_template=chat_template, tool_prompt=tool_prompt,
                           warmup=warmup, prompt_cache=prompt_cache, prompt_cache_bytes=pc_bytes, adapters=lora,
                           max_loras=max_loras, max_lora_rank=max_lora_rank, lora_path=lora_path,
                           prompt_cache_size=prompt_cache_size, prompt_cache_dir=prompt_cache_dir,
                           prompt_cache_disk_bytes=pc_disk, cudnn_attention=cudnn_attention, kv_bits=kv_bits,
                           kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start, kv_config=kv_config,
                           spec=spec, num_draft_tokens=num_draft_tokens, lookup_ngram=lookup_ngram,
                           draft_model=draft_model, spec_max_batch=spec_max_batch, spec_fixed=spec_fixed, spec_pipeline=spec_pipeline, tp=tp, tp_timeout=tp_timeout,
                           compile_decode=compile_decode, compile_batch=compile_batch, skinny_matmul=skinny_matmul,
                           fuse_projections=fuse_projections, share_prefix=share_prefix,
                           share_min_tokens=share_min_tokens, share_f32_values=share_f32_values,
                           prep_threads=prep_threads)
    import mlx.core as mx

    from mlxb.kernels.quantized_attention import kv_attention_note

    app = create_app(gw, api_key=api_key, max_body_bytes=max_body, served_names={str(gw.path)})
    console.print(f"[bold green]mlxb serve[/] http://{host}:{port}/v1  model={gw.model_name}"
                  f"{' (synthetic, random weights)' if gw.spec.synthetic else ''}  device={mx.default_device()}  "
                  f"mode={gw.engine.mode} (batch {batch})"
                  + (f"  warm-up {gw.engine.warmup['seconds']:.1f}s" if gw.engine.warmup else "")
                  + (f" ({gw.engine.warmup['attention_variants']} attention kernels in "
                     f"{gw.engine.warmup['attention_variants_s']:.1f}s)"
                     if gw.engine.warmup and "attention_variants" in gw.engine.warmup else "")
                  + ("" if gw.engine.attention_kernels.startswith("n/a") else f"  attention {gw.engine.attention_kernels}")
                  + f"  kv-attention {kv_attention}")
    note = kv_attention_note()
    if note and (kv_attention == "fused" or "refused" in note):  # CUDA: what auto chose, and why
        console.print(f"{'[yellow]' if 'refused' in note else ''}kv-attention {note}")
    console.print("APIs: /v1/chat/completions, /v1/completions, /v1/responses (OpenAI), /v1/messages (Anthropic), "
                  "/v1/models; /health /stats /metrics")
    if compile_decode or compile_batch:
        console.print("compiled decode: " + ("lone rows and batch steps" if compile_batch else "lone rows")
                      + " (checked bit for bit against the plain step at start-up)")
    console.print("tool calls: " + gw.tool_summary())
    pc = gw.engine.prompt_cache
    if gw.engine.kv_scheme is not None:
        console.print(f"KV cache: {gw.engine.kv_scheme.name} (full-attention and sliding-window layers; recurrent "
                      "and latent layers stay at full width)")
    sp = gw.engine.spec_stats()
    if sp is not None:
        console.print(f"speculation: {sp['method']}{' (' + sp['draft_model'] + ')' if sp.get('draft_model') else ''}, "
                      f"up to {sp['num_draft_tokens']} draft tokens per row, while at most {sp['max_batch']} rows decode"
                      if sp["active"] else f"speculation: off ({sp['off_reason']})")
    sh = gw.engine.stats()["shared_prefix"]
    console.print(f"shared-prefix KV: on (full-attention layers, prompts sharing at least {sh['min_tokens']} tokens)"
                  if sh["active"] else f"shared-prefix KV: off ({sh['off_reason']})")
    tps = gw.engine.stats()["tensor_parallel"]
    if tps is not None:
        console.print(f"tensor parallel: {tps['ranks']} ranks ({tps['backend']}); weights and KV rows split per rank; "
                      f"one process only: {', '.join(tps['not_mirrored'])}")
    if pc is None:
        console.print("prompt cache: off" + ("" if prompt_cache else " (--no-prompt-cache)"))
    else:
        disk = f"SSD {pc.disk.root}{' (each rank its own tp<N>-rank<r> folder)' if tps is not None else ''} cap {pc.disk.index.max_bytes / 2**30:.1f} GiB, leaves {pc.disk.reserve_bytes / 2**30:.1f} GiB free ({pc.disk.num_entries} entries found)" if pc.disk else "SSD off"
        console.print(f"prompt cache: RAM cap {pc.ram.max_bytes / 2**30:.2f} GiB, {disk}; reuse: "
                      + "; ".join(f"{k} {v}" for k, v in pc.stats()["reuse"].items()))
    if switch_interval_ms is not None or os.environ.get("MLXB_SWITCH_INTERVAL"):  # how often Python hands the GIL over
        sys.setswitchinterval(switch_interval_ms / 1000 if switch_interval_ms is not None
                              else float(os.environ["MLXB_SWITCH_INTERVAL"]))  # (the variable: seconds)
        console.print(f"GIL switch interval: {sys.getswitchinterval() * 1000:g} ms")
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=3,
                            access_log=log_level == "debug")
    server = _server(config, gw.engine)
    # NOTE: uvicorn drains on SIGINT/SIGTERM and then re-raises the signal through the handler that
    # was installed before it started; a recording handler here turns that into a clean exit 0.
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        gw.close()
        gw.engine.shutdown()
    console.print("[dim]mlxb serve stopped[/]")


def _server(config, engine):
    """uvicorn's server, but on SIGINT/SIGTERM the engine stops after its current step and answers every
    open request with a 503 (``shutting down``), so streams end within uvicorn's graceful window instead
    of being cut."""
    import threading

    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            threading.Thread(target=engine.stop, name="mlxb-stop", daemon=True).start()

    return Server(config)


def parse_adapters(items: Optional[list[str]]) -> Optional[dict]:
    from mlxb.errors import ValidationError

    out: dict = {}
    for part in (p.strip() for item in items or [] for p in item.split(",")):
        name, eq, path = part.partition("=")
        if not part:
            continue
        if not eq or not name or not path or ":" in name:
            raise ValidationError(f"--adapters {part!r}: give NAME=PATH (a name without ':'), e.g. coder=./adapters/coder")
        if name in out:
            raise ValidationError(f"--adapters: {name!r} is given twice")
        out[name] = path
    return out or None


def parse_bytes(s: str, flag: str = "--kv-budget") -> int:
    from mlxb.errors import ValidationError

    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
    t = s.strip().lower().replace(" ", "")
    num = t.rstrip("kmgib")
    unit = t[len(num):]
    try:
        return int(float(num) * units[unit])
    except (ValueError, KeyError):
        raise ValidationError(f"{flag} {s!r}: use a number with an optional unit, e.g. 2GB or 512MiB") from None
