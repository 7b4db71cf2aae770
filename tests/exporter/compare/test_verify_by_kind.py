"""`b12x verify` reads what buffers hold and how passes chain from the manifest's data.

Rows decode by the recorded format and dims (so index keys and compressor state compare
as values, which the name-based lookup before format 2 could not do), inputs are made by
their kind, and a pass that persists another's staging runs right after it, whatever
the passes are called.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from b12x_toolchain.exporter.compare.package_verify import Tolerance, compare, pass_order, verify_packages
from b12x_toolchain.exporter.model.pass_modules import PASSES
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.runtime import load
from b12x_toolchain.runtime.formats.codecs import get_format
from b12x_toolchain.runtime.package.reader import Package

NAMES = {"prefill": "ingest", "verify": "check", "draft": "guess", "commit": "persist", "decode": "step"}


def _info(advances=None, reads_staging_of=None, width=8):
    return SimpleNamespace(advances=advances, reads_staging_of=reads_staging_of, width=width)


def test_pass_order_comes_from_the_data():
    passes = {"persist": _info("accept_len", "check"), "guess": _info(), "check": _info(), "ingest": _info("lengths", width=64),
              "step": _info("lengths", width=1)}
    assert pass_order(passes) == ["ingest", "step", "check", "guess", "persist"]


@pytest.mark.parametrize("kind", ["index_keys", "compressor_state", "draft_window"])
def test_encoded_rows_compare_as_values_by_their_recorded_format(tiny_recipe, kind):
    specs = [s for s in PASSES["prefill"](Dims.from_recipe(tiny_recipe)).caches() if s.info.kind == kind]
    spec = specs[0]
    fmt, dims = get_format(spec.info.format), spec.info.dims
    x = torch.linspace(-1, 1, 4 * dims).reshape(4, dims)
    a, b = fmt.encode(x), fmt.encode(x * 1.01 + 0.01)
    assert compare(spec.name, a, b, spec, None).endswith("bytes differ")
    assert compare(spec.name, a, b, spec, Tolerance(atol=0.5)) is None  # mxfp4 steps are coarse
    assert "values differ beyond tolerance" in compare(spec.name, a, b, spec, Tolerance(atol=1e-9))


@pytest.fixture(scope="module")
def renamed(small_path):
    package = load(small_path)
    passes = {NAMES[old]: dataclasses.replace(info, name=NAMES[old], reads_staging_of=NAMES.get(info.reads_staging_of))
              for old, info in package.passes.items()}
    return Package(package.path, package.manifest, passes, package.weights)


def test_verify_drives_renamed_passes(renamed):
    checks = verify_packages(renamed, renamed, seed=1)
    assert [c.pass_name for c in checks][::4] == ["ingest", "step", "check", "guess", "persist"]
    assert all(c.replays == 1 for c in checks) and [d for c in checks for d in c.differences] == []
