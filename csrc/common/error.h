#pragma once
// Two kinds of error (STYLE.md 5):
//   KILN_CHECK(cond) << "what was wrong and what to do";   the user's mistake -> kiln.errors.KilnError
//   KILN_ASSERT(cond) << "detail";                         a broken invariant -> kiln.errors.InternalError
// Both throw C++ exceptions; bindings translate them into kiln's Python exception types.
#include <sstream>
#include <stdexcept>
#include <string>

namespace kiln {

enum class ErrorKind { User, Internal, Unsupported, GraphBreak };

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, std::string message) : std::runtime_error(std::move(message)), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

namespace detail {
// Collects the streamed message, throws from its destructor's caller via `throw_now`.
class ErrorBuilder {
 public:
  ErrorBuilder(ErrorKind kind, const char* file, int line, const char* cond) : kind_(kind) {
    if (kind == ErrorKind::Internal)
      stream_ << "kiln internal error at " << file << ":" << line << " (" << cond << "): ";
  }
  template <typename T>
  ErrorBuilder& operator<<(const T& value) {
    stream_ << value;
    return *this;
  }
  [[noreturn]] void throw_now() {
    if (kind_ == ErrorKind::Internal) stream_ << ". Please report this as a kiln bug.";
    throw Error(kind_, stream_.str());
  }

 private:
  ErrorKind kind_;
  std::ostringstream stream_;
};

// `Thrower() & builder << ...` lets the macro take a streamed tail and still throw.
struct Thrower {
  [[noreturn]] void operator&(ErrorBuilder& b) { b.throw_now(); }
  [[noreturn]] void operator&(ErrorBuilder&& b) { b.throw_now(); }
};
}  // namespace detail

}  // namespace kiln

#define KILN_ERROR_IMPL(kind, cond_text) \
  ::kiln::detail::Thrower() & ::kiln::detail::ErrorBuilder(kind, __FILE__, __LINE__, cond_text)

#define KILN_CHECK(cond) \
  if (cond) {            \
  } else                 \
    KILN_ERROR_IMPL(::kiln::ErrorKind::User, #cond)

#define KILN_ASSERT(cond) \
  if (cond) {             \
  } else                  \
    KILN_ERROR_IMPL(::kiln::ErrorKind::Internal, #cond)

#define KILN_UNSUPPORTED() KILN_ERROR_IMPL(::kiln::ErrorKind::Unsupported, "")

#define KILN_ASSERT_EQ(a, b) KILN_ASSERT((a) == (b)) << #a " = " << (a) << ", " #b " = " << (b) << " "
#define KILN_ASSERT_LT(a, b) KILN_ASSERT((a) < (b)) << #a " = " << (a) << ", " #b " = " << (b) << " "
#define KILN_CHECK_EQ(a, b) KILN_CHECK((a) == (b)) << #a " = " << (a) << ", " #b " = " << (b) << ": "
