// The 8x8 simdgroup_matrix part of metal_compat.h (included from there, after
// the simd ops it builds on).
#pragma once

namespace metal {

// ---- simdgroup matrices (8x8) ------------------------------------------------
//
// simdgroup_matrix<T, 8, 8> is distributed over the 32 lanes of a
// simdgroup: each lane's object holds two adjacent elements of one row, in
// Apple's layout (the one MLX's steel BaseMMAFrag::get_coord relies on):
// lane l holds row 4 (l / 16) + (l / 2) % 4, columns 4 ((l / 8) % 2) +
// 2 (l % 2) and the next. thread_elements() exposes a lane's two elements
// (as Metal does; MLX's steel MMA loads fragments through it, mixbits'
// kernels do not use it); everything else goes through the collective
// operations below (and the diagonal / filled constructors).
// Every collective must be reached by all 32 lanes with the same arguments
// (pointer, elements per row, origin, transpose), or the run fails.
//
// Semantics (element (r, c) = row r, column c; origin = (column, row)):
//   simdgroup_load:  m(r, c) = src[(origin.y + r) * elements_per_row +
//                                  origin.x + c], or with transpose
//                    m(r, c) = src[(origin.y + c) * elements_per_row +
//                                  origin.x + r];
//   simdgroup_store: the same addressing, writing m;
//   simdgroup_multiply_accumulate(d, a, b, c): d = a b + c, each element
//                    summed over k = 0..7 in float, rounded to T once.
// A load completes for the whole simdgroup before any lane goes on (it is
// one collective); a store's values are not visible to other lanes until a
// barrier (each lane writes its own elements and goes on), so reading them
// back without simdgroup_barrier / threadgroup_barrier gives NaN here.
// A default-constructed matrix holds NaN (its contents are undefined).
template <typename T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "the emulator knows 8x8 simdgroup matrices only");
  static constexpr int kPerLane = 2;
  T e[kPerLane];

  simdgroup_matrix() {
    for (T& v : e) v = T(std::numeric_limits<float>::quiet_NaN());
  }
  // Metal: a diagonal matrix with `diag` on the diagonal, 0 elsewhere.
  explicit simdgroup_matrix(T diag) {
    const uint32_t lane = simt::current_lane();
    for (int i = 0; i < kPerLane; ++i) e[i] = row(lane) == col(lane, i) ? diag : T(0);
  }

  // Metal's thread_elements(): this lane's two elements, (row, col(lane, 0))
  // and (row, col(lane, 1)).
  metal_compat_detail::vec<T, 2>& thread_elements() {
    static_assert(sizeof(metal_compat_detail::vec<T, 2>) == sizeof(e));
    return *reinterpret_cast<metal_compat_detail::vec<T, 2>*>(e);
  }
  const metal_compat_detail::vec<T, 2>& thread_elements() const {
    return *reinterpret_cast<const metal_compat_detail::vec<T, 2>*>(e);
  }

  static int row(uint32_t lane) { return int(4 * (lane / 16) + (lane / 2) % 4); }
  static int col(uint32_t lane, int i) { return int(4 * ((lane / 8) % 2) + 2 * (lane % 2)) + i; }
};

typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <typename T, int Cols, int Rows>
simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, Cols, Rows> m;
  for (T& v : m.e) v = value;
  return m;
}

namespace compat_detail {

struct MatrixArgs {
  const void* ptr;
  unsigned long elements_per_row, ox, oy;
  bool transpose;
  bool operator==(const MatrixArgs&) const = default;
};

// The collective's first rendezvous: every lane must be here, with the
// same arguments.
inline void matrix_rendezvous(const char* op, const MatrixArgs& a,
                              const std::source_location& loc) {
  const uint64_t h = std::hash<const void*>()(a.ptr) ^ (a.elements_per_row * 0x9e3779b97f4a7c15ull) ^
                     (a.ox * 0xc2b2ae3d27d4eb4full) ^ (a.oy * 0x165667b19e3779f9ull) ^
                     (a.transpose ? 0x27d4eb2f165667c5ull : 0);
  auto g = gather(op, h, loc);
  for (int i = 1; i < g.n; ++i)
    if (g.v[i] != g.v[0])
      throw simt::Error(std::string("simt: lanes pass different arguments to ") + op +
                        " at line " + std::to_string(loc.line()) + " (lane 0 and lane " +
                        std::to_string(i) + ")");
  if (g.n != simt::kSimdWidth)
    throw simt::Error(std::string("simt: ") + op + " at line " + std::to_string(loc.line()) +
                      " in a simdgroup of " + std::to_string(g.n) +
                      " lanes (simdgroup matrices need all 32)");
}

inline size_t matrix_offset(const MatrixArgs& a, int r, int c) {
  return a.transpose ? (a.oy + c) * a.elements_per_row + a.ox + r
                     : (a.oy + r) * a.elements_per_row + a.ox + c;
}

}  // namespace compat_detail

#define MB_SIMD_MATRIX_LOC std::source_location loc = std::source_location::current()

template <typename T, int Cols, int Rows>
void simdgroup_load(simdgroup_matrix<T, Cols, Rows>& d, const T* src,
                    ulong elements_per_row = Cols, ulong2 matrix_origin = ulong2(0, 0),
                    bool transpose_matrix = false, MB_SIMD_MATRIX_LOC) {
  const compat_detail::MatrixArgs a{src, elements_per_row, matrix_origin.x, matrix_origin.y,
                                    transpose_matrix};
  compat_detail::matrix_rendezvous("simdgroup_load", a, loc);
  const uint32_t lane = simt::current_lane();
  for (int i = 0; i < d.kPerLane; ++i)
    d.e[i] = src[compat_detail::matrix_offset(a, d.row(lane), d.col(lane, i))];
  // No lane goes on (and perhaps overwrites the source) before all have read.
  compat_detail::gather("simdgroup_load", 0, loc);
}

template <typename T, int Cols, int Rows>
void simdgroup_store(const simdgroup_matrix<T, Cols, Rows>& m, T* dst,
                     ulong elements_per_row = Cols, ulong2 matrix_origin = ulong2(0, 0),
                     bool transpose_matrix = false, MB_SIMD_MATRIX_LOC) {
  const compat_detail::MatrixArgs a{dst, elements_per_row, matrix_origin.x, matrix_origin.y,
                                    transpose_matrix};
  compat_detail::matrix_rendezvous("simdgroup_store", a, loc);
  const uint32_t lane = simt::current_lane();
  for (int i = 0; i < m.kPerLane; ++i)
    dst[compat_detail::matrix_offset(a, m.row(lane), m.col(lane, i))] = m.e[i];
}

template <typename T, int Cols, int Rows>
void simdgroup_multiply_accumulate(simdgroup_matrix<T, Cols, Rows>& d,
                                   const simdgroup_matrix<T, Cols, Rows>& a,
                                   const simdgroup_matrix<T, Cols, Rows>& b,
                                   const simdgroup_matrix<T, Cols, Rows>& c,
                                   MB_SIMD_MATRIX_LOC) {
  using M = simdgroup_matrix<T, Cols, Rows>;
  struct Share {
    T a[M::kPerLane], b[M::kPerLane], c[M::kPerLane];
  } mine;
  for (int i = 0; i < M::kPerLane; ++i) {
    mine.a[i] = a.e[i];
    mine.b[i] = b.e[i];
    mine.c[i] = c.e[i];
  }
  auto g = compat_detail::gather("simdgroup_multiply_accumulate", mine, loc);
  if (g.n != simt::kSimdWidth)
    throw simt::Error("simt: simdgroup_multiply_accumulate in a simdgroup of " +
                      std::to_string(g.n) + " lanes (simdgroup matrices need all 32)");
  const uint32_t lane = simt::current_lane();
  if (lane == 0) simt::count_mma();  // one 8x8x8 op per simdgroup
  float A[8][8], B[8][8], C[8][8];
  for (uint32_t l = 0; l < uint32_t(simt::kSimdWidth); ++l)
    for (int i = 0; i < M::kPerLane; ++i) {
      A[M::row(l)][M::col(l, i)] = float(g.v[l].a[i]);
      B[M::row(l)][M::col(l, i)] = float(g.v[l].b[i]);
      C[M::row(l)][M::col(l, i)] = float(g.v[l].c[i]);
    }
  for (int i = 0; i < M::kPerLane; ++i) {
    const int r = M::row(lane), col = M::col(lane, i);
    float s = C[r][col];
    for (int k = 0; k < 8; ++k) s += A[r][k] * B[k][col];
    d.e[i] = T(s);
  }
}

template <typename T, int Cols, int Rows>
void simdgroup_multiply(simdgroup_matrix<T, Cols, Rows>& d,
                        const simdgroup_matrix<T, Cols, Rows>& a,
                        const simdgroup_matrix<T, Cols, Rows>& b, MB_SIMD_MATRIX_LOC) {
  simdgroup_multiply_accumulate(d, a, b, make_filled_simdgroup_matrix<T, Cols, Rows>(T(0)),
                                loc);
}

#undef MB_SIMD_MATRIX_LOC

}  // namespace metal
