// Stand-in for the Metal Shading Language declarations that metal_ext kernels use, so that the
// Metal sources MLX generates can be compiled as C++ on a machine without Metal (CI). It checks
// names, types and syntax; it does not model Metal semantics. Extend it when a body uses more.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#define device
#define constant
#define threadgroup
#define thread

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;

struct half {
  unsigned short bits;
  half() = default;
  half(float f);
  operator float() const;
};
typedef half float16_t;
struct bfloat16_t {
  unsigned short bits;
  bfloat16_t() = default;
  bfloat16_t(float f);
  operator float() const;
};
typedef bfloat16_t bfloat;

template <typename T> struct vec2 { T x, y; };
template <typename T> struct vec3 { T x, y, z; };
template <typename T> struct vec4 { T x, y, z, w; };
typedef vec2<uint> uint2;
typedef vec3<uint> uint3;
typedef vec4<uint> uint4;
typedef vec2<float> float2;
typedef vec4<float> float4;
typedef vec2<half> half2;
template <typename T> vec2<T> operator+(vec2<T> a, vec2<T> b);
typedef vec4<half> half4;

template <typename To, typename From> To as_type(From x) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs equal sizes");
  To out;
  std::memcpy(&out, &x, sizeof(To));
  return out;
}

namespace metal {
enum class mem_flags { mem_none, mem_device, mem_threadgroup, mem_texture };
void threadgroup_barrier(mem_flags);
void simdgroup_barrier(mem_flags);
template <typename T> T simd_shuffle_xor(T v, ushort mask);
template <typename T> T simd_shuffle(T v, ushort lane);
template <typename T> T simd_shuffle_down(T v, ushort delta);
template <typename T> T simd_broadcast(T v, ushort lane);
template <typename T> T simd_sum(T v);
template <typename T> T simd_max(T v);
template <typename T> T simd_min(T v);
float fma(float a, float b, float c);
half2 fma(half2 a, half2 b, half2 c);
float fmax(float a, float b);
float rint(float x);
float fmin(float a, float b);
template <typename T> T max(T a, T b);
template <typename T> T min(T a, T b);
template <typename T> T clamp(T x, T lo, T hi);
float abs(float x);
float exp(float x);
float log(float x);
float sqrt(float x);
float rsqrt(float x);
bool isnan(float x);
bool isinf(float x);
bool isfinite(float x);
uint popcount(uint x);
uint clz(uint x);
namespace fast {
float cos(float x);
float sin(float x);
}  // namespace fast
namespace precise {
float exp(float x);
float log(float x);
float sqrt(float x);
float divide(float a, float b);
}  // namespace precise
}  // namespace metal
using namespace metal;
