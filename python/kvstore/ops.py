"""Paged-attention torch ops: `torch.ops.kvstore.*` behind two Python functions.

```python
from kvstore import ops
out = ops.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)
ops.write_kv(key, value, key_cache, value_cache, slot_mapping)   # in place
```

- query `[num_seqs, num_heads, D]`; key/value caches (one layer)
  `[num_blocks, B, H, D]`; block_tables int32 `[num_seqs, max_blocks]`; seq_lens
  int32 `[num_seqs]`; slot_mapping int64 `[num_tokens]` with
  `slot = block * B + offset` (a negative slot skips its token). GQA:
  `num_heads % H == 0`, query head `i` attends with kv head `i // (num_heads // H)`.
- float16, bfloat16 and float32; scores, softmax and sums in fp32. A score of -inf
  (K at -inf, or q·k past fp32's range) weighs 0, as in the softmax; a head whose
  every score is -inf gives zeros, like a sequence of length 0. The P·V accumulator
  is unnormalised (as in vLLM and FlashAttention: the sum of `exp(s - max) * v`,
  divided by the sum of the weights at the end), so V values near float32's largest
  (`|v| * sum of weights > 3.4e38`) overflow it to inf even where the exact average
  is finite.
- fp8 KV: caches of dtype `torch.float8_e4m3fn` with fp32 scales per (block, kv
  head), `key_scales`/`value_scales` `[num_blocks, H]` (a byte's value is its e4m3
  value times its block's and head's scale). `paged_attention` dequantizes in
  registers (query and output stay float16/bfloat16/float32); `write_kv` quantizes
  on the way in: the token at offset 0 of a block sets the scale to the smallest
  power of two `s` with `max|x| <= 448 * s`; a later token that does not fit grows
  it (to the power of two it needs) and requantizes the block's earlier tokens,
  which is exact for values that stay at or above e4m3's smallest normal
  (`2**-6 * s`). So nothing saturates (only an inf would), and every value comes
  back within `2**-4 * |x| + 2**-10 * s` (half a unit in the last place of a 3-bit
  mantissa, or half the subnormal step `2**-9 * s`) when its block's scale did not
  grow after it was written, within `2**-4 * |x| + 2**-9 * s` in any case (values a
  grown scale pushes below the smallest normal are rounded again, by at most half
  the subnormal step of each scale the block grew through: a geometric sum).
  A block must be written from offset 0 (as paged engines do): that write resets
  the scale left by an earlier occupant.

The C++/CUDA sources (`python/kvstore/csrc` in the repository) are compiled with
`torch.utils.cpp_extension.load` on the first call, not on import: into
`$TORCH_EXTENSIONS_DIR` or `~/.cache/kvstore/torch_extensions` (`$XDG_CACHE_HOME`
respected), in a folder named by a hash of the sources, the flags and the torch
version, so a second process (or run) loads the cached library at once. The
`.cu` file is compiled only when CUDA is available, so a CPU build needs no nvcc.
Call `ops.load()` to build ahead of time. The build runs the `ninja` on PATH, else
the one the `ninja` package installed (a virtualenv's python run by absolute path,
as a service or a cron job does, has the package but not its bin folder on PATH).

`python -m kvstore.ops --compile-check` compiles every `.cu` file with nvcc for
sm_80 and sm_90 without a GPU (CI's check that the CUDA code builds).

Under `torch.compile`, the ops are traced through fake implementations
registered with `torch.library.register_fake`; call `ops.load()` (or the op
once) before compiling so the tracer does not meet the build.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import importlib.metadata
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from .errors import InvalidInput

__all__ = [
    "FP8_MAX",
    "compile_check",
    "find_nvcc",
    "last_kernel",
    "load",
    "paged_attention",
    "source_dir",
    "write_kv",
]

#: The largest finite float8_e4m3fn value: a scale `s` covers `[-448 s, 448 s]`.
FP8_MAX = 448.0

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_loaded = False

# Compile flags are part of the build folder's hash: changing one rebuilds.
# at::parallel_for is a header template that runs serially unless the extension itself
# is compiled with OpenMP (torch's own libgomp, already loaded, serves it at run time).
# Tuples: cpp_extension.load appends to the lists it is given.
_OPENMP = ("-fopenmp",) if sys.platform.startswith("linux") else ()
_CFLAGS = ("-O3", *_OPENMP)
_LDFLAGS = (*_OPENMP,)
_CUDA_CFLAGS = ("-O3", "-lineinfo")
_COMPILE_CHECK_ARCHS = ("80", "90")


def source_dir() -> Path:
    """The folder of the C++/CUDA sources: `$KVSTORE_CSRC`, else `kvstore/csrc`, shipped
    in the package."""
    env = os.environ.get("KVSTORE_CSRC")
    candidates = [Path(env)] if env else []
    candidates.append(Path(__file__).resolve().parent / "csrc")
    for c in candidates:
        if (c / "ops.cpp").is_file():
            return c
    tried = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(f"kvstore.ops: C++ sources not found (looked in {tried})")


def _sources(with_cuda: bool) -> list[Path]:
    d = source_dir()
    names = ["ops.cpp", "paged_attention_cpu.cpp"]
    if with_cuda:
        names.append("paged_attention_cuda.cu")
    return [d / n for n in names]


def _build_dir(key: str) -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        base = Path(root)
    else:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
        base = Path(cache) / "kvstore" / "torch_extensions"
    return base / f"kvstore_ops_{key}"


def _build_key(sources: list[Path], with_cuda: bool) -> str:
    h = hashlib.sha256()
    for part in (torch.__version__, str(torch.version.cuda), sys.version, str(with_cuda)):
        h.update(part.encode() + b"\0")
    h.update(repr((_CFLAGS, _CUDA_CFLAGS, _LDFLAGS)).encode())
    d = source_dir()
    # Headers count too: a change in a shared header must rebuild.
    for path in sorted({*sources, *d.glob("*.h")}):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def load(verbose: bool = False) -> None:
    """Builds (first time) and loads the extension; registers the ops' fake kernels.

    Idempotent and thread-safe. CUDA sources are compiled only when
    `torch.cuda.is_available()`.
    """
    global _loaded
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        from torch.utils import cpp_extension

        with_cuda = torch.cuda.is_available()
        sources = _sources(with_cuda)
        key = _build_key(sources, with_cuda)
        build_dir = _build_dir(key)
        build_dir.mkdir(parents=True, exist_ok=True)
        _log.info("kvstore.ops: building/loading the torch extension in %s", build_dir)
        with _ninja_on_path():
            cpp_extension.load(
                name=f"kvstore_ops_{key}",
                sources=[str(s) for s in sources],
                extra_cflags=list(_CFLAGS),
                extra_cuda_cflags=list(_CUDA_CFLAGS) if with_cuda else None,
                extra_ldflags=list(_LDFLAGS),
                extra_include_paths=[str(source_dir())],
                build_directory=str(build_dir),
                with_cuda=with_cuda,
                is_python_module=False,
                verbose=verbose,
            )
        _register_fakes()
        _loaded = True


def _ninja_dir() -> Path | None:
    """The folder of the ninja binary that the `ninja` package installed, else of one
    beside this interpreter; None if neither exists.

    A virtualenv's python run by absolute path (a service, a cron job) has the
    package but not the venv's bin folder on PATH. `ninja.BIN_DIR` looks in this
    interpreter's scripts folder only (empty for a package inherited from the base
    environment), so the file list of the installed distribution is asked too.
    """
    exe = "ninja.exe" if sys.platform == "win32" else "ninja"
    candidates: list[Path] = []
    try:
        import ninja

        if ninja.BIN_DIR:
            candidates.append(Path(ninja.BIN_DIR) / exe)
    except ImportError:
        pass
    try:
        dist = importlib.metadata.distribution("ninja")
        candidates += [Path(str(dist.locate_file(f))) for f in dist.files or () if f.name == exe]
    except importlib.metadata.PackageNotFoundError:
        pass
    candidates.append(Path(sys.executable).parent / exe)
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c.parent
    return None


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """torch.utils.cpp_extension runs `ninja` from PATH: when it is not there, puts
    the folder of the `ninja` package's binary first on PATH for the build."""
    if shutil.which("ninja"):
        yield
        return
    found = _ninja_dir()
    if found is None:
        raise RuntimeError(
            "kvstore.ops: building the torch extension needs ninja, and none is on PATH "
            f"or installed for {sys.executable}: run `{sys.executable} -m pip install "
            "ninja`, or put the folder of a ninja binary on PATH"
        )
    old = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join([str(found), *filter(None, [old])])
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = old


def _check_attention_shapes(query: torch.Tensor, key_cache: torch.Tensor) -> None:
    """The shape checks every paged-attention fake shares (bf16 and fp8 alike)."""
    torch._check(query.dim() == 3, lambda: "query: expected [num_seqs, num_heads, head_dim]")
    torch._check(key_cache.dim() == 4, lambda: "key_cache: expected 4 dims")
    torch._check(key_cache.shape[3] == query.shape[2], lambda: "key_cache: head_dim != query's")
    torch._check(
        query.shape[1] % key_cache.shape[2] == 0,
        lambda: "num_heads must be a multiple of num_kv_heads",
    )


def _register_fakes() -> None:
    @torch.library.register_fake("kvstore::paged_attention")
    def _(
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        _check_attention_shapes(query, key_cache)
        return query.new_empty(query.shape)

    @torch.library.register_fake("kvstore::write_kv")
    def _(
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        torch._check(key.dim() == 3, lambda: "key: expected [num_tokens, num_kv_heads, head_dim]")
        return None

    @torch.library.register_fake("kvstore::paged_attention_fp8")
    def _(
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        key_scales: torch.Tensor,
        value_scales: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        _check_attention_shapes(query, key_cache)
        torch._check(
            key_cache.dtype == torch.float8_e4m3fn, lambda: "key_cache: expected float8_e4m3fn"
        )
        torch._check(
            key_scales.dim() == 2 and key_scales.dtype == torch.float32,
            lambda: "key_scales: expected float32 [num_blocks, num_kv_heads]",
        )
        return query.new_empty(query.shape)

    @torch.library.register_fake("kvstore::write_kv_fp8")
    def _(
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        key_scales: torch.Tensor,
        value_scales: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        torch._check(key.dim() == 3, lambda: "key: expected [num_tokens, num_kv_heads, head_dim]")
        torch._check(
            key_cache.dtype == torch.float8_e4m3fn, lambda: "key_cache: expected float8_e4m3fn"
        )
        return None


def _ensure_loaded() -> None:
    # Under torch.compile the tracer must not step into the build; it is loaded by then.
    if not _loaded and not torch.compiler.is_compiling():
        load()


def _fp8_args(
    op: str,
    key_cache: torch.Tensor,
    key_scales: torch.Tensor | None,
    value_scales: torch.Tensor | None,
) -> bool:
    """Whether `op` runs its fp8 kernel: an fp8 cache, or scales given. Either way both
    scales are needed (InvalidInput), and only fp8 caches take them."""
    if key_cache.dtype != torch.float8_e4m3fn and key_scales is None and value_scales is None:
        return False
    if key_scales is None or value_scales is None:
        raise InvalidInput(
            f"kvstore.{op}: fp8 caches need key_scales and value_scales, and only they take "
            "them (float32 [num_blocks, num_kv_heads])"
        )
    return True


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of one query token per sequence over paged KV.

    Returns `[num_seqs, num_heads, D]` in query's dtype: for each sequence `s` and
    head `i`, softmax(scale * q·K[:len]) · V[:len], K and V gathered through
    `block_tables[s]` (token `t` is at block `block_tables[s, t // B]`, offset
    `t % B`). A sequence of length 0 gives zeros, and so does a head whose every
    score is -inf; a -inf score weighs 0. Scores, softmax and the P·V sum are fp32,
    the sum unnormalised until the end: V values near float32's largest can overflow
    it to inf (module doc). The CPU op checks every block id and
    length against the cache; the CUDA op does not (a device-side check would cost a
    sync): its tables must hold valid ids, as `BlockPool` tables do.

    fp8 caches (`torch.float8_e4m3fn`) need `key_scales` and `value_scales`
    (float32 `[num_blocks, H]`): `torch.ops.kvstore.paged_attention_fp8`.
    """
    _ensure_loaded()
    if _fp8_args("paged_attention", key_cache, key_scales, value_scales):
        return torch.ops.kvstore.paged_attention_fp8(
            query, key_cache, value_cache, key_scales, value_scales, block_tables, seq_lens, scale
        )
    return torch.ops.kvstore.paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, scale
    )


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_scales: torch.Tensor | None = None,
    value_scales: torch.Tensor | None = None,
) -> None:
    """Writes `key`/`value` `[num_tokens, H, D]` into the caches at `slot_mapping`
    (int64, `block * B + offset`; negative: skipped), in place. The CPU op refuses a
    slot past the cache; the CUDA op skips it. Both refuse caches (and fp8 scales)
    whose blocks overlap (`expand()`ed, or a block stride shorter than a block) and K
    and V caches (or scales) that share elements: a write would land on other blocks.
    K and V interleaved in one pool (`[N, 2, B, H, D][:, 0]` and `[:, 1]`) are fine.

    fp8 caches (`torch.float8_e4m3fn`, with `key_scales`/`value_scales` float32
    `[num_blocks, H]`, updated in place) quantize on the way in, `key`/`value` in any
    float dtype: `torch.ops.kvstore.write_kv_fp8`, scale policy in the module doc.
    """
    _ensure_loaded()
    if _fp8_args("write_kv", key_cache, key_scales, value_scales):
        torch.ops.kvstore.write_kv_fp8(
            key, value, key_cache, value_cache, key_scales, value_scales, slot_mapping
        )
        return
    torch.ops.kvstore.write_kv(key, value, key_cache, value_cache, slot_mapping)


# ------------------------------------------------------------------ nvcc compile check


def find_nvcc() -> Path | None:
    """nvcc from `$NVCC`, `$CUDA_HOME`, `PATH`, or the `nvidia-cuda-nvcc` wheel."""
    candidates: list[str | None] = [os.environ.get("NVCC")]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "bin", "nvcc"))
    candidates.append(shutil.which("nvcc"))
    # The wheel's `nvidia` namespace package may be in a venv's site-packages or,
    # for a venv with --system-site-packages, in the system's: look on all of sys.path.
    for site_dir in [sysconfig.get_paths()["purelib"], *sys.path]:
        candidates += sorted(glob.glob(os.path.join(site_dir, "nvidia", "*", "bin", "nvcc")))
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return Path(c)
    return None


def _cuda_include_dirs(nvcc: Path) -> list[str]:
    # nvcc's own profile adds <root>/include; the pip layout also splits CCCL
    # (cuda/std, cub, thrust) into include/cccl, and torch's headers need both.
    root = nvcc.parent.parent
    dirs = [root / "include", root / "include" / "cccl"]
    return [str(d) for d in dirs if d.is_dir()]


def last_kernel() -> dict[str, str | int]:
    """What the calling thread's last CPU `paged_attention` call ran: `isa` (the kernel
    build: `avx512_bf16`, `avx512`, `avx2`, `avx2_generic` (AVX2 at head sizes that are
    not a multiple of 16), `base`, or `none` before any call),
    `partitions` (split-K partitions of the longest sequence; 1: no split),
    `partition_tokens` and `threads` (the threads that ran its work items: 1 for a step
    too small to share, or where a helper started after the caller had taken every item).
    For tests and benchmarks that must know that the fast kernel ran, not only that the
    result is right."""
    load()
    info: dict[str, str | int] = {}
    for field in torch.ops.kvstore.last_cpu_kernel().split():
        name, value = field.split("=", 1)
        info[name] = value if name == "isa" else int(value)
    return info


def compile_check(archs: tuple[str, ...] = _COMPILE_CHECK_ARCHS, verbose: bool = False) -> int:
    """Compiles every `.cu` source with nvcc (`-c`, no GPU needed) for each arch in
    `archs`; returns the number of failures."""
    from torch.utils import cpp_extension

    nvcc = find_nvcc()
    if nvcc is None:
        print(
            "kvstore.ops: nvcc not found (set NVCC or CUDA_HOME, or pip install nvidia-cuda-nvcc)",
            file=sys.stderr,
        )
        return 1
    includes = [str(source_dir())]
    includes += cpp_extension.include_paths("cpu") + _cuda_include_dirs(nvcc)
    py_include = sysconfig.get_path("include")
    if py_include:
        includes.append(py_include)
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for src in sorted(source_dir().glob("*.cu")):
            cmd = [
                str(nvcc),
                "-c",
                str(src),
                "-o",
                os.path.join(tmp, src.stem + ".o"),
                "-std=c++20",
                "--compiler-options",
                "-fPIC",
                *cpp_extension.COMMON_NVCC_FLAGS,
                *_CUDA_CFLAGS,
                "-Werror",
                "all-warnings",
                # The archs' compilations in parallel, one per core.
                "--threads",
                "0",
                *gencode,
                *[f"-I{d}" for d in includes],
            ]
            if verbose:
                print(" ".join(cmd))
            r = subprocess.run(cmd, capture_output=True, text=True)
            status = "ok" if r.returncode == 0 else f"FAILED (exit {r.returncode})"
            print(f"nvcc {src.name} sm_{',sm_'.join(archs)}: {status}")
            if r.returncode != 0:
                failures += 1
                print(r.stdout + r.stderr, file=sys.stderr)
    return failures


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstore.ops", description=__doc__)
    parser.add_argument(
        "--compile-check", action="store_true", help="nvcc -c every .cu source, no GPU needed"
    )
    parser.add_argument("--arch", action="append", help="SM to compile for (default 80 and 90)")
    parser.add_argument("--build", action="store_true", help="build and load the extension")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.compile_check:
        archs = tuple(args.arch) if args.arch else _COMPILE_CHECK_ARCHS
        return 1 if compile_check(archs, args.verbose) else 0
    if args.build:
        load(verbose=args.verbose)
        print(f"kvstore.ops: loaded ({'CUDA and CPU' if torch.cuda.is_available() else 'CPU'})")
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(_main())
