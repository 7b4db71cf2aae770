"""Serve more requests than there are slots, the way a server's loop would.

    python examples/serving_loop.py out/dsv41-tiny.b12x

Copy from here: it uses only `b12x_toolchain.runtime`, which never imports the exporter.
"""

from __future__ import annotations

import sys

import torch

from b12x_toolchain.runtime import Engine, Request, load


def main(path: str) -> None:
    package = load(path)
    # Four slots for ten requests: slots are handed to waiting requests as others finish.
    session = package.session(device="cpu", slots=4)
    engine = Engine(session, temperature=0.0)  # greedy; above 0, seeded speculative sampling

    gen = torch.Generator().manual_seed(0)
    requests = [Request(torch.randint(0, package.vocab_size, (length,), generator=gen).tolist(),
                        max_new_tokens=4 + length % 9, id=f"r{i}")
                for i, length in enumerate((1, 5, 140, 30, 64, 65, 2, 200, 9, 17))]
    engine.submit(requests)
    while engine.busy:  # or engine.run(on_step) / engine.generate(requests)
        step = engine.step()
        print(f"step {step.step}: {step.rows} rows, admitted {step.admitted}, retired {step.retired}")
    for state in sorted(engine.finished, key=lambda s: int(s.id[1:])):
        print(f"{state.id}: prompt of {len(state.prompt)} tokens, slot {state.slot}, {state.finish_reason}, "
              f"{state.latency_s * 1e3:.0f} ms -> {state.tokens}")
    print("stats:", {k: round(v, 3) if isinstance(v, float) else v for k, v in engine.stats.as_dict().items()})


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "out/dsv41-tiny.b12x")
