// CPU and CUDA backends. The CUDA one uses only the CUDA runtime API from C++
// (cudaMalloc / cudaMemcpy / cudaMemset), so the test binary needs no .cu file.
#include "support/backend.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>

#if EXPERTACT_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace eat {

const char* backend_name(BackendKind k) {
  switch (k) {
    case BackendKind::kCpu: return "cpu";
    case BackendKind::kCuda: return "cuda";
    case BackendKind::kCudaOther: return "cuda1";
  }
  return "?";
}

namespace {

class CpuBackend final : public Backend {
 public:
  BackendKind kind() const override { return BackendKind::kCpu; }
  expertact::DeviceType device() const override { return expertact::DeviceType::kCPU; }
  int32_t device_id() const override { return 0; }
  DLDevice dl_device() const override { return DLDevice{kDLCPU, 0}; }
  void* alloc(size_t bytes) override {
    const size_t n = (bytes + 255) / 256 * 256 + 256;
    return ::operator new(n, std::align_val_t{256}, std::nothrow);
  }
  void release(void* p) override { ::operator delete(p, std::align_val_t{256}); }
  void upload(void* dst, const void* src, size_t n) override { std::memcpy(dst, src, n); }
  void download(void* dst, const void* src, size_t n) override { std::memcpy(dst, src, n); }
  void fill(void* dst, uint8_t byte, size_t n) override { std::memset(dst, byte, n); }
  void* stream() override { return nullptr; }
  void finish(const char*) override {}
};

#if EXPERTACT_WITH_CUDA
// A failed runtime call fails the test and unwinds it (gtest catches the throw).
void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::string msg = std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
    ADD_FAILURE() << msg;
    throw std::runtime_error(msg);
  }
}

int cuda_device_count() {
  static const int n = [] {
    int c = 0;
    if (cudaGetDeviceCount(&c) != cudaSuccess) {
      cudaGetLastError();  // clear: no driver or no device is not an error of the library
      return 0;
    }
    return c;
  }();
  return n;
}

class CudaBackend final : public Backend {
 public:
  // dev: where buffers live; device 0 stays current in every case, so a call
  // on dev 1 checks that the library uses the tensor's device.
  CudaBackend(BackendKind k, int dev) : kind_(k), dev_(dev) {
    cuda_ok(cudaSetDevice(0), "cudaSetDevice(0)");
    if (dev_ == 0) {
      cuda_ok(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    }
  }
  BackendKind kind() const override { return kind_; }
  expertact::DeviceType device() const override { return expertact::DeviceType::kCUDA; }
  int32_t device_id() const override { return dev_; }
  DLDevice dl_device() const override { return DLDevice{kDLCUDA, dev_}; }
  void* alloc(size_t bytes) override {
    OnDevice g(dev_);
    void* p = nullptr;
    if (cudaMalloc(&p, bytes == 0 ? 256 : bytes) != cudaSuccess) {
      cudaGetLastError();  // out of memory is reported by the caller (skip), not sticky
      return nullptr;
    }
    return p;  // cudaMalloc aligns to 256 bytes
  }
  void release(void* p) override {
    OnDevice g(dev_);
    cudaFree(p);
  }
  void upload(void* dst, const void* src, size_t n) override {
    cuda_ok(cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
    // From pageable memory cudaMemcpy may return before the DMA lands, and the
    // library's kernels run on a non-blocking stream that does not wait for it.
    OnDevice g(dev_);
    cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize after cudaMemcpy H2D");
  }
  void download(void* dst, const void* src, size_t n) override {
    cuda_ok(cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
  }
  void fill(void* dst, uint8_t byte, size_t n) override {
    OnDevice g(dev_);
    cuda_ok(cudaMemset(dst, byte, n), "cudaMemset");
    cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize after cudaMemset");
  }
  void* stream() override { return stream_; }
  void finish(const char* what) override {
    if (stream_) cuda_ok(cudaStreamSynchronize(stream_), what);
    {
      OnDevice g(dev_);
      cuda_ok(cudaDeviceSynchronize(), what);
    }
    // Nothing may be left behind, and device 0 must still be current.
    cuda_ok(cudaGetLastError(), what);
    int cur = -1;
    cuda_ok(cudaGetDevice(&cur), "cudaGetDevice");
    EXPECT_EQ(cur, 0) << what << " changed the current CUDA device";
  }

 private:
  struct OnDevice {
    explicit OnDevice(int d) {
      cudaGetDevice(&prev);
      if (d != prev) cudaSetDevice(d);
    }
    ~OnDevice() { cudaSetDevice(prev); }
    int prev = 0;
  };
  BackendKind kind_;
  int dev_;
  cudaStream_t stream_ = nullptr;
};
#endif  // EXPERTACT_WITH_CUDA

}  // namespace

bool backend_available(BackendKind k, std::string* why) {
  if (k == BackendKind::kCpu) return true;
#if EXPERTACT_WITH_CUDA
  const int need = k == BackendKind::kCudaOther ? 2 : 1;
  if (cuda_device_count() >= need) return true;
  if (why) *why = need == 1 ? "no GPU" : "no GPU: needs 2 GPUs";
  return false;
#else
  if (why) *why = "no GPU";
  return false;
#endif
}

Backend& backend(BackendKind k) {
  static CpuBackend cpu;
  if (k == BackendKind::kCpu) return cpu;
#if EXPERTACT_WITH_CUDA
  if (k == BackendKind::kCuda) {
    static CudaBackend cuda(BackendKind::kCuda, 0);
    return cuda;
  }
  static CudaBackend other(BackendKind::kCudaOther, 1);
  return other;
#else
  throw std::logic_error("backend(): CUDA backend requested in a build without CUDA");
#endif
}

DeviceBuffer::DeviceBuffer(Backend& be, size_t bytes) : be_(be), bytes_(bytes) {
  ptr_ = be_.alloc(bytes);
  if (ptr_) image.assign(bytes, 0);
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_) be_.release(ptr_);
}

}  // namespace eat
