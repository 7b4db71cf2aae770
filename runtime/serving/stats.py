"""Counters of the serving loop, per step and cumulative, handed out as plain dicts.

Terms: a row-step is one request decoded in one step. Each row-step drafts
`draft_width` tokens (none in plain decoding), the target accepts a prefix of them,
and one more token comes from the target itself — the bonus (after a rejection in
sampling, the resampled token). So a row-step emits accepted + 1 tokens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass
class Counters:
    rows: int = 0  # row-steps decoded
    padding_rows: int = 0  # rows the buckets added, all pointing at the scratch slot
    drafted: int = 0
    accepted: int = 0
    bonus: int = 0
    prefill_tokens: int = 0
    admitted: int = 0
    retired: int = 0
    aside_rows: int = 0  # row-steps a drafting engine decoded without drafting (draft_policy.py)
    slot_reuse: int = 0  # admissions into a slot an earlier request of this engine held
    page_waits: int = 0  # admissions deferred because the request's pages could not be had yet
    generated: int = 0  # tokens handed to requests (the first one comes from prefill)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    def add(self, other: "Counters") -> None:
        for f in fields(Counters):  # not the subclass's own fields (step index, step count)
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def derived(self) -> dict:
        seconds = self.prefill_seconds + self.decode_seconds
        return {
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "mean_accepted_per_step": self.accepted / self.rows if self.rows else 0.0,
            "tokens_per_step": (self.accepted + self.bonus) / self.rows if self.rows else 0.0,
            "decode_tokens_per_second": (self.accepted + self.bonus) / self.decode_seconds if self.decode_seconds else 0.0,
            "tokens_per_second": self.generated / seconds if seconds else 0.0,
        }


@dataclass
class StepStats(Counters):
    step: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # drafts accepted, per row-step that verified

    def as_dict(self) -> dict:
        return {"step": self.step, **asdict(self), **self.derived()}


@dataclass
class EngineStats(Counters):
    steps: int = 0  # steps that decoded at least one row

    def record(self, step: StepStats) -> None:
        self.add(step)
        self.steps += step.rows > 0

    def as_dict(self) -> dict:
        return {"steps": self.steps, **asdict(self), **self.derived()}
