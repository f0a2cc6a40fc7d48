"""Stop strings matched on streamed text; no partial stop text ever leaks."""

from __future__ import annotations


class StopMatcher:
    """Feed text deltas; get back the text safe to emit and whether a stop string was hit.

    A suffix that could still become a stop string is held back until the next delta decides it.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.hit: str | None = None

    def feed(self, delta: str) -> tuple[str, bool]:
        if not self.stops:
            return delta, False
        buf = self._held + delta
        first = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (first is None or i < first[0]):
                first = (i, s)
        if first is not None:
            self._held = ""
            self.hit = first[1]
            return buf[: first[0]], True
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:k]):
                    keep = max(keep, k)
                    break
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        out, self._held = self._held, ""
        return out
