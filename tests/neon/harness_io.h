// What the aarch64 harnesses (qmm_harness.cpp, repacked_harness.cpp) share:
// a fatal error with the harness's name, and a bounds-checked reader of the
// case files the Python tests write. Each harness defines kHarnessName.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

extern const char* const kHarnessName;

[[noreturn]] inline void die(const char* what, int code = 2) {
  std::fprintf(stderr, "%s: %s\n", kHarnessName, what);
  std::exit(code);
}

struct Reader {
  std::vector<char> buf;
  size_t at = 0;
  const char* take(size_t n) {
    if (at + n > buf.size()) die("truncated case file");
    at += n;
    return buf.data() + at - n;
  }
  int32_t i32() {
    int32_t v;
    std::memcpy(&v, take(4), 4);
    return v;
  }
};
