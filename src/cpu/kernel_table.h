// The CPU kernels of one instruction set as a table of function pointers: each
// kernel translation unit (glu_cpu.cpp baseline, glu_cpu_avx2.cpp) fills one,
// and glu_cpu.cpp picks a table once, at run time, from what the CPU supports.
#pragma once

#include <cstdint>

#include "core/problem.h"

namespace expertact::cpu {

// Columns per block: a row is processed (and split between threads) in blocks of
// this many elements. Five float32 block buffers (backward) take 5 KiB of L1.
// 256 and 512 cost the same in cache; from DRAM with 2 threads 256 was ahead in
// 11 of 18 size x layout x direction pairs (docs/notes/perf-notes.md, "CPU path").
constexpr int64_t kBlock = 256;

// Rows [r0, r1), columns [c0, c1) (c0 and c1 multiples of kBlock, or c1 = F).
// stream: store the results with non-temporal (cache-bypassing) stores, for
// outputs too large to stay in the cache anyway: the store then costs no read of
// the line first (x86-64 only; elsewhere it is ignored).
using FwdKernel = void (*)(const detail::GluProblem& p, const detail::FwdOutput& o, int64_t r0,
                           int64_t r1, int64_t c0, int64_t c1, bool stream);
// The same for backward. With the weight gradient wanted: block_sums == nullptr
// writes each row's sum to io.dw (the range must then be whole rows); otherwise
// the sum of block b (columns [b * kBlock, ...)) goes to block_sums[b], for the
// caller to add up in block order, so that a row split between threads sums
// exactly as a whole one.
using BwdKernel = void (*)(const detail::GluProblem& p, const detail::BwdIO& io, int64_t r0,
                           int64_t r1, int64_t c0, int64_t c1, float* block_sums, bool stream);

// The last index, clamped, is the problem's has_limit: with limit = +inf as a
// compile-time constant the clamps and gradient masks fold away (backward's
// AVX2 loop: 49 -> 35 instructions per 8 elements).
struct KernelTable {
  const char* isa;
  FwdKernel fwd[3][2][2][2][2];     // [dtype][act][step - 1][weighted][clamped]
  BwdKernel bwd[3][2][2][2][2][2];  // [dtype][act][step - 1][weighted][want weight gradient][clamped]
};

// The portable kernels (any x86-64, or the target's baseline elsewhere).
const KernelTable& baseline_kernels();
// AVX2 + FMA + F16C kernels; nullptr when this build has none (not x86-64, or a
// compiler without GCC-style target flags). The caller checks the CPU.
const KernelTable* avx2_kernels();

}  // namespace expertact::cpu
