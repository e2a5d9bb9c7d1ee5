"""The bench floor's byte count for `flash-slice:4`, against a hand count from the release shapes.

The floor counts the checkpoint format (`bytes_ckpt`): FP8 dense weights 1 B per element + 1 B ue8m0
per 128x128 block (not the fp32 the engine holds), FP4 routed experts 0.5 B per element + 1 B ue8m0 per
32, floats 2 B (bf16) except the tensors the release keeps in fp32 (attn_sink, compressor ape, hc_*,
gate.bias), the LM head as bf16, one bf16 embedding row per token, 8 B per tid2eid entry read (int64, as
the engine holds it) and only the routed experts a step is expected to touch. The final norm, hc_head_*
and the MTP block are not counted. The expected values below are written out from the shapes, not from
the floor's helpers, so a miscounted format (an FP4 weight as 1 B, say) fails here.
"""

import pytest

from deepinfer.bench.floor import floors, model_bytes
from deepinfer.presets import preset_config

BW, RATE = 1e12, 1e15  # any rates: only bytes are checked


def fp8(n, k):  # e4m3 + one ue8m0 byte per 128x128 block
    return n * k + -(-n // 128) * -(-k // 128)


def fp4(n, k):  # e2m1 two per byte + one ue8m0 byte per 32 inputs
    return n * k // 2 + n * k // 32


def bf16(*shape):
    return 2 * _numel(shape)


def fp32(*shape):
    return 4 * _numel(shape)


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


@pytest.fixture(scope="module")
def cfg():
    c = preset_config("flash-slice:4")
    # the shapes the hand count is written for (presets.flash_config, sliced to layers 0..3)
    assert c.attn_kinds[:4] == ("swa", "swa", "csa", "hca") and c.compress_ratios[:4] == (0, 0, 4, 128)
    assert c.hash_layers == (True, True, True, False)
    assert (c.vocab_size, c.dim, c.n_heads, c.head_dim, c.q_lora_rank, c.o_groups, c.o_lora_rank) == (
        129280, 4096, 64, 512, 1024, 8, 1024)
    assert (c.n_routed_experts, c.n_activated_experts, c.moe_inter_dim, c.hc_mult) == (256, 6, 2048, 4)
    assert (c.index_n_heads, c.index_head_dim, c.window_size, c.index_topk) == (64, 128, 128, 512)
    assert (c.weight_dtype, c.expert_dtype) == ("fp8", "fp4")
    return c


# per main layer, everything but the routed experts and tid2eid
ATTN = (fp32(64)                       # attn_sink
        + fp8(1024, 4096)              # wq_a
        + bf16(1024)                   # q_norm
        + fp8(64 * 512, 1024)          # wq_b
        + fp8(512, 4096)               # wkv
        + bf16(512)                    # kv_norm
        + fp8(8 * 1024, 64 * 512 // 8)  # wo_a
        + fp8(4096, 8 * 1024))         # wo_b
FFN = (bf16(256, 4096)                 # gate.weight
       + fp8(2048, 4096) + fp8(4096, 2048) + fp8(2048, 4096))  # shared expert w1, w2, w3
NORMS_HC = 2 * bf16(4096) + 2 * (fp32(24, 4 * 4096) + fp32(24) + fp32(3))  # attn/ffn_norm; hc_{attn,ffn}_{fn,base,scale}
CSA_EXTRA = (fp32(4, 2 * 512) + bf16(2 * 512, 4096) + bf16(2 * 512, 4096) + bf16(512)  # compressor (2 series)
             + fp8(64 * 128, 1024) + bf16(64, 4096)                                     # indexer wq_b, weights_proj
             + fp32(4, 2 * 128) + bf16(2 * 128, 4096) + bf16(2 * 128, 4096) + bf16(128))  # indexer compressor
HCA_EXTRA = fp32(128, 512) + bf16(512, 4096) + bf16(512, 4096) + bf16(512)  # compressor (1 series)
GATE_BIAS = fp32(256)  # layer 3 routes by top-k; layers 0..2 are hash layers (tid2eid, read per token)
DENSE = 4 * (ATTN + FFN + NORMS_HC) + CSA_EXTRA + HCA_EXTRA + GATE_BIAS
EXPERT = 3 * fp4(2048, 4096)  # w1, w3 [2048, 4096]; w2 [4096, 2048]
HEAD, EMBED_ROW, TID2EID_ROW = bf16(129280, 4096), bf16(4096), 6 * 8  # k int64 entries per hash layer


def test_hand_count_is_what_it_says():
    assert EXPERT == 3 * (4_194_304 + 262_144) == 13_369_344  # 0.5 B x 8M elements + 1 B x 256K blocks
    assert DENSE == 588_125_280 and HEAD == 1_059_061_760


@pytest.mark.parametrize("B", [1, 8, 64])
def test_flash_slice4_floor_weight_bytes(cfg, B):
    f = floors(cfg, model_bytes(cfg), [20] * B, BW, RATE, cache_elem=2)
    distinct = 256 * (1 - (1 - 6 / 256) ** B)  # expected distinct experts of 256 when B tokens pick 6
    want = DENSE + 4 * distinct * EXPERT + HEAD + B * EMBED_ROW + B * 3 * TID2EID_ROW
    assert f["bytes_ckpt"] - f["kv_bytes"] == pytest.approx(want, rel=1e-12)
    assert "bytes_engine" not in f  # counted from the config alone: no engine bytes to report


def test_flash_slice4_floor_one_token_total(cfg):
    """B = 1 touches exactly k = 6 experts per layer: the whole decode step's checkpoint bytes, in bytes."""
    f = floors(cfg, model_bytes(cfg), [20], BW, RATE, cache_elem=2)
    assert DENSE + 4 * 6 * EXPERT + HEAD + EMBED_ROW + 3 * TID2EID_ROW == 1_968_059_632
    assert f["bytes_ckpt"] - f["kv_bytes"] == pytest.approx(1_968_059_632, abs=1e-3)
    # KV at position 20, bf16 entries of head_dim: SWA 21 entries (x2 layers); CSA 21 + 21 // 4 = 5 selected
    # entries + 5 indexer keys of 128; HCA 21 + 21 // 128 = 0 compressed entries
    assert f["kv_bytes"] == 2 * 21 * 1024 + (21 + 5) * 1024 + 5 * 128 * 2 + 21 * 1024 == 92_416
    assert f["t_bytes_ckpt_ms"] == pytest.approx(f["bytes_ckpt"] / BW * 1e3)
