# Sourced by build_llama_bench.sh and build_llama_quant.sh (after fetch_sdist.sh
# and isa.sh): extracts the whole llama.cpp vendored in the llama-cpp-python
# sdist (src/, common/, tools/, vendor/, ggml/; not the submodule's git
# metadata) into $SRC when any of $NEED (paths under it) is missing, and
# configures one CPU-only build folder $CM that every tool target shares:
# Release, static libraries, -march from isa.sh, no OpenMP (ggml's own
# threadpool), BLAS, OpenSSL/HTTPS, tests, examples, server or app.
SRC="$OUT/llama.cpp"
for f in $NEED; do
  if [ ! -f "$SRC/$f" ]; then
    rm -rf "$SRC" && mkdir -p "$SRC"
    echo "extracting vendor/llama.cpp"
    tar xzf "$SDIST" -C "$SRC" --strip-components=3 --exclude='*/.git/*' \
        "llama_cpp_python-$VERSION/vendor/llama.cpp"
    break
  fi
done
[ -f "$SRC/ggml/ggml.pc.in" ] || : > "$SRC/ggml/ggml.pc.in"

# GIT_CEILING_DIRECTORIES: the configure asks git for "its" commit and would
# otherwise find this repository's.
CM="$OUT/llama-cmake$SUFFIX"
GIT_CEILING_DIRECTORIES="$SRC" cmake -S "$SRC" -B "$CM" -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=OFF "${ISA_FLAGS[@]}" -DGGML_BACKEND_DL=OFF \
  -DGGML_CPU=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_BLAS=OFF \
  -DGGML_OPENMP=OFF -DGGML_LLAMAFILE=ON -DGGML_RPC=OFF \
  -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_LLGUIDANCE=OFF \
  >"$CM.log" 2>&1 || { tail -30 "$CM.log"; exit 1; }
