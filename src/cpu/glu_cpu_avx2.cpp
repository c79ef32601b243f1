// The CPU kernels built for AVX2 + FMA + F16C: CMake compiles this file with
// -mavx2 -mfma -mf16c on x86-64, and glu_cpu.cpp calls them only on a CPU that has
// all three. Elsewhere (another architecture, or no such flags) it has no kernels.
#include "cpu/kernel_table.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "cpu/glu_cpu_kernels.h"

namespace expertact::cpu {
const KernelTable* avx2_kernels() {
  static const KernelTable table = make_table("avx2+fma+f16c");
  return &table;
}
}  // namespace expertact::cpu

#else

namespace expertact::cpu {
const KernelTable* avx2_kernels() { return nullptr; }
}  // namespace expertact::cpu

#endif
