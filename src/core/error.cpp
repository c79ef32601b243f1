// The thread-local last-error message and the formatting of values inside messages.
#include "core/error.h"

#include <cmath>
#include <cstdio>

namespace expertact::detail {
namespace {
thread_local std::string g_last_error;
}

void set_error(Status, std::string msg) { g_last_error = std::move(msg); }
void clear_error() { g_last_error.clear(); }

std::string to_str(const char* s) { return s ? std::string(s) : std::string("(null)"); }
std::string to_str(const std::string& s) { return s; }
std::string to_str(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}
std::string to_str(float v) { return to_str(static_cast<double>(v)); }
std::string to_str(long long v) { return std::to_string(v); }
std::string to_str(long v) { return std::to_string(v); }
std::string to_str(int v) { return std::to_string(v); }
std::string to_str(unsigned long v) { return std::to_string(v); }
std::string to_str(unsigned long long v) { return std::to_string(v); }
std::string to_str(unsigned v) { return std::to_string(v); }
std::string to_str(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", p);
  return buf;
}
std::string to_str(DType d) {
  switch (d) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat64: return "float64";
    case DType::kFloat8E4M3: return "float8_e4m3fn";
  }
  return "dtype(" + std::to_string(static_cast<int>(d)) + ")";
}
std::string to_str(DeviceType d) {
  switch (d) {
    case DeviceType::kCPU: return "cpu";
    case DeviceType::kCUDA: return "cuda";
  }
  return "device_type(" + std::to_string(static_cast<int>(d)) + ")";
}
std::string to_str(Layout l) {
  switch (l) {
    case Layout::kSeparate: return "separate";
    case Layout::kHalves: return "halves";
    case Layout::kHalvesUpFirst: return "halves_up_first";
    case Layout::kInterleaved: return "interleaved";
  }
  return "layout(" + std::to_string(static_cast<int>(l)) + ")";
}

}  // namespace expertact::detail

namespace expertact {
const char* last_error() { return detail::g_last_error.c_str(); }
}  // namespace expertact
