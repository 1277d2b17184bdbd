// metal_ext backend header: Metal (Apple GPUs).
// Kernel bodies in metal_ext/*.metal are written once against the KX_* names below; the twin header
// backend_cuda.h maps the same names to CUDA, so both backends compile the same body text.
// Rules for bodies: 1-D threadgroups along x wherever SIMD helpers are used; `unsigned int`
// (or u32), never `uint`; scalars arrive as 1-element arrays and are read as `x[0]`.
#pragma once
#define KX_METAL 1

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef int i32;
typedef ulong u64;
typedef long i64;

// Address spaces (CUDA: empty).
#define KX_DEVICE device
#define KX_THREADGROUP threadgroup
#define KX_INLINE inline

// Thread geometry. The Metal names below are also listed in a comment that kernels.py adds to every
// body, because MLX only adds a [[...]] argument when its name appears in the body text.
#define KX_TID_X (thread_position_in_grid.x)
#define KX_TID_Y (thread_position_in_grid.y)
#define KX_TID_Z (thread_position_in_grid.z)
#define KX_LID_X (thread_position_in_threadgroup.x)
#define KX_TGID_X (threadgroup_position_in_grid.x)
#define KX_TGID_Y (threadgroup_position_in_grid.y)
#define KX_TGID_Z (threadgroup_position_in_grid.z)
#define KX_TG_SIZE_X (threads_per_threadgroup.x)
#define KX_LANE (thread_index_in_simdgroup)
#define KX_WARP (simdgroup_index_in_threadgroup)
#define KX_SIMD_WIDTH 32

// Synchronisation and threadgroup memory.
#define KX_BARRIER() threadgroup_barrier(metal::mem_flags::mem_threadgroup)
#define KX_SIMD_BARRIER() simdgroup_barrier(metal::mem_flags::mem_threadgroup)
#define KX_SHARED(T, name, n) threadgroup T name[n]

// SIMD exchange. Reductions are written as explicit xor butterflies in the bodies so that the
// summation order is the same on both backends and in every kernel variant (simd_sum's order is
// unspecified).
#define KX_SHUFFLE_XOR(v, m) metal::simd_shuffle_xor((v), (ushort)(m))
#define KX_SHUFFLE(v, lane) metal::simd_shuffle((v), (ushort)(lane))

// Arithmetic that the compiler must not re-associate or contract differently per kernel:
// explicit fma, precise exp (kernels are compiled with math_mode="safe").
#define KX_FMA(a, b, c) metal::fma((a), (b), (c))
#define KX_EXP(x) metal::precise::exp(x)
#define KX_LOG(x) metal::precise::log(x)
#define KX_ROPE_COS(x) metal::fast::cos(x)  // as MLX's Metal rope
#define KX_ROPE_SIN(x) metal::fast::sin(x)
#define KX_ROPE_INV(p) (1.0f / (p))
// The value of a 0-d input (MLX passes it as `const constant T&` on Metal).
#define KX_SCALAR(x) (x)
// No device-scope fence in the Metal versions MLX targets: a launch never finishes another
// threadgroup's work (exl3_gemv's FINISH is off; exl3_gemv_out is its own launch).
#define KX_HAS_GRID_FINISH 0
#define KX_GRID_FENCE()
#define KX_ATOMIC_INC(p) ((void)(p), 0u)
#define KX_ATOMIC_ZERO(p) ((void)(p))
#define KX_LOAD_CG(p) (*(p))
#define KX_SQRT(x) metal::precise::sqrt(x)
#define KX_FMAX(a, b) metal::fmax((a), (b))
#define KX_RINT(x) metal::rint(x)  // round half to even
#define KX_ISNAN(x) metal::isnan(x)
#define KX_ISINF(x) metal::isinf(x)
#define KX_INF_F32 (INFINITY)
#define KX_NAN_F32 (NAN)
#define KX_POPCOUNT(x) metal::popcount(x)
// v[0..3] = the 4 elements of vector type VT (float4, uint4) at p (16-byte aligned): one load.
#define KX_LOAD_X4(VT, p, v)          \
  do {                                \
    const VT kx_t = *(const device VT*)(p); \
    (v)[0] = kx_t.x;                  \
    (v)[1] = kx_t.y;                  \
    (v)[2] = kx_t.z;                  \
    (v)[3] = kx_t.w;                  \
  } while (0)
#define KX_LOAD_F32X4(p, v) KX_LOAD_X4(float4, p, v)
#define KX_LOAD_F32X4_CG(p, v) KX_LOAD_F32X4(p, v)  // no grid finish on Metal: a plain load
#define KX_LOAD_U32X4(p, v) KX_LOAD_X4(uint4, p, v)

// Conversions (all round-to-nearest-even).
#define KX_TO_F32(x) static_cast<float>(x)
#define KX_F16_BITS_TO_F32(bits) static_cast<float>(as_type<half>((ushort)(bits)))
#define KX_F32_TO_F16_BITS(f) ((u32)as_type<ushort>(static_cast<half>(f)))
#define KX_F32_BITS(f) as_type<u32>(f)
#define KX_BITS_F32(u) as_type<float>((u32)(u))
typedef half f16;

// Packed fp16 pairs in a u32 (first element in the low half); each op rounds once (IEEE RNE).
KX_INLINE u32 kx_hfma2_bits(u32 a, u32 b, u32 c) {
  return as_type<u32>(metal::fma(as_type<half2>(a), as_type<half2>(b), as_type<half2>(c)));
}
KX_INLINE u32 kx_hadd2_bits(u32 a, u32 b) { return as_type<u32>(as_type<half2>(a) + as_type<half2>(b)); }
#define KX_HFMA2_BITS(a, b, c) kx_hfma2_bits((a), (b), (c))
#define KX_HADD2_BITS(a, b) kx_hadd2_bits((a), (b))
// c + the sum of the four bytes of u32 x.
KX_INLINE u32 kx_byte_sum(u32 x, u32 c) {
  const u32 pairs = (x & 0x00FF00FFu) + ((x >> 8) & 0x00FF00FFu);
  return (pairs & 0xFFFFu) + (pairs >> 16) + c;
}
#define KX_BYTE_SUM(x, c) kx_byte_sum((u32)(x), (u32)(c))
// Fully unroll the loop that follows (constant trip count).
#define KX_UNROLL _Pragma("clang loop unroll(full)")
#define KX_UNROLL_2 _Pragma("clang loop unroll_count(2)")
// Keep the loop that follows rolled (its body holds registers the rest of the kernel needs).
#define KX_NO_UNROLL _Pragma("clang loop unroll(disable)")
// Funnel shifts of the 64-bit value hi:lo by s in [0, 31]: the high word after a left shift, the
// low word after a right shift.
KX_INLINE u32 kx_funnel_l(u32 lo, u32 hi, u32 s) { return (u32)(((((u64)hi) << 32) | (u64)lo) << s >> 32); }
KX_INLINE u32 kx_funnel_r(u32 lo, u32 hi, u32 s) { return (u32)(((((u64)hi) << 32) | (u64)lo) >> s); }
#define KX_FUNNEL_L(lo, hi, s) kx_funnel_l((u32)(lo), (u32)(hi), (u32)(s))
#define KX_FUNNEL_R(lo, hi, s) kx_funnel_r((u32)(lo), (u32)(hi), (u32)(s))
// The low 16 bits of lo and of hi in one u32 (lo in the low half).
#define KX_PACK_LO16(lo, hi) ((((u32)(lo)) & 0xFFFFu) | (((u32)(hi)) << 16))
// Whether pointer p allows 16-byte vector loads: not checkable here (no pointer-to-integer
// casts), so false; a body that knows its Metal inputs are aligned says so itself.
#define KX_ALIGNED16(p) false
// Byte n of the result is byte (s >> 4n) & 7 of the 8 bytes hi:lo (lo bytes 0-3); s a constant
// whose nibbles are all < 8.
KX_INLINE u32 kx_byte_perm(u32 lo, u32 hi, u32 s) {
  const u64 v = ((u64)hi << 32) | lo;
  u32 r = 0;
  for (u32 n = 0; n < 4; n++) r |= (u32)((v >> (8 * ((s >> (4 * n)) & 7u))) & 0xFFu) << (8 * n);
  return r;
}
#define KX_BYTE_PERM(lo, hi, s) kx_byte_perm((u32)(lo), (u32)(hi), (u32)(s))

// No asynchronous global -> threadgroup copies here (see backend_cuda.h): bodies read device
// memory directly where KX_HAS_ASYNC_COPY is 0 (Apple GPUs also have 32 KiB of threadgroup memory,
// too little for a trellis ring).
#define KX_HAS_ASYNC_COPY 0
#define KX_SHARED16(T, name, n) threadgroup T name[n]

// Tensor-core tile product: Apple GPUs have 8x8 simdgroup matrices with another fragment layout,
// so KX_MMA_F16_F32 does not exist here and bodies use per-lane FMAs (see backend_cuda.h).
#define KX_HAS_MMA_F16 0
