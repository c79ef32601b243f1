// Where a test's buffers live and how the library is called on them: the CPU
// backend uses host memory; the CUDA backend (built only when the library has
// its CUDA path) allocates device memory with the plain CUDA runtime, copies
// inputs in and results out. Every data-carrying test runs on each backend.
#pragma once

#include <dlpack/dlpack.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "expertact/expertact.hpp"

namespace eat {

enum class BackendKind {
  kCpu,
  kCuda,       // device 0, a non-default stream
  kCudaOther,  // device 1 while device 0 is current, legacy default stream (needs 2 GPUs)
};

const char* backend_name(BackendKind k);

class Backend {
 public:
  virtual ~Backend() = default;
  virtual BackendKind kind() const = 0;
  virtual expertact::DeviceType device() const = 0;
  virtual int32_t device_id() const = 0;
  virtual DLDevice dl_device() const = 0;
  // 256-byte aligned; nullptr if the memory is not available.
  virtual void* alloc(size_t bytes) = 0;
  virtual void release(void* p) = 0;
  virtual void upload(void* dst, const void* src, size_t bytes) = 0;
  virtual void download(void* dst, const void* src, size_t bytes) = 0;
  virtual void fill(void* dst, uint8_t byte, size_t bytes) = 0;
  // The stream handed to the library (nullptr on the CPU).
  virtual void* stream() = 0;
  // Called after every library call: waits for the work and reports a CUDA
  // error left behind (sticky or not) as a test failure.
  virtual void finish(const char* what) = 0;
};

// Whether the backend can run here; why not in *why ("no GPU" for CUDA).
bool backend_available(BackendKind k, std::string* why);
// The process-wide instance (call only when available).
Backend& backend(BackendKind k);

// Skips the current test when the backend cannot run on this machine.
#define EAT_REQUIRE_BACKEND(kind)                                        \
  do {                                                                   \
    std::string eat_why_;                                                \
    if (!::eat::backend_available((kind), &eat_why_)) GTEST_SKIP() << eat_why_; \
  } while (0)

// An owned buffer on a backend with a host staging image of the same size.
class DeviceBuffer {
 public:
  DeviceBuffer(Backend& be, size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  bool ok() const { return ptr_ != nullptr; }
  char* data() const { return static_cast<char*>(ptr_); }
  size_t size() const { return bytes_; }
  Backend& backend() const { return be_; }

  std::vector<uint8_t> image;  // host copy of the whole buffer
  void upload() { be_.upload(ptr_, image.data(), bytes_); }
  void download() { be_.download(image.data(), ptr_, bytes_); }

 private:
  Backend& be_;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace eat
