"""The manifest's weights.engram_tables: which weights are Engram tables, as data; read back,
and refused when malformed."""

from __future__ import annotations

import pytest

from b12x_toolchain.exporter.model.parallel import engram_tables
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.runtime.errors import PackageError
from runtime.package.manifests import contract_manifest, edited, read_back

TABLE = "model.layers.1.engram.embed.weight"


@pytest.fixture(scope="module")
def manifest(tiny_recipe):
    tables = list(engram_tables(Dims.from_recipe(tiny_recipe)))
    assert TABLE in tables
    return edited(contract_manifest(tiny_recipe), lambda m: m["weights"].update(engram_tables=tables))


def test_the_tables_are_read_back(manifest, tmp_path):
    assert TABLE in read_back(manifest, tmp_path).weights.engram_tables


@pytest.mark.parametrize("tables, fragment", [
    ([], "weights.engram_tables"),
    ("model.layers.1.engram.embed.weight", "weights.engram_tables"),
    ([TABLE, TABLE], "weights.engram_tables"),
    ([TABLE, 3], "weights.engram_tables"),
    ([TABLE, "model.layers.1.engram.nothing"], "lists model.layers.1.engram.nothing, which is no weight input"),
])
def test_a_malformed_list_is_refused(manifest, tmp_path, tables, fragment):
    with pytest.raises(PackageError, match=fragment):
        read_back(edited(manifest, lambda m: m["weights"].update(engram_tables=tables)), tmp_path)
