#!/usr/bin/env bash
# Build llama.cpp's llama-bench (the llama.cpp copy vendored in the
# llama-cpp-python sdist that bench/ggml/build.sh uses) into
# build/ggml/llama-bench (ignored by git). Optional baseline: only
# `bench/bench_decode.py --llama-bench PATH` uses it; not part of .ci/run.
#
#   bench/ggml/build_llama_bench.sh          # -> build/ggml/llama-bench
#   JOBS=2 LLAMA_CPP_PYTHON_VERSION=0.3.36 bench/ggml/build_llama_bench.sh
#   GGML_ISA=avx2 bench/ggml/build_llama_bench.sh   # -> build/ggml/llama-bench-avx2 (isa.sh)
#
# CPU backend only, Release, -march=native (GGML_NATIVE; or isa.sh's set), static libraries,
# no OpenMP (ggml's own threadpool), no BLAS, no OpenSSL/HTTPS, no tests,
# examples, server or app: of the tools only the llama-bench target is built
# (it links libllama and llama-common). The sdist comes from
# build/ggml/dl/ when present, else pip downloads it (sdist only, no deps),
# as build.sh does. On a shared host wrap it: flock /tmp/mixbits-build.lock ...
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/fetch_sdist.sh"
source "$(dirname "${BASH_SOURCE[0]}")/isa.sh"

NEED="tools/llama-bench/llama-bench.cpp"
source "$(dirname "${BASH_SOURCE[0]}")/llama_configure.sh"
nice -n 10 cmake --build "$CM" --target llama-bench -j "$JOBS"

BIN=$(find "$CM" -type f -name llama-bench -perm -u+x | head -1)
[ -n "$BIN" ] || { echo "error: no llama-bench under $CM" >&2; exit 1; }
cp -f "$BIN" "$OUT/llama-bench$SUFFIX"
echo "built $OUT/llama-bench$SUFFIX (llama-cpp-python==$VERSION, GGML_ISA=$ISA)"
"$OUT/llama-bench$SUFFIX" --help 2>&1 | head -5 || true
