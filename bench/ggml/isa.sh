# Sourced by build.sh and build_llama_bench.sh: GGML_ISA (default native)
# -> ISA_FLAGS, ggml's CMake options for it, and SUFFIX, appended to the
# build folder and the binary's name so both builds can sit side by side.
#   native: -march=native (AVX2/AVX-512 where present)
#   avx2:   the instruction sets of an AVX2 host without AVX-512 or
#           AVX-VNNI, to set against mixbits' AVX2 kernels (MIXBITS_ISA=avx2
#           or --backend avx2) on a CPU that has more
ISA="${GGML_ISA:-native}"
case "$ISA" in
  native) ISA_FLAGS=(-DGGML_NATIVE=ON); SUFFIX="" ;;
  avx2) ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
                   -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF
                   -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF)
        SUFFIX="-avx2" ;;
  *) echo "error: GGML_ISA must be native or avx2, got '$ISA'" >&2; exit 2 ;;
esac
