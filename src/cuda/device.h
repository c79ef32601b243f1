// Entering the tensors' device for a launch, for every CUDA entry point beyond the
// activation's own (src/cuda/glu_cuda.cu): make it current for the guard's scope and
// prove that every operand is memory of it (a host pointer or another GPU's memory
// would fault in the kernel and poison the caller's CUDA context).
#pragma once

#include <initializer_list>

#include "cuda/common.cuh"

namespace expertact::detail {

struct DevicePointer {
  const char* name;
  const void* ptr;  // nullptr: an absent optional operand, skipped
};

Status enter_operands(int device, cuda::DeviceGuard& guard,
                      std::initializer_list<DevicePointer> operands);

}  // namespace expertact::detail
