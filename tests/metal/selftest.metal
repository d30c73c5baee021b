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

MB_INSTANTIATE_KERNEL("st_group_sum", st_group_sum, 0)
MB_INSTANTIATE_KERNEL("st_reverse", st_reverse, 0)
MB_INSTANTIATE_KERNEL("st_reverse_no_barrier", st_reverse_no_barrier, 0)
MB_INSTANTIATE_KERNEL("st_shuffles", st_shuffles, 0)
MB_INSTANTIATE_KERNEL("st_divergent_sum", st_divergent_sum, 0)
MB_INSTANTIATE_KERNEL("st_split_sum", st_split_sum, 0)
MB_INSTANTIATE_KERNEL("st_early_return", st_early_return, 0)
MB_INSTANTIATE_KERNEL("st_barrier_mismatch", st_barrier_mismatch, 0)
MB_INSTANTIATE_KERNEL("st_bad_lane", st_bad_lane, 0)
MB_INSTANTIATE_KERNEL("st_write_past_end", st_write_past_end, 0)
