"""The CPU's feature flags as the extension sees them: /proc/cpuinfo's
(empty elsewhere), without the AVX-512 and AVX-VNNI ones when
MIXBITS_ISA=avx2 holds the kernels to AVX2 (cpp/common/cpu.cpp;
tests/test_isa_limit.py). For the tests that check that this machine runs
the kernels its CPU allows."""

import os


def cpu_flags() -> set[str]:
    if not os.path.exists("/proc/cpuinfo"):
        return set()
    flags = set(open("/proc/cpuinfo").read().split())
    if os.environ.get("MIXBITS_ISA") == "avx2":
        flags = {f for f in flags if not f.startswith("avx512") and f != "avx_vnni"}
    return flags
