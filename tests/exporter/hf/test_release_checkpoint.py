"""DeepSeek's release layout (FP8 block-scaled, FP4 experts, BF16, FP32): written from a tiny
model, decoded by transformers on the CPU, and read by b12x in its stored formats."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers

from b12x_toolchain.exporter.hf.names import target_of
from b12x_toolchain.exporter.hf.release_layout import INT64, NativeTensor, release_formats, stack_experts
from b12x_toolchain.exporter.hf.release_reader import read_release_checkpoint
from b12x_toolchain.exporter.model.weights import weight_shapes, weight_specs
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.runtime.formats.weight_formats import BF16, FP4_E2M1, FP32, WeightFormat
from b12x_toolchain.runtime.package.checkpoint import CheckpointError
from hf_reference import fp32_tiny_recipe, save_tiny_checkpoint, tiny_v4_config, tiny_weights
from release_checkpoint import (
    edit_config,
    quantize_fp4_rows,
    quantize_fp8_blocks,
    rewrite_tensors,
    write_release_checkpoint,
)

# E2M1 codes 0..15: bit 3 the sign, bits 0-2 the magnitude.
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
SCALE_KEYS = (".scale", ".weight_scale_inv")

# The release's variants: V4 Instruct, V4.1's 32x32 blocks on the V4 model (transformers 5.24
# has no V4.1 model), and V3-style float32 scales under weight_scale_inv.
VARIANTS = {
    "v4-instruct": dict(block=(128, 128)),
    "v41-blocks": dict(block=(32, 32), expert_dtype_inside=True),
    "v3-style-scales": dict(scale_dtype="fp32", scale_key="weight_scale_inv"),
}


@pytest.fixture(scope="module")
def dims():
    return Dims.from_recipe(fp32_tiny_recipe())  # release_formats maps the fp32 specs


@pytest.fixture(scope="module")
def weights():
    return tiny_weights(seed=0)


@pytest.fixture(scope="module")
def written(tmp_path_factory, weights):
    """variant -> (directory, tensors written by release name, block)."""
    out = {}
    for variant, options in VARIANTS.items():
        root = tmp_path_factory.mktemp("release") / variant
        out[variant] = (root, write_release_checkpoint(root, tiny_v4_config(), weights, **options),
                        options.get("block", (128, 128)))
    return out


@pytest.fixture(scope="module")
def instruct(written):
    return written["v4-instruct"]


@pytest.fixture(scope="module")
def expected(dims):
    return release_formats(weight_specs(dims))


def copy_of(root: Path, tmp_path) -> Path:
    return Path(shutil.copytree(root, tmp_path / "ckpt"))


# --- an independent decode of what was written ---------------------------------------

def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """A scale tensor's values in float32: UE8M0 bytes are 2^(byte - 127)."""
    if scale.dtype == torch.float8_e8m0fnu:
        return torch.exp2(scale.view(torch.uint8).float() - 127.0)
    return scale.float()


def decode_fp8(data: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    rows, cols = data.shape[-2:]
    grid = scale_values(scale).repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return data.float() * grid[..., :rows, :cols]


def decode_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    octets = packed.view(torch.uint8).long()
    codes = torch.stack([octets & 0xF, octets >> 4], dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])
    return torch.tensor(E2M1)[codes] * scale_values(scale).repeat_interleave(32, dim=-1)


def scale_of(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    module = name.removesuffix(".weight")
    found = [module + key for key in SCALE_KEYS if module + key in tensors]
    return tensors[found[0]] if found else None


def decoded(tensors: dict[str, torch.Tensor], block) -> dict[str, torch.Tensor]:
    """Release name -> its value: quantized tensors decoded exactly in float32, the rest widened."""
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(SCALE_KEYS) and name.rsplit(".", 1)[0] + ".weight" in tensors:
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            out[name] = decode_fp8(tensor, scale_of(tensors, name), block)
        elif tensor.dtype == torch.int8:
            out[name] = decode_fp4(tensor, scale_of(tensors, name))
        else:
            out[name] = tensor.float() if tensor.is_floating_point() else tensor
    return out


def by_state_dict_name(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Release names -> b12x (state-dict) names, routed experts merged as transformers merges them."""
    whole, pieces = {}, {}
    for name, tensor in values.items():
        target = target_of(name)
        if target.expert is None:
            whole[target.name] = tensor
        else:
            pieces.setdefault(target.name, {})[(target.expert, target.part)] = tensor
    for name, held in pieces.items():
        experts = 1 + max(e for e, _ in held)
        parts = sorted({p for _, p in held})
        whole[name] = torch.cat([torch.stack([held[(e, p)] for e in range(experts)]) for p in parts], dim=1)
    return whole


# --- the writer -----------------------------------------------------------------------

def test_fp4_packs_the_even_column_in_the_low_nibble():
    row = torch.tensor([[0.5, 6.0, -1.0, 0.0] + [0.0] * 28])  # amax 6: scale 2^0
    packed, scale = quantize_fp4_rows(row)
    assert packed.dtype == torch.int8 and list(packed.shape) == [1, 16] and list(scale.shape) == [1, 1]
    assert scale.view(torch.uint8).item() == 127
    assert packed.view(torch.uint8)[0, :2].tolist() == [0x71, 0x0A]  # (0.5 | 6 << 4), (-1 | 0 << 4)
    assert torch.equal(decode_fp4(packed, scale), row)


def test_fp8_ue8m0_scale_is_the_power_of_two_above_amax_over_448():
    weight = torch.full((4, 4), 3.0)
    weight[0, 0] = -896.0  # amax / 448 = 2: scale 2^1, the block max lands on -448
    data, scale = quantize_fp8_blocks(weight, (128, 128), "e8m0")
    assert scale.dtype == torch.float8_e8m0fnu and scale.view(torch.uint8).tolist() == [[128]]
    assert data.dtype == torch.float8_e4m3fn and torch.equal(decode_fp8(data, scale, (128, 128)), weight)


def test_the_checkpoint_holds_the_release_formats(instruct, weights):
    _, tensors, _ = instruct
    kinds = {
        "layers.0.attn.wq_a.weight": torch.float8_e4m3fn, "layers.0.attn.wq_a.scale": torch.float8_e8m0fnu,
        "layers.1.attn.indexer.wq_b.weight": torch.float8_e4m3fn, "layers.1.ffn.shared_experts.w2.scale":
        torch.float8_e8m0fnu, "mtp.0.e_proj.weight": torch.float8_e4m3fn,
        "layers.1.ffn.experts.3.w3.weight": torch.int8, "layers.1.ffn.experts.3.w3.scale": torch.float8_e8m0fnu,
        "embed.weight": torch.bfloat16, "head.weight": torch.bfloat16, "norm.weight": torch.bfloat16,
        "layers.1.ffn.gate.weight": torch.bfloat16, "layers.1.attn.compressor.wkv.weight": torch.bfloat16,
        "layers.1.attn.indexer.compressor.wgate.weight": torch.bfloat16,
        "layers.1.attn.indexer.weights_proj.weight": torch.bfloat16, "layers.0.attn.attn_sink": torch.float32,
        "layers.0.hc_ffn_fn": torch.float32, "hc_head_base": torch.float32, "layers.1.attn.compressor.ape":
        torch.float32, "layers.1.ffn.gate.bias": torch.float32, "layers.0.ffn.gate.tid2eid": torch.int64,
    }
    assert {name: tensors[name].dtype for name in kinds} == kinds
    assert list(tensors["layers.1.ffn.experts.3.w3.weight"].shape) == [64, 32]  # [out, in/2]
    assert list(tensors["layers.1.ffn.experts.3.w3.scale"].shape) == [64, 2]  # [out, in/32]
    assert list(tensors["layers.0.attn.wq_b.scale"].shape) == [2, 1]  # 256 x 32 in 128x128 blocks
    # Quantized, not copied: the decode is near the float32 weight, not equal to it.
    wq_a = decoded(tensors, (128, 128))["layers.0.attn.wq_a.weight"]
    original = weights["model.layers.0.self_attn.q_a_proj.weight"]
    assert not torch.equal(wq_a, original) and torch.allclose(wq_a, original, rtol=0.07, atol=1e-3)


# --- transformers on the CPU ----------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_transformers_loads_it_on_cpu_as_the_exact_decode(written, variant):
    root, tensors, block = written[variant]
    model, info = transformers.AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32,
                                                                    output_loading_info=True)
    assert not any(info.values()), info
    assert not hasattr(model.config, "quantization_config")  # decoded on load, nothing left quantized
    expected = by_state_dict_name({k: v for k, v in decoded(tensors, block).items() if not k.startswith("mtp.")})
    state = model.state_dict()
    assert set(state) == set(expected)
    for name, tensor in state.items():
        want = expected[name]
        assert tensor.dtype == (torch.float32 if want.is_floating_point() else want.dtype), name
        assert torch.equal(tensor, want), name
    # A forward pass runs, and equals a float32 model holding the decoded weights.
    plain = transformers.DeepseekV4ForCausalLM(tiny_v4_config()).eval()
    plain.load_state_dict(expected, strict=True)
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]])
    with torch.no_grad():
        logits = model.eval()(tokens).logits
        assert torch.isfinite(logits).all()
        assert torch.equal(logits, plain(tokens).logits)


def test_transformers_has_no_v41_model():
    # Why the V4.1 variant is the V4 model with V4.1's 32x32 blocks: transformers 5.24 has no
    # deepseek_v41 config or model to load a V4.1 checkpoint into.
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    assert "deepseek_v4" in CONFIG_MAPPING_NAMES and "deepseek_v41" not in CONFIG_MAPPING_NAMES


def test_transformers_takes_the_block_from_the_scale_grid():
    # Why every quantized dimension of the tiny checkpoints is a multiple of the block:
    # 192 rows in 128-row blocks have a 2-row grid, which transformers reads as 96-row blocks.
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    weight = torch.randn(192, 128)
    weight[128:] *= 16  # the second block's scale differs from the first's
    data, scale = quantize_fp8_blocks(weight, (128, 128), "e8m0")
    ours = decode_fp8(data, scale, (128, 128))
    theirs = Fp8Dequantize(None)._dequantize_one(data, scale, output_dtype=torch.float32)
    assert not torch.equal(theirs, ours)
    assert torch.equal(theirs[:96], ours[:96])


# --- b12x reads the stored formats --------------------------------------------------

def test_reads_every_weight_as_stored(instruct, expected, dims):
    root, tensors, _ = instruct
    ckpt = read_release_checkpoint(root, expected, weight_shapes(dims))
    assert ckpt.quantization.block == (128, 128) and ckpt.quantization.scale_encoding == "ue8m0"
    assert ckpt.quantization.expert_dtype == "fp4" and ckpt.quantization.activation_scheme == "dynamic"
    assert set(ckpt.weights) | set(ckpt.experts) == set(expected)
    natives = [*ckpt.weights.values(), *(p for held in ckpt.experts.values() for p in held.values())]
    # The bytes read are the checkpoint's, no more: nothing decoded or widened on the way.
    assert sum(native.nbytes for native in natives) == sum(t.nbytes for t in tensors.values())
    pieces = 0
    for native in natives:
        stored = tensors[native.stored]
        assert native.data.dtype == stored.dtype and torch.equal(native.data.view(torch.uint8),
                                                                 stored.view(torch.uint8)), native.stored
        scale = scale_of(tensors, native.stored)
        assert (native.scale is None) == (scale is None or not native.format.quantized), native.stored
        if native.scale is not None:
            assert native.scale.dtype == torch.float8_e8m0fnu and torch.equal(native.scale.view(torch.uint8),
                                                                              scale.view(torch.uint8))
        pieces += 1
    assert pieces == len([n for n in tensors if not n.endswith(".scale")])
    q_b = ckpt.weights["model.layers.0.self_attn.q_b_proj.weight"]
    assert q_b.format == WeightFormat("fp8_e4m3", (128, 128), "ue8m0") and q_b.shape == (256, 32) and list(q_b.scale.shape) == [2, 1]
    assert ckpt.weights["lm_head.weight"].format == BF16 and ckpt.weights["model.layers.0.self_attn.sinks"].format == FP32
    assert ckpt.weights["model.layers.0.mlp.gate.tid2eid"].format == INT64


def test_stacked_experts_decode_to_what_transformers_merges(instruct, expected, dims):
    root, tensors, block = instruct
    ckpt = read_release_checkpoint(root, expected, weight_shapes(dims))
    merged = by_state_dict_name(decoded(tensors, block))
    shapes = weight_shapes(dims)
    for name in ckpt.experts:
        stacked = ckpt.stacked(name)
        assert stacked.format == FP4_E2M1 and stacked.shape == shapes[name], name
        assert stacked.data.dtype == torch.int8 and list(stacked.scale.shape) == [*shapes[name][:-1],
                                                                                  shapes[name][-1] // 32]
        assert torch.equal(decode_fp4(stacked.data, stacked.scale), merged[name]), name


def test_reads_the_v41_blocks_and_the_v3_style_scales(written, dims):
    root, tensors, _ = written["v41-blocks"]
    ckpt = read_release_checkpoint(root, release_formats(weight_specs(dims), block=(32, 32)), weight_shapes(dims))
    assert ckpt.quantization.block == (32, 32) and ckpt.quantization.expert_dtype == "fp4"
    assert list(ckpt.weights["model.layers.0.self_attn.q_b_proj.weight"].scale.shape) == [8, 1]
    root, tensors, _ = written["v3-style-scales"]
    ckpt = read_release_checkpoint(root, release_formats(weight_specs(dims), scale_encoding="fp32"),
                                   weight_shapes(dims))
    wkv = ckpt.weights["model.layers.0.self_attn.kv_proj.weight"]
    assert wkv.format == WeightFormat("fp8_e4m3", (128, 128), "fp32") and wkv.scale.dtype == torch.float32
    assert torch.equal(wkv.scale, tensors["layers.0.attn.wkv.weight_scale_inv"])


@pytest.mark.parametrize("stored_as", ["uint8", "float32"])
def test_ue8m0_scales_stored_otherwise_become_e8m0(instruct, expected, dims, tmp_path, stored_as):
    root = copy_of(instruct[0], tmp_path)

    def recode(tensors):
        for name, t in tensors.items():
            if t.dtype == torch.float8_e8m0fnu:
                tensors[name] = t.view(torch.uint8) if stored_as == "uint8" else t.float()
    rewrite_tensors(root, recode)
    want = read_release_checkpoint(instruct[0], expected, weight_shapes(dims))
    got = read_release_checkpoint(root, expected, weight_shapes(dims))
    for name, native in got.weights.items():
        if native.scale is not None:
            assert native.scale.dtype == torch.float8_e8m0fnu
            assert torch.equal(native.scale.view(torch.uint8), want.weights[name].scale.view(torch.uint8)), name


def test_reads_state_dict_names_and_merged_experts(instruct, expected, dims, tmp_path):
    """transformers' own names: `<weight>_scale_inv` scales, routed experts stored merged."""
    root = copy_of(instruct[0], tmp_path)
    want = read_release_checkpoint(instruct[0], expected, weight_shapes(dims))

    def rename(tensors):
        tensors.clear()
        for name, native in want.weights.items():
            tensors[name] = native.data
            if native.scale is not None:
                tensors[name + "_scale_inv"] = native.scale
        for name in want.experts:
            stacked = want.stacked(name)
            tensors[name], tensors[name + "_scale_inv"] = stacked.data, stacked.scale
    rewrite_tensors(root, rename)
    got = read_release_checkpoint(root, expected, weight_shapes(dims))
    assert not got.experts and set(got.weights) == set(expected)
    for name, native in got.weights.items():
        source = want.weights[name] if name in want.weights else want.stacked(name)
        assert torch.equal(native.data.view(torch.uint8), source.data.view(torch.uint8)), name


def test_an_unquantized_checkpoint_reads_as_it_is(tmp_path, dims):
    ckpt = save_tiny_checkpoint(tmp_path / "fp32", seed=1)
    unquantized = {name: FP32 if dtype == "float32" else INT64 for name, (_, dtype) in weight_specs(dims).items()}
    read = read_release_checkpoint(ckpt.path, unquantized, weight_shapes(dims))
    assert read.quantization is None and not read.weights["model.norm.weight"].format.quantized
    assert torch.equal(read.stacked("model.layers.2.mlp.experts.down_proj").data,
                       ckpt.weights["model.layers.2.mlp.experts.down_proj"])


def test_an_int32_routing_table_becomes_int64(instruct, expected, dims, tmp_path):
    root = copy_of(instruct[0], tmp_path)
    rewrite_tensors(root, lambda t: t.update({"layers.0.ffn.gate.tid2eid": t["layers.0.ffn.gate.tid2eid"].int()}))
    table = read_release_checkpoint(root, expected, weight_shapes(dims)).weights["model.layers.0.mlp.gate.tid2eid"]
    assert table.data.dtype == torch.int64 and torch.equal(table.data, instruct[1]["layers.0.ffn.gate.tid2eid"])


def test_tied_embeddings_give_lm_head_the_embedding(instruct, expected, dims, tmp_path):
    root = copy_of(instruct[0], tmp_path)
    rewrite_tensors(root, lambda t: t.pop("head.weight"))
    edit_config(root, lambda c: c.update(tie_word_embeddings=True))
    ckpt = read_release_checkpoint(root, expected, weight_shapes(dims))
    assert torch.equal(ckpt.weights["lm_head.weight"].data, ckpt.weights["model.embed_tokens.weight"].data)


# --- refusals, each naming the tensor or key ------------------------------------------

def refused(root, expected, dims) -> str:
    with pytest.raises(CheckpointError) as caught:
        read_release_checkpoint(root, expected, weight_shapes(dims))
    return str(caught.value)


def test_refuses_a_tensor_in_another_format(instruct, expected, dims, tmp_path):
    root = copy_of(instruct[0], tmp_path)

    def to_bf16(tensors):
        tensors["layers.2.attn.wo_b.weight"] = tensors["layers.2.attn.wo_b.weight"].float().bfloat16()
        del tensors["layers.2.attn.wo_b.scale"]
    rewrite_tensors(root, to_bf16)
    assert refused(root, expected, dims) == (
        "layers.2.attn.wo_b.weight: the recipe expects fp8_e4m3 (128x128 blocks, ue8m0 scales) (it holds "
        "model.layers.2.self_attn.o_b_proj.weight); the checkpoint has BF16 [64, 32] without a scale")


def test_refuses_bf16_where_the_recipe_says_fp32(instruct, expected, dims):
    message = refused(instruct[0], {**expected, "model.embed_tokens.weight": FP32}, dims)
    assert message == ("embed.weight: the recipe expects fp32 (it holds model.embed_tokens.weight); the checkpoint "
                       "has BF16 [512, 64] without a scale")


def test_refuses_fp8_experts_where_the_recipe_says_fp4(instruct, expected, dims, tmp_path):
    root = copy_of(instruct[0], tmp_path)
    edit_config(root, lambda c: c.update(expert_dtype="fp8"))
    message = refused(root, expected, dims)
    assert message.startswith("config.json: expert_dtype 'fp8' declares fp8_e4m3 routed experts, but the recipe "
                              "expects fp4_e2m1")


def test_refuses_a_scale_grid_that_does_not_match_the_block(instruct, expected, dims, tmp_path):
    root = copy_of(instruct[0], tmp_path)
    rewrite_tensors(root, lambda t: t.update({"layers.0.attn.wq_b.scale": t["layers.0.attn.wq_b.scale"][:1]}))
    assert refused(root, expected, dims) == (
        "layers.0.attn.wq_b.weight: the recipe expects fp8_e4m3 (128x128 blocks, ue8m0 scales) (it holds "
        "model.layers.0.self_attn.q_b_proj.weight); its scale layers.0.attn.wq_b.scale has grid [1, 1], which does "
        "not match 128x128 blocks of [256, 32] ([2, 1])")


def test_refuses_a_checkpoint_with_other_blocks_than_the_recipe(written, dims, tmp_path):
    recipe_32 = release_formats(weight_specs(dims), block=(32, 32))
    message = refused(written["v4-instruct"][0], recipe_32, dims)
    assert message.startswith("config.json: quantization_config.weight_block_size [128, 128] differs from the "
                              "recipe's fp8_e4m3 (32x32 blocks, ue8m0 scales)")
    # A config that claims 32x32 blocks over 128x128 scales: the grids give it away.
    root = copy_of(written["v4-instruct"][0], tmp_path)
    edit_config(root, lambda c: c["quantization_config"].update(weight_block_size=[32, 32]))
    assert refused(root, recipe_32, dims).endswith("its scale layers.0.attn.wkv.scale has grid [1, 1], which does not "
                                                   "match 32x32 blocks of [64, 64] ([2, 2])")


def test_refuses_fp4_codes_not_packed_two_a_byte(instruct, expected, dims, tmp_path):
    root = copy_of(instruct[0], tmp_path)
    name = "layers.3.ffn.experts.2.w2.weight"
    rewrite_tensors(root, lambda t: t.update({name: t[name].repeat(1, 2)}))
    assert refused(root, expected, dims) == (
        f"{name}: the recipe expects fp4_e2m1 (packed int8, ue8m0 scale per 32 inputs) (it holds routed expert 2's "
        f"down rows of model.layers.3.mlp.experts.down_proj); the checkpoint has shape [64, 64], not [64, 32]")


def test_refuses_a_missing_scale(instruct, expected, dims, tmp_path):
    root = copy_of(instruct[0], tmp_path)
    rewrite_tensors(root, lambda t: t.pop("layers.1.ffn.shared_experts.w3.scale"))
    assert refused(root, expected, dims) == (
        "layers.1.ffn.shared_experts.w3.weight: the recipe expects fp8_e4m3 (128x128 blocks, ue8m0 scales) (it holds "
        "model.layers.1.mlp.shared_experts.up_proj.weight); the checkpoint has no scale for it "
        "(layers.1.ffn.shared_experts.w3.scale or layers.1.ffn.shared_experts.w3.weight_scale_inv)")


def test_refuses_a_quantized_checkpoint_where_the_recipe_says_fp32(instruct, expected, dims, tmp_path):
    unquantized = {name: fmt if fmt in (BF16, FP32, INT64) else FP32 for name, fmt in expected.items()}
    assert refused(instruct[0], unquantized, dims) == (
        "config.json: quantization_config declares a quantized (fp8) checkpoint, but the recipe expects every weight "
        "unquantized")
    root = copy_of(instruct[0], tmp_path)  # quantized tensors without the declaration: refused by tensor
    edit_config(root, lambda c: [c.pop("quantization_config"), c.pop("expert_dtype")])
    assert refused(root, unquantized, dims) == (
        "layers.0.attn.wkv.weight: the recipe expects fp32 (it holds model.layers.0.self_attn.kv_proj.weight); the "
        "checkpoint has F8_E4M3 [64, 64] with a F8_E8M0 [1, 1] scale layers.0.attn.wkv.scale")


def test_refuses_fp8_tensors_without_a_quantization_config(instruct, expected, dims, tmp_path):
    root = copy_of(instruct[0], tmp_path)
    edit_config(root, lambda c: c.pop("quantization_config"))
    assert refused(root, expected, dims).startswith("config.json: no quantization_config, but the recipe expects "
                                                    "quantized weights")


def test_refuses_scales_in_another_encoding(written, expected, dims, tmp_path):
    fp32_scales = release_formats(weight_specs(dims), scale_encoding="fp32")
    assert refused(written["v4-instruct"][0], fp32_scales, dims).startswith(
        "config.json: quantization_config declares ue8m0 scales, but the recipe expects fp8_e4m3 (128x128 blocks, "
        "fp32 scales)")
    root = copy_of(written["v4-instruct"][0], tmp_path / "e8m0")
    edit_config(root, lambda c: c["quantization_config"].pop("scale_fmt"))
    assert refused(root, fp32_scales, dims).endswith("its scale layers.0.attn.wkv.scale is F8_E8M0")
    # V3-style float32 scales are not powers of two, so they are no UE8M0 scales either.
    root = copy_of(written["v3-style-scales"][0], tmp_path)
    edit_config(root, lambda c: c["quantization_config"].update(scale_fmt="ue8m0"))
    message = refused(root, expected, dims)
    assert message.startswith("layers.") and ": float32 scale " in message and "is not a power of two" in message


def test_refuses_a_missing_routed_expert(instruct, expected, dims, tmp_path):
    root = copy_of(instruct[0], tmp_path)
    rewrite_tensors(root, lambda t: [t.pop("layers.2.ffn.experts.3.w3.weight"), t.pop("layers.2.ffn.experts.3.w3.scale")])
    assert refused(root, expected, dims) == ("routed expert 3's up rows of model.layers.2.mlp.experts.gate_up_proj: "
                                             "not in the checkpoint; the recipe expects fp4_e2m1 (packed int8, ue8m0 "
                                             "scale per 32 inputs)")


def test_refuses_a_tensor_the_recipe_does_not_have(instruct, expected, dims, tmp_path):
    root = copy_of(instruct[0], tmp_path)
    rewrite_tensors(root, lambda t: t.update({"layers.0.attn.extra.weight": torch.zeros(2)}))
    assert refused(root, expected, dims) == ("layers.0.attn.extra.weight: in the checkpoint but not a weight of the "
                                             "recipe's model")


def test_refuses_two_scales_for_one_weight(instruct, expected, dims, tmp_path):
    root = copy_of(instruct[0], tmp_path)
    rewrite_tensors(root, lambda t: t.update({"layers.0.attn.wkv.weight_scale_inv": t["layers.0.attn.wkv.scale"].clone()}))
    assert refused(root, expected, dims).startswith("layers.0.attn.wkv.scale: layers.0.attn.wkv.weight has more "
                                                    "than one scale")


def test_stacking_refuses_blocks_that_straddle_gate_and_up():
    piece = NativeTensor(torch.zeros(64, 64, dtype=torch.float8_e4m3fn), torch.ones(1, 1), WeightFormat("fp8_e4m3", (128, 128), "fp32"),
                         "experts.0.w1.weight")
    with pytest.raises(CheckpointError, match=r"^experts\.gate_up_proj: its gate and up rows \(64 each\) do not fill"):
        stack_experts("experts.gate_up_proj", {(0, 0): piece, (0, 1): piece})
    down = stack_experts("experts.down_proj", {(0, 0): piece, (1, 0): piece})
    assert down.shape == (2, 64, 64) and list(down.scale.shape) == [2, 1, 1]


def test_refuses_a_checkpoint_block_no_weight_format_takes(dims, weights, tmp_path):
    # 64x64 blocks are no block a recipe can give fp8_e4m3, so no recipe expects them.
    root = tmp_path / "blocks-64"
    write_release_checkpoint(root, tiny_v4_config(), weights, block=(64, 64))
    expected = release_formats(weight_specs(dims))
    assert refused(root, expected, dims).startswith(
        "config.json: quantization_config.weight_block_size [64, 64] differs from the recipe's fp8_e4m3 (128x128 "
        "blocks, ue8m0 scales) for model.")
    # Declared as 128x128 blocks: the first tensor whose grid tells them apart is refused by name.
    edit_config(root, lambda c: c["quantization_config"].update(weight_block_size=[128, 128]))
    message = refused(root, expected, dims)
    assert message.startswith("layers.") and ": the recipe expects fp8_e4m3 (128x128 blocks, ue8m0 scales)" in message
    assert "which does not match 128x128 blocks of" in message


def test_int64_is_a_logical_dtype_not_a_format(instruct, dims):
    with pytest.raises(ValueError, match=r"^model\.layers\.0\.mlp\.gate\.tid2eid: 'int32' is neither"):
        read_release_checkpoint(instruct[0], {**release_formats(weight_specs(dims)),
                                              "model.layers.0.mlp.gate.tid2eid": "int32"})


def test_release_formats_refuse_a_name_they_cannot_place(dims):
    with pytest.raises(ValueError, match=r"^model\.layers\.0\.self_attn\.mystery\.weight: not a weight"):
        release_formats([*weight_specs(dims), "model.layers.0.self_attn.mystery.weight"])
