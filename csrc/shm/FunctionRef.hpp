#pragma once

// A non-owning reference to a callable, for the engine's callbacks (a step's
// fill, a pooled step's use). The engine calls them before it returns, so
// nothing needs to own them; a std::function would copy the caller's lambda,
// and one capturing more than two references is copied to the heap: a malloc
// and a free on every small call.

#include <cstddef>
#include <memory>
#include <type_traits>
#include <utility>

namespace hsdp::shm {

template <typename Signature>
class FunctionRef;

template <typename R, typename... Args>
class FunctionRef<R(Args...)> {
 public:
  FunctionRef() = default;
  FunctionRef(std::nullptr_t) {} // implicit, as std::function

  // Refers to `f`, which must outlive this reference: pass a lambda to a call
  // that takes a FunctionRef, never keep one.
  template <
      typename F,
      typename = std::enable_if_t<
          !std::is_same_v<std::remove_cvref_t<F>, FunctionRef> &&
          std::is_invocable_r_v<R, F&, Args...>>>
  FunctionRef(F&& f) // implicit, as std::function
      : callable_(const_cast<void*>(static_cast<const void*>(std::addressof(f)))),
        call_([](void* callable, Args... args) -> R {
          return (*static_cast<std::remove_reference_t<F>*>(callable))(std::forward<Args>(args)...);
        }) {}

  R operator()(Args... args) const {
    return call_(callable_, std::forward<Args>(args)...);
  }

  explicit operator bool() const {
    return call_ != nullptr;
  }

 private:
  void* callable_ = nullptr;
  R (*call_)(void*, Args...) = nullptr;
};

} // namespace hsdp::shm
