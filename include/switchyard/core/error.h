// The one error convention of switchyard.
//
// Expected failures (bad arguments, bad files, lost peers, timeouts) throw a subclass of
// switchyard::Error whose message says what was wrong, where, and what was expected.
// Broken invariants (bugs) use SY_CHECK, which throws InternalError with file:line.
// Library code never calls exit() or abort(); the CLI maps Error to one line and an exit code.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace switchyard {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A caller passed something the contract does not allow (shape, option, value).
class InvalidArgument : public Error {
 public:
  using Error::Error;
};
// A file could not be read or written, or its contents are malformed.
class IoError : public Error {
 public:
  using Error::Error;
};
// A blocking wait passed its deadline (e.g. a peer that never answered).
class TimeoutError : public Error {
 public:
  using Error::Error;
};
// A peer failed, left, or called a different collective.
class PeerError : public Error {
 public:
  using Error::Error;
};
// An allocation failed although the up-front memory checks (RequireMemory, core/limits.h) let it
// through: the memory was taken by something else meanwhile, or a size was not foreseen. The
// message names what was being allocated where that is known (a tensor's shape and bytes).
class OutOfMemory : public Error {
 public:
  using Error::Error;
};
// A broken invariant inside switchyard: a bug, reported with file:line.
class InternalError : public Error {
 public:
  using Error::Error;
};

namespace detail {
[[noreturn]] void ThrowInternal(const char* file, int line, const char* cond,
                                const std::string& msg);
}  // namespace detail

}  // namespace switchyard

// SY_CHECK(cond, "format {}", args...): invariant; throws InternalError("file:line: check 'cond'
// failed: ...").
#define SY_CHECK(cond, ...)                                               \
  do {                                                                    \
    if (!(cond)) [[unlikely]] {                                           \
      ::switchyard::detail::ThrowInternal(__FILE__, __LINE__, #cond,      \
                                          ::fmt::format("" __VA_ARGS__)); \
    }                                                                     \
  } while (0)

// SY_REQUIRE(cond, ExceptionType, "format {}", args...): validates input; throws
// ExceptionType(msg).
#define SY_REQUIRE(cond, ExceptionType, ...)           \
  do {                                                 \
    if (!(cond)) [[unlikely]] {                        \
      throw ExceptionType(::fmt::format(__VA_ARGS__)); \
    }                                                  \
  } while (0)
