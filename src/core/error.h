// Status helpers: one thread-local last-error message shared by the C++ API and the C ABI.
#pragma once

#include <string>

#include "expertact/expertact.hpp"

namespace expertact::detail {

// Records the message for last_error() and returns the status, so that a check reads
//   if (bad) return fail(Status::kInvalidArgument, "x.rows must be ... (got ", n, ")");
void set_error(Status s, std::string msg);
void clear_error();

template <typename... Args>
Status fail(Status s, const Args&... parts);

std::string to_str(const char* s);
std::string to_str(const std::string& s);
std::string to_str(double v);
std::string to_str(float v);
std::string to_str(long long v);
std::string to_str(long v);
std::string to_str(int v);
std::string to_str(unsigned long v);
std::string to_str(unsigned long long v);
std::string to_str(unsigned v);
std::string to_str(const void* p);
std::string to_str(DType d);
std::string to_str(DeviceType d);
std::string to_str(Layout l);

// Returns from the calling function when expr (a Status) is not kOk.
#define EA_TRY(expr)                        \
  do {                                      \
    Status ea_s_ = (expr);                  \
    if (ea_s_ != Status::kOk) return ea_s_; \
  } while (0)

template <typename... Args>
Status fail(Status s, const Args&... parts) {
  std::string msg;
  ((msg += to_str(parts)), ...);
  set_error(s, std::move(msg));
  return s;
}

}  // namespace expertact::detail
