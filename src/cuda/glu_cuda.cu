// The CUDA entry points behind the C++ API: check that every pointer is memory
// of the device the tensors claim, make that device current, dispatch on dtype.
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>

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

// The number of visible devices is fixed for the life of the process (the
// runtime reads CUDA_VISIBLE_DEVICES once, when it initialises): asked once, and
// asked again only while it fails, so that the failure is reported each time.
cudaError_t visible_devices(int& count) {
  static const int cached = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();
      return -1;
    }
    return n;
  }();
  if (cached >= 0) {
    count = cached;
    return cudaSuccess;
  }
  return cudaGetDeviceCount(&count);
}

Status enter_device(int device, cuda::DeviceGuard& guard) {
  int count = 0;
  cudaError_t e = visible_devices(count);
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
// every operand is memory of that device. A pointer equal to an earlier
// operand's (an in-place gradient is its input's pointer) is not asked again:
// cudaPointerGetAttributes is the costly part of the host path here.
Status enter_and_check(int device, cuda::DeviceGuard& guard,
                       std::initializer_list<NamedPointer> operands) {
  EA_TRY(enter_device(device, guard));
  for (auto it = operands.begin(); it != operands.end(); ++it) {
    bool seen = false;
    for (auto prev = operands.begin(); prev != it && !seen; ++prev) seen = prev->ptr == it->ptr;
    if (!seen) EA_TRY(check_device_pointer(it->name, it->ptr, device));
  }
  return Status::kOk;
}

// EXPERTACT_CUDA_KERNEL (auto | rows | flat; unset: cuda::kDefaultKernel),
// read once per process. An unknown value fails every CUDA call, naming it,
// rather than timing something other than what was asked for.
Status kernel_choice(cuda::KernelChoice& k) {
  struct Parsed {
    bool ok = true;
    cuda::KernelChoice k = cuda::kDefaultKernel;
    std::string value;
  };
  static const Parsed parsed = [] {
    Parsed r;
    const char* env = std::getenv("EXPERTACT_CUDA_KERNEL");
    if (env == nullptr || env[0] == '\0') return r;
    r.value = env;
    if (std::strcmp(env, "auto") == 0) r.k = cuda::KernelChoice::kAuto;
    else if (std::strcmp(env, "rows") == 0) r.k = cuda::KernelChoice::kRows;
    else if (std::strcmp(env, "flat") == 0) r.k = cuda::KernelChoice::kFlat;
    else r.ok = false;
    return r;
  }();
  if (!parsed.ok)
    return fail(Status::kInvalidArgument, "EXPERTACT_CUDA_KERNEL=", parsed.value,
                " is not one of auto, rows, flat");
  k = parsed.k;
  return Status::kOk;
}

// The weight gradient of an F == 0 backward: zero per row (the only operand checked is
// grad_weights, the only one touched).
Status zero_weight_gradient(const GluProblem& p, const BwdIO& io, void* stream) {
  float* dw = io.dw;
  const int64_t n = p.rows, stride = io.dw_stride;
  cuda::DeviceGuard guard(p.device_id);
  EA_TRY(enter_and_check(p.device_id, guard, {{"grad_weights", dw}}));
  const int threads = 256;
  const int64_t blocks = (n + threads - 1) / threads;
  fill_zero_kernel<<<static_cast<unsigned>(blocks), threads, 0,
                     static_cast<cudaStream_t>(stream)>>>(dw, n, stride);
  return cuda::cuda_check(cudaGetLastError(), "fill_zero kernel launch");
}

}  // namespace

Status cuda_forward(const GluProblem& p, const FwdOutput& o, void* stream) {
  cuda::DeviceGuard guard(p.device_id);
  // For a packed layout up lies inside gate_up's view, which is checked.
  EA_TRY(enter_and_check(p.device_id, guard,
                         {{p.packed ? "gate_up" : "gate", p.g},
                          {"up", p.packed ? nullptr : p.u},
                          {"weights", p.w},
                          {"out", o.out}}));
  cuda::KernelChoice k;
  EA_TRY(kernel_choice(k));
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  switch (p.dtype) {
    case DType::kFloat32: return cuda::forward_f32(p, o, k, st);
    case DType::kFloat16: return cuda::forward_f16(p, o, k, st);
    case DType::kBFloat16: return cuda::forward_bf16(p, o, k, st);
    default: break;
  }
  return fail(Status::kInternal, "cuda_forward: unexpected dtype ", static_cast<int>(p.dtype));
}

Status cuda_backward(const GluProblem& p, const BwdIO& io, void* stream) {
  if (p.F == 0) return zero_weight_gradient(p, io, stream);
  cuda::DeviceGuard guard(p.device_id);
  // Packed: up and grad_up lie inside the gate_up and grad_gate_up views.
  EA_TRY(enter_and_check(p.device_id, guard,
                         {{p.packed ? "gate_up" : "gate", p.g},
                          {"up", p.packed ? nullptr : p.u},
                          {"weights", p.w},
                          {"grad_out", io.dy},
                          {p.packed ? "grad_gate_up" : "grad_gate", io.dg},
                          {"grad_up", p.packed ? nullptr : io.du},
                          {"grad_weights", io.dw}}));
  cuda::KernelChoice k;
  EA_TRY(kernel_choice(k));
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  switch (p.dtype) {
    case DType::kFloat32: return cuda::backward_f32(p, io, k, st);
    case DType::kFloat16: return cuda::backward_f16(p, io, k, st);
    case DType::kBFloat16: return cuda::backward_bf16(p, io, k, st);
    default: break;
  }
  return fail(Status::kInternal, "cuda_backward: unexpected dtype ", static_cast<int>(p.dtype));
}

// The same entry for the other CUDA entry points (src/cuda/device.h).
Status enter_operands(int device, cuda::DeviceGuard& guard,
                      std::initializer_list<DevicePointer> operands) {
  EA_TRY(enter_device(device, guard));
  for (const DevicePointer& o : operands) EA_TRY(check_device_pointer(o.name, o.ptr, device));
  return Status::kOk;
}

}  // namespace expertact::detail
