"""Whether a group of requests drafts this step: speculation that pays, or steps aside.

A verify step (draft, verify, commit) emits each row's accepted drafts plus one token and
costs `ratio` decode steps of the same rows bucket; it pays while the rows' tokens per
verify step beat that ratio. The policy measures both costs as the engine runs (a moving
average of seconds per step, per mode and rows bucket) and keeps, per request, a moving
average of its tokens per verify step, from PRIOR_TOKENS (each request earns its own
standing: one request's prompt says little about another's). A group whose rows' mean falls
below the ratio decodes through the decode pass instead, then probes with one verify step
after `first_probe` steps, twice as long after each probe that does not pay (at most
`last_probe`, the engine's interval carrying over to the next group that steps aside); a
probe that pays puts the group back to drafting. The choice is per group, not per row: a
group split in two would replay twice, which costs more than either choice.

Greedy rows only: their tokens are the same whichever pass computes them (exact decoding),
so their choice may follow timings and the other requests. A sampled request's tokens
depend on how many draws it made, so a group with a sampled row always drafts: for a seed,
its tokens never depend on timing or on its neighbours.
"""

from __future__ import annotations

SMOOTHING = 0.25  # weight of the newest step in each moving average
FIRST_PROBE = 8
LAST_PROBE = 64
# Until both steps of a bucket are timed, a verify step is taken to cost this many decode steps:
# above 1, so that a drafter that accepts nothing makes a group step aside, which times the decode step.
UNMEASURED_RATIO = 1.5
PRIOR_TOKENS = 2.0  # tokens per verify step a request is credited with before its first


def _moved(average: float | None, value: float) -> float:
    return value if average is None else average + SMOOTHING * (value - average)


def _standing(request) -> float:
    """A greedy request's tokens per verify step so far (the prior before its first)."""
    return PRIOR_TOKENS if request.speculation is None else request.speculation


class DraftPolicy:
    def __init__(self, bucket_rows, first_probe: int = FIRST_PROBE, last_probe: int = LAST_PROBE):
        """bucket_rows(mode, rows): the rows bucket a group of `rows` replays in ("verify" or "decode")."""
        if not 1 <= first_probe <= last_probe:
            raise ValueError(f"probe intervals must satisfy 1 <= first_probe <= last_probe, got {first_probe}, "
                             f"{last_probe}")
        self.bucket_rows, self.first_probe, self.last_probe = bucket_rows, first_probe, last_probe
        self.seconds: dict[tuple[str, int], float] = {}  # (mode, bucket rows) -> seconds per step
        self._warm: set[tuple[str, int]] = set()
        self.wait, self.interval = 0, first_probe  # aside: decode steps before the next probe
        self.probes = 0

    def ratio(self, rows: int) -> float:
        """What a verify step of `rows` rows costs in decode steps, as measured."""
        verify = self.seconds.get(("verify", self.bucket_rows("verify", rows)))
        decode = self.seconds.get(("decode", self.bucket_rows("decode", rows)))
        return verify / decode if verify and decode else UNMEASURED_RATIO

    def drafts(self, group: list) -> bool:
        """Whether the group drafts this step (else each row decodes one token)."""
        if any(r.temperature > 0 for r in group):
            return True
        if self.expected(group) >= self.ratio(len(group)):
            return True
        if self.wait > 0:
            return False
        self.probes += 1
        return True

    def expected(self, group: list) -> float:
        """The group's mean tokens per verify step, each greedy row by its own average."""
        greedy = [_standing(r) for r in group if r.temperature == 0]
        return sum(greedy) / len(greedy) if greedy else PRIOR_TOKENS

    def drafted(self, rows: list, emitted: list[int], seconds: float) -> None:
        """After a verify step: each row's tokens that step, and what the step took."""
        probe = self.expected(rows) < self.ratio(len(rows))  # as drafts() judged it, before this step's timing
        self._timed("verify", len(rows), seconds)
        for request, tokens in zip(rows, emitted):
            if request.temperature == 0:
                # A probe is judged on its own step: the averages before it made the group step aside.
                request.speculation = tokens if probe else _moved(_standing(request), tokens)
        if self.expected(rows) >= self.ratio(len(rows)):
            self.wait, self.interval = 0, self.first_probe
        elif probe or self.wait == 0:  # step aside; after a probe that did not pay, twice as long
            self.wait = self.interval
            self.interval = min(2 * self.interval, self.last_probe)

    def decoded(self, rows: list, seconds: float) -> None:
        """After a decode step of a group that stepped aside."""
        self._timed("decode", len(rows), seconds)
        self.wait = max(0, self.wait - 1)

    def _timed(self, mode: str, rows: int, seconds: float) -> None:
        key = (mode, self.bucket_rows(mode, rows))
        if key not in self._warm:  # a bucket's first step pays one-off work (first touch of its buffers)
            self._warm.add(key)
            return
        self.seconds[key] = _moved(self.seconds.get(key), seconds)
