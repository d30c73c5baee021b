// The contract between the fused KL kernel (kl.metal) and the host code
// (kl_host.h, cpp/kl/metal.cpp). Plain ints only.
#pragma once

// Per row of reference a and candidate logits b (both [rows, V]): KL(P || Q)
// with Q = softmax(b) and, by mode,
//   LOGITS:      P = softmax(a);
//   FIXED_SHIFT: P = softmax(a), the row's max of a given (row_param), so
//                the reference side is never rebased;
//   PROBS:       a holds non-negative weights proportional to P and
//                row_param the row's negH = sum p log p as a float32 pair
//                hi + lo ([rows, 2]; one float32 would cost ~5e-7 on
//                every KL).
// The same modes, row parameters and outputs as the CPU primitive
// (cpp/kl/kl.h, whose builder takes the pair's width from here).
enum MbKlMode { MB_KL_MODE_LOGITS = 0, MB_KL_MODE_FIXED_SHIFT = 1, MB_KL_MODE_PROBS = 2 };

// float32 words of the row parameter per row, by mode.
enum MbKlParamWords {
  MB_KL_FIXED_SHIFT_PARAM_WORDS = 1,
  MB_KL_PROBS_PARAM_WORDS = 2,
};

struct MbKlParams {
  int rows;
  int V;
  int mode;  // MbKlMode
};

// Buffer indices; the outputs (3..8) are in the CPU primitive's output order.
enum MbKlBuffer {
  MB_KL_A = 0,          // reference [rows, V]
  MB_KL_B = 1,          // candidate logits [rows, V] (any float dtype)
  MB_KL_ROW_PARAM = 2,  // float32 [rows] shift, or [rows, 2] negH hi + lo
  MB_KL_OUT = 3,        // float32 [rows]: KL(P || Q), NaN where status != 0
  MB_KL_STATUS = 4,     // int32 [rows]: MbKlStatus bits
  MB_KL_ARG_Q = 5,      // int32 [rows]: first index of max b
  MB_KL_LSE_Q = 6,      // float32 [rows]: log-sum-exp of b
  MB_KL_ARG_REF = 7,    // int32 [rows]: first index of max a (LOGITS), else -1
  MB_KL_LSE_REF = 8,    // float32 [rows]: log-sum-exp of a (NaN in PROBS)
  MB_KL_PARAMS = 9,     // MbKlParams
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
  MB_KL_NEG_WEIGHT = 64,
};

enum MbKlShape {
  MB_KL_THREADS = 256,  // one threadgroup per row
  MB_KL_MAX_SIMDGROUPS = 32,
  // Threadgroup scratch: one reduced state per simdgroup, 14 words each.
  MB_KL_STATE_WORDS = 14,
  MB_KL_TG_FLOATS = 32 * 14,
};
