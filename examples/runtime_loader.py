"""Load a b12x package inside a server process and generate speculatively.

    python examples/runtime_loader.py out/dsv41-tiny.b12x

Copy from here: it uses only `b12x_toolchain.runtime`, which never imports the exporter.
"""

from __future__ import annotations

import sys

from b12x_toolchain.runtime import Decoder, load


def main(path: str) -> None:
    package = load(path)  # checks format/op-set versions and every file's sha256
    print(f"loaded {package.manifest.name}  abi {package.abi_fingerprint[:16]}")

    # Caches, staging and outputs are allocated once here and never move afterwards;
    # every pass is prepared for each rows bucket up to max_rows.
    session = package.session(device="cpu", slots=2, max_rows=2)
    decoder = Decoder(session)

    prompts = [[11, 42, 7, 300, 5], list(range(1, 140))]  # the second is longer than the window
    outputs = decoder.generate(prompts, max_new_tokens=24)
    for prompt, tokens in zip(prompts, outputs):
        print(f"prompt of {len(prompt)} tokens -> {tokens}")
    print("stats:", {k: round(v, 3) if isinstance(v, float) else v for k, v in decoder.stats.as_dict().items()})

    # Or drive a pass yourself. Inputs and outputs go by kind (runtime/package/kinds.py),
    # not by the names the exporter gave them: prefill a prompt into slot 0 again.
    session.reset_slot(0)
    prompt, chunk = prompts[0], package.passes["prefill"].width
    out = session.replay("prefill", token_ids=[prompt + [0] * (chunk - len(prompt))], slot_ids=[0], positions=[0],
                         new_tokens=[len(prompt)])
    print(f"first token after the prompt: {int(out['logits'][0, len(prompt) - 1].argmax())}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "out/dsv41-tiny.b12x")
