"""`mlxb parity` and `mlxb golden-gen`: the engine against mlx-lm's batch mode at the same B."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.progress import Progress
from rich.table import Table

from mlxb.commands._common import DtypeOpt, JsonOpt, cli_errors, console, progress
from mlxb.parity.protocol import CASES

TINY_DTYPES = ("float32", "bfloat16")

ModelsOpt = typer.Option(None, "--model", "-m", help="Model(s): preset, alias, folder or HF id (repeatable). Default: tiny-llama.")
BOpt = typer.Option("1,2,3,4", "--b", help="Batch sizes (the cap B), comma-separated.")
CaseOpt = typer.Option(None, "--case", "-c", help="Case(s): " + " ".join(CASES) + " (repeatable; default all that apply).")
GoldensOpt = typer.Option(None, "--goldens", help="Goldens folder (default: the checkout's goldens/).")
AllOpt = typer.Option(False, "--all", help="Every tiny preset x case x B, in float32 and bfloat16.")


def _root(goldens: Optional[Path]) -> Path:
    if goldens:
        return goldens
    import mlxb

    repo = Path(mlxb.__file__).resolve().parent.parent / "goldens"
    return repo if repo.is_dir() else Path.cwd() / "goldens"


def _bs(b: str) -> list[int]:
    from mlxb.errors import ValidationError

    try:
        bs = [int(x) for x in b.split(",") if x.strip()]
    except ValueError:
        bs = []
    if not bs or min(bs) < 1:
        raise ValidationError(f"--b {b!r}: give batch sizes >= 1, comma-separated, e.g. --b 4 or --b 1,2,3,4")
    return bs


def _targets(models, dtype, all_):
    from mlxb.models.presets import PRESETS
    from mlxb.parity.run import target

    if all_:
        tiny = [n for n, p in PRESETS.items() if "tiny" in p.tags]
        return [target(m, d) for d in TINY_DTYPES for m in tiny]
    return [target(m, dtype) for m in (models or ["tiny-llama"])]


def _tracker(prog: Progress, prefix: str):
    tasks: dict = {}

    def cb(phase: str, done: int, total: int) -> None:
        name = f"{prefix} {phase}"
        if name not in tasks:
            tasks[name] = prog.add_task(name, total=total)
        prog.update(tasks[name], completed=done, total=total)

    return cb


@cli_errors
def parity(
    models: Optional[list[str]] = ModelsOpt,
    b: str = BOpt,
    cases: Optional[list[str]] = CaseOpt,
    dtype: DtypeOpt = None,
    against: str = typer.Option("both", "--against", help="live (mlx-lm oracle now) | golden (this machine's goldens) | both"),
    all_: bool = AllOpt,
    goldens: Optional[Path] = GoldensOpt,
    json_out: JsonOpt = False,
    plant_fault: Optional[str] = typer.Option(None, "--plant-fault", hidden=True,
                                              help="Test only: plant a known engine bug (negative controls)."),
    tp: int = typer.Option(1, "--tp", min=1, help="Run our engine sharded over N processes (start every rank under mlx.launch with the same command); the oracle stays one unsharded mlx-lm process. Logits that are not bit-equal pass only within goldens/tp_envelope.json, with equal tokens."),
    compile_decode: bool = typer.Option(False, "--compile-decode", help="Run decode steps compiled, a lone row's and the batch lane's, as `mlxb serve --compile-batch` does (same goldens, same oracle)."),
) -> None:
    """Run the engine under the parity protocol and compare every row-step with mlx-lm's batch mode."""
    from mlxb.doctor import machine_key
    from mlxb.engine.runner import FAULTS
    from mlxb.errors import ValidationError
    from mlxb.kernels.quantized_attention import set_kv_attention
    from mlxb.parity.run import build_cases, parity as run_parity, skipped

    set_kv_attention("mlx-lm")  # the protocol compares MLX's read bit for bit, whatever $MLXB_KV_ATTENTION says
    if plant_fault and plant_fault not in FAULTS:
        raise ValidationError(f"--plant-fault {plant_fault!r}: one of {', '.join(FAULTS)}")
    faults = frozenset([plant_fault]) if plant_fault else frozenset()
    if compile_decode and tp > 1:
        raise ValidationError("--compile-decode is one process only; leave it off with --tp")
    root, machine, bs = _root(goldens), machine_key(), _bs(b)
    link = _tp_link(tp, models, dtype, all_)  # None without --tp; followers never come back from here
    results, notes, skips = [], [], {}
    with progress(transient=True) as prog:
        for t in _targets(models, dtype, all_):
            cs = build_cases(t, bs, cases, tp=tp)
            skips[t.label] = skipped(t, cases, tp)
            if against != "live" and not (root / machine / t.label).is_dir():
                notes.append(f"no goldens for machine key {machine} and {t.label} under {root}: against the shared "
                             "layer only tokens and cache geometry can be compared (counted as 'tokens only', never "
                             f"'exact'); write this machine's with `mlxb golden-gen --model {t.shown or t.model}"
                             f"{' --dtype ' + t.dtype if t.label != t.model else ''}`"
                             " or run --against live")
            if cs:
                results += run_parity(t, cs, against, root, machine, faults, _tracker(prog, t.label), link,
                                      compile_decode)
    if link is not None:
        from mlxb.distributed.leader import STOP

        link.send([STOP])  # the other ranks leave their loops
    from mlxb.parity.compare import supersede_shared

    notes += supersede_shared(results)
    ok = all(r.ok for r in results) and bool(results)
    if json_out:
        print(json.dumps({"ok": ok, "machine_key": machine, "warnings": notes, "skipped": skips,
                          "results": [r.to_dict() for r in results]}))
    else:
        _render(results, machine, root)
        for lbl, sk in skips.items():
            if sk:
                console.print(f"{lbl}: skipped " + "; ".join(f"{n} ({why})" for n, why in sk.items()))
        for n in notes:
            console.print(f"[yellow]warning: {n}[/]")
        if not results:
            console.print("[red]no parity case applies to the selection[/]")
    raise typer.Exit(0 if ok else 1)


def _tp_link(tp: int, models, dtype, all_):
    """--tp N: join the mlx.launch group; a rank other than 0 loads and shards the model and follows
    rank 0's engine until it is done (then this process exits)."""
    if tp <= 1:
        return None
    from mlxb.distributed.leader import Link, init_group, shard_model
    from mlxb.distributed.follower import run_follower
    from mlxb.errors import ValidationError
    from mlxb.models import load_model

    if all_ or len(models or []) > 1:
        raise ValidationError("--tp runs one model at a time: give a single --model (no --all)")
    link = Link(init_group(tp))
    if link.rank != 0:
        t = _targets(models, dtype, False)[0]
        src = t.load or (t.model, t.dtype)

        def shard(recipes=None):  # a fresh shard; lora cases: with the case's adapters, as rank 0 builds them
            m = load_model(*src, lazy=True)[0]
            shard_model(m, link.group, t.model)
            if recipes:
                from mlxb.adapters.lora import install, read_adapter
                from mlxb.models.adapters import ensure_adapters

                install(m, [read_adapter(f"a{i}", f) for i, f in enumerate(ensure_adapters(*src, t.model, recipes))])
            return m

        raise typer.Exit(run_follower(shard(), link, shard))
    return link


def _render(results, machine: str, root: Path) -> None:
    per_row = sum(len(r.rows) for r in results) <= 120
    t = Table(title=f"mlxb parity on {machine} (goldens: {root})")
    for c in ("model", "case", "vs", "row" if per_row else "rows", "steps", "exact", "envelope", "tokens only",
              "diverged", "result"):
        t.add_column(c, no_wrap=c in ("model", "case"))
    fails = []
    for r in results:
        if r.error or r.schedule_mismatch:
            msg = "no golden" if r.error and r.error.startswith("no golden") else ("error" if r.error else "schedule")
            t.add_row(*r.label.split(), r.against.split(":")[0], "-", "-", "-", "-", "-", "-", f"[red]{msg}[/]")
            fails.append(r)
        units = r.rows if per_row else [None]
        for row in units:
            rows = [row] if row is not None else r.rows
            steps = sum(x.steps for x in rows)
            exact = sum(x.exact for x in rows)
            env = sum(x.envelope for x in rows)
            tok = sum(x.tokens_only for x in rows)
            div = sum(1 for x in rows if not x.ok)
            good = all(x.ok for x in rows)
            verdict = "[green]pass[/]" if good else "[yellow]superseded[/]" if r.superseded else "[red]FAIL[/]"
            t.add_row(*r.label.split(), r.against.split(":")[0], str(row.row) if row is not None else str(len(rows)), str(steps),
                      str(exact), str(env), f"[yellow]{tok}[/]" if tok else "0", str(div), verdict)
        if not r.ok and r not in fails:
            fails.append(r)
    console.print(t)
    envs = {r.label.split()[0]: r.envelope for r in results if r.envelope}
    for lbl, env in envs.items():
        console.print(f"envelope {lbl}: max |dlogprob| {env['max_abs_logprob']}, KL(top-5) {env['kl_top5']}")
    tot = {k: sum(r.counts()[k] for r in results) for k in ("steps", "exact", "envelope", "tokens_only")}
    console.print(f"{len(results)} comparisons, {tot['steps']} row-steps: {tot['exact']} exact, "
                  f"{tot['envelope']} within envelope, {tot['tokens_only']} tokens only (no logit hash to compare), "
                  f"{len(fails)} case(s) failed"
                  + (f", {sum(1 for r in results if r.superseded)} shared golden(s) superseded by the live oracle"
                     if any(r.superseded for r in results) else ""))
    for r in fails[:10]:
        if r.error:
            console.print(f"[red]{r.label} ({r.against}): {r.error}[/]")
        for row in r.rows:
            d = row.first_divergence
            if d:
                console.print(f"[red]{r.label} ({r.against}) row {row.row}: first divergence at step {d['step']} "
                              f"({d['what']})[/]\n  ours: token {d['ours_token']} geometry {d['ours_geometry']} "
                              f"top5 {d['ours_top5']}\n  ref:  token {d['ref_token']} geometry {d['ref_geometry']} "
                              f"top5 {d['ref_top5']}")
                break
        if r.schedule_mismatch:
            console.print(f"[red]{r.label}: schedule mismatch {r.schedule_mismatch}[/]")


@cli_errors
def golden_gen(
    models: Optional[list[str]] = ModelsOpt,
    b: str = BOpt,
    cases: Optional[list[str]] = CaseOpt,
    dtype: DtypeOpt = None,
    all_: bool = AllOpt,
    force: bool = typer.Option(False, "--force", help="Overwrite existing goldens and print what changed."),
    goldens: Optional[Path] = GoldensOpt,
) -> None:
    """Run the mlx-lm oracle and write goldens for this machine key."""
    from mlxb.doctor import machine_key
    from mlxb.parity.run import build_cases, golden_gen as gen

    root, machine, bs = _root(goldens), machine_key(), _bs(b)
    counts: dict = {}
    with progress(transient=True) as prog:
        for t in _targets(models, dtype, all_):
            cs = build_cases(t, bs, cases)
            for item in gen(t, cs, root, machine, force, _tracker(prog, t.label)):
                counts[item["status"]] = counts.get(item["status"], 0) + 1
                if item["status"] == "oracle failed":
                    console.print(f"[red]{t.label} {item['case']}: the mlx-lm oracle failed: {item['changes'][0]}[/]")
                elif item["changes"]:
                    console.print(f"[yellow]{t.label} {item['case']}[/] changed:")
                    for line in item["changes"][:10]:
                        console.print(f"  {line}")
    console.print(f"goldens for {machine} under {root}: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
