// The codes of a repacked block (repack.h) as AVX-512 vectors: lane r of
// every vector is W row r of the block, each 32-bit lane holding 4 byte
// codes (int8 contract) or 2 16-bit codes (int16). One definition for the
// GEMV (repacked_vnni.cpp), which feeds them straight to vpdpbusd, and the
// prefill GEMM (repacked_vnni_gemm.cpp), which stores them once per K-chunk
// and reuses them for many x rows: both must produce a word's codes in the
// order repacked_x_col put the activations in.
//
// Include after <immintrin.h> under a target with AVX512F/BW/VNNI (a pragma
// region), like x86_load16.h: internal linkage, one copy per including
// file, compiled for that file's target.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "qmatmul_int8/repack.h"

namespace mixbits {
namespace {

template <class T>
inline __m512i idot(__m512i acc, __m512i w, __m512i x) {
  if constexpr (sizeof(T) == 1) return _mm512_dpbusd_epi32(acc, w, x);  // u8 codes x s8 x
  else return _mm512_dpwssd_epi32(acc, w, x);  // codes <= 255 are valid s16
}

template <int D>
inline __m512i shift_r(__m512i v) {
  if constexpr (D > 0) return _mm512_srli_epi32(v, D);
  else if constexpr (D < 0) return _mm512_slli_epi32(v, -D);
  else return v;
}

// 2, 4, 8 bits: shift k of a word of 16 rows (x position 4k/sizeof(T)
// quads of the word's codes), masked to one code per element.
template <int B, class T>
inline __m512i word_code(__m512i w, int k) {
  constexpr uint32_t kMask = repack_code_mask<B, T>();
  const __m512i c = k == 0 ? w : _mm512_srli_epi32(w, k * B);
  if constexpr (kMask != 0xFFFFFFFFu) return _mm512_and_si512(c, _mm512_set1_epi32(int(kMask)));
  else return c;
}

// 2 and 4 bits, int8: shift k's codes left where they are, masked: each
// byte holds code << (k * B) (<= 192 for 2 bits, 240 for 4), so a dot with
// it is 2^(k*B) times the dot with the codes, exactly; the caller shifts
// the int32 sum back.
template <int B>
inline __m512i word_code_in_place(__m512i w, int k) {
  return _mm512_and_si512(w, _mm512_set1_epi32(int(repack_code_mask<B, int8_t>() << (k * B))));
}

// Split segments (3, 5, 6 bits; repack.h): step K of low word W of a chunk
// of 32 codes (cw: its B words of 16 rows), i.e. the LB-bit kernel's shift
// K of low word W ORed with high word split_hword's shift by split_hshift,
// masked to bits LB.. of each element.
template <int B, class T, int W, int K>
inline __m512i split_code(const __m512i (&cw)[B]) {
  constexpr int LB = split_low_bits(B);
  const __m512i ml = _mm512_set1_epi32(int(repack_code_mask<LB, T>()));
  const __m512i mh = _mm512_set1_epi32(int(repack_code_mask<B - LB, T>() << LB));
  const __m512i lo = _mm512_and_si512(shift_r<LB * K>(cw[W]), ml);
  const __m512i hw = cw[LB + split_hword(B, W * (32 / LB))];
  const __m512i hi = _mm512_and_si512(shift_r<split_hshift(B, W, K)>(hw), mh);
  return _mm512_or_si512(lo, hi);
}

}  // namespace
}  // namespace mixbits
