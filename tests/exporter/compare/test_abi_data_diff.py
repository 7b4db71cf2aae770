"""`b12x abi diff` names changes to the buffer and pass data the fingerprint covers (format 2)."""

from __future__ import annotations

from b12x_toolchain.exporter.compare.abi_diff import diff_manifests
from runtime.package.manifests import contract_manifest, edited


def test_buffer_and_pass_data_changes_are_reported(tiny_recipe):
    base = contract_manifest(tiny_recipe)
    assert diff_manifests(base, base) == []
    changes = {
        "buffer": (lambda m: m["buffers"]["cache.layer2.compressed"].update(format="dsv41_mxfp8"),
                   ["buffer cache.layer2.compressed: format dsv41_nvfp4 -> dsv41_mxfp8"]),
        "pass": (lambda m: m["passes"]["commit"].update(reads_staging_of=None),
                 ["pass commit: reads_staging_of verify -> None"]),
        "row input": (lambda m: m["passes"]["verify"]["row_inputs"].update(positions="slot_ids"),
                      ["verify input positions: kind positions -> slot_ids"]),
        # Another FlashInfer release's records: same names and shapes, other bytes.
        "cache format": (lambda m: m["cache_formats"].update(dsv41_nvfp4="DeepSeek V4.1 compressed record (indexed), "
                                                                          "flashinfer-python 0.8.0"),
                         ["cache format dsv41_nvfp4: 'DeepSeek V4.1 compressed record (indexed), flashinfer-python "
                          "0.7.4' -> 'DeepSeek V4.1 compressed record (indexed), flashinfer-python 0.8.0'"]),
    }
    for label, (edit, lines) in changes.items():
        other = edited(base, edit)
        assert other["abi_fingerprint"] != base["abi_fingerprint"], label
        assert diff_manifests(base, other) == lines, label
