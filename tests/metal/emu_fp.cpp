// fp_qmv.metal, unchanged, compiled as C++ for the SIMT emulator.
#include "metal_compat.h"
#include "fp_qmv.metal"
