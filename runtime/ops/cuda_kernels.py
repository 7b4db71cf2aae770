"""CUDA implementations of the op set, registered for the CUDA dispatch key.

`ops.py` imports this module only when CUDA is available, and the registrations apply
only to CUDA tensors: CPU tensors keep dispatching to the torch references. Which backend
serves an op is decided by the tensor's device (through the dispatcher), never by trying
one and catching its failure.

Backends:

* Triton for every op that reads or writes a cache format. The references cannot be
  captured in a CUDA graph (boolean-mask indexing syncs with the host, the decode tables
  are built from Python lists), and the Triton kernels are bit-exact with them by
  construction (`triton_codecs`). Each op is one launch; the fused window op is one
  launch where the unfused pair is two.
* Triton for the context-proportional ops of `sparse_ops` too: `sparse_attention` is one
  launch (`triton_sparse`); `indexer_topk` and `candidate_blocks` score the live entries
  and select from them in two launches, three with candidates (`triton_indexer`). Their
  int32 index outputs are the reference's exactly (a radix select on the float bits with
  the reference's tie rule); attention agrees to fp32 rounding (an online softmax sums
  in another order). Each reads only what the lengths make live, with static shapes and
  no host sync, so they capture like the rest.
* Triton for `hc_sinkhorn` (`triton_mhc`): one launch for the whole Sinkhorn loop, equal
  to the reference to float32 rounding.
* Triton for the linears of `quant_ops` (`triton_quant`), in fixed tiles with a whole K
  loop per tile, so a row's result does not depend on the rows beside it: `dense_linear`
  multiplies float32 weights in IEEE float32; `fp8_block_linear`
  and `fp4_expert_linear` decode the checkpoint's FP8 and packed FP4 weights tile by tile
  in registers (never to a float32 copy) and agree with the references to float32
  accumulation order; the expert op groups rows by expert on the device, so it captures.
* Triton for Engram's `engram_hash` and `engram_lookup` (`triton_engram`), bit-exact with
  the references: the hash's constants are compiled in, so it copies nothing from the
  host; the lookup reads only the rows named, from a GPU table or in place from a pinned
  host one (unified addressing), so it captures either way.
* The reference for `set_seq_len`: one `index_put_`, which captures as it is.

FlashInfer is not called, on any device. The caches hold its pinned 0.7.4 release's V4.1
records (formats/dsv41.py), which these kernels write bit for bit, but its own writers do
not always give its reference's bytes: the SM120/SM121 V4.1 cache writer computes the
window scale as `amax * (1/448)` with a ceiling on the bits, where the reference divides
and takes the ceiling of float32 `log2`, so blocks whose maximum is a few ulps above
`448 * 2^k` get another scale byte; `deepseek_v41_quantize_cache` is SM100-only and stores
a page's data rows before its scale rows; its indexer's MXFP4 key pages are planar too; and
`append_paged_kv_cache` is an unmasked raw copy for head dims 64-512, which matches no
masked commit and no encoded row size here (66, 528, 36, 288, 17 or 68 bytes).
"""

from __future__ import annotations

import torch

from b12x_toolchain.runtime.ops import (
    triton_engram,
    triton_indexer,
    triton_mhc,
    triton_quant,
    triton_rows,
    triton_sparse,
    triton_window,
)
from b12x_toolchain.runtime.ops.namespace import NAMESPACE, OPSET_VERSION

KERNELS = {
    "window_snapshot": triton_window.window_snapshot,
    "cache_append": triton_window.cache_append,
    "window_snapshot_append": triton_window.window_snapshot_append,
    "window_commit": triton_window.window_commit,
    "window_read": triton_rows.window_read,
    "write_rows": triton_rows.write_rows,
    "write_slots": triton_rows.write_slots,
    "gather_rows": triton_rows.gather_rows,
    "stage_rows": triton_rows.stage_rows,
    "read_rows": triton_rows.read_rows,
    "round_trip": triton_rows.round_trip,
    "indexer_topk": triton_indexer.indexer_topk,
    "candidate_blocks": triton_indexer.candidate_blocks,
    "sparse_attention": triton_sparse.sparse_attention,
    "hc_sinkhorn": triton_mhc.hc_sinkhorn,
    "dense_linear": triton_quant.dense_linear,
    "fp8_block_linear": triton_quant.fp8_block_linear,
    "fp4_expert_linear": triton_quant.fp4_expert_linear,
    "engram_hash": triton_engram.engram_hash,
    "engram_lookup": triton_engram.engram_lookup,
}
REFERENCE_ON_CUDA = ("set_seq_len",)  # capturable as written; see the module docstring

_registered = False


def backend_for(op_name: str, device_type: str) -> str:
    """Which implementation serves an op of the op set for tensors on this device type."""
    if op_name not in KERNELS and op_name not in REFERENCE_ON_CUDA:
        raise ValueError(f"{op_name!r} is not an op of op set v{OPSET_VERSION}")
    if device_type == "cuda" and op_name in KERNELS:
        return "triton"
    return "reference"


def register() -> None:
    """Register every Triton kernel for the CUDA dispatch key (once per process)."""
    global _registered
    if _registered:
        return
    for name, kernel in KERNELS.items():
        torch.library.register_kernel(f"{NAMESPACE}::{name}", "cuda", kernel)
    _registered = True
