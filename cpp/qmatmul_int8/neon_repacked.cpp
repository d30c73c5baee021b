// Integer-activation GEMV on the row-interleaved layout (repack.h) for
// arm64: the consumption order of repacked_vnni.cpp (word j of 16 rows;
// shift k·B and mask give, per 32-bit lane r, the codes of row r in byte
// (int8) or 16-bit (int16) elements; 3, 5, 6 bits from their low and high
// plane words; x in
// repacked_x_col order, so run by the same driver, repacked_run.cpp), with
// a block of 16 rows as four uint32x4 vectors (rows 4q..4q+3, q = 0..3).
// Each shift of a word pairs with one quad (int8) or pair (int16) of x,
// lane L of a 16-byte x vector:
//   int8, dot-product extension (every Apple M core): SDOT by lane,
//          vdotq_laneq_s32, one instruction per 4 rows.
//   int8, plain armv8: SMULL of the codes with the quad broadcast, SADALP
//          into two lanes per row, the lanes paired up once per group.
//   int16: SMLAL of 16-bit codes with the pair broadcast, likewise.
// SDOT and SMULL take signed bytes: 8-bit codes (0..255) enter as c - 128
// (one XOR) and 128·ix is added back to the group's integer dot, exactly,
// as neon.cpp does. Codes of 2-6 bits and all int16 codes are taken as
// they are.
// Per group, x row and 4 rows: one convert and two FMAs (scales·d,
// biases·xs), as the x86 kernels, so all agree to float rounding.
// Checked under qemu-user with and without the dot-product extension
// (tests/test_repacked_neon_emulated.py); speed on Apple cores not measured.
#include "qmatmul_int8/repack.h"

#if defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>

#include <cstdint>
#include <type_traits>
#include <utility>

namespace mixbits {
namespace {

constexpr int R = kRepackRows;

// 4 rows' scales (or biases) of one group as float32.
inline float32x4_t load4(const void* p, int64_t off, DType t) {
  if (t == DType::f32) return vld1q_f32(static_cast<const float*>(p) + off);
  const uint16x4_t h = vld1_u16(static_cast<const uint16_t*>(p) + off);
  if (t == DType::f16) return vcvt_f32_f16(vreinterpret_f16_u16(h));
  return vreinterpretq_f32_u32(vshll_n_u16(h, 16));  // bf16: the high half of a float
}

// Right shift by D bits (left for D < 0); D is a compile-time constant as
// the NEON immediates need.
template <int D>
inline uint32x4_t shift_r(uint32x4_t v) {
  if constexpr (D > 0) return vshrq_n_u32(v, D);
  else if constexpr (D < 0) return vshlq_n_u32(v, -D);
  else return v;
}

// The integer dots of one group, 16 rows, one x row. add<L>(q, c, x): c
// holds rows 4q..4q+3 (a 32-bit lane each, 4 byte or 2 16-bit codes), lane
// L of x the quad (pair) of activations those codes meet.
template <class T>
struct Acc;

#if defined(__ARM_FEATURE_DOTPROD)
template <>
struct Acc<int8_t> {
  static constexpr int kPassMB = 4;  // 16 accumulators for 4 x rows
  int32x4_t v[4];
  void zero() {
    for (auto& a : v) a = vdupq_n_s32(0);
  }
  template <int L>
  void add(int q, uint32x4_t c, int8x16_t x) {
    v[q] = vdotq_laneq_s32(v[q], vreinterpretq_s8_u32(c), x, L);
  }
  int32x4_t sum(int q) const { return v[q]; }
};
#else
template <>
struct Acc<int8_t> {
  static constexpr int kPassMB = 2;  // two vectors per 4 rows
  // Rows 4q, 4q+1 in v[2q] (lanes 0-1, 2-3), rows 4q+2, 4q+3 in v[2q+1].
  int32x4_t v[8];
  void zero() {
    for (auto& a : v) a = vdupq_n_s32(0);
  }
  template <int L>
  void add(int q, uint32x4_t c, int8x16_t x) {
    const int8x16_t cs = vreinterpretq_s8_u32(c);
    const int8x16_t xq = vreinterpretq_s8_s32(vdupq_laneq_s32(vreinterpretq_s32_s8(x), L));
    // |code·x| <= 128·127: a pair of products fits int16 before SADALP.
    v[2 * q] = vpadalq_s16(v[2 * q], vmull_s8(vget_low_s8(cs), vget_low_s8(xq)));
    v[2 * q + 1] = vpadalq_s16(v[2 * q + 1], vmull_high_s8(cs, xq));
  }
  int32x4_t sum(int q) const { return vpaddq_s32(v[2 * q], v[2 * q + 1]); }
};
#endif

template <>
struct Acc<int16_t> {
  static constexpr int kPassMB = 2;
  int32x4_t v[8];  // as the plain int8 one: two lanes per row
  void zero() {
    for (auto& a : v) a = vdupq_n_s32(0);
  }
  template <int L>
  void add(int q, uint32x4_t c, int16x8_t x) {
    const int16x8_t cs = vreinterpretq_s16_u32(c);
    const int16x8_t xp = vreinterpretq_s16_s32(vdupq_laneq_s32(vreinterpretq_s32_s16(x), L));
    // codes <= 255, |x| <= 32767, G/2 products per lane: inside int32.
    v[2 * q] = vmlal_s16(v[2 * q], vget_low_s16(cs), vget_low_s16(xp));
    v[2 * q + 1] = vmlal_high_s16(v[2 * q + 1], cs, xp);
  }
  int32x4_t sum(int q) const { return vpaddq_s32(v[2 * q], v[2 * q + 1]); }
};

inline int8x16_t load_x(const int8_t* p) { return vld1q_s8(p); }
inline int16x8_t load_x(const int16_t* p) { return vld1q_s16(p); }

// f(std::integral_constant<int, i>) for i = 0..n-1, unrolled by the
// language rather than left to the optimizer: the accumulator arrays below
// are indexed only by constants, so they live in registers (a loop the
// compiler kept would put them on the stack, one load and store per dot).
template <class F, int... i>
inline void unroll_seq(F&& f, std::integer_sequence<int, i...>) {
  (f(std::integral_constant<int, i>{}), ...);
}
template <int n, class F>
inline void for_n(F&& f) {
  unroll_seq(f, std::make_integer_sequence<int, n>{});
}
#define MIXBITS_IDX(i) decltype(i)::value

// One block b of 16 rows against MB (<= Acc<T>::kPassMB) x rows.
//
// The group's words go in units that take whole 16-byte x vectors (4
// quads or pairs): one word where a word has >= 4 shifts (S), else 4/S
// words; for 3, 5, 6 bits a chunk of B words (repack.h: LB low-plane
// words, then the high ones), whose LB·S shifts of the low words meet its
// 32 codes.
// Step t of a unit is x lane t % 4 of vector t / 4 of the unit.
template <int B, int G, int MB, class T>
void block(const RSeg& s, const RX& x, int b, int N, float* y, int ldy) {
  using XV = decltype(load_x(static_cast<const T*>(nullptr)));
  constexpr int P = 4 / int(sizeof(T));                   // activations per step
  constexpr bool kSplit = repack_splits(B);
  constexpr int LB = split_low_bits(B);                   // bits per low-word code
  constexpr int S = 8 * int(sizeof(T)) / LB;              // shifts per (low) word
  constexpr int UW = kSplit ? B : S >= 4 ? 1 : 4 / S;     // words per unit
  constexpr int US = kSplit ? LB * S : UW * S;            // steps per unit
  constexpr int UV = US / 4;                              // x vectors per unit
  constexpr int WG = G * B / 32;                          // words per group
  constexpr uint32_t kMask = repack_code_mask<LB, T>();
  // 8-bit int8 codes enter as c - 128 (see the top).
  constexpr bool kOffset = B == 8 && sizeof(T) == 1;
  static_assert(US % 4 == 0 && WG % UW == 0 && UV * 16 == US * P * int(sizeof(T)));

  const T* xq = static_cast<const T*>(x.xq);
  const uint32_t* wb = s.wq + int64_t(b) * s.words * R;
  const int64_t sb = int64_t(b) * s.ngroups * R;
  float32x4_t accf[MB][4];
  for_n<MB>([&](auto m) {
    for_n<4>([&](auto q) { accf[MIXBITS_IDX(m)][MIXBITS_IDX(q)] = vdupq_n_f32(0.0f); });
  });

  for (int g = 0; g < s.ngroups; ++g) {
    Acc<T> acc[MB];
    for_n<MB>([&](auto m) { acc[MIXBITS_IDX(m)].zero(); });
    for (int u = 0; u < WG / UW; ++u) {
      const uint32_t* wp = wb + (int64_t(g) * WG + int64_t(u) * UW) * R;
      const int64_t x0 = int64_t(g) * G + int64_t(u) * US * P;
      XV xv[MB][UV];
      for_n<MB>([&](auto m) {
        for_n<UV>([&](auto v) {
          const T* xp = xq + int64_t(m) * x.ldx + x0 + v * (16 / int(sizeof(T)));
          xv[MIXBITS_IDX(m)][MIXBITS_IDX(v)] = load_x(xp);
        });
      });
      // Rows 4q..4q+3 one after the other: their UW words, then every step
      // (live registers: the accumulators, x, UW words, the codes).
      for_n<4>([&](auto qc) {
        constexpr int q = MIXBITS_IDX(qc);
        uint32x4_t w[UW];
        for_n<UW>([&](auto i) { w[MIXBITS_IDX(i)] = vld1q_u32(wp + i * R + 4 * q); });
        for_n<US>([&](auto tc) {
          constexpr int t = MIXBITS_IDX(tc);
          uint32x4_t c;
          if constexpr (kSplit) {  // repack.h: low bits from L<lw>, the rest from a high word
            constexpr int lw = t / S, k = t % S;
            constexpr int hw = LB + split_hword(B, lw * (32 / LB));
            const uint32x4_t lo = vandq_u32(shift_r<LB * k>(w[lw]), vdupq_n_u32(kMask));
            const uint32x4_t hi = vandq_u32(shift_r<split_hshift(B, lw, k)>(w[hw]),
                                            vdupq_n_u32(repack_code_mask<B - LB, T>() << LB));
            c = vorrq_u32(lo, hi);
          } else {
            c = shift_r<(t % S) * B>(w[t / S]);
            if constexpr (kMask != 0xFFFFFFFFu) c = vandq_u32(c, vdupq_n_u32(kMask));
            if constexpr (kOffset) c = veorq_u32(c, vdupq_n_u32(0x80808080u));
          }
          for_n<MB>([&](auto mc) {
            constexpr int m = MIXBITS_IDX(mc);
            acc[m].template add<t % 4>(q, c, xv[m][t / 4]);
          });
        });
      });
    }
    for_n<4>([&](auto qc) {
      constexpr int q = MIXBITS_IDX(qc);
      const float32x4_t sc = load4(s.scales, sb + int64_t(g) * R + 4 * q, s.sdt);
      const float32x4_t bi = load4(s.biases, sb + int64_t(g) * R + 4 * q, s.sdt);
      for_n<MB>([&](auto mc) {
        constexpr int m = MIXBITS_IDX(mc);
        const int64_t gi = int64_t(m) * x.ldg + g;
        int32x4_t iq = acc[m].sum(q);
        if constexpr (kOffset) iq = vaddq_s32(iq, vdupq_n_s32(128 * x.ix[gi]));
        const float32x4_t sd = vmulq_n_f32(sc, x.d[gi]);
        accf[m][q] = vfmaq_f32(accf[m][q], vcvtq_f32_s32(iq), sd);
        accf[m][q] = vfmaq_n_f32(accf[m][q], bi, x.xs[gi]);
      });
    });
  }
  // The last block may hold padding rows: store the real ones only.
  const int n0 = b * R, nreal = N - n0 < R ? N - n0 : R;
  for_n<MB>([&](auto mc) {
    constexpr int m = MIXBITS_IDX(mc);
    float* yp = y + int64_t(m) * ldy + n0;
    if (nreal == R) {
      for_n<4>([&](auto q) {
        vst1q_f32(yp + 4 * q, vaddq_f32(vld1q_f32(yp + 4 * q), accf[m][MIXBITS_IDX(q)]));
      });
    } else {
      float part[R];
      for_n<4>([&](auto q) { vst1q_f32(part + 4 * q, accf[m][MIXBITS_IDX(q)]); });
      for (int r = 0; r < nreal; ++r) yp[r] += part[r];
    }
  });
}
#undef MIXBITS_IDX

// Blocks [b0, b1) of one segment against mb (<= kRepackMaxMB) x rows, in
// passes of at most Acc<T>::kPassMB rows so the accumulators stay in
// registers; each block's words are read once per pass, from cache after
// the first.
template <int B, int G, class T>
void seg_kernel(const RSeg& s, const RX& x, int mb, int b0, int b1, int N, float* y, int ldy) {
  constexpr int PM = Acc<T>::kPassMB;
  for (int b = b0; b < b1; ++b)
    for (int m0 = 0; m0 < mb; m0 += PM) {
      const int64_t gm = int64_t(m0) * x.ldg;
      const RX xm{static_cast<const T*>(x.xq) + int64_t(m0) * x.ldx, x.ldx, x.d + gm, x.xs + gm,
                  x.ldg, x.ix + gm};
      float* ym = y + int64_t(m0) * ldy;
      const int n = mb - m0 < PM ? mb - m0 : PM;
      if constexpr (PM == 4) {
        if (n == 4) { block<B, G, 4, T>(s, xm, b, N, ym, ldy); continue; }
        if (n == 3) { block<B, G, 3, T>(s, xm, b, N, ym, ldy); continue; }
      }
      if (n == 2) block<B, G, 2, T>(s, xm, b, N, ym, ldy);
      else block<B, G, 1, T>(s, xm, b, N, ym, ldy);
    }
}

template <class T>
RTable make_table() {
  RTable t{};
#define MIXBITS_R_ROW(B) \
  t.fn[B][0] = seg_kernel<B, 32, T>;   \
  t.fn[B][1] = seg_kernel<B, 64, T>;   \
  t.fn[B][2] = seg_kernel<B, 128, T>;
  MIXBITS_R_ROW(2) MIXBITS_R_ROW(3) MIXBITS_R_ROW(4) MIXBITS_R_ROW(5) MIXBITS_R_ROW(6)
  MIXBITS_R_ROW(8)
#undef MIXBITS_R_ROW
  return t;
}

}  // namespace

const RTable& repacked_int8_table_neon() {
  static const RTable t = make_table<int8_t>();
  return t;
}
const RTable& repacked_int16_table_neon() {
  static const RTable t = make_table<int16_t>();
  return t;
}

}  // namespace mixbits

#endif  // an arm64 target without NEON has no tables (select_repacked)
