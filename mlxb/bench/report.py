"""Render benchmark results (Parquet summaries) into HTML or Markdown with plots and A/B verdicts.

For each (cell, concurrency) with mlxb and a peer: the ratio mlxb / peer of aggregate output tok/s
(per-repeat values) and of p95 TTFT (per-request TTFTs pooled over repeats), each with a bootstrap
95% CI (scipy.stats.bootstrap, percentile method). Verdict: ``faster`` / ``slower`` when the CI
excludes 1 (for TTFT, lower is faster), otherwise ``indistinguishable``.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd

from mlxb.bench.store import LABEL_KEYS

OURS = "mlxb"
# one colour per stack in every plot of a report: mlxb first, then peers in name order (matplotlib's tab10)
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")


def stack_colors(stacks) -> dict:
    """Stack -> colour, the same for every plot of one report (ours always the first colour)."""
    order = [OURS] + sorted(s for s in set(stacks) if s != OURS)
    return {s: PALETTE[i % len(PALETTE)] for i, s in enumerate(order)}


def _ratio_ci(a: np.ndarray, b: np.ndarray, stat, seed: int = 0) -> tuple[float, Optional[float], Optional[float]]:
    from scipy.stats import bootstrap

    if not len(a) or not len(b) or stat(b) == 0 or not np.isfinite(stat(b)):
        return None, None, None  # the peer produced nothing to compare with (every request failed)
    point = stat(a) / stat(b)
    if len(a) < 2 or len(b) < 2:
        return point, None, None
    res = bootstrap((a, b), lambda x, y: stat(x) / stat(y), vectorized=False, paired=False, n_resamples=2000,
                    method="percentile", confidence_level=0.95, random_state=np.random.default_rng(seed))
    return point, float(res.confidence_interval.low), float(res.confidence_interval.high)


def _verdict(lo, hi, higher_is_better: bool) -> str:
    if lo is None:
        return "too few samples"
    if lo > 1:
        return "faster" if higher_is_better else "slower"
    if hi < 1:
        return "slower" if higher_is_better else "faster"
    return "indistinguishable"


def ab_table(summ: pd.DataFrame, reqs: pd.DataFrame) -> list[dict]:
    rows = []
    ok = summ[summ["status"].isin(["ok", "errors", "gate_failed"])]
    waves = "wave" in ok.columns and ok["wave"].notna().any()  # first wave (fresh servers) and warm apart
    keys = ["cell", "concurrency", "wave"] if waves else ["cell", "concurrency"]
    for key, g in ok.groupby(keys, sort=True):
        cell, conc = key[0], key[1]
        wave = key[2] if waves else None
        peers = [s for s in g["stack"].unique() if s != OURS]
        if OURS not in set(g["stack"]) or not peers:
            continue
        for peer in peers:
            a = g[g["stack"] == OURS]["output_throughput"].to_numpy(float)
            b = g[g["stack"] == peer]["output_throughput"].to_numpy(float)
            tp, tlo, thi = _ratio_ci(a, b, np.mean)
            row = {"cell": cell, "concurrency": int(conc), "wave": wave, "peer": peer, "ours_tps": float(a.mean()),
                   "peer_tps": float(b.mean()), "tps_ratio": tp, "tps_lo": tlo, "tps_hi": thi,
                   "tps_verdict": "peer served nothing" if tp is None else _verdict(tlo, thi, True)}
            row.update({"ours_p95_ttft": None, "peer_p95_ttft": None, "ttft_ratio": None, "ttft_lo": None,
                        "ttft_hi": None, "ttft_verdict": "no TTFT from a stack"})
            if not reqs.empty:
                sel = reqs[(reqs["cell"] == cell) & (reqs["concurrency"] == conc) & reqs["ok"]]
                if wave is not None and "wave" in sel.columns:
                    sel = sel[sel["wave"] == wave]
                ta = sel[sel["stack"] == OURS]["ttft"].dropna().to_numpy(float)
                tb = sel[sel["stack"] == peer]["ttft"].dropna().to_numpy(float)
                if len(ta) and len(tb):
                    p95 = lambda x: np.percentile(x, 95)  # noqa: E731
                    r, lo, hi = _ratio_ci(ta, tb, p95)
                    row.update({"ours_p95_ttft": float(p95(ta)), "peer_p95_ttft": float(p95(tb)), "ttft_ratio": r,
                                "ttft_lo": lo, "ttft_hi": hi, "ttft_verdict": _verdict(lo, hi, False)})
            rows.append(row)
    return rows


def headline(ab: list[dict]) -> list[dict]:
    """What a reader came for, one line per (cell, concurrency, peer): the tok/s and p95 TTFT verdicts with
    their ratios, worded so a reader need not decode the tables."""
    out = []
    for r in ab:
        def part(name, ratio, verdict):
            return f"{name}: {verdict}" if ratio is None else f"{name} {ratio:.2f}x the peer's ({verdict})"
        text = "; ".join([part("tok/s", r["tps_ratio"], r["tps_verdict"]),
                          part("p95 TTFT", r["ttft_ratio"], r["ttft_verdict"])])
        good = [r["tps_verdict"] == "faster", r["ttft_verdict"] == "faster"]
        bad = [r["tps_verdict"] == "slower", r["ttft_verdict"] == "slower"]
        tone = "slower" if any(bad) else "faster" if any(good) else "indistinguishable"
        out.append({"cell": r["cell"] + (f" ({r['wave']} wave)" if r.get("wave") else ""), "concurrency": r["concurrency"],
                    "peer": r["peer"], "text": text, "tone": tone})
    return out


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def figures(summ: pd.DataFrame) -> list[tuple]:
    """(cell, matplotlib figure) per measured cell: tok/s and TTFT against concurrency, one colour per stack."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    ok = summ[summ["status"] != "unsupported"]
    colors = stack_colors(ok["stack"].unique())
    for cell, g in ok.groupby("cell", sort=True):
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
        for stack, s in g.groupby("stack"):
            m = s.groupby("concurrency").agg(tps=("output_throughput", "median"), p50=("p50_ttft", "median"),
                                             p95=("p95_ttft", "median")).reset_index()
            c = colors[stack]  # the stack's colour in both panels; p50 solid, p95 dashed
            axes[0].plot(m["concurrency"], m["tps"], marker="o", color=c, label=stack)
            axes[1].plot(m["concurrency"], m["p50"], marker="o", color=c, label=f"{stack} p50")
            axes[1].plot(m["concurrency"], m["p95"], marker="x", linestyle="--", color=c, label=f"{stack} p95")
        axes[0].set(title="aggregate output tok/s", xlabel="concurrency", ylabel="tok/s")
        axes[1].set(title="TTFT (solid p50, dashed p95)", xlabel="concurrency", ylabel="seconds")
        for ax in axes:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        out.append((cell, fig))
    return out


def plots(summ: pd.DataFrame) -> list[dict]:
    return [{"cell": cell, "png": _png(fig)} for cell, fig in figures(summ)]


def render(summ: pd.DataFrame, reqs: pd.DataFrame, out: Path, title: str = "mlxb benchmark report") -> Path:
    import jinja2

    env = jinja2.Environment(loader=jinja2.PackageLoader("mlxb.bench", "templates"), autoescape=out.suffix == ".html")
    env.filters["f"] = lambda v, n=3: "-" if v is None or (isinstance(v, float) and np.isnan(v)) else f"{v:.{n}f}"
    # "complete" False: a run cut short whose finished phases were kept (``write_run``)
    labels = summ[[k for k in (*LABEL_KEYS, "complete") if k in summ]].drop_duplicates().to_dict("records")
    unsupported = summ[summ["status"] == "unsupported"][["cell", "stack", "reason"]].drop_duplicates()
    cols = [c for c in ("cell", "stack", "concurrency", "repeat", "status", "output_throughput", "p50_ttft",
                        "p95_ttft", "p50_tpot", "p95_itl", "failed") if c in summ]
    ab = ab_table(summ, reqs)
    ctx = {"title": title, "labels": labels, "ab": ab, "headline": headline(ab),
           "colors": stack_colors(summ["stack"].unique()) if "stack" in summ else {},
           "plots": plots(summ) if out.suffix == ".html" else [], "unsupported": unsupported.to_dict("records"),
           "runs": summ[cols].sort_values(["cell", "concurrency", "repeat", "stack"]).to_dict("records"),
           "gates": [c for c in summ.columns if c.startswith("gate_")]}
    tpl = env.get_template("report.html.j2" if out.suffix == ".html" else "report.md.j2")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(tpl.render(**ctx))
    return out
