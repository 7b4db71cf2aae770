"""Where a session keeps Engram's tables: on its device like every weight, or in pinned host
memory, read in place by the lookup. Which weights are tables is the manifest's data."""

from __future__ import annotations

import pytest
import torch

from b12x_toolchain.runtime.serving.speculative import Decoder
from conftest import random_tokens

PROMPT = random_tokens(torch.Generator().manual_seed(3), 20)
DRAFT = [5, 9, 11, 2, 40, 7, 300, 1]  # a verify block: anchor and drafts


def verify_logits(session) -> torch.Tensor:
    Decoder(session).prefill(0, PROMPT)
    out = session.replay("verify", token_ids=[DRAFT], slot_ids=[0], positions=[len(PROMPT)])
    return out["logits"][0].clone().cpu()


def test_the_manifest_lists_the_engram_tables(fused_pkg):
    tables = fused_pkg.manifest.weights.engram_tables
    assert tables == ("model.layers.1.engram.embed.weight", "model.layers.3.engram.embed.weight")
    assert set(tables) <= set(fused_pkg.weights)


def test_host_tables_give_the_device_tables_logits_and_bad_places_are_refused(fused_pkg):
    device = fused_pkg.session(slots=1, max_rows=4)
    host = fused_pkg.session(slots=1, max_rows=4, engram_tables="host")
    assert torch.equal(verify_logits(host), verify_logits(device))
    for bad in ("gpu", None, "HOST"):
        with pytest.raises(ValueError, match=r"engram_tables=.*'device', 'host'"):
            fused_pkg.session(slots=1, max_rows=4, engram_tables=bad)


@pytest.mark.cuda
def test_on_cuda_host_tables_are_pinned_cpu_tensors_and_replay_as_device_tables(fused_pkg):
    device = fused_pkg.session(device="cuda", slots=1, max_rows=4)
    host = fused_pkg.session(device="cuda", slots=1, max_rows=4, engram_tables="host")
    tables = fused_pkg.manifest.weights.engram_tables
    for name, tensor in host.weights.items():
        if name in tables:
            assert tensor.device.type == "cpu" and tensor.is_pinned(), name
        else:
            assert tensor.is_cuda, name
    assert all(device.weights[name].is_cuda for name in tables)
    assert torch.equal(verify_logits(host), verify_logits(device))
