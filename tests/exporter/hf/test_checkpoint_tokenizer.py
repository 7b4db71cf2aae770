"""A checkpoint's tokenizer carried into a package (listed, hashed, refused when tampered
with) and out again as text from `b12x run --prompt`. The package is the shared small one
with a tokenizer added as export adds it (`with_tokenizer`), so no export runs here; that
`export --checkpoint` passes the checkpoint's tokenizer on is tested in test_hf_import.py."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from b12x_toolchain.exporter.cli.main import main
from b12x_toolchain.exporter.cli.run_requests import Defaults, PromptError, encode_texts, from_ids, from_text
from b12x_toolchain.exporter.hf.tokenizer_files import checkpoint_tokenizer
from b12x_toolchain.exporter.pipeline.export import with_tokenizer
from b12x_toolchain.exporter.pipeline.package_writer import manifest_digest, write_package
from b12x_toolchain.exporter.train.corpus import load_corpus
from b12x_toolchain.exporter.train.tokenizer import save_tokenizer, train_tokenizer
from b12x_toolchain.runtime import PackageError, TextCodec, load
from b12x_toolchain.runtime.package.checkpoint import CheckpointError
from b12x_toolchain.runtime.package.reader import read_manifest
from b12x_toolchain.runtime.serving.requests import Request

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], terminal_width=200)


def one_error_line(result) -> str:
    assert result.exit_code == 1, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(load_corpus().train[:20], vocab_size=512)  # the small recipe's vocabulary


@pytest.fixture(scope="module")
def checkpoint(tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    save_tokenizer(tokenizer, root)
    return root


@pytest.fixture(scope="module")
def package(small_path, checkpoint, tmp_path_factory):
    manifest = read_manifest(small_path)
    files = {name: (small_path / name).read_bytes() for name in manifest.files}
    manifest, files = with_tokenizer(manifest, files, checkpoint_tokenizer(checkpoint, manifest.model.vocab_size))
    return write_package(tmp_path_factory.mktemp("out") / "dsv41-small.b12x", files, manifest)


def edit_manifest(root, edit) -> None:
    data = json.loads((root / "manifest.json").read_text())
    edit(data)
    data["manifest_sha256"] = manifest_digest(data)
    (root / "manifest.json").write_text(json.dumps(data))


def test_without_a_tokenizer_nothing_changes(small_path):
    manifest = read_manifest(small_path)
    assert with_tokenizer(manifest, {"a": b""}, None) == (manifest, {"a": b""}) and manifest.tokenizer is None
    assert "tokenizer" not in json.loads((small_path / "manifest.json").read_text())


def test_the_tokenizer_files_are_in_the_package(package, checkpoint):
    manifest = read_manifest(package)
    assert manifest.format_version == "4.4"
    facts = manifest.tokenizer
    assert (facts.file, facts.config) == ("tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json")
    assert (facts.eos_token_id, facts.pad_token_id, facts.chat_template) == (0, 2, True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (package / "tokenizer" / name).read_bytes() == (checkpoint / name).read_bytes()
        assert f"tokenizer/{name}" in manifest.files
    shown = run("inspect", package)
    assert "tokenizer: tokenizer/tokenizer.json, eos 0, pad 2, a chat template" in shown.stdout, shown.output
    codec = load(package).tokenizer
    assert isinstance(codec, TextCodec) and TextCodec.from_package(load(package)).eos_id == 0
    assert codec.decode(codec.encode("def f():\n    pass\n")) == "def f():\n    pass\n"
    assert codec.apply_chat_template([{"role": "user", "content": "hi"}]) == "# user:\nhi\n# assistant:\n"


def test_a_tampered_tokenizer_is_refused_at_load(package, tmp_path):
    copy = shutil.copytree(package, tmp_path / "pkg.b12x")
    path = copy / "tokenizer" / "tokenizer.json"
    path.write_text(path.read_text().replace('"<|endoftext|>"', '"<|endoftxet|>"', 1))
    with pytest.raises(PackageError, match=r"^tokenizer/tokenizer\.json: sha256 .* does not match the manifest's"):
        load(copy)


def test_a_tokenizer_section_naming_an_unlisted_file_is_refused(package, tmp_path):
    copy = shutil.copytree(package, tmp_path / "pkg.b12x")
    edit_manifest(copy, lambda m: m["tokenizer"].update(file="tokenizer/other.json"))
    with pytest.raises(PackageError, match=r"tokenizer\.file: 'tokenizer/other\.json' is not a file the package lists"):
        read_manifest(copy)


def test_run_prints_text(package, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "import os\n", "id": "file", "max_new_tokens": 3}) + "\n5 6 7\n")
    result = run("run", package, "--prompt", "def main():\n", "--prompts", prompts, "--max-new-tokens", 4,
                 "--show-ids")
    assert result.exit_code == 0, result.output
    texts = [line for line in result.stdout.splitlines() if " text: " in line]
    assert [line.split(" text: ")[0] for line in texts] == ["request 0", "request file", "request 2"]
    ids = {line.split(" tokens: ")[0]: line.split(" tokens: ")[1] for line in result.stdout.splitlines()
           if " tokens: " in line}
    assert len(ids["request file"].split()) <= 3


def test_a_text_prompt_without_a_tokenizer_names_the_package(package, tmp_path):
    copy = shutil.copytree(package, tmp_path / "plain.b12x")
    shutil.rmtree(copy / "tokenizer")

    def drop(m):
        del m["tokenizer"]
        m["files"] = {n: h for n, h in m["files"].items() if not n.startswith("tokenizer/")}

    edit_manifest(copy, drop)
    line = one_error_line(run("run", copy, "--prompt", "hello", "--max-new-tokens", 1))
    assert f"{copy}: the package has no tokenizer, so --prompt #1 cannot be a text prompt" in line
    result = run("run", copy, "--prompt-ids", "1,2", "--max-new-tokens", 1)  # ids still run, printed as ids
    assert result.exit_code == 0 and "request 0 tokens: " in result.stdout, result.output


def test_the_tokenizers_eos_is_the_default_stop(package):
    codec = load(package).tokenizer
    defaults = Defaults(max_new_tokens=4, stop=())
    items = [from_text("x = 1", "a", defaults), from_ids("3 4", "b", defaults), (Request([5], 4, (7,)), "c")]
    encoded = encode_texts(items, codec, "pkg")
    assert encoded[0][0].prompt == codec.encode("x = 1")
    assert [r.stop for r, _ in encoded] == [(0,), (0,), (7,)]  # a request's own stop stays
    with pytest.raises(PromptError, match="pkg: the package has no tokenizer, so a cannot be a text prompt"):
        encode_texts(items, None, "pkg")


def test_a_checkpoint_tokenizer_is_checked_before_export(tokenizer, tmp_path):
    assert checkpoint_tokenizer(tmp_path, 512) is None
    save_tokenizer(tokenizer, tmp_path)
    with pytest.raises(CheckpointError, match="tokenizer.json: 512 tokens, more than the model's vocab_size 256"):
        checkpoint_tokenizer(tmp_path, 256)
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": 3}')
    with pytest.raises(CheckpointError, match="tokenizer_config.json: eos_token 3: expected a token string"):
        checkpoint_tokenizer(tmp_path, 512)
