#!/usr/bin/env bash
# Runs every libFuzzer program of a -Dfuzz=true build for a while each, and prints what each did.
#
#   CXX=clang++ meson setup build-fuzz -Dfuzz=true -Dbuildtype=debugoptimized && meson compile -C build-fuzz
#   scripts/fuzz.sh build-fuzz [SECONDS_PER_TARGET] [TARGET ...]
#   FUZZ_RUNS=1000000 scripts/fuzz.sh build-fuzz 3600 gguf   # stop at a number of executions (time stays a cap)
#
# Each target keeps its corpus in BUILD/fuzz-corpus/TARGET (seeded from tests/fuzz_seeds.hpp on the first run) and
# writes any crashing input to BUILD/fuzz-crashes/TARGET/. The exit status is non-zero if any target found a crash.
set -uo pipefail
build=${1:?usage: scripts/fuzz.sh BUILD_DIR [SECONDS_PER_TARGET] [TARGET ...]}
seconds=${2:-60}
shift $(( $# >= 2 ? 2 : 1 ))
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(gguf safetensors config llama2c llama2c_tokenizer tokenizer_json tokenize json chat_template request)
fi
export ASAN_OPTIONS=${ASAN_OPTIONS:-allocator_may_return_null=1:detect_leaks=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
status=0
for target in "${targets[@]}"; do
  program="$build/fuzz_$target"
  [ -x "$program" ] || { echo "$program: not built (meson setup -Dfuzz=true with clang)"; status=1; continue; }
  corpus="$build/fuzz-corpus/$target"
  crashes="$build/fuzz-crashes/$target"
  mkdir -p "$corpus" "$crashes"
  log="$build/fuzz-$target.log"
  run_limit=()
  [ -n "${FUZZ_RUNS:-}" ] && run_limit=(-runs="$FUZZ_RUNS")
  "$program" "$corpus" "${run_limit[@]}" -max_total_time="$seconds" -timeout=30 -rss_limit_mb=4096 -max_len=65536 \
    -artifact_prefix="$crashes/" -print_final_stats=1 > "$log" 2>&1
  result=$?
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$')
  if [ $result -eq 0 ]; then
    echo "$target: ${runs:-?} executions, no crash"
  else
    echo "$target: CRASH after ${runs:-?} executions (see $log and $crashes)"
    status=1
  fi
done
exit $status
