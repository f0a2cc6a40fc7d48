"""Run a feature matrix (or one ad-hoc cell) against one or more stacks, A/B alternated.

For each cell x concurrency x repeat, every stack runs the identical closed-loop load (fresh prompts
per cell, level and repeat, so no prompt cache carries over between runs or cells); the stack order flips every repeat (A B, B A, ...) so drift hits both. Before a stack's first run of a cell,
one short probe request checks that it can serve the cell at all: a 4xx or a refused feature
records the cell as ``unsupported`` for that stack (with the reason), never a silent skip. Gates
(e.g. ``top_logprobs_5``) are checked on every response and recorded per summary row.
"""

from __future__ import annotations

import asyncio
import zlib
from dataclasses import dataclass
from typing import Callable, Optional

from mlxb.bench import load as L
from mlxb.bench.matrix import Cell, Matrix

Progress = Callable[[str, int, int], None]


@dataclass
class Target:
    stack: str
    base_url: str
    model: str  # the model id to send
    flags: str = ""
    api: str = "chat"  # the endpoint chat payloads go to (mlxb.bench.load.APIS)


def dataset_for(cell: Cell, tokenizer, n: int, vocab: int, scale: float, seed: int) -> L.Dataset:
    ds = _dataset(cell, tokenizer, n, vocab, scale, seed)
    for i, p in enumerate(ds.payloads if cell.adapter_folders else []):  # LoRA: mlx-lm's field, by folder
        p["adapters"] = cell.adapter_folders[i % len(cell.adapter_folders)]
    return ds


def _dataset(cell: Cell, tokenizer, n: int, vocab: int, scale: float, seed: int) -> L.Dataset:
    ln = {k: max(1, int(round(v * scale))) if k.endswith("_len") and k != "question_len" else v
          for k, v in cell.lengths.items()}
    extra = dict(cell.params)
    forced_every = int(extra.pop("forced_every", 0) or 0)
    choice = extra.pop("forced_choice", "required")
    if cell.dataset == "random":
        return L.random_dataset(tokenizer, n, ln["input_len"], cell.output_len, vocab, seed, extra, forced_every,
                                choice)
    if cell.dataset == "shared-prefix":
        groups = ln.get("groups", 1)
        return L.shared_prefix_dataset(tokenizer, groups, max(1, -(-n // groups)), ln["system_len"],
                                       ln["question_len"], cell.output_len, vocab, seed, extra)
    if cell.dataset == "multi-turn":
        turns = int(ln.get("turns", 4))
        return L.multi_turn_dataset(tokenizer, max(1, -(-n // turns)), turns, ln["system_len"], ln["turn_len"],
                                    cell.output_len, vocab, seed, extra)
    if cell.dataset == "agent-loop":
        turns = int(ln.get("turns", 4))
        return L.agent_loop_dataset(tokenizer, max(1, -(-n // turns)), turns, ln["system_len"], ln["turn_len"],
                                    ln["tool_len"], cell.output_len, vocab, seed, extra)
    return L.mixed_dataset(tokenizer, n, ln["short_len"], ln["long_len"], cell.output_len, vocab, seed, extra)


def _schema_valid(cell: Cell, text: str) -> bool:
    import json

    import jsonschema

    schema = ((cell.params.get("response_format") or {}).get("json_schema") or {}).get("schema", {"type": "object"})
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def gate_results(cell: Cell, results: list[L.RequestResult]) -> dict:
    out = {}
    ok = [r for r in results if r.ok]
    for g in cell.gates:
        if g == "top_logprobs_5":
            out[g] = bool(ok) and all(r.logprob_tokens > 0 and (r.min_top_logprobs or 0) >= 5 for r in ok)
        elif g == "json_schema_valid":  # every reply parses and validates against the cell's schema
            out[g] = bool(ok) and all(_schema_valid(cell, r.text) for r in ok)
    return out


async def _probe(t: Target, ds: L.Dataset, cell: Optional[Cell] = None) -> Optional[str]:
    """None if the stack serves one short request of this cell; else the reason it cannot. A cell whose
    gate checks the reply itself (``json_schema_valid``) probes with a whole reply: a server that ignores
    the field (200, free text) is unsupported, not a failed gate."""
    first = ds.payloads[0] if ds.payloads else {**ds.conversations[0]["extra"], "messages": ds.conversations[0]["messages"]}
    whole = cell is not None and "json_schema_valid" in cell.gates
    probe = L.Dataset(ds.name, [dict(first, max_tokens=cell.output_len if whole else 2)])
    res = await L.run_load(t.base_url, t.model, probe, concurrency=1, n_requests=1, api=t.api)
    r = res[0]
    if not r.ok:
        return r.error or "failed"
    if whole and not _schema_valid(cell, r.text):
        return f"ignores response_format: the reply is not schema-valid JSON ({r.text[:60]!r})"
    return None


def text_seed(seed: int, cell: str, rep: int, conc: int) -> int:
    """The prompt text's seed for one (cell, level, repeat) of a run. The cell is part of it: two cells that
    ran the same text on one server (the forced-tools A/B, cells "auto" then "required") made the second a
    prompt-cache replay of the first (whole prompts restored, from the SSD tier too, on the engine thread),
    which is not what it measures (H100, ``reports/h100/session68``)."""
    return seed * 1_000_003 + rep * 7919 + conc + zlib.crc32(cell.encode()) * 15_485_863


def run_matrix(matrix: Matrix, targets: list[Target], tokenizer, vocab: int, *, scale: float = 1.0,
               ignore_eos: bool = True, seed: int = 0, progress: Optional[Progress] = None,
               cells: Optional[list[str]] = None,
               on_phase: Optional[Callable[[list, list], None]] = None) -> tuple[list[dict], list[dict]]:
    """Returns (request rows, summary rows). ``on_phase`` gets both lists so far after every (cell, level,
    repeat, stack) phase, so a caller can keep what finished if the run is cut short. Every row records the
    run's ``seed`` (prompt text is drawn from it, per cell, level and repeat) and its ``wave``: ``first`` for a
    stack's first measured phase on the servers of this call (a fresh server: first-shape compiles land
    there), ``warm`` after it."""
    chosen = [c for c in matrix.cells if not cells or c.name in cells]
    total = sum(len(c.concurrency) for c in chosen) * matrix.repeats * len(targets)
    done = 0
    req_rows: list[dict] = []
    summ_rows: list[dict] = []
    measured: set[str] = set()
    for cell in chosen:
        unsupported: dict[str, str] = {}
        probed: set[str] = set()
        for conc in cell.concurrency:
            n = cell.requests or conc * cell.requests_per_slot
            for rep in range(matrix.repeats):
                # fresh prompts per (cell, level, repeat), identical for every stack: a server's prompt cache
                # may reuse what a run shares (the agents' system prompt), never an earlier repeat or cell
                ds = dataset_for(cell, tokenizer, n, vocab, scale, text_seed(seed, cell.name, rep, conc))
                order = targets if rep % 2 == 0 else list(reversed(targets))
                for t in order:
                    base = {"cell": cell.name, "stack": t.stack, "concurrency": conc, "repeat": rep,
                            "dataset": cell.dataset, "scale": scale, "server_flags": t.flags,
                            "needs": ",".join(cell.needs), "params": str(cell.params), "seed": seed,
                            "wave": "warm" if t.stack in measured else "first"}
                    if t.stack not in probed:
                        probed.add(t.stack)
                        # the probe uses its own prompts so it warms no cache the measured load uses
                        reason = asyncio.run(_probe(t, dataset_for(cell, tokenizer, 1, vocab, scale, seed + 999_983), cell))
                        if reason:
                            unsupported[t.stack] = reason
                    if t.stack in unsupported:
                        summ_rows.append({**base, "status": "unsupported", "reason": unsupported[t.stack]})
                    else:
                        res = asyncio.run(L.run_load(t.base_url, t.model, ds, concurrency=conc, n_requests=n,
                                                     ignore_eos=ignore_eos and t.stack.startswith("mlxb"), seed=seed, api=t.api))
                        measured.add(t.stack)
                        s = L.summarize(res)
                        gates = gate_results(cell, res)
                        status = "ok" if s["failed"] == 0 and all(gates.values()) else (
                            "gate_failed" if not all(gates.values()) else "errors")
                        errs = sorted({r.error for r in res if r.error})[:3]
                        summ_rows.append({**base, **s, "status": status, "reason": "; ".join(errs) or None,
                                          **{f"gate_{g}": v for g, v in gates.items()}})
                        req_rows += [{**base, **r.to_row()} for r in res]
                    done += 1
                    if on_phase:
                        on_phase(req_rows, summ_rows)
                    if progress:
                        progress(f"{cell.name} c={conc} rep {rep + 1} {t.stack}", done, total)
    return req_rows, summ_rows
