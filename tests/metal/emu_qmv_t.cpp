// qmatmul_t.metal, unchanged, compiled as C++ for the SIMT emulator.
#include "metal_compat.h"
#include "qmatmul_t.metal"
