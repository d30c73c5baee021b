// selftest.metal (the emulator's own test kernels) compiled as C++.
#include "metal_compat.h"
#include "selftest.metal"
