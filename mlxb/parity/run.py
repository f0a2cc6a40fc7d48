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
from mlxb.parity.protocol import CASES, Case, applies

Progress = Callable[[str, int, int], None]  # (phase, done, total)


@dataclass
class Target:
    """One (model, dtype) with what case generation needs from its config."""

    model: str
    dtype: str
    label: str
    vocab: int
    window: int


def target(model: str, dtype: Optional[str]) -> Target:
    from mlxb.models.presets import PRESETS
    from mlxb.models.registry import model_path, resolve_model

    spec = resolve_model(model, goldens.DTYPES.get(dtype, dtype) if dtype else None)
    cfg = json.loads((model_path(spec) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    if spec.kind == "preset":
        native = PRESETS[spec.source].dtype
    else:
        native = cfg.get("torch_dtype") or cfg.get("dtype") or spec.dtype or "native"
    dt = spec.dtype or native
    lbl = goldens.label(spec.name.replace("/", "--"), dt, native)
    return Target(spec.name, dt, lbl, int(cfg.get("vocab_size", 8192)), int(cfg.get("sliding_window") or 64))


def build_cases(t: Target, bs: Iterable[int], names: Optional[list[str]] = None, seed: int = 0) -> list[Case]:
    bad = [n for n in names or [] if n not in CASES]
    if bad:
        raise ValidationError(f"unknown case(s) {', '.join(bad)}; cases are: {', '.join(CASES)}")
    return [make_case(t.model, t.dtype, n, b, seed, t.vocab, t.window)
            for n in (names or CASES) if applies(n, t.model) for b in bs]


def run_oracle(cases: list[Case], progress: Optional[Progress] = None) -> list[dict]:
    """Run every case through mlx-lm in a child process; results in case order."""
    with tempfile.TemporaryDirectory() as d:
        src, dst = Path(d) / "cases.jsonl", Path(d) / "oracle.json"
        src.write_text("".join(json.dumps(c.to_dict()) + "\n" for c in cases))
        env = dict(os.environ, TRANSFORMERS_VERBOSITY="error")
        proc = subprocess.Popen([sys.executable, "-m", "mlxb.oracle", str(src), str(dst)], stderr=subprocess.PIPE,
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


def run_ours(cases: list[Case], faults: frozenset = frozenset(), progress: Optional[Progress] = None) -> list[dict]:
    from mlxb.models import load_model
    from mlxb.parity.driver import run_engine

    loaded: dict = {}
    out = []
    for i, c in enumerate(cases):
        if (c.model, c.dtype) not in loaded:
            loaded.clear()
            m, tok, _, _ = load_model(c.model, c.dtype)
            loaded[(c.model, c.dtype)] = (m, tok)
        m, tok = loaded[(c.model, c.dtype)]
        out.append(run_engine(m, tok, c, faults))
        if progress:
            progress("engine (mlxb)", i + 1, len(cases))
    return out


def parity(t: Target, cases: list[Case], against: str, root: Path, machine: str,
           faults: frozenset = frozenset(), progress: Optional[Progress] = None) -> list[CaseResult]:
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
    ref = run_oracle(cases, progress) if against in ("live", "both") else None
    ours = run_ours(cases, faults, progress)
    results = []
    for i, c in enumerate(cases):
        label = f"{t.label} {c.key}"
        mismatch = ours[i]["schedule_mismatch"]
        if ref is not None:
            r = compare(label, "live", ours[i]["records"], ref[i]["records"])
            r.schedule_mismatch = mismatch
            results.append(r)
        if against in ("golden", "both"):
            g = gold[c.key]
            if g is None or g["records"] is None:
                r = CaseResult(label, "golden")
                r.error = (f"no golden for {t.label}/{c.key} under {root} (machine key {machine}); "
                           f"run `mlxb golden-gen --model {t.model} --b {c.b} --case {c.case}`")
            else:
                r = compare(label, f"golden:{g['level']}", ours[i]["records"], g["records"], g["envelope"])
                r.envelope = g["envelope"]
            r.schedule_mismatch = mismatch
            results.append(r)
    return results


def golden_gen(t: Target, cases: list[Case], root: Path, machine: str, force: bool = False,
               progress: Optional[Progress] = None) -> list[dict]:
    """Write this machine's goldens; refuses to overwrite without ``force`` (then reports changes)."""
    from mlxb.doctor import device_info, versions

    plans = []
    for c in cases:
        old = goldens.read(root, machine, t.label, c.key)
        exists = old is not None and old["level"] == "machine"
        plans.append((c, old if exists else None))
    todo = [c for c, old in plans if old is None or force]
    ref = run_oracle(todo, progress) if todo else []
    envelopes = goldens.load_envelopes(root)
    by_digest = {c.digest(): r for c, r in zip(todo, ref)}
    report = []
    for c, old in plans:
        if old is not None and not force:
            report.append({"case": c.key, "status": "kept (exists; use --force)", "changes": []})
            continue
        res = by_digest[c.digest()]
        changes = goldens.diff(old["records"], res["records"]) if old is not None else []
        goldens.write(root, machine, t.label, c, res["records"], envelopes.get(t.label))
        status = "new" if old is None else ("unchanged" if not changes else "CHANGED")
        report.append({"case": c.key, "status": status, "changes": changes})
    if todo:
        goldens.write_meta(root, machine, {
            "machine_key": machine, "versions": versions(), "device": device_info(),
            "generated": {t.label: {"dtype": t.dtype, "date": time.strftime("%Y-%m-%d")}},
        })
    return report
