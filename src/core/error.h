// Status helpers: one thread-local last-error message shared by the C++ API and the C ABI,
// and the exception guard of both boundaries.
#pragma once

#include <exception>
#include <new>
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

// Records "<what>: <part1><part2>" as kInternal; if even that message cannot be
// allocated, the status alone is returned.
inline Status internal_error(const char* what, const char* part1, const char* part2) noexcept {
  try {
    return fail(Status::kInternal, what, ": ", part1, part2);
  } catch (...) {
    return Status::kInternal;
  }
}

// The exception guard of a public entry point: clears the last error, runs fn (which
// returns a Status) and turns anything thrown (std::bad_alloc of a message, a failed
// thread start) into kInternal, so that no exception leaves the library. Each call passes
// exactly one guard, at the boundary it comes in through: the C ABI (src/c_api.cpp) or
// the C++ API (src/api.cpp, src/api_moe.cpp); both call the unguarded bodies of
// src/api.h. `what` names the entry point in the message.
template <typename Fn>
Status guarded(const char* what, Fn&& fn) noexcept {
  try {
    clear_error();
    return fn();
  } catch (const std::bad_alloc&) {
    return internal_error(what, "out of host memory", "");
  } catch (const std::exception& e) {
    return internal_error(what, "internal error: ", e.what());
  } catch (...) {
    return internal_error(what, "internal error: ", "unknown exception");
  }
}

}  // namespace expertact::detail
