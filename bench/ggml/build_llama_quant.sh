#!/usr/bin/env bash
# Build llama.cpp's llama-quantize, llama-imatrix, llama-tokenize and
# llama-perplexity (the llama.cpp copy vendored in the llama-cpp-python
# sdist, as build_llama_bench.sh) into build/ggml/ (ignored by git). Optional: only
# bench/kquant.py (quality_protocol.py --kquant) uses them, to add
# llama.cpp's K-quant mixes (with an importance matrix) to the protocol's
# contenders; not part of .ci/run.
#
#   bench/ggml/build_llama_quant.sh   # -> build/ggml/llama-{quantize,imatrix,tokenize,perplexity}
#   JOBS=2 LLAMA_CPP_PYTHON_VERSION=0.3.36 bench/ggml/build_llama_quant.sh
#
# CPU backend only, Release, static libraries, no OpenMP, BLAS, OpenSSL,
# tests, examples or server; of the tools only these four targets
# (llama-tokenize checks that llama-imatrix sees the protocol's tokens;
# llama-perplexity --kl-divergence cross-checks our KL: kquant.py's main). The
# quantized tensors do not depend on the ISA (the quantizers are the
# reference C code), so GGML_ISA only changes how fast llama-imatrix runs.
# On a shared host wrap it: flock /tmp/mixbits-build.lock ...
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/fetch_sdist.sh"
source "$(dirname "${BASH_SOURCE[0]}")/isa.sh"

SRC="$OUT/llama.cpp"
if [ ! -f "$SRC/tools/quantize/quantize.cpp" ] || [ ! -f "$SRC/tools/imatrix/imatrix.cpp" ]; then
  rm -rf "$SRC" && mkdir -p "$SRC"
  echo "extracting vendor/llama.cpp"
  tar xzf "$SDIST" -C "$SRC" --strip-components=3 --exclude='*/.git/*' \
      "llama_cpp_python-$VERSION/vendor/llama.cpp"
fi
[ -f "$SRC/ggml/ggml.pc.in" ] || : > "$SRC/ggml/ggml.pc.in"

# the same configure as build_llama_bench.sh: both can share one build folder
CM="$OUT/llama-cmake$SUFFIX"
GIT_CEILING_DIRECTORIES="$SRC" cmake -S "$SRC" -B "$CM" -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=OFF "${ISA_FLAGS[@]}" -DGGML_BACKEND_DL=OFF \
  -DGGML_CPU=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_BLAS=OFF \
  -DGGML_OPENMP=OFF -DGGML_LLAMAFILE=ON -DGGML_RPC=OFF \
  -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_LLGUIDANCE=OFF \
  >"$CM.log" 2>&1 || { tail -30 "$CM.log"; exit 1; }
for tool in llama-quantize llama-imatrix llama-tokenize llama-perplexity; do
  nice -n 10 cmake --build "$CM" --target "$tool" -j "$JOBS"
  BIN=$(find "$CM" -type f -name "$tool" -perm -u+x | head -1)
  [ -n "$BIN" ] || { echo "error: no $tool under $CM" >&2; exit 1; }
  cp -f "$BIN" "$OUT/$tool$SUFFIX"
  echo "built $OUT/$tool$SUFFIX (llama-cpp-python==$VERSION, GGML_ISA=$ISA)"
done
