"""kvstore.ops: paged_attention and write_kv against float64 references.

The reference gathers K and V through the block table in float64 and runs a
plain softmax attention. Every test cache is NaN everywhere but in the slots
that hold a sequence's tokens, and unused block-table entries point at a
NaN-only block, so a kernel that reads a token past a sequence's length (or a
table entry past its last block) returns NaN and fails.

Tolerances (absolute and relative, against float64 on the same rounded inputs):
float32 1e-5; float16 2e-3 (a few ulp of the 2^-11 output rounding); bfloat16
1.6e-2 (a few ulp of 2^-8).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kvstore import ops  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HAVE_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA device (none available)")


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    ops.load()  # the first test run compiles (~30 s); later runs reuse the cached build


def reference(q, key_cache, value_cache, block_tables, seq_lens, scale):
    """float64 attention of each sequence's query over its gathered K/V."""
    num_seqs, num_heads, _ = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    for s in range(num_seqs):
        n = int(seq_lens[s])
        if n == 0:
            continue
        t = torch.arange(n)
        blocks = block_tables[s].long().cpu()[t // block_size]
        k = key_cache.cpu()[blocks, t % block_size].double().repeat_interleave(group, 1)
        v = value_cache.cpu()[blocks, t % block_size].double().repeat_interleave(group, 1)
        scores = torch.einsum("hd,thd->ht", q[s].cpu().double(), k) * scale
        out[s] = torch.einsum("ht,thd->hd", scores.softmax(-1), v)
    return out


def paged_case(
    lens: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int = 16,
    seed: int = 0,
    device: str = "cpu",
):
    """Random K/V/q for sequences of `lens` tokens in a NaN-filled paged cache with
    random, non-contiguous block tables (extra table columns point at a NaN block)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in lens]
    width = max(blocks_per_seq) + 2
    num_blocks = sum(blocks_per_seq) + 5
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    perm = torch.randperm(num_blocks, generator=g)
    nan_block = int(perm[-1])
    tables = torch.full((len(lens), width), nan_block, dtype=torch.int32)
    used = 0
    for s, n in enumerate(lens):
        ids = perm[used : used + blocks_per_seq[s]]
        used += blocks_per_seq[s]
        tables[s, : len(ids)] = ids.int()
        t = torch.arange(n)
        blk, off = ids[t // block_size], t % block_size
        key_cache[blk, off] = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        value_cache[blk, off] = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=g).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    args = (q, key_cache, value_cache, tables, seq_lens)
    return tuple(a.to(device) for a in args)


def check_against_reference(args, scale, dtype) -> None:
    out = ops.paged_attention(*args, scale)
    assert out.dtype == dtype and out.shape == args[0].shape
    ref = reference(*args, scale)
    got = out.cpu().double()
    assert not got.isnan().any(), "NaN: the kernel read a slot past a sequence's length"
    torch.testing.assert_close(got, ref, atol=TOL[dtype], rtol=TOL[dtype])


# Lengths: 1, not multiples of B (16), a multiple of B, several chunks and partitions.
LENS = [1, 37, 16, 301, 1000]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_paged_attention_matches_float64_reference(dtype, group, head_dim):
    args = paged_case(LENS, num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype)
    check_against_reference(args, 1 / math.sqrt(head_dim), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_k_partitions_of_a_long_context(dtype):
    # One sequence, one kv head: fewer (sequence, kv head) pairs than threads, so the
    # context is split into partitions whose softmax states are merged.
    args = paged_case([3001], num_kv_heads=1, group=8, head_dim=64, dtype=dtype, seed=1)
    check_against_reference(args, 0.125, dtype)


@pytest.mark.parametrize("block_size", [1, 5, 32])
def test_odd_block_sizes_and_head_dims(block_size):
    # head_dim 72: not a multiple of the 32-float column tile, tails included.
    args = paged_case([1, 29, 77], 3, 2, 72, torch.float32, block_size=block_size, seed=2)
    check_against_reference(args, 0.1, torch.float32)


@pytest.mark.parametrize("head_dim", [16, 48, 144])
@pytest.mark.parametrize("group", [2, 3, 5, 6, 7])
def test_tile_shapes_match_float64_reference(monkeypatch, head_dim, group):
    """Head sizes of an odd number of 16-element columns (the AVX2 kernel's 16-column
    P·V steps, rows that start inside a cache line; bfloat16 caches leave the AVX-512
    kernel there), GQA groups that leave 1 to 3 query heads after the tiles of four,
    and lengths 0, 1 and on either side of one and two 8-lane score vectors; then one
    sequence with one kv head split into partitions of 32 tokens."""
    threads = torch.get_num_threads()
    try:
        for i, dtype in enumerate(DTYPES):
            monkeypatch.delenv("KVSTORE_SPLIT_MIN_TOKENS", raising=False)
            args = paged_case([0, 1, 9, 17, 70], 2, group, head_dim, dtype, seed=group + i)
            check_against_reference(args, head_dim**-0.5, dtype)
            assert ops.last_kernel()["isa"] == expected_isa(dtype, False, head_dim)
            monkeypatch.setenv("KVSTORE_SPLIT_MIN_TOKENS", "32")
            torch.set_num_threads(2)
            args = paged_case([70], 1, group, head_dim, dtype, seed=group + i)
            check_against_reference(args, head_dim**-0.5, dtype)
            assert ops.last_kernel()["partitions"] > 1, ops.last_kernel()
            torch.set_num_threads(threads)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_k_merge_of_odd_head_dims(split_k, dtype):
    # head_dim 36: the merge's eight-column loop leaves a tail of four; a length-0
    # sequence beside split ones merges to zeros.
    args = paged_case([0, 613, 70], 2, 3, 36, dtype, block_size=5, seed=3)
    check_against_reference(args, 1 / 6, dtype)
    assert ops.last_kernel()["partitions"] > 1, ops.last_kernel()


def test_zero_length_sequence_gives_zeros():
    q, kc, vc, tables, lens = paged_case([5, 9], 2, 2, 64, torch.float16)
    lens[1] = 0
    out = ops.paged_attention(q, kc, vc, tables, lens, 0.125)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    check_against_reference((q, kc, vc, tables, lens), 0.125, torch.float16)


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_split_k_matches_float64_reference(split_k, group, head_dim, block_size):
    # Lengths 1 and not multiples of the block (nor of the 32-token partition); every
    # dtype in turn, one per case, so that the 27 shapes stay cheap.
    dtype = DTYPES[(group + head_dim // 64 + block_size // 16) % 3]
    args = paged_case([1, 613], 1, group, head_dim, dtype, block_size=block_size, seed=group)
    check_against_reference(args, 1 / math.sqrt(head_dim), dtype)


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


AVX2 = {"avx2", "fma", "f16c"}
AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


def capability_env(capability: str) -> dict[str, str]:
    """os.environ with ATEN_CPU_CAPABILITY=capability, for a check in a new process.
    ATen takes the variable at its word: =avx512 on a CPU without AVX-512 runs its own
    AVX-512 kernels (the float64 reference's among them) into an illegal instruction,
    so a capability the CPU lacks skips the test."""
    needs = {"avx2": AVX2, "avx512": AVX512}.get(capability, set())
    if not needs <= cpu_flags():
        pytest.skip(f"this CPU lacks {capability}, and ATen does not check before using it")
    return dict(os.environ, ATEN_CPU_CAPABILITY=capability)


def expected_isa(qdtype, fp8: bool, head_dim: int, capability: str | None = None) -> str:
    """The kernel build the CPU's flags (/proc/cpuinfo) and ATEN_CPU_CAPABILITY call for
    (`capability`, else the environment's, which the kernel reads once per process):
    AVX-512 (F, BW, VL, DQ) for head sizes of whole 16-float columns (32 for bfloat16
    caches), with AVX512-BF16 and VBMI for bfloat16 queries and head sizes of whole 64
    columns; else AVX2 with FMA and F16C (the generic kernel for head sizes that are not
    a multiple of 16); else the baseline."""
    if capability is None:
        capability = os.environ.get("ATEN_CPU_CAPABILITY")
    flags = cpu_flags()
    if capability == "default" or not flags >= AVX2:
        return "base"
    avx2 = "avx2" if head_dim % 16 == 0 else "avx2_generic"
    if capability == "avx2" or not flags >= AVX512:
        return avx2
    bf16_cache = qdtype == torch.bfloat16 and not fp8
    if head_dim % (32 if bf16_cache else 16) != 0:
        return avx2
    dot = {"avx512_bf16", "avx512vbmi"} <= flags and capability != "avx512"
    if dot and qdtype == torch.bfloat16 and head_dim % 64 == 0:
        return "avx512_bf16"
    return "avx512"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_long_context_runs_the_widest_kernel_split_k(two_threads, dtype):
    """A long context (one sequence, 8K tokens, GQA 4) on two threads runs the widest
    kernel this CPU has (AVX-512 with AVX512-BF16 for bfloat16 here) and is split
    across the threads (split-K), and still matches the float64 reference."""
    args = paged_case([8000], 2, 4, 128, dtype, seed=11)
    check_against_reference(args, 1 / math.sqrt(128), dtype)
    info = ops.last_kernel()
    assert info["isa"] == expected_isa(dtype, False, 128), info
    # threads: those that ran items (a helper the OS starts late may find none left).
    assert info["partitions"] > 1 and 1 <= info["threads"] <= 2, info


@pytest.mark.parametrize("helpers", ["team", "inter-op pool"])
def test_threads_are_those_that_ran_items(two_threads, monkeypatch, helpers):
    """last_kernel's `threads` counts the threads that ran work items: a short step (the
    KV of 40 tokens) runs on the calling thread alone, unsplit; a long one (8K tokens)
    on both threads in some call, with the same result bit for bit whichever threads ran
    its items, whether its helper comes from ATen's inter-op pool (the default) or is one
    of OpenMP's team ($KVSTORE_TEAM_MAX_ELEMENTS, for steps up to that many K and V
    elements); on one configured thread a long context is not split (a merge would buy
    nothing) and still matches the float64 reference."""
    if helpers == "team":
        monkeypatch.setenv("KVSTORE_TEAM_MAX_ELEMENTS", str(1 << 23))
    else:
        monkeypatch.delenv("KVSTORE_TEAM_MAX_ELEMENTS", raising=False)
    for dtype in DTYPES:
        args = paged_case([40, 7], 2, 4, 128, dtype, seed=14)
        check_against_reference(args, 1 / math.sqrt(128), dtype)
        info = ops.last_kernel()
        assert info["threads"] == 1 and info["partitions"] == 1, info
    args = paged_case([8000], 2, 4, 128, torch.bfloat16, seed=15)
    first = ops.paged_attention(*args, 0.1)
    seen = set()
    for _ in range(200):
        assert torch.equal(ops.paged_attention(*args, 0.1), first)
        seen.add(ops.last_kernel()["threads"])
        if 2 in seen:
            break
    assert seen <= {1, 2} and 2 in seen, seen
    torch.set_num_threads(1)
    check_against_reference(args, 0.1, torch.bfloat16)
    info = ops.last_kernel()
    assert info["threads"] == 1 and info["partitions"] == 1, info


def test_last_kernel_reports_no_split_for_a_short_context(two_threads):
    args = paged_case([40], 2, 4, 64, torch.float32, seed=12)
    check_against_reference(args, 0.125, torch.float32)
    info = ops.last_kernel()
    assert info["partitions"] == 1 and info["isa"] == expected_isa(torch.float32, False, 64)


@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_narrower_cpu_kernels(capability):
    """ATEN_CPU_CAPABILITY=default selects the baseline x86-64 build of the kernel,
    =avx2 the AVX2 one, =avx512 the AVX-512 one without AVX512-BF16 (where the CPU has
    AVX-512 with BF16, the default is that kernel); last_kernel says which ran."""
    code = textwrap.dedent(
        f"""
        import os, sys, torch
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_ops import paged_case, check_against_reference, expected_isa, DTYPES
        from kvstore import ops
        for dtype in DTYPES:
            for group in (1, 4):
                args = paged_case([3, 40, 700], 2, group, 64, dtype, seed=group)
                check_against_reference(args, 0.125, dtype)
                want = expected_isa(dtype, False, 64, {capability!r})
                assert ops.last_kernel()["isa"] == want, (ops.last_kernel(), want)
        # Head sizes of an odd number of 16-float columns (80: the AVX-512 kernel for
        # float32/float16 queries, its scalar output path) and of 32 but not 64 (96).
        for head_dim in (80, 96):
            for dtype in DTYPES:
                args = paged_case([3, 40, 700], 2, 4, head_dim, dtype, seed=head_dim)
                check_against_reference(args, 0.1, dtype)
                want = expected_isa(dtype, False, head_dim, {capability!r})
                assert ops.last_kernel()["isa"] == want, (ops.last_kernel(), want)
        os.environ["KVSTORE_SPLIT_MIN_TOKENS"] = "32"
        args = paged_case([1, 301], 1, 4, 128, torch.bfloat16, seed=7)
        check_against_reference(args, 0.1, torch.bfloat16)
        assert ops.last_kernel()["partitions"] > 1, ops.last_kernel()
        print("ok")
        """
    )
    env = capability_env(capability)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


def test_avx2_kernels_pass_the_reference_tests():
    """The AVX2 kernels (head-major on 8 lanes for head sizes of whole 16-element columns,
    the generic one for the others) are the widest only on CPUs without AVX-512, which
    this host may not be: the float64-reference tests of both op suites run again under
    ATEN_CPU_CAPABILITY=avx2 (GQA 1 to 8, head sizes 16 to 256 for the head-major kernel
    and 36 and 72 for the generic one, block sizes 5 to 64, lengths 0, 1 and not a
    multiple of the block, NaN-poisoned unused slots, split-K, fp8 with scales per kv
    head, every e4m3 byte, NaN bytes in the last 16-byte column), and those that check
    which kernel ran expect "avx2" or "avx2_generic" (expected_isa reads the
    environment)."""
    if not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip("no AVX2 on this CPU")
    select = (
        "(float64_reference or odd_block or odd_head or split_k or widest or one_score_vector"
        " or tile_shapes"
        " or every_magnitude or every_byte or nan_byte) and not avx2_kernels"
    )
    here = Path(__file__).resolve().parent
    suites = [str(here / "test_ops.py"), str(here / "test_ops_fp8.py")]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *suites, "-k", select]
    env = capability_env("avx2")
    r = subprocess.run(cmd, env=env, cwd=here.parent, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " failed" not in r.stdout, r.stdout[-2000:]


# -------------------------------------------------------- scores of -inf and fp32 overflow

# Token ranges whose scores are -inf: a whole first tile (16 tokens on AVX2/AVX-512) and
# chunk (32, the generic kernel's), which is also the first split-K partition; a middle
# partition (after finite tokens); every token (the softmax is 0/0 there: zeros, as for
# a sequence of length 0, whatever the kernel and split).
MINUS_INF_RANGES = [(0, 32), (32, 64), (0, 70)]


def minus_inf_case(dtype, head_dim, first, last, overflow, seed=0):
    """One sequence of 70 tokens, one kv head, GQA 4 (one kv head: split-K can split
    it), whose tokens first .. last - 1 score -inf for every query head: K[..., 0] is
    -inf (an overflowed float16 cache), or, with `overflow`, a finite -3e38 whose
    product with q[..., 0] = 20 is past fp32's range (float64 keeps it finite)."""
    q, kc, vc, tables, lens = paged_case([70], 1, 4, head_dim, dtype, seed=seed)
    t = torch.arange(first, last)
    kc[tables[0].long()[t // 16], t % 16, :, 0] = -3e38 if overflow else float("-inf")
    q[..., 0] = 20.0
    return q, kc, vc, tables, lens


def check_minus_inf_scores(capability: str | None = None) -> None:
    """Tokens whose scores are -inf weigh 0, as in the float64 reference, wherever they
    are: before, the running max stayed -inf over a whole first tile or chunk (or a
    split-K partition) and exp(-inf - -inf) made the output NaN (or the merge dropped the
    whole head: zeros). Every dtype, a head size of the head-major kernels (64) and one
    of the generic kernel (40), split and not split."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for split in ("4096", "32"):
            os.environ["KVSTORE_SPLIT_MIN_TOKENS"] = split
            cases = itertools.product(DTYPES, (64, 40), (False, True), MINUS_INF_RANGES)
            for dtype, head_dim, overflow, (first, last) in cases:
                if overflow and dtype == torch.float16:
                    continue  # float16 cannot hold -3e38: its overflow is the -inf case
                args = minus_inf_case(dtype, head_dim, first, last, overflow)
                scale = head_dim**-0.5
                got = ops.paged_attention(*args, scale)
                info = ops.last_kernel()
                assert info["isa"] == expected_isa(dtype, False, head_dim, capability), info
                assert (info["partitions"] > 1) == (split == "32"), info
                where = (dtype, head_dim, overflow, first, last, info)
                every = last - first == 70
                assert_minus_inf_output(got, (*args, scale), dtype, where, every)
    finally:
        torch.set_num_threads(threads)


def assert_minus_inf_output(
    got: torch.Tensor, reference_args: tuple, dtype: torch.dtype, where: tuple, every_token: bool
) -> None:
    """The verdict of the -inf checks: zeros where every token's score is -inf (as for a
    sequence of length 0), else no NaN and the float64 `reference(*reference_args)`."""
    if every_token:
        assert torch.equal(got, torch.zeros_like(got)), where
        return
    ref = reference(*reference_args)
    assert not got.isnan().any(), where
    tol = TOL[dtype]
    torch.testing.assert_close(got.double(), ref, atol=tol, rtol=tol, msg=lambda m: f"{where}: {m}")


def run_check(module: str, check: str, capability: str | None) -> None:
    """Runs check(capability), a function of `module` (in tests/), in a new interpreter:
    under ATEN_CPU_CAPABILITY=capability (the kernel is chosen once per process), or the
    host's own kernel for None; what the check sets in os.environ stays there."""
    code = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from {module} import {check}
        {check}({capability!r})
        print("ok")
        """
    )
    env = dict(os.environ) if capability is None else capability_env(capability)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("capability", [None, "default", "avx2", "avx512"])
def test_scores_of_minus_inf_weigh_zero_on_every_cpu_kernel(capability):
    # In a new process even for the host's kernel: the check sets the split threshold.
    run_check("test_ops", "check_minus_inf_scores", capability)


# ------------------------------------------------------------------------------ write_kv


def contiguous_attention(q, k, v, scale):
    """float64 attention of q [heads, D] over contiguous k, v [T, H, D]."""
    group = q.shape[0] // k.shape[1]
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    p = (torch.einsum("hd,thd->ht", q.double(), k) * scale).softmax(-1)
    return torch.einsum("ht,thd->hd", p, v)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_kv_then_attention_equals_contiguous_attention(dtype):
    g = torch.Generator().manual_seed(3)
    block_size, heads, head_dim, group = 8, 2, 64, 4
    lens = [5, 8, 50]
    num_blocks = 20
    kc = torch.full((num_blocks, block_size, heads, head_dim), float("nan"), dtype=dtype)
    vc = kc.clone()
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros((len(lens), 7), dtype=torch.int32)
    keys, values, slots, used = [], [], [], 0
    for s, n in enumerate(lens):
        nb = -(-n // block_size)
        tables[s, :nb] = perm[used : used + nb].int()
        used += nb
        t = torch.arange(n)
        slots.append(tables[s].long()[t // block_size] * block_size + t % block_size)
        keys.append(torch.randn(n, heads, head_dim, generator=g).to(dtype))
        values.append(torch.randn(n, heads, head_dim, generator=g).to(dtype))
    ops.write_kv(torch.cat(keys), torch.cat(values), kc, vc, torch.cat(slots))

    # The written rows are the given bytes, at the mapped slots.
    for s, n in enumerate(lens):
        t = torch.arange(n)
        blk, off = tables[s].long()[t // block_size], t % block_size
        assert torch.equal(kc[blk, off], keys[s]) and torch.equal(vc[blk, off], values[s])

    q = torch.randn(len(lens), heads * group, head_dim, generator=g).to(dtype)
    out = ops.paged_attention(q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32), 0.125)
    for s in range(len(lens)):
        want = contiguous_attention(q[s], keys[s], values[s], 0.125)
        torch.testing.assert_close(out[s].double(), want, atol=TOL[dtype], rtol=TOL[dtype])


def test_write_kv_skips_negative_slots_and_takes_strided_inputs():
    kc = torch.zeros(4, 4, 2, 8)
    vc = torch.zeros(4, 4, 2, 8)
    # [T, H, D] views with a non-contiguous token/head layout (from a [T, D, H] transpose).
    key = torch.randn(3, 8, 2).transpose(1, 2)
    value = torch.randn(3, 8, 2).transpose(1, 2)
    ops.write_kv(key, value, kc, vc, torch.tensor([5, -1, 15]))
    assert torch.equal(kc[1, 1], key[0]) and torch.equal(vc[3, 3], value[2])
    assert kc.count_nonzero() == 2 * 2 * 8, "the token with slot -1 was written"


def test_write_kv_refuses_caches_whose_blocks_overlap():
    """An expand()ed cache (block stride 0), one whose block stride is shorter than a
    block, and K and V caches that share elements (one tensor, overlapping views) are
    refused before anything is written: before, a write to one block landed on others.
    K and V interleaved in one pool ([N, 2, B, H, D][:, 0] and [:, 1]) are fine."""
    n, b, h, d = 4, 4, 2, 8
    key = torch.ones(1, h, d)
    slot = torch.tensor([b])  # block 1, offset 0
    pool = torch.zeros(n + 1, b, h, d)
    base = torch.zeros(n * b * h * d)
    cases = [
        (torch.zeros(1, b, h, d).expand(n, b, h, d), torch.zeros(n, b, h, d), "key_cache"),
        (torch.zeros(n, b, h, d), torch.zeros(1, b, h, d).expand(n, b, h, d), "value_cache"),
        (base.as_strided((n, b, h, d), (b * h * d // 2, h * d, d, 1)), pool[1:], "key_cache"),
        (pool[1:], pool[1:], "value_cache: expected memory apart from key_cache's"),
        (pool[:-1], pool[1:], "value_cache: expected memory apart from key_cache's"),
    ]
    for kc, vc, message in cases:
        pool.zero_()
        base.zero_()
        with pytest.raises(RuntimeError, match=message):
            ops.write_kv(key, key, kc, vc, slot)
        assert kc.count_nonzero() == 0 and vc.count_nonzero() == 0
    interleaved = torch.zeros(n, 2, b, h, d)
    kc, vc = interleaved[:, 0], interleaved[:, 1]
    ops.write_kv(key, 2 * key, kc, vc, slot)
    assert torch.equal(kc[1, 0], key[0]) and torch.equal(vc[1, 0], 2 * key[0])
    assert interleaved.count_nonzero() == 2 * h * d


# -------------------------------------------------------------------------------- errors


def test_bad_arguments_raise_clear_errors():
    q, kc, vc, tables, lens = paged_case([5, 9], 2, 2, 64, torch.float32)
    cases = [
        ((q.half(), kc, vc, tables, lens), r"key_cache: expected dtype Half"),
        ((q, kc, vc, tables.long(), lens), r"block_tables: expected an int32 tensor"),
        ((q, kc, vc, tables, lens.long()), r"seq_lens: expected an int32 tensor"),
        ((q[:, :3], kc, vc, tables, lens), r"multiple of num_kv_heads"),
        ((q[:, :, :32], kc, vc, tables, lens), r"expected head_dim 32"),
        ((q[0], kc, vc, tables, lens), r"query: expected 3 dims"),
        ((q, kc, vc[:-1], tables, lens), r"value_cache: expected the shape of key_cache"),
        ((q, kc, vc, tables[:1], lens), r"block_tables: expected 2 rows"),
        ((q.double(), kc, vc, tables, lens), r"query: expected dtype float16"),
        ((q, kc.transpose(1, 2), vc, tables, lens), r"key_cache: expected packed"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            ops.paged_attention(*args, 0.1)

    too_long = lens.clone()
    too_long[0] = tables.shape[1] * kc.shape[1] + 1
    with pytest.raises(RuntimeError, match=r"seq_lens\[0\]: expected 0 to"):
        ops.paged_attention(q, kc, vc, tables, too_long, 0.1)
    bad_table = tables.clone()
    bad_table[1, 0] = kc.shape[0]
    with pytest.raises(RuntimeError, match=r"block_tables\[1, 0\]: expected a block id in"):
        ops.paged_attention(q, kc, vc, bad_table, lens, 0.1)


def test_write_kv_bad_arguments_write_nothing():
    kc = torch.zeros(2, 4, 2, 8)
    vc = torch.zeros(2, 4, 2, 8)
    key = torch.ones(2, 2, 8)
    with pytest.raises(RuntimeError, match=r"slot_mapping\[1\]: expected a slot below 8"):
        ops.write_kv(key, key, kc, vc, torch.tensor([0, 8]))
    assert kc.count_nonzero() == 0 and vc.count_nonzero() == 0
    with pytest.raises(RuntimeError, match=r"slot_mapping: expected an int64 tensor"):
        ops.write_kv(key, key, kc, vc, torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"key: expected dtype Float"):
        ops.write_kv(key.half(), key, kc, vc, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match=r"key: expected \[num_tokens, 2, 8\]"):
        ops.write_kv(key[:, :1], key[:, :1], kc, vc, torch.tensor([0, 1]))


# --------------------------------------------------------------------- torch integration


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck(dtype):
    args = paged_case([5, 40], 2, 4, 64, dtype)
    torch.library.opcheck(torch.ops.kvstore.paged_attention.default, (*args, 0.125))
    q, kc, vc, tables, lens = args
    key = torch.randn(3, 2, 64).to(dtype)
    slots = torch.tensor([0, 17, 33])
    write_args = (key, key.clone(), kc.nan_to_num(), vc.nan_to_num(), slots)
    torch.library.opcheck(torch.ops.kvstore.write_kv.default, write_args)


def test_torch_compile_traces_the_ops():
    args = paged_case([7, 70], 2, 4, 64, torch.float32)
    q, kc, vc, tables, lens = args

    def step(q, k_new, kc, vc, slots, tables, lens):
        ops.write_kv(k_new, k_new, kc, vc, slots)
        return ops.paged_attention(q * 2, kc, vc, tables, lens, 0.125) + 1

    k_new = torch.randn(2, 2, 64)
    slots = tables[:, 0].long() * kc.shape[1]  # overwrite token 0 of each sequence
    kc2, vc2 = kc.clone(), vc.clone()
    want = step(q, k_new, kc, vc, slots, tables, lens)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got = compiled(q, k_new, kc2, vc2, slots, tables, lens)
    torch.testing.assert_close(got, want)
    assert torch.equal(kc2.nan_to_num(), kc.nan_to_num())


def test_import_compiles_nothing(tmp_path):
    """Importing kvstore, kvstore.ops, kvstore.torch and kvstore.attention neither builds
    nor loads the extension."""
    code = textwrap.dedent(
        """
        import os
        import kvstore, kvstore.ops, kvstore.torch, kvstore.attention
        assert not kvstore.ops._loaded
        print(sorted(os.listdir(os.environ["TORCH_EXTENSIONS_DIR"])))
        """
    )
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


def test_build_is_cached_by_source_hash():
    from kvstore.ops import _build_dir, _build_key, _sources

    key = _build_key(_sources(HAVE_CUDA), HAVE_CUDA)
    built = _build_dir(key)
    assert built.is_dir() and any(p.suffix == ".so" for p in built.iterdir())


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("KVSTORE_COMPILE_CHECK") != "1" or ops.find_nvcc() is None,
    reason="nvcc compile check is its own CI step (python -m kvstore.ops --compile-check); "
    "set KVSTORE_COMPILE_CHECK=1 with nvcc installed to run it here",
)
def test_cuda_sources_compile_for_sm80_and_sm90():
    assert ops.compile_check(("80", "90")) == 0


# ------------------------------------------------------------------------------------ GPU


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cuda_paged_attention_matches_float64_reference(dtype, group, head_dim):
    args = paged_case(LENS + [2049], 2, group, head_dim, dtype, device="cuda")
    check_against_reference(args, 1 / math.sqrt(head_dim), dtype)


@gpu
@needs_cuda
@pytest.mark.parametrize("group", [2, 3, 5, 6, 12, 16])
@pytest.mark.parametrize("head_dim", [80, 128])
def test_cuda_groups_that_fill_part_of_a_tile_or_span_tiles(group, head_dim):
    # The CUDA op attends 4 query heads per CTA for groups up to 4, else 8: groups
    # that leave part of a tile empty (2, 3; 5, 6) or need two tiles (12 = 8 + 4,
    # 16 = 8 + 8); 80, a head size whose rows leave some of their threads no columns.
    args = paged_case(LENS + [2049], 2, group, head_dim, torch.bfloat16, device="cuda")
    check_against_reference(args, 1 / math.sqrt(head_dim), torch.bfloat16)


@gpu
@needs_cuda
@pytest.mark.parametrize("block_size", [16, 24, 32, 64])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_cuda_block_sizes_and_head_dims(block_size, head_dim):
    # Every head size the CUDA op builds; lengths 1, one token into a block, and
    # several 512-token partitions; every dtype in turn. 24: a block size that is not
    # a power of two (a division where the others shift).
    dtype = DTYPES[(head_dim // 16 + block_size // 16) % 3]
    args = paged_case([1, 613, 2049], 2, 4, head_dim, dtype, block_size, head_dim, "cuda")
    check_against_reference(args, 1 / math.sqrt(head_dim), dtype)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_matches_cpu_and_write_kv(dtype):
    args = paged_case([3, 600, 1500], 2, 4, 128, dtype, seed=5)
    cpu = ops.paged_attention(*args, 0.1)
    dev = ops.paged_attention(*(a.cuda() for a in args), 0.1)
    torch.testing.assert_close(dev.cpu().double(), cpu.double(), atol=TOL[dtype], rtol=TOL[dtype])
    q, kc, vc, tables, lens = (a.cuda() for a in args)
    key = torch.randn(4, 2, 128, device="cuda").to(dtype)
    slots = torch.tensor([0, 1, -1, 17], device="cuda")
    ops.write_kv(key, key, kc, vc, slots)
    assert torch.equal(kc[0, 0], key[0]) and torch.equal(kc[1, 1], key[3])


@gpu
@needs_cuda
def test_cuda_opcheck():
    args = tuple(a.cuda() for a in paged_case([5, 700], 2, 4, 64, torch.float16))
    torch.library.opcheck(torch.ops.kvstore.paged_attention.default, (*args, 0.125))


def test_bench_script_runs_at_a_tiny_size(tmp_path, capsys):
    """benches/bench_attention.py keeps working (no timing asserted)."""
    path = Path(__file__).resolve().parents[1] / "benches" / "bench_attention.py"
    spec = importlib.util.spec_from_file_location("bench_attention", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    argv = ["--contexts", "64", "--batches", "1,2", "--seconds", "0.01", "--stream-gib", "0.05"]
    argv += ["--json", str(out)]
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 and all(r["max_abs_diff_vs_sdpa"] < 0.05 for r in rows)
    assert "paged/sdpa speed" in capsys.readouterr().out
