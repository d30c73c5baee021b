# Sourced by build.sh and build_llama_bench.sh: sets VERSION, JOBS, ROOT,
# OUT, PY and SDIST, the llama-cpp-python source distribution (which
# vendors llama.cpp and its ggml), fetched into $OUT/dl unless already
# there. What it fetches: llama_cpp_python-$VERSION.tar.gz from the
# package index (pip download, source distribution only, no dependencies).
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${JOBS:-1}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${GGML_BUILD_DIR:-$ROOT/build/ggml}"
PY="${PYTHON:-python3}"

mkdir -p "$OUT/dl"
SDIST="$OUT/dl/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
  echo "fetching llama-cpp-python==$VERSION (sdist, no deps) from the package index into $OUT/dl"
  # --no-binary for this package only: build requirements (cmake,
  # scikit-build-core) may come as wheels; pip only reads the metadata.
  "$PY" -m pip download "llama-cpp-python==$VERSION" --no-binary llama-cpp-python \
      --no-deps -d "$OUT/dl"
fi
[ -f "$SDIST" ] || { echo "error: $SDIST not found after pip download" >&2; exit 1; }
echo "using $SDIST (sha256 $(sha256sum "$SDIST" | cut -d' ' -f1))"
