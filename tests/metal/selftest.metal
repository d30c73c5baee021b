// Kernels that test the emulator itself: correct ones whose results the
// tests check, and deliberately wrong ones (a missing barrier, divergent
// simd ops, a barrier skipped by some threads) that must fail. Written as
// Metal, compiled here through metal_compat.h like the real kernels.
#include "mixbits_metal.h"

#define ST_ARGS                                             \
  const device float* in [[buffer(0)]],                     \
      device float* out [[buffer(1)]],                      \
      threadgroup float* tg [[threadgroup(0)]],             \
      uint3 tgid [[threadgroup_position_in_grid]],          \
      uint lid [[thread_index_in_threadgroup]],             \
      uint3 tsize [[threads_per_threadgroup]],              \
      uint simd_gid [[simdgroup_index_in_threadgroup]],     \
      uint simd_lid [[thread_index_in_simdgroup]]

// out[group] = sum of the group's inputs: simd_sum, stash per simdgroup,
// barrier, simd_sum of the stashes.
template <int unused>
[[kernel]] void st_group_sum(ST_ARGS) {
  const uint gid = tgid.x * tsize.x + lid;
  float v = simd_sum(in[gid]);
  if (simd_lid == 0) tg[simd_gid] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (simd_gid == 0) {
    float w = simd_lid * 32 < tsize.x ? tg[simd_lid] : 0.0f;
    w = simd_sum(w);
    if (simd_lid == 0) out[tgid.x] = w;
  }
}

// out = the group's inputs reversed, through threadgroup memory.
template <int unused>
[[kernel]] void st_reverse(ST_ARGS) {
  const uint gid = tgid.x * tsize.x + lid;
  tg[lid] = in[gid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[gid] = tg[tsize.x - 1 - lid];
}

// WRONG: st_reverse without the barrier; a thread reads a slot that the
// mirrored thread may not have written yet.
template <int unused>
[[kernel]] void st_reverse_no_barrier(ST_ARGS) {
  const uint gid = tgid.x * tsize.x + lid;
  tg[lid] = in[gid];
  out[gid] = tg[tsize.x - 1 - lid];
}

// Per thread: shuffle_down 3, shuffle_xor 5, broadcast lane 7, simd_max,
// shuffle_up 2, simd_min: six results per thread.
template <int unused>
[[kernel]] void st_shuffles(ST_ARGS) {
  const uint gid = tgid.x * tsize.x + lid;
  const float v = in[gid];
  out[gid * 6 + 0] = simd_shuffle_down(v, 3);
  out[gid * 6 + 1] = simd_shuffle_xor(v, 5);
  out[gid * 6 + 2] = simd_broadcast(v, 7);
  out[gid * 6 + 3] = simd_max(v);
  out[gid * 6 + 4] = simd_shuffle_up(v, 2);
  out[gid * 6 + 5] = simd_min(v);
}

// WRONG: only even lanes reach the simd_sum.
template <int unused>
[[kernel]] void st_divergent_sum(ST_ARGS) {
  const uint gid = tgid.x * tsize.x + lid;
  float v = in[gid];
  if (simd_lid % 2 == 0) v = simd_sum(v);
  out[gid] = v;
}

// WRONG: the two halves of each simdgroup call different simd_sums.
template <int unused>
[[kernel]] void st_split_sum(ST_ARGS) {
  const uint gid = tgid.x * tsize.x + lid;
  float v = in[gid];
  if (simd_lid < 16) {
    v = simd_sum(v);
  } else {
    v = simd_sum(2.0f * v);
  }
  out[gid] = v;
}

// WRONG: all but the first simdgroup return before the barrier.
template <int unused>
[[kernel]] void st_early_return(ST_ARGS) {
  const uint gid = tgid.x * tsize.x + lid;
  if (simd_gid > 0) return;
  tg[lid] = in[gid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[gid] = tg[31 - lid];
}

// WRONG: the first simdgroup waits at one barrier, the rest at another.
template <int unused>
[[kernel]] void st_barrier_mismatch(ST_ARGS) {
  const uint gid = tgid.x * tsize.x + lid;
  tg[lid] = in[gid];
  if (simd_gid == 0) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  } else {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[gid] = tg[tsize.x - 1 - lid];
}

// WRONG: reads a lane that does not exist.
template <int unused>
[[kernel]] void st_bad_lane(ST_ARGS) {
  const uint gid = tgid.x * tsize.x + lid;
  out[gid] = simd_shuffle(in[gid], ushort(40));
}

// WRONG: the last threadgroup writes one threadgroup past the end of out.
template <int unused>
[[kernel]] void st_write_past_end(ST_ARGS) {
  const uint gid = tgid.x * tsize.x + lid;
  out[gid + tsize.x] = in[gid];
}

// ---- simdgroup matrices ----------------------------------------------------
// 128 threads copy `in` into threadgroup memory, read there as an 8 x 16
// st_reverse with one planted extra device read per threadgroup: thread 0
// also reads its group's last input (already read by another thread), and
// adds 0 times it (kept: 0 * x is not 0 for every float). The traffic
// counters must see 4 more bytes read per group, and no new distinct byte.
template <int unused>
[[kernel]] void st_reverse_extra_read(ST_ARGS) {
  const uint gid = tgid.x * tsize.x + lid;
  tg[lid] = in[gid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float extra = lid == 0 ? 0.0f * in[tgid.x * tsize.x + tsize.x - 1] : 0.0f;
  out[gid] = tg[tsize.x - 1 - lid] + extra;
}

// Loads of every width the traffic counters tell apart: thread i reads
// byte 4i, the 2-byte half-word 2i, float i, and (even i) the 8-byte word
// i / 2 of `in`, so a group of n threads reads n, 2n, 4n and 4n bytes at
// widths 1, 2, 4, 8, and every input byte at least once.
template <int unused>
[[kernel]] void st_load_widths(ST_ARGS) {
  const uint gid = tgid.x * tsize.x + lid;
  const device uchar* b = (const device uchar*)in;
  const device ushort* h = (const device ushort*)in;
  const device ulong* q = (const device ulong*)in;
  float v = float(b[4 * gid]) + float(h[2 * gid]) + in[gid];
  if (gid % 2 == 0) v += float(q[gid / 2] & 1ul);
  out[gid] = v;
}

// row-major matrix T = [L | R] (two 8x8 blocks). Each simdgroup s computes
// one product and stores it into the right half (columns 8..15) of its own
// 8 x 16 region out[128 s ...], leaving the left half untouched:
//   s = 0: L R + 1 (filled)     R loaded with an origin, (8, 0)
//   s = 1: Rᵀ L + 2 I           Rᵀ by a transposed load
//   s = 2: (L L + R)ᵀ           stored transposed
//   s = 3: R R + L              L loaded as the accumulator
template <int unused>
[[kernel]] void st_sgmm(ST_ARGS) {
  const uint gid = tgid.x * tsize.x + lid;
  tg[lid] = in[gid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_float8x8 L, R, D;
  simdgroup_load(L, tg, 16);
  simdgroup_load(R, tg, 16, ulong2(8, 0));
  device float* o = out + 128 * simd_gid;
  if (simd_gid == 0) {
    simdgroup_multiply_accumulate(D, L, R, make_filled_simdgroup_matrix<float, 8, 8>(1.0f));
    simdgroup_store(D, o, 16, ulong2(8, 0));
  } else if (simd_gid == 1) {
    simdgroup_float8x8 Rt;
    simdgroup_load(Rt, tg + 8, 16, ulong2(0, 0), true);
    simdgroup_multiply_accumulate(D, Rt, L, simdgroup_float8x8(2.0f));
    simdgroup_store(D, o, 16, ulong2(8, 0));
  } else if (simd_gid == 2) {
    simdgroup_multiply_accumulate(D, L, L, R);
    simdgroup_store(D, o + 8, 16, ulong2(0, 0), true);
  } else {
    simdgroup_multiply_accumulate(D, R, R, L);
    simdgroup_store(D, o, 16, ulong2(8, 0));
  }
}

// WRONG: st_sgmm's simdgroup 0 product with R loaded one column early
// (origin (7, 0)); every simdgroup computes it.
template <int unused>
[[kernel]] void st_sgmm_wrong_origin(ST_ARGS) {
  const uint gid = tgid.x * tsize.x + lid;
  tg[lid] = in[gid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_float8x8 L, R, D;
  simdgroup_load(L, tg, 16);
  simdgroup_load(R, tg, 16, ulong2(7, 0));
  simdgroup_multiply_accumulate(D, L, R, make_filled_simdgroup_matrix<float, 8, 8>(1.0f));
  simdgroup_store(D, out + 128 * simd_gid, 16, ulong2(8, 0));
}

// WRONG: as st_sgmm_wrong_origin with the right origin but no barrier
// between filling threadgroup memory and the simdgroup loads, which read
// elements other simdgroups write.
template <int unused>
[[kernel]] void st_sgmm_no_barrier(ST_ARGS) {
  const uint gid = tgid.x * tsize.x + lid;
  tg[lid] = in[gid];
  simdgroup_float8x8 L, R, D;
  simdgroup_load(L, tg, 16);
  simdgroup_load(R, tg, 16, ulong2(8, 0));
  simdgroup_multiply_accumulate(D, L, R, make_filled_simdgroup_matrix<float, 8, 8>(1.0f));
  simdgroup_store(D, out + 128 * simd_gid, 16, ulong2(8, 0));
}

// WRONG: simdgroup 0 stores L into threadgroup memory and each lane reads
// elements back without a barrier (other lanes' stores are not yet
// visible). 64 threads, one threadgroup: both simdgroups store the same
// 8x8 matrix `in`, and thread t reads element 63 - t.
template <int unused>
[[kernel]] void st_sgmm_store_no_barrier(ST_ARGS) {
  simdgroup_float8x8 L;
  simdgroup_load(L, in, 8);
  simdgroup_store(L, tg, 8);
  out[lid] = tg[63 - lid];
}

// The same with a simdgroup barrier (each simdgroup stored the whole
// matrix itself): out[t] = in[63 - t].
template <int unused>
[[kernel]] void st_sgmm_store_barrier(ST_ARGS) {
  simdgroup_float8x8 L;
  simdgroup_load(L, in, 8);
  simdgroup_store(L, tg, 8);
  simdgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = tg[63 - lid];
}

// WRONG: only half the lanes load.
template <int unused>
[[kernel]] void st_sgmm_divergent(ST_ARGS) {
  simdgroup_float8x8 L = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  if (simd_lid < 16) simdgroup_load(L, in, 8);
  simdgroup_store(L, out, 8);
}

// WRONG: lanes pass different origins to one load.
template <int unused>
[[kernel]] void st_sgmm_lane_args(ST_ARGS) {
  simdgroup_float8x8 L;
  simdgroup_load(L, in, 8, ulong2(0, simd_lid % 2));
  simdgroup_store(L, out, 8);
}

MB_INSTANTIATE_KERNEL("st_group_sum", st_group_sum, 0)
MB_INSTANTIATE_KERNEL("st_reverse", st_reverse, 0)
MB_INSTANTIATE_KERNEL("st_reverse_extra_read", st_reverse_extra_read, 0)
MB_INSTANTIATE_KERNEL("st_load_widths", st_load_widths, 0)
MB_INSTANTIATE_KERNEL("st_reverse_no_barrier", st_reverse_no_barrier, 0)
MB_INSTANTIATE_KERNEL("st_shuffles", st_shuffles, 0)
MB_INSTANTIATE_KERNEL("st_divergent_sum", st_divergent_sum, 0)
MB_INSTANTIATE_KERNEL("st_split_sum", st_split_sum, 0)
MB_INSTANTIATE_KERNEL("st_early_return", st_early_return, 0)
MB_INSTANTIATE_KERNEL("st_barrier_mismatch", st_barrier_mismatch, 0)
MB_INSTANTIATE_KERNEL("st_bad_lane", st_bad_lane, 0)
MB_INSTANTIATE_KERNEL("st_write_past_end", st_write_past_end, 0)
MB_INSTANTIATE_KERNEL("st_sgmm", st_sgmm, 0)
MB_INSTANTIATE_KERNEL("st_sgmm_wrong_origin", st_sgmm_wrong_origin, 0)
MB_INSTANTIATE_KERNEL("st_sgmm_no_barrier", st_sgmm_no_barrier, 0)
MB_INSTANTIATE_KERNEL("st_sgmm_store_no_barrier", st_sgmm_store_no_barrier, 0)
MB_INSTANTIATE_KERNEL("st_sgmm_store_barrier", st_sgmm_store_barrier, 0)
MB_INSTANTIATE_KERNEL("st_sgmm_divergent", st_sgmm_divergent, 0)
MB_INSTANTIATE_KERNEL("st_sgmm_lane_args", st_sgmm_lane_args, 0)
