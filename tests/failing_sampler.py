"""A sampler that fails for one temperature: how a request whose own distribution cannot be
drawn from (the error torch raises for inf, nan or negative probabilities) is made on demand."""

from __future__ import annotations

import b12x_toolchain.runtime.serving.executor as executor_module

FAILING_TEMPERATURE = 0.5


def fail_sampling_at(monkeypatch, temperature: float = FAILING_TEMPERATURE) -> None:
    """Requests sampling at `temperature` fail choosing their tokens; every other one is untouched."""
    real = executor_module.probabilities

    def failing(logits, t, top_p=1.0):
        if t == temperature:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, t, top_p)

    monkeypatch.setattr(executor_module, "probabilities", failing)
