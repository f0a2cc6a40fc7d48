"""Which layers quantize, and how: ``--kv-bits`` / ``--kv-group-size`` / ``--quantized-kv-start``
(``KVScheme``), ``--kv-config FILE`` (``KVPlan``, per layer), and the checks a plan must pass for this
model and backend."""

from __future__ import annotations

from typing import Optional

from mlxb.cache.quantized_read import kv_reads, whole_buffer_reads
from mlxb.kernels.quantized_attention import kv_attention, kv_attention_note


class KVScheme:
    """``--kv-bits`` / ``--kv-group-size`` / ``--quantized-kv-start`` (mlx-lm's names and meaning)."""

    def __init__(self, bits: int, group_size: int = 64, start: int = 0):
        if bits not in (2, 3, 4, 5, 6, 8):
            raise ValueError(f"--kv-bits {bits}: choose 4 or 8 (MLX quantizes with 2-6 or 8 bits)")
        if group_size not in (32, 64, 128):
            raise ValueError(f"--kv-group-size {group_size}: choose 32, 64 or 128")
        if start < 0:
            raise ValueError("--quantized-kv-start must be >= 0")
        self.bits, self.group_size, self.start = bits, group_size, start

    @property
    def name(self) -> str:
        return f"kv{self.bits}g{self.group_size}s{self.start}"

    def bytes_per_token(self, heads: int, dk: int, dv: int, dtype_bytes: int) -> int:
        """Packed values + scales + biases of K and V for one token of one layer."""
        def one(d):
            return heads * (d * self.bits // 8 + 2 * (d // self.group_size) * dtype_bytes)
        return one(dk) + one(dv)


class KVPlan:
    """Per-layer schemes: ``layers[i]`` is layer i's ``KVScheme`` or None (full width). ``--kv-bits``
    is the uniform plan; ``--kv-config FILE`` gives a per-layer map (JSON):

        {"bits": 4, "group_size": 64, "start": 0, "layers": {"0": "none", "-1": "none", "5": 8}}

    ``layers`` overrides the default per layer index (negative counts from the end) or per layer kind
    ("full" or "sliding": every layer of that kind; an index wins over its kind): "none" keeps the
    layer at full width, an integer sets its bits. Every row uses the server's plan (fixed at start-up),
    so rows of different schemes never share a layer buffer."""

    def __init__(self, layers: list, start: int = 0):
        self.layers, self.start = list(layers), start

    @property
    def uniform(self) -> Optional[KVScheme]:
        """The one scheme when every layer has the same one, else None."""
        first = self.layers[0] if self.layers else None
        same = all((s is None) == (first is None) and (s is None or (s.bits, s.group_size) == (first.bits, first.group_size))
                   for s in self.layers)
        return first if same else None

    @property
    def name(self) -> str:
        u = self.uniform
        if u is not None:
            return u.name
        parts = ["full" if s is None else f"kv{s.bits}g{s.group_size}" for s in self.layers]
        return f"per-layer[{','.join(parts)}]s{self.start}"

    @classmethod
    def from_file(cls, path: str, num_layers: int, kinds: Optional[list] = None) -> "KVPlan":
        """``kinds``: the model's layer kinds (``layer_kinds``), for kind keys."""
        import json

        try:
            with open(path) as f:
                cfg = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"--kv-config {path}: cannot read it as JSON ({e})") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"--kv-config {path}: the file must hold a JSON object")
        unknown = set(cfg) - {"bits", "group_size", "start", "layers"}
        if unknown:
            raise ValueError(f"--kv-config {path}: unknown key(s) {', '.join(sorted(unknown))}; "
                             "keys: bits, group_size, start, layers")
        group, start = int(cfg.get("group_size", 64)), int(cfg.get("start", 0))
        default = KVScheme(int(cfg["bits"]), group, start) if cfg.get("bits") is not None else None
        layers = [default] * num_layers
        by_kind = {"full": "full", "sliding": "rotating"}
        items = sorted((cfg.get("layers") or {}).items(), key=lambda kv: kv[0] not in by_kind)  # kinds first

        def scheme(key, v):
            if v == "none" or v is None:
                return None
            if isinstance(v, int) and not isinstance(v, bool):
                return KVScheme(v, group, start)
            raise ValueError(f"--kv-config {path}: layer {key} must be \"none\" or a bit width, got {v!r}")

        for key, v in items:
            if key in by_kind:
                for i, k in enumerate(kinds or []):
                    if k == by_kind[key]:
                        layers[i] = scheme(key, v)
                continue
            try:
                i = int(key)
            except ValueError:
                raise ValueError(f"--kv-config {path}: layer key {key!r} is neither an integer index nor a kind "
                                 "(full, sliding)") from None
            if not -num_layers <= i < num_layers:
                raise ValueError(f"--kv-config {path}: layer {i} is outside this model's {num_layers} layers")
            layers[i] = scheme(key, v)
        return cls(layers, start)


def check_plan(plan: Optional[KVPlan], kinds: list) -> Optional[KVPlan]:
    """Refuse a plan this backend cannot run: with whole-buffer reads, one attention mask serves every
    full-attention layer, so they must all be quantized or all be full width."""
    if plan is not None and whole_buffer_reads():
        full = [s is None for s, k in zip(plan.layers, kinds) if k == "full"]
        if any(full) and not all(full):
            raise ValueError("this backend's quantized attention reads whole KV buffers, so a --kv-config that keeps "
                             "some full-attention layers at full width cannot run here; quantize them all (--kv-bits)")
    return plan


def as_plan(scheme, num_layers: int) -> Optional[KVPlan]:
    """A ``KVScheme`` (--kv-bits) as the uniform plan; a ``KVPlan`` as is."""
    if scheme is None or isinstance(scheme, KVPlan):
        return scheme
    return KVPlan([scheme] * num_layers, scheme.start)


def shared_kv_sources(model) -> set[int]:
    """Cache layers whose keys and values later layers reuse (Gemma 4's KV-shared layers read
    ``previous_kvs``): those later layers run attention without a cache, so the source must stay at
    full width."""
    for obj in (model, getattr(model, "model", None), getattr(model, "language_model", None),
                getattr(getattr(model, "language_model", None), "model", None)):
        prev = getattr(obj, "previous_kvs", None)
        if prev is not None:
            return {int(p) for j, p in enumerate(prev) if int(p) != j}
    return set()


def fit_plan(plan: Optional["KVPlan"], model) -> Optional["KVPlan"]:
    """The plan with KV-shared source layers kept at full width (the plan's name then shows them)."""
    if plan is None:
        return None
    keep = shared_kv_sources(model)
    if not keep & {i for i, s in enumerate(plan.layers) if s is not None}:
        return plan
    return KVPlan([None if i in keep else s for i, s in enumerate(plan.layers)], plan.start)


def kv_stats(plan: Optional[KVPlan]) -> dict:
    """/stats: the plan's name, the decode attention (``kv_attention``: mlx-lm's, or mlxb's fused kernels for every
    layer kind), and how its quantized layers are read (buffer, and the
    grouped-query read: mlx-lm's, or folded where mlx-lm's is wrong on this backend; None until probed; and
    how many CPU streams a quantized read is split across). ``kv_attention_auto``: why the CLI's default
    ``--kv-attention auto`` chose what it did (None when a mode was named)."""
    if plan is None:
        return {"kv_scheme": "none", "kv_reads": None, "kv_attention": kv_attention(),
                "kv_attention_auto": kv_attention_note(), "kv_gqa_read": None, "kv_split_streams": None}
    from mlxb.kernels import quantized_paths
    from mlxb.kernels.split_read import split_parts

    folded = quantized_paths._FOLD
    return {"kv_scheme": plan.name, "kv_reads": kv_reads(), "kv_attention": kv_attention(),
            "kv_attention_auto": kv_attention_note(),
            "kv_gqa_read": None if folded is None else ("folded" if folded else "mlx-lm"),
            "kv_split_streams": split_parts()}
