// What the aarch64 harnesses (qmm, repacked, fpm, attn) share: a fatal error
// with the harness's name, and a bounds-checked reader of the case files the
// Python tests write. Each harness defines kHarnessName.
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

// The whole case file at `path`, its 4-byte magic (e.g. "MBQ1") checked and
// consumed: the harness's reader starts at the case count.
inline Reader read_case_file(const char* path, const char* magic) {
  std::FILE* f = std::fopen(path, "rb");
  if (!f) die("cannot open the case file");
  Reader r;
  char chunk[1 << 16];
  for (size_t n; (n = std::fread(chunk, 1, sizeof chunk, f)) > 0;) r.buf.insert(r.buf.end(), chunk, chunk + n);
  std::fclose(f);
  if (std::memcmp(r.take(4), magic, 4) != 0) die("not a case file");
  return r;
}
