"""Shared fixtures: packages of the tiny recipe, exported once per test run.

The suite runs in several worker processes (pytest-xdist); a package every worker needs
is exported by the first worker that asks, under a file lock, into a folder all workers
of the run share, and read by the others (exports are byte-identical across processes).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from filelock import FileLock

if not torch.cuda.is_available():
    # Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors. It has to
    # be chosen before any kernel module is imported (decoration reads it).
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Engines open without compiling unless a test asks: a compilation of every pass graph takes
# minutes of CPU per engine. test_background_compile tests the default itself.
os.environ.setdefault("B12X_COMPILE", "0")

import paths  # noqa: F401  (before any test module: puts the repository root, and so `benchmarks`, on the path)
from b12x_toolchain.exporter.pipeline import trace_cache
from b12x_toolchain.exporter.pipeline.export import export_package
from b12x_toolchain.exporter.recipe.loader import load_recipe
from b12x_toolchain.exporter.recipe.variants import recipe_variant
from b12x_toolchain.runtime import load
from decode_steps import FP32_CACHES, SMALL_V4

# What makes a test cost seconds rather than milliseconds here: an exported package (a
# shared one, or one its module exports itself) or a child process (torch's import alone
# takes seconds). `make test-fast` leaves out what carries the `exports` marker.
EXPORT_FIXTURES = {"small_path", "small_release_path", "one_layer_path", "fused_path", "unfused_path", "fused_pkg", "unfused_pkg", "structural_path", "checkpoint_dir",
                   "chat_path", "chat_parallel_path", "fp32_path", "dsv4_small_path"}
COSTLY_CALLS = ("export_package(", "exported(", "subprocess.", "CliRunner(", "on_ranks(")  # on_ranks: a process per rank


def _module_minutes(item) -> float:
    marks = [mark for mark in item.iter_markers("slow") if "minutes" in mark.kwargs]
    return max((mark.kwargs["minutes"] for mark in marks), default=0.0)


def _costly_module(module) -> bool:
    source = Path(module.__file__).read_text()
    return any(call in source for call in COSTLY_CALLS)


def pytest_configure(config):
    # Tests export the same toy passes over and over (other weights, unfused, other folders):
    # each worker traces a pass once and copies it after (exporter/pipeline/trace_cache.py).
    trace_cache.reuse_traces()
    # The real clients' venvs (tests/clients) are made while other tests run, once per run: by
    # the process that starts the workers, or the only one.
    if not hasattr(config, "workerinput") and _runs_clients(config):
        from clients.venvs import build_in_background

        config.client_venvs = build_in_background()


def pytest_unconfigure(config):
    building = getattr(config, "client_venvs", None)
    if building is not None and building.poll() is None:
        building.terminate()  # a venv left half made has no stamp and is made again next time


def _runs_clients(config) -> bool:
    """Whether the run may select tests/clients (a path above it or in it, and no marker that leaves it out)."""
    marks = config.option.markexpr or ""
    if "not exports" in marks or "not slow" in marks:
        return False
    clients = (Path(__file__).parent / "clients").resolve()
    for arg in config.args or [str(Path(config.rootpath) / "tests")]:
        path = (Path(config.invocation_params.dir) / arg.split("::")[0]).resolve()
        if path == clients or path in clients.parents or clients in path.parents:
            return True
    return False


def pytest_collection_modifyitems(config, items):
    # The longest modules run first: the workers take whole modules in collection order
    # (--dist loadscope), so a long module left for last would keep one core busy alone.
    # A module states its length as `pytestmark = pytest.mark.slow(minutes=N)`.
    items.sort(key=lambda item: -_module_minutes(item))  # stable: the order within a module stays
    costly = {}
    for item in items:
        module = item.module
        if module not in costly:
            costly[module] = _costly_module(module)
        if costly[module] or EXPORT_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.exports)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# Modules whose exports trace the same passes run on one worker, so the later export copies
# the earlier one's traces (trace_cache.py keeps them per process): the V4 small model in fp32
# is imported from transformers' checkpoint by test_v4_fidelity and drawn from the v4_reference
# seed by dsv4_small_path; the small recipe is exported in the test's own process by the
# killed-export, rewrite-table and tampered `export --check` tests, and as small_path (fused and
# unfused) by the first test of the group: test_gpu_qualify's, the group's longest.
SAME_TRACES = {
    **{module: "dsv4-small-fp32" for module in (
        "tests/exporter/model/test_v4_fidelity.py", "tests/runtime/package/test_graph_loader.py",
        "tests/bench/test_benchmarks.py")},
    **{module: "dsv41-small" for module in (
        "tests/exporter/pipeline/test_atomic_and_concurrent.py", "tests/exporter/cli/test_cli_and_examples.py",
        "tests/robustness/test_untrusted_packages.py", "tests/bench/test_gpu_qualify.py")},
}


def pytest_xdist_make_scheduler(config, log):
    """xdist's scheduling by module (--dist loadscope), with SAME_TRACES's modules as one unit."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedTraces(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return SAME_TRACES.get(scope, scope)

    return SharedTraces(config, log)


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory) -> Path:
    """A folder shared by every worker of this test run (each worker has its own basetemp below it)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    (root / "shared").mkdir(exist_ok=True)
    return root / "shared"


def once_per_run(run_dir: Path, name: str, build) -> Path:
    """`build(folder)` the first time any worker asks for `name`; its result path afterwards."""
    folder = run_dir / name
    done = folder / ".built"
    with FileLock(str(folder) + ".lock"):
        if not done.exists():
            folder.mkdir(exist_ok=True)
            result = build(folder)
            done.write_text(str(Path(result).relative_to(folder)))
    return folder / done.read_text()


@pytest.fixture(scope="session")
def tiny_recipe():
    return load_recipe("dsv41-tiny")


LONG_CONTEXT = 1 << 16  # max_seq_len of long_path

SMALL = {  # one window-only and one ratio-2 (Full) layer, one draft stage: exports in seconds
    "model.num_layers": 2,
    "model.compress_ratios": [0, 2, 0],
    "model.csa2": {"kv_source_layer_ids": [1], "index_source_layer_ids": [1], "candidate_source_layer_id": None},
    "model.draft.stages": 1,
    "model.draft.target_layer_ids": [1],
    "model.engram.layer_ids": [1],
    "rewrites.0.expect_matches": {"prefill": 0, "verify": 2, "draft": 1, "commit": 0, "decode": 0},
}


@pytest.fixture(scope="session")
def small_recipe(tiny_recipe):
    return recipe_variant(tiny_recipe, SMALL, name="dsv41-small")


# SMALL's ratio-2 layer alone (window, compressed rows, indexer, Engram, the fused snapshot): a
# package of every op kind where two layers would only double the work (Inductor's, a fresh venv's).
ONE_LAYER = {"model.num_layers": 1, "model.compress_ratios": [2, 0],
             "model.csa2": {"kv_source_layer_ids": [0], "index_source_layer_ids": [0], "candidate_source_layer_id": None},
             "model.draft.target_layer_ids": [0], "model.engram.layer_ids": [0],
             "rewrites.0.expect_matches": {"prefill": 0, "verify": 1, "draft": 1, "commit": 0, "decode": 0}}


@pytest.fixture(scope="session")
def one_layer_recipe(small_recipe):
    return recipe_variant(small_recipe, ONE_LAYER, name="dsv41-one-layer")


@pytest.fixture(scope="session")
def one_layer_path(one_layer_recipe, run_dir):
    return once_per_run(run_dir, "one-layer", lambda out: export_package(one_layer_recipe, out).path)


@pytest.fixture(scope="session")
def shipped_path(run_dir):
    """The shipped trained model (checkpoints/dsv41-mini) exported as `make demo` exports it."""
    from b12x_toolchain.exporter.hf.tokenizer_files import checkpoint_export_inputs
    from paths import SHIPPED_CHECKPOINT

    def build(out):
        recipe = load_recipe("dsv41-mini")
        weights, source, tokenizer = checkpoint_export_inputs(SHIPPED_CHECKPOINT, recipe)
        return export_package(recipe, out, weights=weights, weights_source=source, tokenizer=tokenizer).path

    return once_per_run(run_dir, "shipped", build)


@pytest.fixture(scope="session")
def small_path(small_recipe, run_dir):
    """The small recipe fused: the package of the serving, prefix, command-line and benchmark tests."""
    return fused_and_unfused(small_recipe, run_dir, "small")[0]


@pytest.fixture(scope="session")
def small_unfused_path(small_recipe, run_dir):
    return fused_and_unfused(small_recipe, run_dir, "small")[1]


@pytest.fixture(scope="session")
def small_pkg(small_path):
    return load(small_path)


@pytest.fixture(scope="session")
def long_path(small_recipe, run_dir):
    """The small recipe at max_seq_len 64k with the small package's weights (the same seed), named
    as the context_scaling benchmark names its variants: a request must cost and give the same at
    either size (test_context_independence, test_prefix_pages, test_context_scaling)."""
    from benchmarks.context_scaling import variant

    recipe = variant(small_recipe, LONG_CONTEXT)
    return once_per_run(run_dir, "long", lambda out: export_package(recipe, out).path)


@pytest.fixture(scope="session")
def small_release_path(small_recipe, run_dir):
    """The small recipe in the V4.1 release's weight formats (FP8 32x32, FP4 experts, the
    deepseek activation rule), its random weights quantized from the draw."""
    from benchmarks.quantized_recipes import v41_release_weights

    recipe = recipe_variant(small_recipe, {"weights": v41_release_weights("deepseek")}, name="dsv41-small-q")
    return once_per_run(run_dir, "small-q-deepseek", lambda out: export_package(recipe, out).path)


# The small recipe with float32 caches (two ranks' logits agree with one device's to 1e-5) at the
# shipped tokenizer's vocabulary and its distinct normalised keys (chat has a template, text a tokenizer).
CHAT = {**SMALL, **FP32_CACHES, "model.vocab_size": 2048, "model.engram.compressed_vocab_size": 1432}
PARALLEL_MAPPINGS = {"tensor2-expert2": {"tensor": 2, "expert": 2}}


@pytest.fixture(scope="session")
def chat_recipe(tiny_recipe):
    return recipe_variant(tiny_recipe, CHAT, name="dsv41-chat")


@pytest.fixture(scope="session")
def shipped_tokenizer(chat_recipe):
    from b12x_toolchain.exporter.hf.tokenizer_files import checkpoint_tokenizer
    from b12x_toolchain.exporter.recipe.dims import Dims
    from paths import SHIPPED_CHECKPOINT

    return checkpoint_tokenizer(SHIPPED_CHECKPOINT, Dims.from_recipe(chat_recipe).vocab)


@pytest.fixture(scope="session")
def chat_path(chat_recipe, shipped_tokenizer, run_dir):
    """chat_recipe for one device, with the recipe's own weights and the shipped tokenizer."""
    return once_per_run(run_dir, "chat", lambda out: export_package(chat_recipe, out, tokenizer=shipped_tokenizer).path)


def chat_parallel_recipe(chat_recipe, mapping: str):
    return recipe_variant(chat_recipe, {"parallel": PARALLEL_MAPPINGS[mapping]}, name=f"dsv41-chat-{mapping}")


@pytest.fixture(scope="session")
def chat_parallel_path(chat_recipe, shipped_tokenizer, run_dir):
    """chat_parallel_path(mapping id): chat_recipe over two ranks with that mapping, the same
    weights (exported by the first test that asks, once per run)."""
    def path(mapping: str):
        recipe = chat_parallel_recipe(chat_recipe, mapping)
        return once_per_run(run_dir, f"chat-{mapping}",
                            lambda out: export_package(recipe, out, tokenizer=shipped_tokenizer).path)

    return path


@pytest.fixture(scope="session")
def dsv4_small_path(run_dir):
    """SMALL_V4 with fp32 weights and caches as the v4_reference benchmark exports it (its
    weights' seed): logits that match transformers to float rounding."""
    from b12x_toolchain.exporter.model.weights import init_weights
    from b12x_toolchain.exporter.recipe.dims import Dims
    from benchmarks import v4_reference

    def build(out):
        recipe = recipe_variant(v4_reference.fp32_variant(v4_reference.fp32_weights(load_recipe("dsv4-tiny"))),
                                SMALL_V4, name="dsv4-small-fp32")
        weights = init_weights(Dims.from_recipe(recipe), v4_reference.SEED)
        return export_package(recipe, out, weights=weights).path

    return once_per_run(run_dir, "dsv4-small-fp32", build)


def fused_and_unfused(recipe, run_dir, key: str) -> tuple[Path, Path]:
    """`recipe` exported fused and unfused (fused, unfused), both by the first worker that asks
    for either: the second export copies the first's traces (trace_cache.py) instead of tracing
    the same passes again in another worker."""
    def build(out):
        export_package(recipe, out / "unfused", fuse=False)
        return export_package(recipe, out / "fused").path

    fused = once_per_run(run_dir, key, build)
    return fused, fused.parent.parent / "unfused" / fused.name


@pytest.fixture(scope="session")
def fused_path(tiny_recipe, run_dir):
    return fused_and_unfused(tiny_recipe, run_dir, "tiny")[0]


@pytest.fixture(scope="session")
def unfused_path(tiny_recipe, run_dir):
    return fused_and_unfused(tiny_recipe, run_dir, "tiny")[1]


@pytest.fixture(scope="session")
def fused_pkg(fused_path):
    return load(fused_path)


@pytest.fixture(scope="session")
def fp32_recipe(tiny_recipe):
    """The tiny recipe with float32 caches: logits compare with references to 1e-5."""
    return recipe_variant(tiny_recipe, FP32_CACHES, name="dsv41-tiny-fp32")


@pytest.fixture(scope="session")
def fp32_path(fp32_recipe, run_dir):
    """fp32_recipe exported with its own weights (those of `init_weights` at the recipe's seed)."""
    return once_per_run(run_dir, "fp32", lambda out: export_package(fp32_recipe, out).path)


@pytest.fixture(scope="session")
def unfused_pkg(unfused_path):
    return load(unfused_path)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module (`pytestmark = pytest.mark.usefixtures("one_torch_thread")`).

    On two cores shared with other work, replays with one thread run several times faster
    than with two threads waiting on each other. Results a module compares were all made
    under the same setting.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def poison(session) -> None:
    """Fill every reusable buffer with garbage: 0xFF bytes, NaN floats, -1 integers."""
    session.poison()


def random_tokens(gen: torch.Generator, count: int, vocab: int = 512) -> list[int]:
    return torch.randint(0, vocab, (count,), generator=gen).tolist()


@pytest.fixture(scope="session")
def checkpoint_dir(small_recipe, run_dir):
    """The small recipe's weights as a checkpoint: safetensors shards, an index with sha256."""
    from b12x_toolchain.exporter.model.weights import init_weights
    from b12x_toolchain.exporter.pipeline.checkpoint_index import write_checkpoint
    from b12x_toolchain.exporter.recipe.dims import Dims

    def build(out):
        weights = init_weights(Dims.from_recipe(small_recipe), small_recipe.model.init_seed)
        return write_checkpoint(weights, out, shard_bytes=1 << 20)

    return once_per_run(run_dir, "small-checkpoint", build)


@pytest.fixture(scope="session")
def structural_path(small_recipe, checkpoint_dir, run_dir):
    """The small recipe exported without weights (two jobs), checksums from the checkpoint's
    index; the graph after every rewrite is dumped into the sibling folder `dump`. test_structural
    compares its graphs with small_path's (one job) byte for byte."""
    from b12x_toolchain.exporter.model.weights import weight_shapes
    from b12x_toolchain.exporter.pipeline.checkpoint_index import index_checksums
    from b12x_toolchain.exporter.recipe.dims import Dims

    def build(root):
        checksums = index_checksums(checkpoint_dir, weight_shapes(Dims.from_recipe(small_recipe)))
        return export_package(small_recipe, root / "out", structural=True, checksums=checksums,
                              dump_dir=root / "dump", jobs=2).path

    return once_per_run(run_dir, "small-structural", build)
