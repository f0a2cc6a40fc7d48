"""What `mlxb bench load` and `bench features` share: the model's tokenizer and folder, cell flags resolved to
folders, the run's text seed, and starting the stacks, running the matrix on them, storing and printing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from rich.table import Table

from mlxb.commands._common import console, progress, sigterm_as_exit


def _tokenizer_and_path(model: Optional[str], dtype: Optional[str]):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlxb.models.registry import model_path, resolve_model

    spec = resolve_model(model, dtype)
    path = model_path(spec)
    cfg = json.loads((path / "config.json").read_text())
    vocab = int(cfg.get("text_config", cfg).get("vocab_size", 8192))
    return spec, path, load_tokenizer(path), vocab


def _resolved_args(args: list, dtype: Optional[str]) -> list:
    """A cell's server_args with model references (``--draft-model tiny-llama``) as folders, which
    every stack (mlx_lm.server included) opens."""
    from mlxb.bench.matrix import MODEL_ARGS
    from mlxb.models.registry import model_path, resolve_model

    out = list(args)
    for i, a in enumerate(out[:-1]):
        if a in MODEL_ARGS:
            out[i + 1] = str(model_path(resolve_model(out[i + 1], dtype)))
    return out


def _run_seed(seed: Optional[int]) -> int:
    """The run's text seed: the one asked for, else a fresh one (printed), so no two runs send the same text
    and a server's SSD prompt cache gains nothing from an earlier run after a restart."""
    if seed is None:
        import secrets

        seed = secrets.randbelow(2**31)
    console.print(f"text seed {seed} (--seed {seed} sends this run's text again)")
    return seed


def _run_stacks(matrix, spec, path, tok, vocab, base_url, peer, batch, scale, cells, dtype, bench_name, api_key=None,
                api="chat", seed=None, one_server=False):
    """Start what is needed, run the matrix on every stack, stop what we started, store and print. With
    ``one_server`` only one started stack is up at a time (every repeat of mlxb, then every repeat of the peer,
    on the same text): two servers of a large model need not fit one device together."""
    from mlxb.bench import servers
    from mlxb.bench.features import Target, run_matrix
    from mlxb.bench.store import labels, write_run
    from mlxb.errors import ValidationError

    chosen = [c for c in matrix.cells if not cells or c.name in cells]
    groups: dict[tuple, list[str]] = {}
    lora: dict[str, list] = {}  # cell -> mlxb's --adapters flags (the peer loads each request's adapter itself)
    for c in chosen:  # cells that need other server flags get their own server starts
        if c.adapters:
            from mlxb.models.adapters import ensure_adapters

            c.adapter_folders = ensure_adapters(str(path), None, f"bench:{spec.name}",
                                                [{"seed": 100 + i, "rank": c.adapter_rank, "num_layers": -1} for i in range(c.adapters)])
            lora[c.name] = ["--adapters", ",".join(f"a{i}={f}" for i, f in enumerate(c.adapter_folders))]
        groups.setdefault(tuple(_resolved_args(c.server_args, dtype)) + tuple(lora.get(c.name, [])), []).append(c.name)
    if base_url and any(groups.keys() - {()}):
        raise ValidationError("cells with server_args (" + ", ".join(c.name for c in chosen if c.server_args)
                              + ") need servers this command starts; leave out --base-url or those cells")
    req_rows, summ_rows, server_stats = [], [], []
    seed = _run_seed(seed)
    lab, root = labels(spec.name, dtype or spec.dtype, bench_name), Path("reports/results")

    def keep(rq, sm):  # every finished phase on disk: a run cut short (timeout, kill) keeps what it measured
        write_run(root, lab, req_rows + rq, summ_rows + sm, complete=False)

    with progress() as prog, sigterm_as_exit():
        task = prog.add_task("load", total=None)
        for extra, names in groups.items():
            stacks = [("mlxb", extra)]
            if peer:
                stacks.append((peer, extra[:extra.index("--adapters")] if "--adapters" in extra and peer == "mlx-lm" else extra))
            for wave in ([[st] for st in stacks] if one_server and not base_url else [stacks]):
                started, targets = [], []
                try:
                    prog.update(task, description=f"starting servers {' '.join(extra)}".rstrip())
                    for stack, flags in wave:
                        if stack == "mlxb" and base_url:
                            targets.append(Target("mlxb", base_url, str(path), f"external {base_url}", api=api))
                            continue
                        srv = servers.start(stack, str(path), batch=batch, extra=flags)
                        started.append(srv)
                        targets.append(Target(stack, srv.base_url, srv.model_name, " ".join(srv.flags),
                                              **({"api": api} if stack == "mlxb" else {})))
                    rq, sm = run_matrix(
                        matrix, targets, tok, vocab, scale=scale, cells=names, seed=seed,
                        progress=lambda d, done, total: prog.update(task, description=d, completed=done, total=total),
                        on_phase=keep)
                    req_rows += rq
                    summ_rows += sm
                finally:
                    for srv in started:
                        st = srv.stats()  # what the server did (shared prefix, prompt cache, speculation), kept
                        if st is not None:
                            server_stats.append({"stack": srv.stack, "flags": srv.flags, "cells": names, "stats": st})
                            (root / lab["run_id"]).mkdir(parents=True, exist_ok=True)
                            (root / lab["run_id"] / "server-stats.json").write_text(
                                json.dumps(server_stats, indent=1, default=str))
                        srv.stop()
    out = write_run(root, lab, req_rows, summ_rows)
    _print_summary(summ_rows)
    console.print(f"wrote {out}/summary.parquet, requests.parquet, summary.json")
    return summ_rows


def _print_summary(rows) -> None:
    t = Table(title="aggregate output tok/s and TTFT (per run)")
    turns = any(r.get("p95_ttft_later") is not None for r in rows)
    mixed = any(r.get("constrained") for r in rows)  # grammar rows beside free ones: the free rows' TPOT too
    for c in ("cell", "stack", "conc", "rep", "wave", "status", "tok/s", "req/s", "p50 ttft", "p95 ttft",
              *(("p95 ttft turn>=2",) if turns else ()), "p50 tpot", *(("p50 tpot free", "p50 itl free") if mixed else ()), "failed"):
        t.add_column(c)
    f = lambda v, n=3: "-" if v is None else f"{v:.{n}f}"  # noqa: E731
    for r in rows:
        t.add_row(r["cell"], r["stack"], str(r["concurrency"]), str(r["repeat"]), r.get("wave", "-"), r["status"],
                  f(r.get("output_throughput"), 1), f(r.get("request_throughput"), 2), f(r.get("p50_ttft")),
                  f(r.get("p95_ttft")), *((f(r.get("p95_ttft_later")),) if turns else ()), f(r.get("p50_tpot"), 4),
                  *((f(r.get("p50_tpot_free"), 4), f(r.get("p50_itl_free"), 4)) if mixed else ()),
                  str(r.get("failed", "-")))
    console.print(t)
