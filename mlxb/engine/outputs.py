"""Plain records crossing the scheduler/runner boundary (no tensors, no mlx)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PrefillChunk:
    request_id: str
    start: int  # first prompt position fed in this chunk
    end: int  # one past the last position fed (never the last prompt token)
    is_last: bool  # after this chunk the runner feeds the held-back last token and samples token 0
    shared: bool = False  # a follower starts from the snapshot at ``end``: prefill alone (no cohort)
    first: bool = False  # the row's first chunk (starts at its cached length; admitted this iteration)


@dataclass
class SchedulerOutput:
    """What the runner does this iteration: joiner prefill chunks (one chunk's tokens in all, in
    order; rows whose last chunk runs join at the end of the batch), then one decode step."""

    prefills: list[PrefillChunk] = field(default_factory=list)
    decode: bool = False  # one decode step over every running row
    admitted: list[str] = field(default_factory=list)  # requests that started prefill this iteration

    @property
    def cohort(self) -> list[PrefillChunk]:
        """Rows admitted this iteration whose whole uncached prompt runs now (two or more): prefilled
        together as one batch, from their cached prefixes. The run restarts after any chunk that
        joins alone or is a shared leader's, so the cohort is contiguous in chunk order and comes
        after every snapshot its rows start from."""
        run: list[PrefillChunk] = []
        for c in self.prefills:
            if c.first and c.is_last and not c.shared:
                run.append(c)
            elif c.is_last or c.shared:
                run = []
        return run if len(run) >= 2 else []

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decode
