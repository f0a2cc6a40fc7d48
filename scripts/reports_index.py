"""Write reports/README.md: one line per committed result (a file, or a run folder with summary.json).

Each line gives the command that made it, the machine key, the date and a headline. They come from the
result's own labels where it has them (``bench`` JSON files and run folders); otherwise the machine is
read from the folder (``reports/h200`` is the lent H200, ``cuda-h200``; ``reports/h100`` the lent H100), the date is the day git first
saw the file, the command is the script or bench named in the file when it says so, and the headline is
the file's first line. Run from the repository root: ``python scripts/reports_index.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPORTS = ROOT / "reports"
SKIP = {"README.md"}
BENCH_KINDS = ("engine", "spec", "kv", "lora", "tp", "features", "load", "restart", "agent")


def git_dates() -> dict:
    """path -> the date (YYYY-MM-DD) of the commit that first added it."""
    out = subprocess.run(["git", "log", "--diff-filter=A", "--name-only", "--format=@%ad", "--date=short", "--", "reports"],
                         cwd=ROOT, capture_output=True, text=True).stdout
    dates, day = {}, None
    for line in out.splitlines():
        if line.startswith("@"):
            day = line[1:]
        elif line.strip():
            dates[line.strip()] = day  # git log runs newest first: the last seen is the first add
    return dates


def machine_from_path(rel: str) -> str:
    if rel.startswith("reports/h200/"):
        return "cuda-h200" if "/tp/" not in rel else "cuda-h200-x2"
    if rel.startswith("reports/h100/"):
        return "cuda-h100-80gb-hbm3"
    if rel.startswith("reports/cpu/"):
        return "cpu (see the file)"
    return "-"


def short(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def bench_headline(d: dict) -> str:
    """A few ratio medians (min-max) from a bench JSON's summary."""
    parts = []
    for row in d.get("summary") or []:
        if not isinstance(row, dict) or "ratio_median" not in row:
            continue
        if row["ratio_median"] is None:
            what = row.get("metric") or row.get("regime") or ""
            parts.append(f"{what} B={row.get('B')}: peer failed ({row.get('peer_failed_reason', '?')[:60]})")
            continue
        what = row.get("metric") or row.get("regime") or row.get("scheme") or row.get("arm") or ""
        extra = [f"{k}={row[k]}" for k in ("B", "kv_bits", "bits") if k in row]
        rng = f" ({short(row.get('ratio_min'))}-{short(row.get('ratio_max'))})" if "ratio_min" in row else ""
        parts.append(f"{what} {' '.join(extra)}: {short(row['ratio_median'])}{rng}".strip())
    return "; ".join(parts[:4]) + (" ..." if len(parts) > 4 else "")


def bench_command(kind: str, d: dict) -> str:
    labels, cfg = d.get("labels", {}), d.get("config") or {}
    args = " ".join(f"--{k.replace('_', '-')} {','.join(map(str, v)) if isinstance(v, list) else v}"
                    for k, v in cfg.items() if isinstance(v, (int, float, str, list)) and not isinstance(v, bool)
                    and v not in (None, ""))
    flags = " ".join(f"--{k.replace('_', '-')}" for k, v in cfg.items() if v is True)
    return f"mlxb bench {kind} -m {labels.get('model', '?')} {args} {flags}".strip()


def infer_kind(d: dict):
    """Which bench wrote a labelled JSON file whose name does not say."""
    cfg = d.get("config") or {}
    if "admission" in d:
        return "kv"
    if "late_joiner_stall" in d or "b1" in str(cfg.get("batches", "")):
        return "engine"
    if "method" in cfg or "num_draft_tokens" in cfg:
        return "spec"
    if "adapters" in cfg:
        return "lora"
    return None


def run_folder_entry(folder: Path) -> dict:
    d = json.loads((folder / "summary.json").read_text())
    labels = d.get("labels", {})
    rows = d.get("summary", [])
    cells = {}
    for r in rows:
        if r.get("status") in ("ok", "errors", "gate_failed"):
            cells.setdefault((r["cell"], r["concurrency"]), {}).setdefault(r["stack"], []).append(r)
    parts = []
    for r in rows:  # bench shared: copies over shared per cell (step time, KV bytes)
        if "speedup_median" in r:
            parts.append(f"{r['cell']} ({r['rows']} rows): step {r['speedup_median']:.2f}x, KV {r['kv_ratio_median']:.1f}x"
                         " fewer bytes, shared over copies")
    for (cell, conc), stacks in sorted(cells.items()):
        ours = stacks.get("mlxb")
        peers = [s for s in stacks if s != "mlxb"]
        tps = lambda rs: sum(x["output_throughput"] for x in rs) / len(rs)  # noqa: E731
        if ours and peers:
            peer = stacks[peers[0]]
            parts.append(f"{cell}@{conc}: {tps(ours) / max(tps(peer), 1e-9):.2f}x {peers[0]} tok/s")
        elif ours:
            parts.append(f"{cell}@{conc}: {tps(ours):.1f} tok/s")
    bench = labels.get("bench", folder.name.split("-")[0])
    model = labels.get("model", "?")
    cmd = f"mlxb bench {bench} -m {model}" + (" --peer mlx-lm" if any("mlx-lm" in str(r.get("stack")) for r in rows) else "")
    return {"machine": labels.get("machine_key", "-"), "date": str(labels.get("date", ""))[:10], "command": cmd,
            "headline": "; ".join(parts[:4]) + (" ..." if len(parts) > 4 else "")}


def file_entry(path: Path, rel: str, dates: dict) -> dict:
    entry = {"machine": machine_from_path(rel), "date": dates.get(rel, "-"), "command": "-", "headline": ""}
    kind = path.name.split("-")[0]
    if path.suffix == ".json":
        try:
            d = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError):
            return {**entry, "headline": "(not JSON)"}
        if isinstance(d, dict) and "labels" in d:
            labels = d["labels"]
            entry.update(machine=labels.get("machine_key", entry["machine"]),
                         date=str(labels.get("date", entry["date"]))[:10] or entry["date"])
            kind = kind if kind in BENCH_KINDS else infer_kind(d)
            if kind:
                entry.update(command=bench_command(kind, d), headline=bench_headline(d))
        if not entry["headline"]:
            keys = list(d)[:6] if isinstance(d, dict) else [f"{len(d)} records"]
            entry["headline"] = "keys: " + ", ".join(map(str, keys))
        return entry
    if path.suffix in (".txt", ".log", ".md", ".err", ".jsonl"):
        text = path.read_text(errors="replace")
        first = next((ln.strip("# ").strip() for ln in text.splitlines() if ln.strip()), "")
        entry["headline"] = first[:160]
        for ln in text.splitlines()[:5]:
            if "scripts/" in ln or "mlxb " in ln:
                entry["command"] = ln.strip("#$ ").strip()[:160]
                break
        return entry
    if path.suffix == ".html":
        return {**entry, "headline": "rendered report (see the .md beside it)"}
    return {**entry, "headline": f"{path.suffix} archive"}


def main() -> int:
    dates = git_dates()
    entries = []
    run_folders = sorted(p.parent for p in REPORTS.rglob("summary.json"))
    inside = set(run_folders)
    for path in sorted(REPORTS.rglob("*")):
        rel = str(path.relative_to(ROOT))
        if path.is_dir() or path.name in SKIP or rel.startswith("reports/history/"):
            continue
        if any(parent in inside for parent in path.parents):
            continue
        entries.append((rel, file_entry(path, rel, dates)))
    for folder in run_folders:
        entries.append((str(folder.relative_to(ROOT)) + "/", run_folder_entry(folder)))
    entries.sort()
    esc = lambda s: str(s).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    lines = [
        "# reports/",
        "",
        "Every committed result, one line each: the command that made it (for bench JSON, rebuilt from the run's",
        "recorded config, whose keys name the flags), the machine key, the date and a",
        "headline. Generated by `python scripts/reports_index.py` from each result's own labels where it has",
        "them (bench JSON files and run folders); otherwise the machine comes from the folder (`reports/h200`:",
        "the lent H200), the date from git, and the headline from the file's first line. Ratios are ours over",
        "the peer (or over our own arm named in the command) in the same run, median (min-max).",
        "",
        "The measurement diaries that used to fill the README are in [history/](history/): "
        + ", ".join(f"[{p.stem}](history/{p.name})" for p in sorted((REPORTS / "history").glob("*.md"))) + ".",
        "",
        f"{len(entries)} results.",
        "",
        "| result | command | machine | date | headline |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| `{esc(rel)}` | {esc(e['command'])} | {esc(e['machine'])} | {esc(e['date'])} | {esc(e['headline'])} |"
              for rel, e in entries]
    (REPORTS / "README.md").write_text("\n".join(lines) + "\n")
    print(f"wrote reports/README.md ({len(entries)} results)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
