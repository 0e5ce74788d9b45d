#!/usr/bin/env bash
# Fuzzes the engine's decoders and the segment scanner (rust/kvstore/fuzz).
#
# Installs cargo-fuzz (pinned), builds every target once, then runs each for
# FUZZ_SECONDS (default 60), FUZZ_JOBS targets at a time (default: the CPU
# count). Prints each target's executions and exits non-zero on any finding;
# the input that failed is left under rust/kvstore/fuzz/artifacts/<target>/.
#
#   FUZZ_SECONDS=60    seconds per target
#   FUZZ_JOBS=N        targets fuzzed at once
#   FUZZ_TARGETS="a b" a subset of the targets
#   FUZZ_SANITIZER     none (default: the engine is safe Rust outside os.rs,
#                      which no target reaches) or address (needs nightly)
#   FUZZ_TOOLCHAIN     +nightly when installed, else the default toolchain
#                      (with no sanitizer, stable builds the targets too)
set -euo pipefail
cd "$(dirname "$0")/.."

CARGO_FUZZ_VERSION=0.13.2
fuzz_dir=rust/kvstore/fuzz
seconds=${FUZZ_SECONDS:-60}
jobs=${FUZZ_JOBS:-$(nproc)}
sanitizer=${FUZZ_SANITIZER:-none}
read -r -a targets <<<"${FUZZ_TARGETS:-record_header segment_header manifest index_values segment_scan}"
if [[ -z ${FUZZ_TOOLCHAIN+x} ]]; then
    if rustup run nightly rustc --version >/dev/null 2>&1; then
        FUZZ_TOOLCHAIN=+nightly
    else
        FUZZ_TOOLCHAIN=
    fi
fi
cargo=(cargo ${FUZZ_TOOLCHAIN:+"$FUZZ_TOOLCHAIN"})

start=$SECONDS
if [[ "$(cargo fuzz --version 2>/dev/null || true)" != "cargo-fuzz $CARGO_FUZZ_VERSION" ]]; then
    echo "fuzz: installing cargo-fuzz $CARGO_FUZZ_VERSION"
    cargo install --locked "cargo-fuzz@$CARGO_FUZZ_VERSION"
fi

echo "fuzz: building ${targets[*]} (${FUZZ_TOOLCHAIN:-default toolchain}, sanitizer $sanitizer)"
for t in "${targets[@]}"; do
    "${cargo[@]}" fuzz build --fuzz-dir "$fuzz_dir" -s "$sanitizer" "$t"
done
built=$SECONDS
echo "fuzz: built in $((built - start)) s; fuzzing each target for $seconds s, $jobs at a time"

logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
run_one() {
    local t=$1
    mkdir -p "$fuzz_dir/corpus/$t" "$fuzz_dir/artifacts/$t"
    # New inputs go to corpus/ (ignored by git); seeds/ is only read.
    "${cargo[@]}" fuzz run --fuzz-dir "$fuzz_dir" -s "$sanitizer" "$t" \
        "$fuzz_dir/corpus/$t" "$fuzz_dir/seeds/$t" -- \
        -max_total_time="$seconds" -timeout=10 \
        -artifact_prefix="$fuzz_dir/artifacts/$t/" >"$logs/$t.log" 2>&1
}
running=0
for t in "${targets[@]}"; do
    if ((running >= jobs)); then
        wait -n || true
        running=$((running - 1))
    fi
    (
        rc=0
        run_one "$t" || rc=$?
        echo "$rc" >"$logs/$t.rc"
    ) &
    running=$((running + 1))
done
wait

failed=0
printf '%-16s %14s %8s  %s\n' target executions seconds result
for t in "${targets[@]}"; do
    rc=$(cat "$logs/$t.rc" 2>/dev/null || echo 1)
    done_line=$(grep -E '^Done [0-9]+ runs in [0-9]+ second' "$logs/$t.log" | tail -n 1 || true)
    runs=$(awk '{print $2}' <<<"$done_line")
    secs=$(awk '{print $5}' <<<"$done_line")
    if [[ $rc == 0 && -n $done_line ]]; then
        result=ok
    else
        result="FAILED (exit $rc)"
        failed=1
    fi
    printf '%-16s %14s %8s  %s\n' "$t" "${runs:--}" "${secs:--}" "$result"
done
if ((failed)); then
    for t in "${targets[@]}"; do
        if [[ $(cat "$logs/$t.rc" 2>/dev/null || echo 1) != 0 ]]; then
            echo "---- $t: last lines of its log"
            tail -n 40 "$logs/$t.log"
        fi
    done
    echo "fuzz: findings are under $fuzz_dir/artifacts/<target>/;" \
        "reproduce with: cargo fuzz run --fuzz-dir $fuzz_dir -s $sanitizer <target> <file>"
fi
echo "fuzz: done in $((SECONDS - start)) s (build $((built - start)) s)"
exit "$failed"
