// The CUDA entry points behind the C++ API: check that every pointer is memory
// of the device the tensors claim, make that device current, dispatch on dtype.
#include <cuda_runtime.h>

#include <initializer_list>

#include "core/error.h"
#include "core/problem.h"
#include "cuda/common.cuh"
#include "cuda/entry.h"
#include "cuda/device.h"

namespace expertact::detail {
namespace {

__global__ void fill_zero_kernel(float* x, int64_t n, int64_t stride) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i * stride] = 0.0f;
}

// A CUDA operand must be device (or managed) memory of device `device`. Catches
// a host pointer labelled CUDA, or a tensor of another GPU, before a kernel
// faults (a fault would poison the caller's CUDA context).
Status check_device_pointer(const char* name, const void* ptr, int device) {
  if (ptr == nullptr) return Status::kOk;
  cudaPointerAttributes attr{};
  cudaError_t e = cudaPointerGetAttributes(&attr, ptr);
  if (e != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it so the caller's next call is clean
    return fail(Status::kInvalidArgument, name, " (", ptr,
                ") is not CUDA device memory: cudaPointerGetAttributes says ",
                cudaGetErrorName(e));
  }
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged)
    return fail(Status::kInvalidArgument, name, " (", ptr,
                ") is not CUDA device memory (memory type ", static_cast<int>(attr.type),
                ": host or unregistered) but was passed as a cuda:", device, " tensor");
  if (attr.type == cudaMemoryTypeDevice && attr.device != device)
    return fail(Status::kInvalidArgument, name, " (", ptr, ") is memory of cuda:", attr.device,
                " but was passed as a cuda:", device, " tensor");
  return Status::kOk;
}

// The oldest driver branch that runs the CUDA runtime linked into this library
// (NVIDIA's minor-version compatibility: CUDA 13.x needs R580, 12.x R525, 11.x R450).
constexpr int kMinDriverBranch = CUDART_VERSION >= 13000 ? 580 : CUDART_VERSION >= 12000 ? 525 : 450;

// The first CUDA call of a process fails here when the driver cannot serve the
// runtime: say which driver is needed instead of the runtime's generic words.
Status no_usable_device(cudaError_t e) {
  if (e == cudaErrorInsufficientDriver) {
    int driver = 0;  // the CUDA version the driver supports; 0: no libcuda.so.1 could be loaded
    cudaDriverGetVersion(&driver);
    if (driver == 0)
      return fail(Status::kCudaError, "no NVIDIA driver found (libcuda.so.1 could not be loaded); "
                  "this build (CUDA runtime ", CUDART_VERSION / 1000, ".", CUDART_VERSION % 1000 / 10,
                  ", linked in) needs driver >= ", kMinDriverBranch, " (cudaErrorInsufficientDriver)");
    return fail(Status::kCudaError, "NVIDIA driver too old for this build (needs >= ", kMinDriverBranch,
                "): it supports CUDA ", driver / 1000, ".", driver % 1000 / 10, ", this library's "
                "CUDA runtime is ", CUDART_VERSION / 1000, ".", CUDART_VERSION % 1000 / 10,
                " (cudaErrorInsufficientDriver)");
  }
  return fail(Status::kCudaError, "no usable CUDA device: cudaGetDeviceCount says ",
              cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}

Status enter_device(int device, cuda::DeviceGuard& guard) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return no_usable_device(e);
  }
  if (device < 0 || device >= count)
    return fail(Status::kInvalidArgument, "device_id ", device, " is not a CUDA device (",
                count, " visible)");
  return cuda::cuda_check(guard.status(), "cudaSetDevice");
}

struct NamedPointer {
  const char* name;
  const void* ptr;
};

// Makes the problem's device current (for the guard's scope) and checks that
// every operand is memory of that device.
Status enter_and_check(int device, cuda::DeviceGuard& guard,
                       std::initializer_list<NamedPointer> operands) {
  EA_TRY(enter_device(device, guard));
  for (const NamedPointer& o : operands) EA_TRY(check_device_pointer(o.name, o.ptr, device));
  return Status::kOk;
}

}  // namespace

Status cuda_forward(const GluProblem& p, const FwdOutput& o, void* stream) {
  cuda::DeviceGuard guard(p.device_id);
  EA_TRY(enter_and_check(p.device_id, guard,
                         {{p.step == 2 || p.u == nullptr ? "gate_up" : "gate", p.g},
                          {"up", p.u},
                          {"weights", p.w},
                          {"out", o.out}}));
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  switch (p.dtype) {
    case DType::kFloat32: return cuda::forward_f32(p, o, st);
    case DType::kFloat16: return cuda::forward_f16(p, o, st);
    case DType::kBFloat16: return cuda::forward_bf16(p, o, st);
  }
  return fail(Status::kInternal, "cuda_forward: unexpected dtype ", static_cast<int>(p.dtype));
}

Status cuda_backward(const GluProblem& p, const BwdIO& io, void* stream) {
  cuda::DeviceGuard guard(p.device_id);
  EA_TRY(enter_and_check(p.device_id, guard,
                         {{"gate", p.g},
                          {"up", p.u},
                          {"weights", p.w},
                          {"grad_out", io.dy},
                          {"grad_gate", io.dg},
                          {"grad_up", io.du},
                          {"grad_weights", io.dw}}));
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  switch (p.dtype) {
    case DType::kFloat32: return cuda::backward_f32(p, io, st);
    case DType::kFloat16: return cuda::backward_f16(p, io, st);
    case DType::kBFloat16: return cuda::backward_bf16(p, io, st);
  }
  return fail(Status::kInternal, "cuda_backward: unexpected dtype ", static_cast<int>(p.dtype));
}

Status cuda_fill_zero(const GluProblem& p, float* dw, int64_t n, int64_t stride, void* stream) {
  cuda::DeviceGuard guard(p.device_id);
  EA_TRY(enter_and_check(p.device_id, guard, {{"grad_weights", dw}}));
  const int threads = 256;
  const int64_t blocks = (n + threads - 1) / threads;
  fill_zero_kernel<<<static_cast<unsigned>(blocks), threads, 0,
                           static_cast<cudaStream_t>(stream)>>>(dw, n, stride);
  return cuda::cuda_check(cudaGetLastError(), "fill_zero kernel launch");
}

// The same entry for the other CUDA entry points (src/cuda/device.h).
Status enter_operands(int device, cuda::DeviceGuard& guard,
                      std::initializer_list<DevicePointer> operands) {
  EA_TRY(enter_device(device, guard));
  for (const DevicePointer& o : operands) EA_TRY(check_device_pointer(o.name, o.ptr, device));
  return Status::kOk;
}

}  // namespace expertact::detail
