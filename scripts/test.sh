#!/usr/bin/env bash
# Installs everything the tests need, then runs every check and test.
# This is the README's test command; .ci/run calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."

export PIP_DISABLE_PIP_VERSION_CHECK=1
step() { printf '\n==> %s\n' "$*"; }

# Every component the tests need beyond pip's is required: a test that would skip
# without one fails instead, naming it (tests/support/require.py).
export KVSTORE_REQUIRE=redis,openssl,vllm

step "the commands the tests run: a Redis or Valkey server, its client and benchmark; openssl"
# tests/test_remote.py starts servers and inspects them with the client, its TLS tests
# make certificates with openssl, benches/bench_remote.py runs redis-benchmark.
have() { for c in "$@"; do command -v "$c" >/dev/null && return 0; done; return 1; }
check_tools() {
    missing=()
    have redis-server valkey-server || missing+=("redis-server (or valkey-server)")
    have redis-cli valkey-cli || missing+=("redis-cli (or valkey-cli)")
    have redis-benchmark valkey-benchmark || missing+=("redis-benchmark (or valkey-benchmark)")
    have openssl || missing+=("openssl")
}
check_tools
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq redis-server redis-tools openssl
    check_tools
fi
if [ ${#missing[@]} -gt 0 ]; then
    printf 'scripts/test.sh: missing: %s\n' "${missing[*]}" >&2
    exit 1
fi

step "install kvstore with its test dependencies (torch, lmdb, zstandard, pytest, ruff, mypy)"
python3 -m pip install --quiet --editable '.[test]'

step "rust: format, lints, tests"
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo clippy -p kvstore --all-targets --all-features --locked -- -D warnings
# With the fault-injection hooks: every test, plus crash, power loss and a
# failed step at each durable step of a scripted workload (crash_points).
cargo test -p kvstore --locked --features fault-injection -- --nocapture
# A build whose block ids keep 16 bits: collisions are misses, never other KV.
cargo test -p kvstore --locked --features test-short-ids --test collisions -- --nocapture

step "rust: fuzz the decoders and the segment scanner, 60 s per target"
bash scripts/fuzz.sh

step "python: lints, types, stubs"
ruff check python tests benches
ruff format --check python tests benches
python3 -m mypy python/kvstore
python3 -m mypy.stubtest kvstore._lib

step "cuda: nvcc compile check of every .cu file for sm_80 and sm_90 (no GPU needed)"
# nvcc from PyPI, matching torch's CUDA 13.2 runtime; the three versions must
# match, or ptxas rejects the PTX.
python3 -m pip install --quiet nvidia-cuda-nvcc==13.2.86 nvidia-nvvm==13.2.86 nvidia-cuda-crt==13.2.86
bash python/kvstore/csrc/compile_check.sh

step "vLLM 0.32 (CPU build) for the connector tests: a cached, pinned virtualenv"
# Built once per machine (scripts/vllm_env.sh); tests/test_vllm.py runs vLLM in
# it and, vllm being in KVSTORE_REQUIRE, fails rather than skips without it.
KVSTORE_VLLM_PYTHON="$(bash scripts/vllm_env.sh | tail -n 1)"
export KVSTORE_VLLM_PYTHON

step "python: tests (GPU tests are skipped without a GPU)"
python3 -m pytest -q tests benches/test_bench_smoke.py "$@"
