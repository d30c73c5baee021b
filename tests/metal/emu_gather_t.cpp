// gather_qmv_t.metal, unchanged, compiled as C++ for the SIMT emulator.
#include "metal_compat.h"
#include "gather_qmv_t.metal"
