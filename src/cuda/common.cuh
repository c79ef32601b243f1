// CUDA helpers shared by the launchers: storage types and their float
// conversions, aligned vector packs, error checking and the device guard.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "core/dispatch.h"
#include "core/error.h"

namespace expertact::cuda {

template <DType D> struct Storage;
template <> struct Storage<DType::kFloat32> { using type = float; };
template <> struct Storage<DType::kFloat16> { using type = __half; };
template <> struct Storage<DType::kBFloat16> { using type = __nv_bfloat16; };

// fn(T{}) with T the storage type of dtype d (float, __half, __nv_bfloat16).
template <typename Fn>
Status dispatch_storage(DType d, Fn&& fn) {
  return detail::dispatch_dtype(d, [&](auto tag) { return fn(typename Storage<decltype(tag)::value>::type{}); });
}

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// N elements moved as one access of N * sizeof(T) bytes (up to 16; 32 bytes
// become two 16-byte accesses). The host proves the alignment before choosing N.
template <typename T, int N>
struct alignas(sizeof(T) * N > 16 ? 16 : sizeof(T) * N) Pack {
  T v[N];
};

// Value i of a pack as float. 16-bit bfloat16 by its 32-bit words: the high value masked, the
// low one shifted up, one instruction each, where __bfloat162float on a value taken out of the
// word costs two for the high one (a byte permute, then the shift). Exact either way.
template <typename T, int N>
__device__ __forceinline__ float pack_f(const Pack<T, N>& p, int i) {
  if constexpr (std::is_same_v<T, __nv_bfloat16> && N % 2 == 0) {
    const uint32_t w = reinterpret_cast<const uint32_t*>(p.v)[i / 2];
    return __uint_as_float(i % 2 ? w & 0xffff0000u : w << 16);
  } else {
    return to_f(p.v[i]);
  }
}

// Sets the message and returns kCudaError when a CUDA call failed.
inline Status cuda_check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::kOk;
  return detail::fail(Status::kCudaError, what, " failed: ", cudaGetErrorName(e), " (",
                      cudaGetErrorString(e), ")");
}

// Makes `device` current for the scope and restores the caller's device after.
// Both cudaSetDevice calls are skipped when `device` already is current (the
// usual case: a framework makes the tensors' device current), so that costs one
// cudaGetDevice per call.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) {
      cudaGetLastError();
      prev_ = -1;
    }
    if (prev_ != device) {
      status_ = cudaSetDevice(device);
      restore_ = status_ == cudaSuccess && prev_ >= 0;
    }
  }
  ~DeviceGuard() {
    if (restore_) cudaSetDevice(prev_);
  }
  cudaError_t status() const { return status_; }

 private:
  int prev_ = -1;
  bool restore_ = false;
  cudaError_t status_ = cudaSuccess;
};

// A hint that [p, p + bytes) will be read soon: on sm_90 one bulk prefetch into L2 (p and bytes
// must be multiples of 16, the range inside one allocation: the caller checks); elsewhere
// nothing. It changes no result, only when
// the bytes leave DRAM: a kernel that holds too little in flight to cover DRAM's latency asks
// for the rows it reads a step or two ahead.
__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#else
  (void)p, (void)bytes;
#endif
}

// Bytes (4, 8 or 16) copied from global src to shared dst without passing through registers
// (cp.async, sm_80 on; earlier: an ordinary copy). Both aligned to Bytes. The issuing thread
// groups its copies with cp_async_commit and waits with cp_async_wait<n> (all but the newest n
// groups complete): only then may it read dst, and other threads only after a barrier.
template <int Bytes>
__device__ __forceinline__ void cp_async(void* dst, const void* src) {
  static_assert(Bytes == 4 || Bytes == 8 || Bytes == 16, "cp.async copies 4, 8 or 16 bytes");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  if constexpr (Bytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(d), "l"(src), "n"(Bytes) : "memory");
  }
#else
  struct alignas(Bytes) B { unsigned char b[Bytes]; };
  *static_cast<B*>(dst) = *static_cast<const B*>(src);
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

}  // namespace expertact::cuda
