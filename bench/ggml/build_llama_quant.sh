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

NEED="tools/quantize/quantize.cpp tools/imatrix/imatrix.cpp tools/tokenize/tokenize.cpp tools/perplexity/perplexity.cpp"
source "$(dirname "${BASH_SOURCE[0]}")/llama_configure.sh"
for tool in llama-quantize llama-imatrix llama-tokenize llama-perplexity; do
  nice -n 10 cmake --build "$CM" --target "$tool" -j "$JOBS"
  BIN=$(find "$CM" -type f -name "$tool" -perm -u+x | head -1)
  [ -n "$BIN" ] || { echo "error: no $tool under $CM" >&2; exit 1; }
  cp -f "$BIN" "$OUT/$tool$SUFFIX"
  echo "built $OUT/$tool$SUFFIX (llama-cpp-python==$VERSION, GGML_ISA=$ISA)"
done
