"""`b12x run` with several prompts: prompt files, per-request limits, stats and errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from b12x_toolchain.exporter.cli.main import main
from b12x_toolchain.runtime.serving.engine import Engine
from b12x_toolchain.runtime.serving.requests import Request
from conftest import random_tokens

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def invoke(*args):
    return CliRunner().invoke(main, ["run", *map(str, args)], terminal_width=200)


def tokens_by_request(output: str) -> dict[str, list[int]]:
    out = {}
    for line in output.splitlines():
        if line.startswith("request ") and " tokens: " in line:
            head, tokens = line.split(" tokens: ")
            out[head.removeprefix("request ")] = [int(t) for t in tokens.split()]
    return out


def table_value(output: str, key: str) -> str:
    row = next(line for line in output.splitlines() if line.split("│")[1:2] and line.split("│")[1].strip() == key)
    return row.split("│")[2].strip()


def test_run_serves_prompt_files_with_per_request_limits(small_pkg, small_path, tmp_path):
    gen = torch.Generator().manual_seed(8)
    long_prompt, short = random_tokens(gen, 150), random_tokens(gen, 4)
    # Where the long request stops: the second token it emits without a stop token.
    alone = Engine(small_pkg.session(slots=1)).generate([Request(long_prompt, 6)])[0].tokens
    lines = [
        json.dumps({"prompt": short, "max_new_tokens": 5, "id": "short"}),
        "# comments and blank lines are skipped",
        "",
        json.dumps([9, 10, 11]),
        json.dumps({"prompt": long_prompt, "max_new_tokens": 6, "stop": [alone[1]], "id": "long"}),
    ]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    ids = tmp_path / "ids.txt"
    ids.write_text("4 5 6 7\n8,9\n")
    result = invoke(small_path, "--prompt-ids", "1,2,3", "--prompts", prompts, "--prompts", ids,
                    "--max-new-tokens", 7, "--slots", 2, "--show-steps")
    assert result.exit_code == 0, result.output

    got = tokens_by_request(result.output)
    assert list(got) == ["0", "short", "2", "long", "4", "5"]  # command-line prompts first, then files in order
    requests = [Request([1, 2, 3], 7), Request(short, 5, id="short"), Request([9, 10, 11], 7),
                Request(long_prompt, 6, stop=(alone[1],), id="long"), Request([4, 5, 6, 7], 7), Request([8, 9], 7)]
    # The same requests through the Python API, batched the same way, give the very same tokens.
    want = Engine(small_pkg.session(slots=2)).generate(requests)
    assert got == {str(s.id): s.tokens for s in want}
    assert got["long"] == alone[: alone.index(alone[1]) + 1] and len(got["short"]) == 5

    assert table_value(result.output, "slot_reuse") == "4"  # six requests through two slots
    assert table_value(result.output, "retired") == "6"
    for stat in ("drafted", "accepted", "bonus", "acceptance_rate", "mean_accepted_per_step", "tokens_per_second"):
        table_value(result.output, stat)
    for column in ("latency ms", "first ms", "finish", "padding_rows"):
        assert column in result.output
    assert "stop" in result.output and "length" in result.output


def test_run_sampling_is_seeded(small_pkg, small_path):
    result = invoke(small_path, "--prompt-ids", "1,2,3", "--prompt-ids", "4", "--max-new-tokens", 6,
                    "--temperature", 0.8, "--seed", 3, "--pages", 5)
    assert result.exit_code == 0, result.output
    assert "speculative sampling" in result.output
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in result.output.splitlines()]
    pools = {row[0]: row[1:] for row in cells if row and row[0].endswith("_pages")}
    assert sorted(pools) == ["entry_pages", "index_key_pages"]
    # 5 pages each; at the end only the prefix cache's snapshots (on by default) hold any.
    assert all(row[0] == "5" and int(row[1]) + int(row[2]) == 5 for row in pools.values())
    # The seed reaches the engine: the Python API with the same seed draws the same tokens.
    want = Engine(small_pkg.session(slots=2), temperature=0.8, seed=3).generate([Request([1, 2, 3], 6), Request([4], 6)])
    assert tokens_by_request(result.output) == {"0": want[0].tokens, "1": want[1].tokens}


# Each case that gets past parsing loads the package (seconds), so only two of them are here;
# the engine's own tests cover every request check.
@pytest.mark.parametrize("line, code, message", [
    ('{"prompt": []}', 1, "request p.jsonl:1: prompt is empty"),
    ('{"prompt": [1], "id": "x", "stop": [900]}', 1, "request 'x' (p.jsonl:1): stop token 900 is out of range"),
    ('{"prompt": [1, 2', 2, "p.jsonl:1: not valid JSON"),
    ('{"prompt": [1], "max_tokens": 3}', 2, "p.jsonl:1: unknown key 'max_tokens'"),
    ("1 2 x", 2, "p.jsonl:1: '1 2 x' is not a list of integer token ids"),
])
def test_run_refuses_bad_prompt_lines(small_path, tmp_path, line, code, message):
    path = tmp_path / "p.jsonl"
    path.write_text(line + "\n")
    result = invoke(small_path, "--prompts", path)
    assert result.exit_code == code and message in result.output, result.output
    assert " tokens: " not in result.output


def test_run_refuses_contradictory_options(small_path):
    assert "give at least one prompt" in invoke(small_path).output
    result = invoke(small_path, "--prompt-ids", "1", "--greedy", "--temperature", 0.5)
    assert result.exit_code == 2 and "cannot be combined with --temperature" in result.output
    result = invoke(small_path, "--prompt-ids", "1", "--pages", 4, "--cache-bytes", 1000)
    assert result.exit_code == 2 and "--pages (4) and --cache-bytes (1000) both size the paged caches" in result.output


def test_run_refuses_a_request_that_can_never_fit(small_path):
    result = invoke(small_path, "--prompt-ids", ",".join(["7"] * 100), "--pages", 2)
    assert result.exit_code == 1 and "request 0 can never fit this session" in result.output, result.output
    assert "Traceback" not in result.output and " tokens: " not in result.output


def test_the_command_line_starts_without_torch():
    # Commands import torch when they run, so `b12x --help` and usage errors answer at once.
    code = "import sys, b12x_toolchain.exporter.cli.main; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
