#!/usr/bin/env bash
# Build ggml's CPU library (the copy llama.cpp ships inside the
# llama-cpp-python sdist) and our timing harness bench/ggml/ggml_mm.c into
# build/ggml/ (ignored by git). Optional: only `mixbits bench --vs-ggml` uses it.
#
#   bench/ggml/build.sh            # -> build/ggml/ggml_mm
#   JOBS=2 LLAMA_CPP_PYTHON_VERSION=0.3.36 bench/ggml/build.sh
#   GGML_ISA=avx2 bench/ggml/build.sh   # -> build/ggml/ggml_mm-avx2: AVX2 + FMA
#                                        # only, as on a CPU without AVX-512
#                                        # (to set against `mixbits bench --backend avx2`)
#
# What it fetches: llama_cpp_python-$VERSION.tar.gz from the package index
# (pip download, source distribution only, no dependencies). Nothing of ggml
# is copied into the repository; nothing is downloaded at Python import time.
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/fetch_sdist.sh"
CC="${CC:-cc}"

SRC="$OUT/src"
if [ ! -f "$SRC/ggml/CMakeLists.txt" ]; then
  rm -rf "$SRC" && mkdir -p "$SRC"
  echo "extracting vendor/llama.cpp/ggml"
  tar xzf "$SDIST" -C "$SRC" --strip-components=3 \
      "llama_cpp_python-$VERSION/vendor/llama.cpp/ggml"
fi

# The sdist leaves out ggml's pkg-config template, which a standalone
# configure wants; we install nothing, so an empty one does.
[ -f "$SRC/ggml/ggml.pc.in" ] || : > "$SRC/ggml/ggml.pc.in"

# ggml alone: CPU backend only, static, tuned for this CPU (GGML_NATIVE ->
# -march=native: AVX2/AVX-512 where present), with llamafile's sgemm as
# llama.cpp builds it (its default there, not in standalone ggml); no GPU,
# BLAS, OpenMP (the harness uses ggml's own threadpool), tests.
# (GIT_CEILING_DIRECTORIES: ggml's configure asks git for "its" commit and
# would otherwise find this repository's.)
source "$(dirname "${BASH_SOURCE[0]}")/isa.sh"
CM="$OUT/cmake$SUFFIX"; BIN="$OUT/ggml_mm$SUFFIX"
GIT_CEILING_DIRECTORIES="$SRC" cmake -S "$SRC/ggml" -B "$CM" -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=OFF "${ISA_FLAGS[@]}" -DGGML_BACKEND_DL=OFF \
  -DGGML_CPU=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_BLAS=OFF \
  -DGGML_OPENMP=OFF -DGGML_LLAMAFILE=ON -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF \
  -DCMAKE_POSITION_INDEPENDENT_CODE=ON >"$CM.log" 2>&1 \
  || { tail -30 "$CM.log"; exit 1; }
nice -n 10 cmake --build "$CM" --target ggml ggml-cpu ggml-base -j "$JOBS"

LIBS=$(find "$CM" -name 'libggml*.a' | sort)
nice -n 10 "$CC" -O2 -std=c11 -DGGML_MM_SOURCE="\"llama-cpp-python==$VERSION\"" \
  -o "$BIN" "$ROOT/bench/ggml/ggml_mm.c" \
  -I "$SRC/ggml/include" -Wl,--start-group $LIBS -Wl,--end-group -lstdc++ -lm -lpthread
echo "built $BIN"
"$BIN" --info
