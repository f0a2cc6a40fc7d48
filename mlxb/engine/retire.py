"""The runner's row retirement: what leaves the batch (``extract_rows`` for the prompt cache, ``filter``, ``drop_all``),
the aligned flag kept after every change, and the bytes the batch holds. A part of ``mlxb.engine.runner.Runner``
(a base class of it), kept apart by concern; it touches only the runner's own state."""

from __future__ import annotations

import mlx.core as mx

from mlxb.cache.protocol import ROW_OPS, nbytes
from mlxb.spec.ahead import cancel as cancel_ahead


class Retire:
    """Runner methods that remove rows (see the module notes)."""

    def extract_rows(self, indices: list[int]) -> list[tuple]:
        """Per batch row ``i`` in ``indices``: (row, single-row caches, tokens those caches hold),
        taken before a filter drops the rows. A lone adopted row hands its own caches back."""
        cancel_ahead(self)
        out = []
        for i in indices:
            row = self.rows[i]
            if self.merged:
                layers = [ROW_OPS[k].extract(c, i) for k, c in zip(self.kinds, self.caches)]
            else:
                layers = list(self.caches)
            out.append((row, layers, row.base + self.num_steps))
        return out

    def filter(self, keep: list[int]) -> None:
        """Keep rows ``keep`` (batch indices, in order)."""
        if len(keep) == len(self.rows):
            return
        cancel_ahead(self)
        if not keep:
            self.drop_all()
            return
        if self.merged:
            trim = "no_filter_trim" not in self.faults
            self.caches = [ROW_OPS[k].filter(c, keep, trim) for k, c in zip(self.kinds, self.caches)]
            if "kv_stale_scale" in self.faults and len(keep) > 1:  # planted bug: scales of the wrong rows
                for c in self.caches:
                    if hasattr(c, "bits") and c.keys is not None:
                        c.keys = (c.keys[0], c.keys[1][::-1], c.keys[2])
        else:
            assert keep == [0]
        idx = mx.array(keep)
        self.register = self.register[idx]
        self.rows = [self.rows[i] for i in keep]
        if self.sharing is not None:
            self.sharing.refresh(self.rows)
        self.pending = [self.pending[i] for i in keep]
        if self.pending_geo is not None:
            self.pending_geo = [self.pending_geo[i] for i in keep]
        self._align()

    def _align(self) -> None:
        """Mark full-attention batch caches aligned iff no row is left-padded (host-side lengths)."""
        if not self.merged or self._geo_layer is None:
            return
        idx = self.caches[self._geo_layer]._idx  # every full/latent layer shares the buffer index
        aligned = all(r.base + self.num_steps - r.shared == idx for r in self.rows)
        aligned = aligned or "always_aligned" in self.faults  # planted bug: padded rows see their padding
        for k, c in zip(self.kinds, self.caches):
            if k in ("full", "latent"):
                c.aligned = aligned

    def drop_all(self) -> None:
        if self.sharing is not None:
            self.sharing.refresh([])
        self.ahead = None
        self.rows, self.pending, self.caches, self.register, self.merged = [], [], None, None, False
        self.pending_geo = None

    @property
    def kv_bytes(self) -> int:
        return sum(nbytes(c) for c in self.caches) if self.caches else 0

