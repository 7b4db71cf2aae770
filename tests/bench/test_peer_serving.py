"""The peer benchmark's own logic: its prompts, and ratios that read "above 1, b12x is better"
for rates and times alike. (Running both servers takes many minutes: benchmarks/ runs it.)"""

from __future__ import annotations

from b12x_toolchain.runtime.serving.text import TextCodec
from benchmarks.peer_serving import CONCURRENCY, TOKENIZER, measurements, prompts


def test_prompts_are_16_of_20_to_200_tokens_of_the_shipped_tokenizer():
    codec = TextCodec.from_files((TOKENIZER / "tokenizer.json").read_bytes(),
                                 (TOKENIZER / "tokenizer_config.json").read_bytes())
    lengths = [len(codec.encode(text)) for text in prompts()]
    assert len(lengths) == 16 and min(lengths) >= 20 and max(lengths) <= 200, lengths


def test_ratios_are_above_one_when_b12x_is_better():
    def rounds(rate, latency, start):
        return [{"start_s": start, **{c: {"tokens_per_s": rate, "ttft_s": latency, "tpot_s": latency / 2}
                                       for c in CONCURRENCY}}]

    found = {m.case: m for m in measurements({"b12x": rounds(30.0, 0.02, 4.0),
                                              "transformers": rounds(20.0, 0.04, 8.0)}, compile_s=1.0)}
    assert set(found) == {"start time"} | {f"concurrency {c} {what}" for c in CONCURRENCY
                                           for what in ("output", "time to first token", "time per output token")}
    assert found["concurrency 1 output"].ratio == 1.5  # b12x faster
    assert found["concurrency 4 time to first token"].ratio == 2.0  # b12x answers in half the time
    assert found["start time"].ratio == 2.0
    assert found["start time"].baseline_label == "transformers serve"
