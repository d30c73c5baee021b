// The contract between the fused KL kernel (kl.metal) and the host code
// (kl_host.h, cpp/kl/metal.cpp). Plain ints only.
#pragma once

// Per row of reference logits a and candidate logits b (both [rows, V]):
//   KL(P || Q) with P = softmax(a), Q = softmax(b), float32;
//   optionally log-sum-exp of both, first argmax of both, status bits.
struct MbKlParams {
  int rows;
  int V;
  int extras;  // 1: also write lse_q, lse_ref, argmax_q, argmax_ref, status
};

enum MbKlBuffer {
  MB_KL_A = 0,        // reference logits [rows, V]
  MB_KL_B = 1,        // candidate logits [rows, V], same dtype as A
  MB_KL_OUT = 2,      // float32 [rows]: KL(P || Q)
  MB_KL_LSE_Q = 3,    // float32 [rows]   (extras; else bound to OUT)
  MB_KL_LSE_REF = 4,  // float32 [rows]   (extras)
  MB_KL_ARG_Q = 5,    // int32 [rows]     (extras)
  MB_KL_ARG_REF = 6,  // int32 [rows]     (extras)
  MB_KL_STATUS = 7,   // int32 [rows]     (extras)
  MB_KL_PARAMS = 8,   // MbKlParams
};

// Status bits; any set bit makes the row's KL and lse NaN. The same values
// as the CPU kernel's KLStatus (cpp/kl/kernel.h).
enum MbKlStatus {
  MB_KL_NAN_REF = 1,
  MB_KL_NAN_LOGITS = 2,
  MB_KL_POSINF_REF = 4,
  MB_KL_POSINF_LOGITS = 8,
  MB_KL_EMPTY_REF = 16,
  MB_KL_EMPTY_LOGITS = 32,
};

enum MbKlShape {
  MB_KL_THREADS = 256,  // one threadgroup per row
  MB_KL_MAX_SIMDGROUPS = 32,
  // Threadgroup scratch: one reduced state per simdgroup, 10 words each.
  MB_KL_STATE_WORDS = 10,
  MB_KL_TG_FLOATS = 32 * 10,
};
