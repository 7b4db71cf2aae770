"""The quantized-weight benchmarks (load_memory, quantized_decode) run and report well-formed rows.

On the small recipe, quantized in the V4.1 release's formats, against the session's fp32 small
package: one round, uncompiled only (a compilation would take longer than the rest). Never
asserts a speed or a memory figure: those depend on the machine.
"""

from __future__ import annotations

import pytest

from b12x_toolchain.runtime import load  # noqa: E402
from benchmarks import load_memory, quantized_decode  # noqa: E402
from benchmarks.registry import Settings  # noqa: E402
from benchmarks.run import discover, table  # noqa: E402

# About 15 s of its own on two busy cores (two child processes); the quantized small export is shared.
pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow(minutes=0.4)]


def well_formed(rows, unit: str) -> None:
    for m in rows:
        assert m.unit == unit and m.baseline > 0 and m.candidate > 0, (m.benchmark, m.case)
        assert m.ratio == pytest.approx(m.candidate / m.baseline, rel=1e-12)
    assert table(rows).row_count == len(rows)


def test_load_memory_reports_peaks_against_weight_bytes(small_release_path, small_path):
    known = discover()
    assert known["load_memory"] is load_memory.run and known["quantized_decode"] is quantized_decode.run
    rows = load_memory.measure({"fp32 twin": small_path, "quantized": small_release_path}, rounds=1)
    peaks, [weight_bytes] = rows[:-1], rows[-1:]
    assert [m.case for m in peaks] == [f"{label}, {what}" for label in ("fp32 twin", "quantized")
                                       for what in ("load()", "load() + session")]
    well_formed(peaks, "MiB")
    for m in peaks:
        assert m.params["weight_buffers"] == 1 and m.params["peak_was_reset"]
        assert len(m.candidate_samples) == 1
    assert {"float8_e4m3fn", "float8_e8m0fnu", "bfloat16", "int8"} <= set(peaks[-1].params["dtypes"])
    assert weight_bytes.case == "quantized / fp32 twin" and 0 < weight_bytes.ratio < 1


def test_quantized_decode_reports_a_rate_per_activation_rule(small_release_path, small_path):
    packages = {quantized_decode.TWIN: load(small_path), "deepseek": load(small_release_path)}
    rows = quantized_decode.measure(packages, Settings(repeat=1, warmup=0), compiled=(False,), prompt_tokens=16,
                                    new_tokens=5)
    assert [(m.benchmark, m.case) for m in rows] == [("quantized_decode", "activation deepseek, uncompiled")]
    well_formed(rows, "tokens/s")
    params = rows[0].params
    assert params["formats"] == ["bf16", "fp4_e2m1 1x32 ue8m0", "fp8_e4m3 32x32 ue8m0"]
    assert params["weight_bytes"] < params["twin_weight_bytes"]
