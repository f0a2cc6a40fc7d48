"""`mlxb generate`: one prompt (or K of them) through the gateway, streamed to the terminal."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import typer
from rich.live import Live
from rich.table import Table

from mlxb.commands._common import DtypeOpt, ModelOpt, cli_errors, console


@cli_errors
def generate(
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Prompt text (chat template applied unless --raw)."),
    prompts_file: Optional[Path] = typer.Option(None, "--prompts-file", help="One prompt per line; with --concurrency K the first K are submitted together."),
    model: ModelOpt = None,
    max_tokens: int = typer.Option(64, "--max-tokens", "-n", min=1),
    temp: float = typer.Option(0.0, "--temp", min=0.0),
    seed: Optional[int] = typer.Option(None, "--seed"),
    batch: int = typer.Option(8, "--batch", "--decode-concurrency", min=1, help="Concurrency cap; 1 = strict serial path."),
    concurrency: int = typer.Option(1, "--concurrency", "-k", min=1, help="Submit K requests together (K copies of --prompt, or K lines of --prompts-file)."),
    raw: bool = typer.Option(False, "--raw", help="Feed the prompt as plain text, no chat template."),
    dtype: DtypeOpt = None,
    json_out: bool = typer.Option(False, "--json", help="Print JSON: text, token ids, finish reason, timings (one object per request)."),
    tp: int = typer.Option(1, "--tp", min=1, help="Tensor parallel over N processes (start every rank under mlx.launch with this same command; rank 0 prints)."),
    compile_decode: bool = typer.Option(False, "--compile-decode", help="A lone row's decode steps as one compiled graph (as mlxb serve --compile-decode)."),
) -> None:
    """Generate through the engine's gateway (continuous batching when K > 1 and --batch > 1)."""
    import signal

    def on_term(*_):
        raise _Stopped(143)

    signal.signal(signal.SIGTERM, on_term)  # first: a stop while MLX loads (slow on CUDA) exits as cleanly
    try:
        _generate(prompt, prompts_file, model, max_tokens, temp, seed, batch, concurrency, raw, dtype, json_out, tp,
                  compile_decode)
    except (KeyboardInterrupt, _Stopped) as e:
        console.print("[yellow]interrupted[/]")
        raise typer.Exit(e.code if isinstance(e, _Stopped) else 130) from None


def _generate(prompt, prompts_file, model, max_tokens, temp, seed, batch, concurrency, raw, dtype, json_out, tp=1,
              compile_decode=False) -> None:
    from mlxb.engine.build import build_gateway
    from mlxb.engine.gateway import GenerationInput
    from mlxb.errors import ValidationError
    from mlxb.request import SamplingParams

    if prompts_file is not None:
        texts = [ln for ln in prompts_file.read_text().splitlines() if ln.strip()][:concurrency]
        if len(texts) < concurrency:
            texts = (texts * concurrency)[:concurrency]
    elif prompt is not None:
        texts = [prompt] * concurrency
    else:
        raise ValidationError("give --prompt TEXT or --prompts-file FILE")
    gw = None
    try:
        gw = build_gateway(model, dtype=dtype, batch=batch, default_max_tokens=max_tokens, warmup=False, tp=tp,  # one-shot
                           compile_decode=compile_decode)
        results = _run(gw, texts, raw, max_tokens, temp, seed, json_out, SamplingParams, GenerationInput)
    finally:  # also on SIGINT/SIGTERM: the engine stops after its step, then the exit is clean
        if gw is not None:
            gw.engine.shutdown()
    if json_out:
        for r in results:
            print(json.dumps(r))
    elif len(results) == 1:
        r = results[0]
        console.print()
        console.print(f"[dim]{len(r['token_ids'])} tokens, finish={r['finish_reason']}, "
                      f"ttft {r['timings']['ttft_s']}s, {r['timings']['decode_tps']} tok/s ({gw.model_name}, {r['mechanism']})[/]")


class _Stopped(Exception):
    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def _run(gw, texts, raw, max_tokens, temp, seed, json_out, SamplingParams, GenerationInput):
    subs = []
    for i, text in enumerate(texts):
        sp = SamplingParams(temperature=temp, seed=None if seed is None else seed + i)
        inp = GenerationInput(prompt=text, max_tokens=max_tokens, sampling=sp) if raw else \
            GenerationInput(messages=[{"role": "user", "content": text}], max_tokens=max_tokens, sampling=sp)
        subs.append(gw.submit(inp))
    state = [{"text": "", "ids": [], "finish": None, "timings": None, "usage": None} for _ in subs]
    t0 = time.perf_counter()
    if len(subs) == 1 and not json_out:
        for out in subs[0][1]:
            console.print(out.text, end="", markup=False, highlight=False, soft_wrap=True)
            _apply(state[0], out)
    else:
        import threading

        def consume(i, stream):
            for out in stream:
                _apply(state[i], out)

        threads = [threading.Thread(target=consume, args=(i, st)) for i, (_, st) in enumerate(subs)]
        for t in threads:
            t.start()
        if json_out:
            for t in threads:  # bounded waits: a signal that Linux delivers to another thread only sets a
                while t.is_alive():  # flag, which a main thread blocked in an untimed join never reads
                    t.join(0.1)
        else:
            with Live(_table(state, gw, t0), console=console, refresh_per_second=8) as live:
                while any(t.is_alive() for t in threads):
                    time.sleep(0.1)
                    live.update(_table(state, gw, t0))
                live.update(_table(state, gw, t0))
    return [
        {"model": gw.model_name, "request_id": req.request_id, "mechanism": req.mechanism, "text": s["text"],
         "prompt_tokens": req.num_prompt_tokens, "token_ids": s["ids"], "finish_reason": s["finish"],
         "usage": s["usage"], "timings": s["timings"]}
        for (req, _), s in zip(subs, state)
    ]


def _apply(s, out):
    s["text"] += out.text
    if out.token is not None:
        s["ids"].append(out.token)
    if out.finish_reason:
        s["finish"], s["timings"], s["usage"] = out.finish_reason, out.timings, out.usage


def _table(state, gw, t0):
    st = gw.engine.stats()
    t = Table(title=f"{gw.model_name}  mode={st['mode']}  active={st['active_rows']} pending={st['pending_rows']} "
                    f"batched_steps={st['batched_steps']}  {time.perf_counter() - t0:.1f}s")
    for c in ("row", "tokens", "finish", "text (tail)"):
        t.add_column(c)
    for i, s in enumerate(state):
        t.add_row(str(i), str(len(s["ids"])), s["finish"] or "…", repr(s["text"][-48:]))
    return t
