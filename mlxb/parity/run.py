"""Orchestrate parity runs and golden generation (the library side of ``mlxb parity`` / ``golden-gen``).

The oracle always runs in a child process (``python -m mlxb.oracle``); the engine under test runs
here, driven deterministically. Results are plain data; the CLI renders them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

from mlxb.errors import ValidationError
from mlxb.parity import goldens
from mlxb.parity.compare import CaseResult, compare
from mlxb.parity.cases import make_case
from mlxb.parity.protocol import CASES, SHARED_ENVELOPE, Case, skip_reason

Progress = Callable[[str, int, int], None]  # (phase, done, total)


@dataclass
class Target:
    """One (model, dtype) with what case generation needs from it."""

    model: str  # the cases' model id: a preset's name, or a folder's content label (never its path)
    dtype: str
    label: str  # goldens folder name: ``model`` plus a dtype suffix when cast
    vocab: int
    window: int
    kinds: tuple = ()  # layer kinds (``mlxb.cache.protocol.layer_kinds``): which cases apply
    load: tuple = ()  # (source, dtype) for ``load_model``: a preset and its dtype, or a folder and its cast
    ids: Optional[list] = None  # prompt id pool (folders: the tokenizer's ordinary ids); None: [3, vocab)
    trimmable: Optional[bool] = None
    shown: str = ""  # what the user typed
    head_dim: int = 64
    lora_ok: bool = True  # every module a LoRA adapter would take is a Linear (no experts, no embeddings)

    def loads(self) -> Optional[dict]:
        """What to load for this target's cases (``run_oracle`` / ``run_ours``)."""
        return {f"{self.model}|{self.dtype}": self.load} if self.load else None


def _config(path: Path) -> dict:
    cfg = json.loads((path / "config.json").read_text())
    return {**cfg, **cfg.get("text_config", {})}


def _head_dim(m) -> int:
    for layer in getattr(m, "layers", None) or getattr(getattr(m, "model", None), "layers", []):
        hd = getattr(getattr(layer, "self_attn", None), "head_dim", None)
        if isinstance(hd, int):
            return hd
    return 64


def _lora_ok(m) -> bool:
    other = ("SwitchLinear", "QuantizedSwitchLinear", "Embedding", "QuantizedEmbedding")
    return not any(type(x).__name__ in other for layer in getattr(m, "layers", []) for _, x in layer.named_modules())


def _probe(source: str, dtype: Optional[str]) -> tuple[tuple, int, Optional[list], int, int, bool]:
    """Layer kinds, window, ordinary token ids, embedding width and attention head size of a model
    (weights stay lazy)."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlxb.cache.protocol import layer_kinds
    from mlxb.models.registry import load_model

    m, tok, _, _ = load_model(source, dtype, lazy=True)
    kinds = tuple(layer_kinds(m))
    sizes = [c.max_size for c in make_prompt_cache(m) if getattr(c, "max_size", None)]
    hf = getattr(tok, "_tokenizer", tok)
    width = int(m.model.embed_tokens.weight.shape[0]) if hasattr(getattr(m, "model", None), "embed_tokens") else len(hf)
    special = set(getattr(hf, "all_special_ids", []) or [])
    ids = [i for i in range(min(width, len(hf))) if i not in special]
    return kinds, min(sizes) if sizes else 64, ids, width, _head_dim(m), _lora_ok(m)


def target(model: str, dtype: Optional[str]) -> Target:
    """Resolve ``--model`` (preset, alias, HF id or local mlx-lm folder, quantized or not) for parity.

    A folder is named by its content (``<model_type>[-q<bits>]-<fingerprint>``), so its goldens follow it
    when it is moved or downloaded again; ``--dtype`` casts a float folder and is refused for quantized
    weights, whose packed values and scales parity runs as stored."""
    from mlxb.models.fingerprint import folder_fingerprint, safetensors_float_dtype
    from mlxb.models.presets import PRESETS
    from mlxb.models.registry import model_path, resolve_model

    want = goldens.DTYPES.get(dtype, dtype) if dtype else None
    if want is not None and want not in goldens.SHORT:
        raise ValidationError(f"--dtype {dtype!r}: use float32, bfloat16 or float16 (or leave it out)")
    spec = resolve_model(model, want)
    path = model_path(spec)
    cfg = _config(path)
    if spec.kind == "preset":
        native, dt = PRESETS[spec.source].dtype, spec.dtype or PRESETS[spec.source].dtype
        kinds, window, _, _, hd, lora_ok = _probe(spec.source, dt)
        return Target(spec.name, dt, goldens.label(spec.name, dt, native), int(cfg.get("vocab_size", 8192)),
                      int(cfg.get("sliding_window") or window), kinds, (spec.source, dt), shown=model, head_dim=hd,
                      lora_ok=lora_ok)
    q = cfg.get("quantization") or cfg.get("quantization_config")
    native = safetensors_float_dtype(path) or cfg.get("torch_dtype") or cfg.get("dtype")
    if native not in goldens.SHORT:
        raise ValidationError(f"{model}: cannot tell the floating dtype of its weights ({native!r}); "
                              "pass --dtype float32, bfloat16 or float16")
    if want is not None and q:
        raise ValidationError(f"--dtype does not apply to {model}: its weights are {q.get('bits', '?')}-bit quantized "
                              f"(scales in {native}) and parity runs them as stored; leave --dtype out")
    cast = want if want not in (None, native) else None
    kinds, window, ids, width, hd, lora_ok = _probe(str(path), cast)
    base = f"{cfg.get('model_type', 'model')}{'-q%s' % q.get('bits') if q else ''}-{folder_fingerprint(path)[:12]}"
    dt = cast or native
    trim = all(k in ("full", "latent") for k in kinds)
    return Target(base, dt, goldens.label(base, dt, native), width, window, kinds, (str(path), cast), ids, trim,
                  shown=model, head_dim=hd, lora_ok=lora_ok)


def _quant_backend(t: Target) -> Optional[str]:
    """Why this backend cannot run the quant case's attention at ``t``'s dtype and head size (None: it
    can). MLX 0.32's CUDA backend, for one, has no quantized matmul for float32 activations, nor for the
    tiny presets' 32-wide heads."""
    import mlx.core as mx
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    from mlxb.parity.protocol import QUANT_GROUP

    dt = getattr(mx, t.dtype)
    try:
        for bits in (4, 8):
            k = mx.quantize(mx.ones((1, 2, 8, t.head_dim), dtype=dt), group_size=QUANT_GROUP, bits=bits)
            q = mx.ones((1, 4, 1, t.head_dim), dtype=dt)
            mx.eval(quantized_scaled_dot_product_attention(q, k, k, scale=1.0, mask=None, group_size=QUANT_GROUP,
                                                           bits=bits))
    except (RuntimeError, ValueError) as e:
        return (f"{mx.default_device()} has no quantized attention for {t.dtype} at head size {t.head_dim} "
                f"({str(e).splitlines()[0][:90]})")
    from mlxb.kernels.quantized_paths import broadcast_exact

    if not broadcast_exact():
        return (f"mlx-lm's grouped-query quantized attention is wrong on {mx.default_device()} (it differs from "
                "float32 attention over the dequantized cache), so the oracle cannot judge the engine's reads")
    return None


TP_OFF: dict = {}  # cases --tp cannot run (prefix runs on the mirrored RAM tier: its SSD round trip keeps every entry)


def skipped(t: Target, names: Optional[list[str]] = None, tp: int = 1) -> dict[str, str]:
    """The cases that do not apply to ``t``'s model (or to this backend, or to --tp), with the reason."""
    out = {n: skip_reason(n, t.kinds) or (TP_OFF.get(n) if tp > 1 else None) for n in (names or CASES)}
    if "quant" in out and out["quant"] is None:
        out["quant"] = _quant_backend(t)
    if "lora" in out and out["lora"] is None and not t.lora_ok:
        out["lora"] = "LoRA on mixture-of-experts or embedding layers is not served (only Linear layers take adapters)"
    return {n: why for n, why in out.items() if why}


def build_cases(t: Target, bs: Iterable[int], names: Optional[list[str]] = None, seed: int = 0,
                tp: int = 1) -> list[Case]:
    bad = [n for n in names or [] if n not in CASES]
    if bad:
        raise ValidationError(f"unknown case(s) {', '.join(bad)}; cases are: {', '.join(CASES)}")
    skip = skipped(t, names, tp)
    return [make_case(t.model, t.dtype, n, b, seed, t.vocab, t.window, t.ids, t.trimmable)
            for n in (names or CASES) if n not in skip for b in bs]


def run_oracle(cases: list[Case], progress: Optional[Progress] = None, loads: Optional[dict] = None) -> list[dict]:
    """Run every case through mlx-lm in a child process; results in case order. ``loads`` maps a case's
    ``model|dtype`` to the ``(source, dtype)`` to load (default: the id and the case's dtype)."""
    with tempfile.TemporaryDirectory() as d:
        src, dst, lds = Path(d) / "cases.jsonl", Path(d) / "oracle.json", Path(d) / "loads.json"
        src.write_text("".join(json.dumps(c.to_dict()) + "\n" for c in cases))
        lds.write_text(json.dumps(loads or {}))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MLX_RANK", "MLX_HOSTFILE", "NCCL_", "MLX_WORLD"))}
        env["TRANSFORMERS_VERBOSITY"] = "error"  # (the oracle is one unsharded process, also under --tp)
        proc = subprocess.Popen([sys.executable, "-m", "mlxb.oracle", str(src), str(dst), str(lds)], stderr=subprocess.PIPE,
                                text=True, env=env)
        tail = []
        for line in proc.stderr:
            if line.startswith("oracle ") and progress:
                done, total = line.split()[1].split("/")
                progress("oracle (mlx-lm)", int(done), int(total))
            else:
                tail = (tail + [line])[-20:]
        if proc.wait() != 0:
            raise RuntimeError("the mlx-lm oracle process failed:\n" + "".join(tail))
        out = json.loads(dst.read_text())
    for c, r in zip(cases, out):
        assert r["digest"] == c.digest()
    return out


def run_ours(cases: list[Case], faults: frozenset = frozenset(), progress: Optional[Progress] = None,
             loads: Optional[dict] = None, tp=None, compile_decode: bool = False) -> list[dict]:
    """Every case through our engine; ``tp`` (an ``mlxb.distributed.leader.Link``): sharded, the other ranks following;
    ``compile_decode``: decode steps compiled, a lone row's and the batch lane's (``mlxb.engine.compiled``)."""
    from functools import partial

    from mlxb.engine.runner import Runner
    from mlxb.models import load_model
    from mlxb.parity.driver import run_engine

    runner_cls = Runner
    if tp is not None:
        from mlxb.distributed.leader import TPRunner, shard_model

        runner_cls = partial(TPRunner, link=tp)

    loaded: dict = {}
    out = []
    for i, c in enumerate(cases):
        try:
            src = (loads or {}).get(f"{c.model}|{c.dtype}", (c.model, c.dtype))
            if (c.model, c.dtype) not in loaded or c.lora:  # adapters change the model: a fresh one per case
                loaded.clear()
                m, tok, _, _ = load_model(*src, lazy=tp is not None)
                if tp is not None:
                    shard_model(m, tp.group, c.model)
                if c.lora:
                    from mlxb.adapters.lora import install, read_adapter
                    from mlxb.models.adapters import ensure_adapters

                    folders = ensure_adapters(*src, c.model, c.lora["adapters"])
                    install(m, [read_adapter(f"a{i}", f) for i, f in enumerate(folders)])
                else:
                    loaded[(c.model, c.dtype)] = (m, tok)
            else:
                m, tok = loaded[(c.model, c.dtype)]
            rc = runner_cls if tp is None or not c.lora else partial(runner_cls, lora_recipes=c.lora["adapters"])
            out.append(run_engine(m, tok, c, faults, rc, compile_decode="all" if compile_decode else False))
        except Exception as e:  # the case fails alone; the others still run
            out.append({"records": {}, "schedule_mismatch": None, "error": f"{type(e).__name__}: {e}"[:300]})
        if progress:
            progress("engine (mlxb)", i + 1, len(cases))
    return out


def parity(t: Target, cases: list[Case], against: str, root: Path, machine: str,
           faults: frozenset = frozenset(), progress: Optional[Progress] = None, tp=None,
           compile_decode: bool = False) -> list[CaseResult]:
    """``tp``: the engine runs sharded (``mlxb.distributed.leader.Link``); steps whose logits are not bit-equal to
    the unsharded reference may pass within ``goldens/tp_envelope.json`` (tokens must agree)."""
    tp_envs = {c.case: goldens.tp_envelope(root, t.dtype, t.label, c.case) for c in cases} if tp is not None else {}
    if against not in ("live", "golden", "both"):
        raise ValidationError(f"--against {against!r}: use live, golden or both")
    gold = {}
    if against in ("golden", "both"):
        for c in cases:
            g = goldens.read(root, machine, t.label, c.key)
            if g is not None and g["case"].digest() != c.digest():
                raise ValidationError(f"the stored case {t.label}/{c.key} differs from the generated one (the "
                                      "case generator changed); regenerate with `mlxb golden-gen --force`")
            gold[c.key] = g
    loads = t.loads()
    ref = run_oracle(cases, progress, loads) if against in ("live", "both") else None
    ours = run_ours(cases, faults, progress, loads, tp, compile_decode)
    results = []
    for i, c in enumerate(cases):
        label = f"{t.label} {c.key}"
        tp_env = tp_envs.get(c.case)
        if c.case == "shared":  # its own layout by design (protocol notes): tokens and logits, within the envelope
            tp_env = tp_env or SHARED_ENVELOPE.get(t.dtype)
            ours[i]["records"] = _no_geometry(ours[i]["records"])
            if ref is not None and not ref[i].get("error"):
                ref[i]["records"] = _no_geometry(ref[i]["records"])
            if gold.get(c.key) and gold[c.key]["records"] is not None:
                gold[c.key]["records"] = _no_geometry(gold[c.key]["records"])
        mismatch = ours[i]["schedule_mismatch"]
        if ours[i].get("error"):
            r = CaseResult(label, "engine")
            r.error = f"the engine failed on this case: {ours[i]['error']}"
            results.append(r)
            continue
        if ref is not None and ref[i].get("error"):
            r = CaseResult(label, "live")
            r.error = f"the mlx-lm oracle failed on this case: {ref[i]['error']}"
            results.append(r)
        elif ref is not None:
            r = compare(label, "live", ours[i]["records"], ref[i]["records"], tp_env)
            r.envelope = tp_env
            r.schedule_mismatch = mismatch
            r.exercised = ours[i].get("exercised")
            results.append(r)
        if against in ("golden", "both"):
            g = gold[c.key]
            if g is None or g["records"] is None:
                r = CaseResult(label, "golden")
                r.error = (f"no golden for {t.label}/{c.key} under {root} (machine key {machine}); "
                           f"run `mlxb golden-gen --model {t.shown or t.model} --b {c.b} --case {c.case}`")
            else:
                env = tp_env or g["envelope"]
                r = compare(label, f"golden:{g['level']}", ours[i]["records"], g["records"], env)
                r.envelope = env
            r.schedule_mismatch = mismatch
            r.exercised = ours[i].get("exercised")
            results.append(r)
    return results


def _no_geometry(records: dict) -> dict:
    return {k: [{f: v for f, v in step.items() if f != "g"} for step in steps] for k, steps in records.items()}


def golden_gen(t: Target, cases: list[Case], root: Path, machine: str, force: bool = False,
               progress: Optional[Progress] = None) -> list[dict]:
    """Write this machine's goldens; refuses to overwrite without ``force`` (then reports changes)."""
    from mlxb.doctor import blas_core, cpu_model, device_info, versions

    plans = []
    for c in cases:
        old = goldens.read(root, machine, t.label, c.key)
        exists = old is not None and old["level"] == "machine"
        plans.append((c, old if exists else None))
    todo = [c for c, old in plans if old is None or force]
    ref = run_oracle(todo, progress, t.loads()) if todo else []
    envelopes = goldens.load_envelopes(root)
    by_digest = {c.digest(): r for c, r in zip(todo, ref)}
    report = []
    for c, old in plans:
        if old is not None and not force:
            report.append({"case": c.key, "status": "kept (exists; use --force)", "changes": []})
            continue
        res = by_digest[c.digest()]
        if res.get("error"):  # nothing is written for a case the oracle could not run
            report.append({"case": c.key, "status": "oracle failed", "changes": [res["error"]]})
            continue
        changes = goldens.diff(old["records"], res["records"]) if old is not None else []
        goldens.write(root, machine, t.label, c, res["records"], envelopes.get(t.label))
        status = "new" if old is None else ("unchanged" if not changes else "CHANGED")
        report.append({"case": c.key, "status": status, "changes": changes})
    if todo:
        goldens.write_meta(root, machine, {
            "machine_key": machine, "versions": versions(), "device": device_info(),
            "generated": {t.label: {"dtype": t.dtype, "date": time.strftime("%Y-%m-%d"), "model": t.shown or t.model,
                                    "cpu": cpu_model(), "blas_core": blas_core()}},
        })
    return report
