"""kvstore.ops over fp8 (float8_e4m3fn) KV with fp32 scales per (block, kv head).

Attention is checked against the float64 reference of tests/test_ops.py computed
over the *dequantized* caches (e4m3 value times scale), so the tolerance is the
kernel's (that of the query dtype), not quantization's. Unused slots hold NaN
bytes (0x7f) and unused blocks NaN scales: a kernel that reads past a sequence's
length returns NaN.

write_kv's quantization: every value comes back within
`2**-4 * |x| + 2**-9 * s` (s: its block's final scale; half an ulp of the 3-bit
mantissa, plus half the subnormal step `2**-9 * s'` for each scale s' the block
grew through, a geometric sum below `2**-9 * s`), scales are the smallest
power of two covering the block's largest magnitude (`amax <= 448 * s`), and the
bytes are torch's own `(x / s).to(float8_e4m3fn)` where the scale did not grow.
"""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

import kvstore  # noqa: E402
from kvstore import ops  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from test_ops import (  # noqa: E402
    DTYPES,
    MINUS_INF_RANGES,
    TOL,
    assert_minus_inf_output,
    capability_env,
    expected_isa,
    gpu,
    needs_cuda,
    reference,
    run_check,
)

FP8 = torch.float8_e4m3fn
NAN_BYTE = 0x7F


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    ops.load()


def nan_cache(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.full(shape, NAN_BYTE, dtype=torch.uint8).view(FP8)


def dequantize(cache: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return cache.cpu().double() * scales.cpu().double()[:, None, :, None]


def fp8_case(
    lens, num_kv_heads, group, head_dim, qdtype, block_size=16, seed=0, q_mul=1.0, kv_mul=1.0
):
    """Random K/V (times kv_mul) quantized per (block, kv head) with arbitrary (not
    power-of-two) scales into NaN-filled fp8 caches; random non-contiguous block tables
    whose extra columns point at a NaN block; queries times q_mul."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in lens]
    width = max(blocks_per_seq) + 2
    num_blocks = sum(blocks_per_seq) + 5
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    kc, vc = nan_cache(shape), nan_cache(shape)
    ks = torch.full((num_blocks, num_kv_heads), float("nan"))
    vs = torch.full((num_blocks, num_kv_heads), float("nan"))
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(lens), width), int(perm[-1]), dtype=torch.int32)
    used = 0
    for s, n in enumerate(lens):
        ids = perm[used : used + blocks_per_seq[s]]
        used += blocks_per_seq[s]
        tables[s, : len(ids)] = ids.int()
        for cache, sc in ((kc, ks), (vc, vs)):
            x = kv_mul * torch.randn(len(ids) * block_size, num_kv_heads, head_dim, generator=g)
            x = x.view(len(ids), block_size, num_kv_heads, head_dim)
            amax = x.abs().amax(dim=(1, 3))
            scale = amax / 448 * (1 + torch.rand(amax.shape, generator=g))
            q8 = (x / scale[:, None, :, None]).to(FP8)
            for i, blk in enumerate(ids.tolist()):
                rows = min(block_size, n - i * block_size)
                cache[blk, :rows] = q8[i, :rows]
                sc[blk] = scale[i]
    q = (q_mul * torch.randn(len(lens), num_kv_heads * group, head_dim, generator=g)).to(qdtype)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    return q, kc, vc, ks, vs, tables, lens_t


def check_fp8_against_reference(case, scale, out_mul=1.0, score_ulps=0) -> None:
    """The op's output, and the reference's, over out_mul (the values' magnitude);
    score_ulps widens the tolerance by that many fp32 ulps of the largest possible
    score, which the softmax passes on to the output (large queries)."""
    q, kc, vc, ks, vs, tables, lens = case
    out = ops.paged_attention(q, kc, vc, tables, lens, scale, ks, vs)
    assert out.dtype == q.dtype and out.shape == q.shape
    k = dequantize(kc, ks)
    ref = reference(q, k, dequantize(vc, vs), tables, lens, scale) / out_mul
    got = out.double().cpu() / out_mul
    assert not got.isnan().any(), "NaN: the kernel read a slot past a sequence's length"
    score_max = scale * q.double().abs().sum(-1).max() * k.nan_to_num(0).abs().max()
    tol = TOL[q.dtype] + score_ulps * 2**-23 * float(score_max)
    torch.testing.assert_close(got, ref, atol=tol, rtol=TOL[q.dtype])


@pytest.mark.parametrize("qdtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_fp8_attention_matches_float64_reference(qdtype, group):
    # Lengths 1, not multiples of B, a multiple of B, several chunks; head sizes in turn.
    head_dim = (64, 128, 256)[group % 3]
    case = fp8_case([1, 37, 16, 301], 2, group, head_dim, qdtype, seed=group)
    check_fp8_against_reference(case, 1 / math.sqrt(head_dim))


@pytest.mark.parametrize(
    ("q_mul", "kv_mul"),
    [(1e-5, 1.0), (300.0, 1.0), (1.0, 1e-12), (1.0, 1e6), (300.0, 1e6), (3e4, 1e-9)],
)
def test_fp8_attention_at_every_magnitude(q_mul, kv_mul):
    """Queries and KV far from 1 (scores that are tiny or saturate the softmax, value
    scales far below and above 1): fp8 rows are decoded with an exponent offset
    (paged_attention_cpu_avx512.h, fp8x16) and scaled per block, and none of it may
    overflow or lose products to fp32's subnormals."""
    for qdtype in (torch.float32, torch.bfloat16):
        case = fp8_case([1, 37, 301], 2, 4, 128, qdtype, seed=7, q_mul=q_mul, kv_mul=kv_mul)
        check_fp8_against_reference(case, 1 / math.sqrt(128), out_mul=kv_mul, score_ulps=4)


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_fp8_split_k_matches_float64_reference(split_k, group, head_dim, block_size):
    qdtype = DTYPES[(group + head_dim // 64 + block_size // 16) % 3]
    case = fp8_case([1, 613], 1, group, head_dim, qdtype, block_size=block_size, seed=group)
    check_fp8_against_reference(case, 1 / math.sqrt(head_dim))


@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_fp8_kv_heads_of_one_score_vector_keep_their_own_scales(monkeypatch, group):
    """One thread and no split: a work item holds every kv head of a sequence, so the
    token-major kernel's score vectors (16 query heads each) span several kv heads, and
    group 3 splits a kv head across two vectors; each head's K and V scales must still
    be its own (8 kv heads, scales that differ per head)."""
    monkeypatch.delenv("KVSTORE_SPLIT_MIN_TOKENS", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        case = fp8_case([1, 37, 301], 8, group, 128, torch.bfloat16, seed=20 + group)
        check_fp8_against_reference(case, 1 / math.sqrt(128))
        info = ops.last_kernel()
        assert info["threads"] == 1 and info["partitions"] == 1, info
        assert info["isa"] == expected_isa(torch.bfloat16, True, 128), info
    finally:
        torch.set_num_threads(threads)


def test_fp8_odd_block_size_and_head_dim():
    # head_dim 72: no AVX-512 kernel (not a multiple of 16), scalar tails of the widening.
    case = fp8_case([1, 29, 77], 3, 2, 72, torch.float32, block_size=5, seed=3)
    check_fp8_against_reference(case, 0.1)


@pytest.mark.parametrize("head_dim", [16, 48, 144])
@pytest.mark.parametrize("group", [3, 6, 7])
def test_fp8_tile_shapes_match_float64_reference(head_dim, group):
    """fp8 caches at head sizes of an odd number of 16-byte columns (the AVX2 kernel's
    16-byte tail of its NaN check, rows that start inside a cache line), groups that
    leave 2 or 3 query heads after the tiles of four, lengths 0, 1, 9, 17 and 70; then a
    NaN byte in the last column of a K row makes its kv head's outputs NaN, and the
    other kv head still matches the reference."""
    for i, qdtype in enumerate(DTYPES):
        case = fp8_case([0, 1, 9, 17, 70], 2, group, head_dim, qdtype, seed=group + i)
        check_fp8_against_reference(case, head_dim**-0.5)
        assert ops.last_kernel()["isa"] == expected_isa(qdtype, True, head_dim)
        q, kc, vc, ks, vs, tables, lens = case
        blk, off = int(tables[4, 50 // 16]), 50 % 16
        kc.view(torch.uint8)[blk, off, 0, head_dim - 1] = NAN_BYTE
        got = ops.paged_attention(q, kc, vc, tables, lens, 0.1, ks, vs).double()
        ref = reference(q, dequantize(kc, ks), dequantize(vc, vs), tables, lens, 0.1)
        assert got[4, :group].isnan().all() and ref[4, :group].isnan().all()
        tol = TOL[qdtype]
        torch.testing.assert_close(got[4, group:], ref[4, group:], atol=tol, rtol=tol)


@pytest.mark.parametrize("qdtype", DTYPES, ids=str)
def test_fp8_long_context_runs_the_widest_kernel_split_k(two_threads, qdtype):
    """fp8 over a long context (one sequence, 8K tokens, GQA 8) on two threads: the
    widest kernel (bfloat16 queries: fp8 looked up as bfloat16 for vdpbf16ps where the
    CPU has AVX512-BF16 and VBMI), split-K, and the float64 reference."""
    case = fp8_case([8000], 1, 8, 128, qdtype, seed=13)
    check_fp8_against_reference(case, 1 / math.sqrt(128))
    info = ops.last_kernel()
    assert info["isa"] == expected_isa(qdtype, True, 128), info
    assert info["partitions"] > 1 and 1 <= info["threads"] <= 2, info


@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_fp8_narrower_cpu_kernels(capability):
    code = textwrap.dedent(
        f"""
        import os, sys, torch
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_ops_fp8 import fp8_case, check_fp8_against_reference
        from test_ops import DTYPES, expected_isa
        from kvstore import ops
        for dtype in DTYPES:
            for group in (1, 4):
                check_fp8_against_reference(fp8_case([3, 40, 700], 2, group, 64, dtype), 0.125)
                want = expected_isa(dtype, True, 64, {capability!r})
                assert ops.last_kernel()["isa"] == want, (ops.last_kernel(), want)
        for dtype in DTYPES:  # an odd number of 16-byte columns
            check_fp8_against_reference(fp8_case([3, 40, 700], 2, 4, 80, dtype), 0.125)
            want = expected_isa(dtype, True, 80, {capability!r})
            assert ops.last_kernel()["isa"] == want, (ops.last_kernel(), want)
        os.environ["KVSTORE_SPLIT_MIN_TOKENS"] = "32"
        case = fp8_case([1, 301], 1, 8, 128, torch.bfloat16, block_size=32, seed=7)
        check_fp8_against_reference(case, 0.1)
        print("ok")
        """
    )
    env = capability_env(capability)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


def check_every_byte_exact(capability: str | None = None) -> None:
    """A one-token sequence attends to its V row alone (probability 1): with float32
    queries and a scale of 1 the output is the row's dequantization, which must be
    every byte's exact e4m3 value, subnormals (below 2**-6) and zeros of either sign
    included. Scaled by 2**-60 too, so that the values the kernel computes with are
    as small as a block's scale can make them."""
    values = torch.arange(256, dtype=torch.int32)
    values = values[(values & 0x7F) != NAN_BYTE]  # 254 bytes, and two zeros more
    values = torch.cat([values, torch.tensor([0x00, 0x80], dtype=torch.int32)]).to(torch.uint8)
    D = 128
    rows = values.view(2, D)  # one sequence per row of 128 bytes
    for scale in (1.0, 2.0**-60):
        kc = torch.zeros(2, 16, 1, D, dtype=torch.uint8)
        vc = torch.zeros(2, 16, 1, D, dtype=torch.uint8)
        vc[:, 0, 0] = rows
        ks = torch.ones(2, 1)
        vs = torch.full((2, 1), scale)
        q = torch.zeros(2, 1, D)
        tables = torch.tensor([[0], [1]], dtype=torch.int32)
        lens = torch.tensor([1, 1], dtype=torch.int32)
        got = ops.paged_attention(q, kc.view(FP8), vc.view(FP8), tables, lens, 1.0, ks, vs).view(
            2, D
        )
        want = rows.view(FP8).double() * scale
        assert torch.equal(got.double(), want), (got.double() - want).abs().max()
        isa = expected_isa(torch.float32, True, D, capability)
        assert ops.last_kernel()["isa"] == isa, (ops.last_kernel(), isa)


def run_in_fresh_process(check: str, capability: str | None) -> None:
    """test_ops.run_check of a check of this module."""
    run_check("test_ops_fp8", check, capability)


@pytest.mark.parametrize("capability", [None, "default", "avx2", "avx512"])
def test_fp8_every_byte_dequantizes_exactly(capability):
    if capability is None:
        check_every_byte_exact()
    else:
        run_in_fresh_process("check_every_byte_exact", capability)


def check_nan_bytes_in_attended_tokens(capability: str | None = None) -> None:
    """A NaN byte (0x7f or 0xff) inside a sequence's length is a NaN value, as in the
    float64 reference over the dequantized caches: one in a K row makes every output of
    its kv head's query heads NaN (the softmax sees a NaN score); one in a V row makes at
    least its column NaN (kernels that check a tile's bytes at once make the whole
    group NaN, never a finite value). Other kv heads and sequences match the reference.
    With and without split-K, so that the partitions' merge keeps the NaN."""
    group, head_dim, bs = 4, 128, 16
    for split in ("4096", "32"):
        os.environ["KVSTORE_SPLIT_MIN_TOKENS"] = split
        for i, dtype in enumerate(DTYPES):
            q, kc, vc, ks, vs, tables, lens = fp8_case(
                [300, 45], 3, group, head_dim, dtype, seed=40 + i
            )
            k8, v8 = kc.view(torch.uint8), vc.view(torch.uint8)
            blk, off = int(tables[0, 150 // bs]), 150 % bs
            k8[blk, off, 0, 5] = 0x7F  # sequence 0, token 150, kv head 0: K
            blk, off = int(tables[0, 200 // bs]), 200 % bs
            v8[blk, off, 1, 77] = 0xFF  # token 200, kv head 1: V, column 77
            got = ops.paged_attention(q, kc, vc, tables, lens, 0.1, ks, vs).double()
            ref = reference(q, dequantize(kc, ks), dequantize(vc, vs), tables, lens, 0.1)
            heads = [slice(h * group, (h + 1) * group) for h in range(3)]
            assert ref[0, heads[0]].isnan().all() and got[0, heads[0]].isnan().all()
            assert ref[0, heads[1], 77].isnan().all() and got[0, heads[1], 77].isnan().all()
            finite = ~ref[0, heads[1]].isnan()
            g1, r1 = got[0, heads[1]][finite], ref[0, heads[1]][finite]
            agree = g1.isnan() | torch.isclose(g1, r1, rtol=TOL[dtype], atol=TOL[dtype])
            assert agree.all(), "a NaN V byte gave a finite value off the reference"
            for s, h in ((0, heads[2]), (1, slice(None))):
                assert not got[s, h].isnan().any(), "a NaN byte reached another kv head"
                torch.testing.assert_close(got[s, h], ref[s, h], atol=TOL[dtype], rtol=TOL[dtype])
            isa = expected_isa(dtype, True, head_dim, capability)
            assert ops.last_kernel()["isa"] == isa, (ops.last_kernel(), isa)
            assert (ops.last_kernel()["partitions"] > 1) == (split == "32"), ops.last_kernel()


@pytest.mark.parametrize("capability", [None, "default", "avx2", "avx512"])
def test_fp8_nan_byte_in_an_attended_token_is_nan(capability):
    # In a new process even for the host's kernel: the check sets the split threshold.
    run_in_fresh_process("check_nan_bytes_in_attended_tokens", capability)


def check_fp8_minus_inf_scores(capability: str | None = None) -> None:
    """test_ops.check_minus_inf_scores over fp8 caches, which hold no inf: the tokens'
    blocks get a K scale of 1e36 and rows of zeros but -448 in column 0, so q·k (q[..., 0]
    = 20) is past fp32's range (-inf) while the float64 reference stays finite (weight
    0). Before, the output was NaN (first tile, chunk or partition) or zeros (split-K)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for split in ("4096", "32"):
            os.environ["KVSTORE_SPLIT_MIN_TOKENS"] = split
            for qdtype, head_dim, (first, last) in itertools.product(
                DTYPES, (64, 40), MINUS_INF_RANGES
            ):
                q, kc, vc, ks, vs, tables, lens = fp8_case([70], 1, 4, head_dim, qdtype, seed=50)
                t = torch.arange(first, last)
                blk, off = tables[0].long()[t // 16], t % 16
                kc[blk, off] = torch.zeros(head_dim).to(FP8)
                kc[blk, off, :, 0] = torch.tensor(-448.0).to(FP8)
                ks[blk] = 1e36
                q[..., 0] = 20.0
                scale = head_dim**-0.5
                got = ops.paged_attention(q, kc, vc, tables, lens, scale, ks, vs)
                info = ops.last_kernel()
                assert info["isa"] == expected_isa(qdtype, True, head_dim, capability), info
                assert (info["partitions"] > 1) == (split == "32"), info
                where = (qdtype, head_dim, first, last, info)
                ref_args = (q, dequantize(kc, ks), dequantize(vc, vs), tables, lens, scale)
                assert_minus_inf_output(got, ref_args, qdtype, where, last - first == 70)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("capability", [None, "default", "avx2", "avx512"])
def test_fp8_scores_of_minus_inf_weigh_zero_on_every_cpu_kernel(capability):
    run_in_fresh_process("check_fp8_minus_inf_scores", capability)


# ------------------------------------------------------------------------------ write_kv


def empty_fp8(num_blocks, block_size, heads, head_dim):
    shape = (num_blocks, block_size, heads, head_dim)
    scales = torch.zeros(num_blocks, heads)
    return nan_cache(shape), nan_cache(shape), scales, scales.clone()


def wide_range_kv(tokens, heads, head_dim, seed):
    """Per-token magnitudes spread over four decades, so blocks' scales must grow."""
    g = torch.Generator().manual_seed(seed)
    mag = 10 ** (4 * torch.rand(tokens, 1, 1, generator=g) - 2)
    return torch.randn(tokens, heads, head_dim, generator=g) * mag


def check_round_trip(x, cache, scales, slots, block_size):
    """Every value within 2^-4 |x| + 2^-9 s of its dequantization; scales minimal
    powers of two of their block's amax."""
    blk, off = slots // block_size, slots % block_size
    deq = cache[blk, off].float() * scales[blk][:, :, None]
    s = scales[blk][:, :, None].expand_as(x)
    bound = 2**-4 * x.abs() + 2**-9 * s
    assert ((deq - x).abs() <= bound * (1 + 1e-6)).all()
    m, _ = torch.frexp(scales[scales > 0])
    assert (m == 0.5).all(), "scales are powers of two"
    used = torch.unique(blk)
    for b in used.tolist():
        amax = x[blk == b].abs().amax(dim=(0, 2))
        assert (amax <= 448 * scales[b]).all() and (amax > 224 * scales[b]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_kv_fp8_round_trip_token_by_token_and_prefill(dtype):
    B, H, D, T = 16, 2, 64, 70
    x_k = wide_range_kv(T, H, D, 1).to(dtype)
    x_v = wide_range_kv(T, H, D, 2).to(dtype)
    slots = torch.tensor([(5 - t // B) * B + t % B for t in range(T)])  # blocks 5, 4, 3, ...
    decode = empty_fp8(8, B, H, D)
    for t in range(T):  # one token per call, as decoding writes
        ops.write_kv(x_k[t : t + 1], x_v[t : t + 1], *decode[:2], slots[t : t + 1], *decode[2:])
    prefill = empty_fp8(8, B, H, D)
    ops.write_kv(x_k, x_v, *prefill[:2], slots, *prefill[2:])
    for kc, vc, ks, vs in (decode, prefill):
        check_round_trip(x_k.float(), kc, ks, slots, B)
        check_round_trip(x_v.float(), vc, vs, slots, B)
    # Same final scales either way: the largest magnitude of each block decides.
    assert torch.equal(decode[2], prefill[2]) and torch.equal(decode[3], prefill[3])


def test_write_kv_fp8_bytes_are_torch_rounding_when_the_scale_holds():
    # The first token of each block holds its largest magnitude: no growth, so each
    # byte is torch's round-to-nearest-even of x / s. Values span e4m3's subnormals.
    B, H, D = 16, 3, 128
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2 * B, H, D, generator=g) * 10 ** (6 * torch.rand(2 * B, H, D, generator=g) - 5)
    x[0, :, 0] = x[B, :, 0] = 1000.0
    kc, vc, ks, vs = empty_fp8(2, B, H, D)
    ops.write_kv(x, -x, kc, vc, torch.arange(2 * B), ks, vs)
    assert torch.equal(ks, torch.full((2, H), 4.0)) and torch.equal(vs, ks)  # 1000 <= 448*4
    expect = (x / 4.0).to(FP8).view(2, B, H, D)
    assert torch.equal(kc.view(torch.uint8), expect.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), (-expect.float()).to(FP8).view(torch.uint8))


def test_write_kv_fp8_first_token_resets_a_reused_block_and_skips_negative_slots():
    kc, vc, ks, vs = empty_fp8(2, 4, 1, 16)
    ks.fill_(1e6)  # a stale scale from an earlier occupant
    x = torch.ones(3, 1, 16)
    ops.write_kv(x, x, kc, vc, torch.tensor([0, -1, 1]), ks, vs)
    assert ks[0, 0] == 2.0**-8  # 1 <= 448 * 2^-8 < 2
    assert torch.equal(kc[0, :2].float() * ks[0, 0], torch.ones(2, 1, 16))
    assert kc[0, 2:].view(torch.uint8).eq(NAN_BYTE).all()  # untouched


def test_write_kv_fp8_then_attention():
    B, H, D, G = 16, 2, 128, 4
    T = 333
    k, v = wide_range_kv(T, H, D, 5), torch.randn(T, H, D)
    kc, vc, ks, vs = empty_fp8(32, B, H, D)
    blocks = torch.randperm(32, generator=torch.Generator().manual_seed(0))[: -(-T // B)]
    slots = blocks[torch.arange(T) // B] * B + torch.arange(T) % B
    ops.write_kv(k.bfloat16(), v.bfloat16(), kc, vc, slots, ks, vs)
    q = torch.randn(1, H * G, D, dtype=torch.bfloat16)
    table = blocks.int()[None]
    lens = torch.tensor([T], dtype=torch.int32)
    check_fp8_against_reference((q, kc, vc, ks, vs, table, lens), 0.05)


def test_write_kv_fp8_refuses_scales_whose_blocks_overlap():
    """Expanded scales (block stride 0: every block shares one row) and K and V scales
    that are one tensor are refused before anything is written: before, a block's scale
    change was every block's. Scales interleaved in one pool ([N, 2, H][:, 0], [:, 1])
    are fine."""
    n, b, h, d = 4, 4, 2, 8
    x = torch.ones(1, h, d)
    slot = torch.tensor([b])
    shared = torch.zeros(n, h)
    cases = [
        (torch.zeros(1, h).expand(n, h), torch.zeros(n, h), "key_scales: expected blocks"),
        (torch.zeros(n, h), torch.zeros(1, h).expand(n, h), "value_scales: expected blocks"),
        (shared, shared, "value_scales: expected memory apart from key_scales'"),
    ]
    for ks, vs, message in cases:
        kc, vc, _, _ = empty_fp8(n, b, h, d)
        with pytest.raises(RuntimeError, match=message):
            ops.write_kv(x, x, kc, vc, slot, ks, vs)
        assert ks.count_nonzero() == 0 and vs.count_nonzero() == 0
        assert kc.view(torch.uint8).eq(NAN_BYTE).all() and vc.view(torch.uint8).eq(NAN_BYTE).all()
    kc, vc, _, _ = empty_fp8(n, b, h, d)
    with pytest.raises(RuntimeError, match="value_cache: expected memory apart from key_cache's"):
        ops.write_kv(x, x, kc, kc, slot, torch.zeros(n, h), torch.zeros(n, h))
    scales = torch.zeros(n, 2, h)
    ops.write_kv(x, 4 * x, kc, vc, slot, scales[:, 0], scales[:, 1])
    assert scales[1, 0].eq(2.0**-8).all() and scales[1, 1].eq(2.0**-6).all()
    assert scales.count_nonzero() == 2 * h


def test_fp8_bad_arguments_raise_clear_errors():
    q, kc, vc, ks, vs, tables, lens = fp8_case([5], 2, 2, 64, torch.float32)
    with pytest.raises(kvstore.InvalidInput, match="key_scales and value_scales"):
        ops.paged_attention(q, kc, vc, tables, lens, 0.1)
    # value_scales alone with a 16-bit cache: refused, not silently ignored.
    kb, vb = kc.float().bfloat16(), vc.float().bfloat16()
    with pytest.raises(kvstore.InvalidInput, match="key_scales and value_scales"):
        ops.paged_attention(q, kb, vb, tables, lens, 0.1, value_scales=vs)
    with pytest.raises(kvstore.InvalidInput, match="key_scales and value_scales"):
        ops.write_kv(torch.randn(1, 2, 64), torch.randn(1, 2, 64), kb, vb,
                     torch.tensor([0]), value_scales=vs)  # fmt: skip
    with pytest.raises(RuntimeError, match=r"key_scales: expected shape"):
        ops.paged_attention(q, kc, vc, tables, lens, 0.1, ks[:, :1], vs)
    with pytest.raises(RuntimeError, match="key_scales: expected a float32"):
        ops.paged_attention(q, kc, vc, tables, lens, 0.1, ks.double(), vs)
    with pytest.raises(RuntimeError, match="expected dtype float8_e4m3fn"):
        torch.ops.kvstore.paged_attention_fp8(q, kc.float(), vc, ks, vs, tables, lens, 0.1)
    key = torch.randn(1, 2, 64)
    with pytest.raises(RuntimeError, match="slot_mapping"):
        ops.write_kv(key, key, kc, vc, torch.tensor([10**6]), ks, vs)


# opcheck's test_schema compares tensors before and after with arithmetic torch has
# no float8 CPU kernel for ("mul_cpu_reduced_float" not implemented for Float8_e4m3fn);
# the other checks run, and the declared mutations are checked by hand below.
FP8_OPCHECKS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[gpu, needs_cuda])])
def test_fp8_opcheck(device):
    case = fp8_case([5, 700], 2, 4, 64, torch.bfloat16)
    q, kc, vc, ks, vs, tables, lens = (t.to(device) for t in case)
    torch.library.opcheck(
        torch.ops.kvstore.paged_attention_fp8.default,
        (q, kc, vc, ks, vs, tables, lens, 0.125),
        test_utils=FP8_OPCHECKS,
    )
    before = [t.clone() for t in (q, kc.view(torch.uint8), vc.view(torch.uint8), ks, vs)]
    ops.paged_attention(q, kc, vc, tables, lens, 0.125, ks, vs)
    after = (q, kc.view(torch.uint8), vc.view(torch.uint8), ks, vs)
    assert all(
        torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(before, after, strict=True)
    )
    schema = torch.ops.kvstore.write_kv_fp8.default._schema
    assert [a.name for a in schema.arguments if a.is_write] == [
        "key_cache",
        "value_cache",
        "key_scales",
        "value_scales",
    ]
    key = torch.randn(3, 2, 64).bfloat16().to(device)
    kc2, vc2, ks2, vs2 = (t.to(device) for t in empty_fp8(4, 16, 2, 64))
    kc2.view(torch.uint8).zero_()
    vc2.view(torch.uint8).zero_()
    args = (key, -key, kc2, vc2, ks2, vs2, torch.tensor([0, 17, 33], device=device))
    torch.library.opcheck(torch.ops.kvstore.write_kv_fp8.default, args, test_utils=FP8_OPCHECKS)


def test_fp8_torch_compile_traces_the_ops():
    q, kc, vc, ks, vs, tables, lens = fp8_case([5, 40], 2, 4, 64, torch.float32)

    def step(q, kc, vc, ks, vs, tables, lens):
        return ops.paged_attention(q, kc, vc, tables, lens, 0.125, ks, vs) * 2

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    args = (q, kc, vc, ks, vs, tables, lens)
    torch.testing.assert_close(compiled(*args), step(*args))


# ----------------------------------------------------------------------------- BlockPool


def test_fp8_block_pool_decodes_with_its_scales(tmp_path):
    import kvstore
    from kvstore.torch import BlockPool

    layout = kvstore.Layout(
        num_layers=2, num_kv_heads=2, head_dim=64, dtype="float8_e4m3fn", block_size=16
    )
    pool = BlockPool(layout, num_blocks=8, device="cpu", huge_pages=False)
    assert pool.kv.dtype == FP8 and pool.kv.element_size() == 1
    assert pool.scales is not None and pool.scales.shape == (2, 2, 8, 2)
    assert pool.key_scales(1).shape == (8, 2) and pool.value_scales(1).shape == (8, 2)
    seq = pool.new_sequence()
    seq.reserve(40)
    k, v = torch.randn(40, 2, 64), torch.randn(40, 2, 64)
    layer = 1
    kc, vc = pool.key_cache(layer), pool.value_cache(layer)
    ks, vs = pool.key_scales(layer), pool.value_scales(layer)
    ops.write_kv(k, v, kc, vc, seq.slot_mapping(0, 40), ks, vs)
    q = torch.randn(1, 8, 64)
    case = (q, kc, vc, ks, vs, seq.table[None], torch.tensor([40], dtype=torch.int32))
    check_fp8_against_reference(case, 0.125)
    assert torch.equal(pool.scales[0], torch.ones(2, 8, 2))  # layer 0 untouched
    seq.length = 40
    with (
        kvstore.open(tmp_path / "s", layout=layout, model="m") as store,
        pytest.raises(kvstore.InvalidInput, match="raw e4m3 values only"),
    ):
        pool.save(store, seq, list(range(40)))
    with pytest.raises(kvstore.InvalidInput, match="scales"):
        BlockPool(layout.__class__(1, 1, 64, "bfloat16"), 2, device="cpu").key_scales(0)


def test_paged_cache_over_an_fp8_pool_quantizes_the_models_kv():
    """transformers over an fp8 BlockPool (kvstore.attention): the pool then holds the
    model's own K and V (layer 0's of an eager run with transformers' cache) within the
    fp8 bound of write_kv, `2^-4 |x| + 2^-9 s` per (block, head) scale s, and decoding
    on it runs with the pool's scales (finite logits)."""
    pytest.importorskip("transformers")
    from test_hf_attention import tiny_llama
    from transformers import DynamicCache

    import kvstore
    from kvstore import attention
    from kvstore.torch import BlockPool

    model = tiny_llama()
    c = model.config
    prompt = torch.randint(1, c.vocab_size, (1, 40), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        eager = DynamicCache()
        model(input_ids=prompt, past_key_values=eager)
        layout = kvstore.Layout(
            num_layers=c.num_hidden_layers,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.hidden_size // c.num_attention_heads,
            dtype="float8_e4m3fn",
            block_size=16,
        )
        pool = BlockPool(layout, num_blocks=8, device="cpu", huge_pages=False)
        seq = pool.new_sequence()
        cache = attention.PagedCache(pool, [seq])
        model.set_attn_implementation(attention.register())
        pos = cache.position_ids(prompt.shape[1])
        logits = model(input_ids=prompt, position_ids=pos, past_key_values=cache).logits
        nxt = logits[:, -1:].argmax(-1)
        step = model(input_ids=nxt, position_ids=cache.position_ids(1), past_key_values=cache)
    assert logits.isfinite().all() and step.logits.isfinite().all()
    t = torch.arange(prompt.shape[1])
    blk = torch.tensor(seq.blocks)[t // layout.block_size]
    off = t % layout.block_size
    # Layer 0's K and V are projections of the embeddings: the same in both runs. Later
    # layers' depend on attention over fp8 KV, so they differ by more than write_kv's
    # rounding; the pool holds them with scales all the same.
    for cache_of, scales_of, want in (
        (pool.key_cache, pool.key_scales, eager.layers[0].keys),
        (pool.value_cache, pool.value_scales, eager.layers[0].values),
    ):
        s = scales_of(0)[blk].double()[:, :, None]  # [T, H, 1]
        got = cache_of(0)[blk, off].double() * s
        x = want[0].transpose(0, 1).double()  # [T, H, D]
        assert (s > 0).all()
        assert ((got - x).abs() <= 2.0**-4 * x.abs() + 2.0**-9 * s).all()
    for layer in range(1, layout.num_layers):
        assert (pool.key_scales(layer)[blk] > 0).all()
        assert (pool.value_scales(layer)[blk] > 0).all()
    seq.release()


# ------------------------------------------------------------------------------------ GPU


def on_cuda(tensors):
    return tuple(t.cuda() for t in tensors)


@gpu
@needs_cuda
@pytest.mark.parametrize("qdtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cuda_fp8_attention_matches_float64_reference(qdtype, group, head_dim):
    # Lengths 1, not multiples of B, a multiple of B, and 1100: several partitions
    # (64 to 512 tokens, as the op sizes them), whose softmax states the reduce kernel
    # merges.
    case = fp8_case([1, 37, 16, 301, 1100], 2, group, head_dim, qdtype, seed=group + head_dim)
    check_fp8_against_reference(on_cuda(case), 1 / math.sqrt(head_dim))


@gpu
@needs_cuda
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_cuda_fp8_block_sizes_and_kv_heads_keep_their_scales(block_size):
    # Eight kv heads, each with its own scales; a sequence ending one token into a
    # block, and one of a whole number of partitions (2048 tokens).
    case = fp8_case([1, 2049, 2048], 8, 4, 128, torch.bfloat16, block_size, seed=block_size)
    check_fp8_against_reference(on_cuda(case), 1 / math.sqrt(128))


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_write_kv_fp8_writes_the_cpu_ops_bytes_and_scales(dtype):
    """The CUDA quantizer walks the tokens in the CPU op's order with the same scale
    policy: decode (a token per call) and prefill (one call) give the CPU's bytes and
    scales exactly, and those meet the round-trip bound by themselves."""
    B, H, D, T = 16, 2, 128, 70
    x_k = wide_range_kv(T, H, D, 11).to(dtype)
    x_v = wide_range_kv(T, H, D, 12).to(dtype)
    slots = torch.tensor([(5 - t // B) * B + t % B for t in range(T)])
    slots[9] = -1  # skipped
    cpu = empty_fp8(8, B, H, D)
    ops.write_kv(x_k, x_v, *cpu[:2], slots, *cpu[2:])
    prefill = on_cuda(empty_fp8(8, B, H, D))
    ops.write_kv(x_k.cuda(), x_v.cuda(), *prefill[:2], slots.cuda(), *prefill[2:])
    decode = on_cuda(empty_fp8(8, B, H, D))
    for t in range(T):
        step = slice(t, t + 1)
        ops.write_kv(
            x_k[step].cuda(), x_v[step].cuda(), *decode[:2], slots[step].cuda(), *decode[2:]
        )
    for dev in (prefill, decode):
        kc, vc, ks, vs = (t.cpu() for t in dev)
        assert torch.equal(kc.view(torch.uint8), cpu[0].view(torch.uint8))
        assert torch.equal(vc.view(torch.uint8), cpu[1].view(torch.uint8))
        assert torch.equal(ks, cpu[2]) and torch.equal(vs, cpu[3])
    kept = slots >= 0
    check_round_trip(x_k.float()[kept], cpu[0], cpu[2], slots[kept], B)
    check_round_trip(x_v.float()[kept], cpu[1], cpu[3], slots[kept], B)


@gpu
@needs_cuda
def test_cuda_write_kv_fp8_then_attention_matches_cpu():
    B, H, D, G, T = 16, 2, 128, 4, 333
    k, v = wide_range_kv(T, H, D, 5), torch.randn(T, H, D)
    blocks = torch.randperm(32, generator=torch.Generator().manual_seed(0))[: -(-T // B)]
    slots = blocks[torch.arange(T) // B] * B + torch.arange(T) % B
    kc, vc, ks, vs = on_cuda(empty_fp8(32, B, H, D))
    ops.write_kv(k.bfloat16().cuda(), v.bfloat16().cuda(), kc, vc, slots.cuda(), ks, vs)
    q = torch.randn(1, H * G, D, dtype=torch.bfloat16)
    case = (q.cuda(), kc, vc, ks, vs, blocks.int()[None].cuda(), torch.tensor([T]).int().cuda())
    check_fp8_against_reference(case, 0.05)
    on_cpu = tuple(t.cpu() for t in case)
    cpu_out = ops.paged_attention(*on_cpu[:3], *on_cpu[5:], 0.05, *on_cpu[3:5])
    dev_out = ops.paged_attention(*case[:3], *case[5:], 0.05, *case[3:5])
    torch.testing.assert_close(dev_out.cpu().double(), cpu_out.double(), atol=2e-2, rtol=2e-2)
