// Typed counts so that element counts, byte counts and ranks cannot be mixed up. Collective and
// copy APIs take Elements; only allocation and accounting deal in Bytes.
#pragma once

#include <compare>
#include <cstdint>

namespace meshproof::kernels {

// A number of tensor elements (never bytes).
struct Elements {
  int64_t value = 0;
  constexpr Elements() = default;
  constexpr explicit Elements(int64_t v) : value(v) {}
  constexpr auto operator<=>(const Elements&) const = default;
  constexpr Elements operator+(Elements o) const { return Elements(value + o.value); }
  constexpr Elements operator-(Elements o) const { return Elements(value - o.value); }
  constexpr Elements operator*(int64_t k) const { return Elements(value * k); }
};

// A number of bytes (never elements).
struct Bytes {
  int64_t value = 0;
  constexpr Bytes() = default;
  constexpr explicit Bytes(int64_t v) : value(v) {}
  constexpr auto operator<=>(const Bytes&) const = default;
  constexpr Bytes operator+(Bytes o) const { return Bytes(value + o.value); }
  constexpr Bytes operator-(Bytes o) const { return Bytes(value - o.value); }
  constexpr Bytes& operator+=(Bytes o) {
    value += o.value;
    return *this;
  }
  constexpr Bytes& operator-=(Bytes o) {
    value -= o.value;
    return *this;
  }
};

}  // namespace meshproof::kernels
