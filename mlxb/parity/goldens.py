"""Golden files, layered per machine.

* ``goldens/<label>/<case>-b<N>.json``: machine-independent data (the case: prompt ids, arrivals,
  max_tokens, chunk size, join op) and the expectations every machine shares: per row and step the
  greedy token and the cache geometry (no logit hashes: those depend on the backend and BLAS).
* ``goldens/<machine-key>/<label>/<case>-b<N>.json``: this machine's expectations (per row and step:
  token, logprob-vector hash, top-5) and the envelope the comparison may use.
* ``goldens/<machine-key>/meta.json``: versions, device and date for that machine key.

A machine-specific file wins over the flat one. ``label`` is the preset name for its own dtype and
``<name>-bf16`` / ``<name>-fp16`` / ``<name>-fp32`` when another dtype is asked for.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

from mlxb.errors import ValidationError
from mlxb.parity.protocol import Case

SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
DTYPES = {"fp32": "float32", "f32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
          "fp16": "float16", "f16": "float16", "float16": "float16"}


def goldens_root() -> Path:
    return Path(os.environ.get("MLXB_GOLDENS", Path.cwd() / "goldens"))


def label(model: str, dtype: str, native: str) -> str:
    return model if dtype == native else f"{model}-{SHORT[dtype]}"


def paths(root: Path, machine: str, lbl: str, key: str) -> tuple[Path, Path]:
    return root / lbl / f"{key}.json", root / machine / lbl / f"{key}.json"


def load_envelopes(root: Path) -> dict:
    """Per-model envelopes written by people (``goldens/envelopes.json``), copied into each golden."""
    p = root / "envelopes.json"
    return json.loads(p.read_text()).get("models", {}) if p.exists() else {}


def read(root: Path, machine: str, lbl: str, key: str) -> Optional[dict]:
    """Return ``{"case": Case, "records", "envelope", "source"}`` or None when no golden exists."""
    flat, mine = paths(root, machine, lbl, key)
    if not flat.exists():
        return None
    base = json.loads(flat.read_text())
    case = Case.from_dict(base["case"])
    for src in (mine, flat):
        if src.exists():
            d = json.loads(src.read_text()) if src is mine else base
            if "records" in d:
                if d.get("digest", case.digest()) != case.digest():
                    raise ValidationError(f"{src} was generated for a different case than {flat}; "
                                          "regenerate with `mlxb golden-gen --force`")
                return {"case": case, "records": d["records"], "envelope": d.get("envelope"), "source": str(src),
                        "level": "machine" if src is mine else "shared"}
    return {"case": case, "records": None, "envelope": None, "source": str(flat), "level": None}


def write(root: Path, machine: str, lbl: str, case: Case, records: dict, envelope: Optional[dict]) -> None:
    flat, mine = paths(root, machine, lbl, case.key)
    flat.parent.mkdir(parents=True, exist_ok=True)
    mine.parent.mkdir(parents=True, exist_ok=True)
    shared = {k: [{"t": s["t"], "g": s["g"]} for s in v] for k, v in records.items()}
    if flat.exists():  # keep the first machine's shared expectations; a second machine only adds its own
        old = json.loads(flat.read_text())
        if old.get("digest") == case.digest() and "records" in old:
            shared = old["records"]
    flat.write_text(json.dumps({"case": case.to_dict(), "digest": case.digest(), "records": shared},
                               separators=(",", ":")) + "\n")
    mine.write_text(json.dumps({"digest": case.digest(), "envelope": envelope, "records": records},
                               separators=(",", ":")) + "\n")


def write_meta(root: Path, machine: str, info: dict) -> None:
    p = root / machine / "meta.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    meta = json.loads(p.read_text()) if p.exists() else {}
    generated = {**meta.get("generated", {}), **info.pop("generated", {})}
    meta.update(info, generated=generated, updated=time.strftime("%Y-%m-%dT%H:%M:%S"))
    p.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def diff(old: dict, new: dict) -> list[str]:
    """Human lines saying what changed between two record sets."""
    lines = []
    for key in sorted(set(old) | set(new), key=int):
        a, b = old.get(key, []), new.get(key, [])
        if len(a) != len(b):
            lines.append(f"row {key}: {len(a)} -> {len(b)} steps")
        for s, (x, y) in enumerate(zip(a, b)):
            if x["t"] != y["t"] or x["h"] != y["h"]:
                what = "token" if x["t"] != y["t"] else "logits"
                lines.append(f"row {key} step {s}: {what} changed ({x['t']} -> {y['t']})")
                break
    return lines


def tp_envelope(root: Path, dtype: str, label: str = "", case: str = "") -> dict:
    """The envelope a tensor-parallel run may use where logits are not bit-equal (``--tp``): written by
    people from measured runs (``goldens/tp_envelope.json`` keeps the measurements next to it)."""
    p = root / "tp_envelope.json"
    if not p.exists():
        raise ValidationError(f"{p} is missing: parity --tp needs its envelope (written from measured runs; see the README)")
    whole = json.loads(p.read_text())
    if label in whole.get("models", {}):
        e = whole["models"][label]
        e, src = (e["cases"][case], f"{label} {case}") if case in e.get("cases", {}) else (e, label)
        return {"max_abs_logprob": float(e["max_abs_logprob"]), "kl_top5": float(e["kl_top5"]), "source": src}
    d = whole["envelopes"]
    if dtype not in d:
        raise ValidationError(f"{p} has no envelope for {dtype} (it has {', '.join(d)}): measure one before gating on it")
    return {"max_abs_logprob": float(d[dtype]["max_abs_logprob"]), "kl_top5": float(d[dtype]["kl_top5"]),
            "source": f"{dtype} default"}
