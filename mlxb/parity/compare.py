"""Compare one case's step records (ours vs a reference): exact, within an envelope, or diverged.

Exact means the same token and the same sha256 of the float32 logprob vector. A reference without
the hash (the shared golden layer, on a machine key with no goldens of its own) can only agree on
tokens and cache geometry: such a step counts as ``tokens_only``, never as exact. A per-model
envelope (max |Δlogprob| over the reference's top-5 ids, KL over the renormalized top-5) is only
consulted where the hash differs and the token agrees; the envelope comes from the golden and is
never changed here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class RowResult:
    row: int
    steps: int = 0
    exact: int = 0
    envelope: int = 0
    tokens_only: int = 0  # token and geometry agree; the reference holds no logit hash to compare
    missing: int = 0  # steps the reference has and we do not (or the reverse)
    first_divergence: Optional[dict] = None
    worst: tuple = (0.0, 0.0)  # over the steps passed by the envelope: max |Δlogprob| (top-5), max KL

    @property
    def ok(self) -> bool:
        return self.first_divergence is None and self.missing == 0


@dataclass
class CaseResult:
    label: str
    against: str
    rows: list[RowResult] = field(default_factory=list)
    schedule_mismatch: Optional[dict] = None
    error: Optional[str] = None
    envelope: Optional[dict] = None  # the golden's envelope, printed with the result
    superseded: Optional[str] = None  # a shared golden this machine's live oracle overrules (``supersede_shared``)
    exercised: Optional[dict] = None  # what the engine's run went through (shared-prefix counts), where reported

    @property
    def ok(self) -> bool:
        return self.superseded is not None or (
            self.error is None and self.schedule_mismatch is None and all(r.ok for r in self.rows))

    def to_dict(self) -> dict:
        return {"case": self.label, "against": self.against, "ok": self.ok, "superseded": self.superseded,
                **self.counts(),
                "schedule_mismatch": self.schedule_mismatch, "error": self.error, "envelope_spec": self.envelope,
                "rows": [{"row": r.row, "steps": r.steps, "exact": r.exact, "envelope": r.envelope,
                          "tokens_only": r.tokens_only, "missing": r.missing, "first_divergence": r.first_divergence,
                          "envelope_worst": {"max_abs_logprob": r.worst[0], "kl_top5": r.worst[1]}} for r in self.rows],
                **({"exercised": self.exercised} if self.exercised is not None else {})}

    def counts(self) -> dict:
        return {k: sum(getattr(r, k) for r in self.rows) for k in ("steps", "exact", "envelope", "tokens_only", "missing")}


def _top_delta(ours: list, ref: list) -> tuple[float, float]:
    a, b = dict((int(i), lp) for i, lp in ours), dict((int(i), lp) for i, lp in ref)
    if set(a) != set(b):
        return math.inf, math.inf
    if not b:
        return 0.0, 0.0
    # a grammar mask leaves -inf in the top-5 when fewer than 5 tokens are allowed: equal -inf is no
    # difference, and a token with probability 0 adds nothing to the KL
    dmax = max(0.0 if a[i] == b[i] else abs(a[i] - b[i]) for i in b)
    za, zb = sum(math.exp(v) for v in a.values()), sum(math.exp(v) for v in b.values())
    kl = sum(math.exp(b[i]) / zb * ((b[i] - math.log(zb)) - (a[i] - math.log(za))) for i in b if b[i] != -math.inf)
    return dmax, kl


def within(envelope: Optional[dict], ours: dict, ref: dict) -> bool:
    if not envelope:
        return False
    dmax, kl = _top_delta(ours["top"], ref["top"])
    return dmax <= envelope["max_abs_logprob"] and kl <= envelope["kl_top5"]


def compare(label: str, against: str, ours: dict, ref: dict, envelope: Optional[dict] = None) -> CaseResult:
    res = CaseResult(label, against)
    for key in sorted(ref, key=int):
        rr = RowResult(int(key))
        mine, theirs = ours.get(key, []), ref[key]
        rr.missing = abs(len(mine) - len(theirs))
        for step, (a, b) in enumerate(zip(mine, theirs)):
            rr.steps += 1
            same_geo = a.get("g") == b.get("g")
            # a flat (machine-independent) golden holds tokens and geometry only
            same_hash = a["h"] == b["h"] if "h" in b else True
            if a["t"] == b["t"] and same_hash and same_geo and "h" not in b:
                rr.tokens_only += 1
            elif a["t"] == b["t"] and same_hash and same_geo:
                rr.exact += 1
            elif a["t"] == b["t"] and same_geo and "top" in b and within(envelope, a, b):
                rr.envelope += 1
                d = _top_delta(a["top"], b["top"])
                rr.worst = (max(rr.worst[0], d[0]), max(rr.worst[1], d[1]))
            elif rr.first_divergence is None:
                dmax, kl = _top_delta(a["top"], b.get("top", []))
                rr.first_divergence = {"step": step, "what": "token" if a["t"] != b["t"] else
                                       ("cache geometry" if not same_geo else "logits"),
                                       "ours_geometry": a.get("g"), "ref_geometry": b.get("g"),
                                       "ours_token": a["t"], "ref_token": b["t"], "ours_top5": a["top"],
                                       "ref_top5": b.get("top"), "max_abs_dlogprob_top5": dmax, "kl_top5": kl}
        res.rows.append(rr)
    return res


def supersede_shared(results: list[CaseResult]) -> list[str]:
    """The shared golden layer holds tokens written on another machine. Where it disagrees on a token
    but this machine's live mlx-lm oracle passes the same case (so mlx-lm here chose what the engine
    chose: a near-tie decided differently in the last bits by another CPU or BLAS), the live oracle is
    the authority: the shared result is marked superseded (reported, not failed). Geometry, missing
    steps, errors, or a failing live result are never superseded. Returns one note per case."""
    live = {r.label: r for r in results if r.against == "live"}
    notes = []
    for r in results:
        lv = live.get(r.label)
        if r.against != "golden:shared" or r.ok or lv is None or not lv.ok or r.error or r.schedule_mismatch:
            continue
        divs = [(row.row, row.first_divergence) for row in r.rows if row.first_divergence is not None]
        if any(row.missing for row in r.rows) or any(
                d.get("what") != "token" or d.get("ours_geometry") != d.get("ref_geometry") for _, d in divs):
            continue
        where = "; ".join(f"row {i} step {d['step']}: {d['ours_token']} here, {d['ref_token']} in the shared golden"
                          for i, d in divs)
        r.superseded = f"this machine's mlx-lm agrees with the engine ({where})"
        notes.append(f"{r.label}: the shared golden (another machine) differs from this machine's live mlx-lm, "
                     f"which the engine matches ({where}); write this machine's goldens with `mlxb golden-gen`")
    return notes
