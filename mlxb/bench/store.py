"""Benchmark results as labelled Parquet: one row per request and one summary row per
(cell, stack, load, repeat), appended under ``reports/results/<run>/`` with a JSON summary beside.

Every row carries the run's labels (machine key, device, memory, OS, mlx / mlx-lm / mlxb versions,
git commit, date, model, dtype, server flags), so no number travels without its context.
Written through pandas (pyarrow engine).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Optional

import pandas as pd

LABEL_KEYS = ("run_id", "machine_key", "device", "backend", "cpu", "memory_gb", "os", "mlx", "mlx_lm", "mlxb",
              "git_commit", "date", "model", "dtype", "bench")


def git_commit() -> str:
    """The checkout's commit (``-dirty`` with local changes). ``MLXB_GIT_COMMIT`` overrides it where the tree was
    copied without its own history (the lent GPU machines: the label read a stale commit there)."""
    if os.environ.get("MLXB_GIT_COMMIT"):
        return os.environ["MLXB_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, timeout=5,
                               cwd=Path(__file__).resolve().parent).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except Exception:
        return "unknown"


def result_file(kind: str, model: str) -> Path:
    """reports/results/<kind>-<model>-<time>.json; a model given as a folder path is named by its last part."""
    stem = Path(model.rstrip("/")).name or "model"
    return Path("reports/results") / f"{kind}-{stem}-{time.strftime('%Y%m%d-%H%M%S')}.json"


def labels(model: str, dtype: Optional[str], bench: str) -> dict:
    from mlxb.doctor import report

    facts = report(measure=False)
    v = facts["versions"]
    return {
        "run_id": f"{bench}-{time.strftime('%Y%m%d-%H%M%S')}",
        "machine_key": facts["machine_key"],
        "device": str(facts.get("device")),
        "backend": str(facts.get("backend")),
        "cpu": facts.get("cpu"),
        "memory_gb": float(facts.get("memory_gb") or 0),
        "os": facts.get("os"),
        "mlx": v.get("mlx"),
        "mlx_lm": v.get("mlx-lm") or v.get("mlx_lm"),
        "mlxb": v.get("mlxb"),
        "git_commit": git_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "model": model,
        "dtype": dtype or "native",
        "bench": bench,
    }


def json_labels(model: str, dtype: Optional[str], **extra) -> dict:
    """Labels of a JSON result (bench engine, spec, kv): the machine and versions (``mlxb doctor``), the commit,
    model, dtype and date."""
    from mlxb.doctor import report

    return {**report(measure=False), "model": model, "dtype": dtype, "git_commit": git_commit(), **extra,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S")}


def write_run(root: Path, lab: dict, requests: list[dict], summaries: list[dict], complete: bool = True) -> Path:
    """Write ``requests.parquet``, ``summary.parquet`` and ``summary.json`` under ``root/<run_id>/``
    (``complete`` False: the phases so far of a run still going, rewritten as it goes; summary.json says so)."""
    out = Path(root) / lab["run_id"]
    out.mkdir(parents=True, exist_ok=True)
    req = pd.DataFrame([{**lab, **r} for r in requests])
    summ = pd.DataFrame([{**lab, "complete": complete, **s} for s in summaries])
    if "itls" in req:
        req["itls"] = req["itls"].apply(lambda x: json.dumps(x))  # keep the column a plain string
    req.to_parquet(out / "requests.parquet", engine="pyarrow", index=False)
    summ.to_parquet(out / "summary.parquet", engine="pyarrow", index=False)
    (out / "summary.json").write_text(json.dumps({"labels": lab, "complete": complete, "summary": summaries},
                                                 indent=2, default=str))
    return out


def read_summaries(paths: list[Path]) -> pd.DataFrame:
    """Every ``summary.parquet`` under the given files/folders, concatenated."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(p.rglob("summary.parquet"))
        elif p.suffix == ".parquet":
            files.append(p)
    if not files:
        from mlxb.errors import ValidationError

        raise ValidationError(f"no summary.parquet under {', '.join(map(str, paths))}; run `mlxb bench load` or "
                              "`mlxb bench features` first")
    return pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)


def read_requests(paths: list[Path]) -> pd.DataFrame:
    files: list[Path] = []
    for p in map(Path, paths):
        files += sorted(p.rglob("requests.parquet")) if p.is_dir() else ([p] if p.name == "requests.parquet" else [])
    return pd.concat([pd.read_parquet(f) for f in files], ignore_index=True) if files else pd.DataFrame()
