// metal_ext backend header: CUDA (MLX's CUDA backend, NVRTC). Twin of backend_metal.h: the same
// KX_* names, so both backends compile the same body text. NVRTC compiles with
// --device-as-default-execution-space; helpers are still declared KX_INLINE (__device__) so that
// plain nvcc can compile the same text in CI. No fast-math is used.
// MLX's CUDA prelude defines a macro named `inf`: never use that identifier in a body.
#pragma once
#define KX_CUDA 1

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef int i32;
typedef unsigned long long u64;
typedef long long i64;

#define KX_DEVICE
#define KX_THREADGROUP
#define KX_INLINE __device__ __forceinline__

#define KX_TID_X (blockIdx.x * blockDim.x + threadIdx.x)
#define KX_TID_Y (blockIdx.y * blockDim.y + threadIdx.y)
#define KX_TID_Z (blockIdx.z * blockDim.z + threadIdx.z)
#define KX_LID_X (threadIdx.x)
#define KX_TGID_X (blockIdx.x)
#define KX_TGID_Y (blockIdx.y)
#define KX_TGID_Z (blockIdx.z)
#define KX_TG_SIZE_X (blockDim.x)
#define KX_LANE (threadIdx.x & 31u)
#define KX_WARP (threadIdx.x >> 5)
#define KX_SIMD_WIDTH 32

#define KX_BARRIER() __syncthreads()
#define KX_SIMD_BARRIER() __syncwarp()
#define KX_SHARED(T, name, n) __shared__ T name[n]

#define KX_SHUFFLE_XOR(v, m) __shfl_xor_sync(0xffffffffu, (v), (m))
#define KX_SHUFFLE(v, lane) __shfl_sync(0xffffffffu, (v), (lane))

#define KX_FMA(a, b, c) __fmaf_rn((a), (b), (c))
#define KX_EXP(x) expf(x)
#define KX_LOG(x) logf(x)  // IEEE-accurate (no fast math)
#define KX_ROPE_COS(x) cosf(x)  // as MLX's CUDA rope: the accurate cos / sin (no fast math)
#define KX_ROPE_SIN(x) sinf(x)
#define KX_ROPE_INV(p) ((float)(1.0 / (double)(p)))  // MLX's rope divides in double (1.0 / freq)
// The value of a 0-d input (MLX passes every input as a pointer on CUDA, a 0-d one as a reference on Metal).
#define KX_SCALAR(x) ((x)[0])
// A threadgroup may finish work that other threadgroups of the launch left (exl3_gemv's FINISH):
// a device-scope fence, atomics on a uint32 scratch input (MLX passes inputs as const pointers),
// loads through L2.
#define KX_HAS_GRID_FINISH 1
#define KX_GRID_FENCE() __threadfence()
#define KX_ATOMIC_INC(p) atomicAdd((unsigned int*)(p), 1u)
#define KX_ATOMIC_ZERO(p) atomicExch((unsigned int*)(p), 0u)
#define KX_LOAD_CG(p) __ldcg(p)
#define KX_SQRT(x) sqrtf(x)  // IEEE (NVRTC's default -prec-sqrt=true)
#define KX_FMAX(a, b) fmaxf((a), (b))
#define KX_RINT(x) rintf(x)  // round half to even
#define KX_ISNAN(x) isnan(x)
#define KX_ISINF(x) isinf(x)
#define KX_INF_F32 (__int_as_float(0x7f800000))
#define KX_NAN_F32 (__int_as_float(0x7fc00000))
#define KX_POPCOUNT(x) __popc(x)
// v[0..3] = the 4 elements of vector type VT (float4, uint4) at p (16-byte aligned): one load.
#define KX_LOAD_X4(VT, p, v)          \
  do {                                \
    const VT kx_t = *reinterpret_cast<const VT*>(p); \
    (v)[0] = kx_t.x;                  \
    (v)[1] = kx_t.y;                  \
    (v)[2] = kx_t.z;                  \
    (v)[3] = kx_t.w;                  \
  } while (0)
#define KX_LOAD_F32X4(p, v) KX_LOAD_X4(float4, p, v)
// The same through L2 (ld.global.cg): data another threadgroup of the launch may have written.
#define KX_LOAD_F32X4_CG(p, v)                                       \
  do {                                                               \
    const float4 kx_t = __ldcg(reinterpret_cast<const float4*>(p)); \
    (v)[0] = kx_t.x;                                                 \
    (v)[1] = kx_t.y;                                                 \
    (v)[2] = kx_t.z;                                                 \
    (v)[3] = kx_t.w;                                                 \
  } while (0)
#define KX_LOAD_U32X4(p, v) KX_LOAD_X4(uint4, p, v)

#define KX_TO_F32(x) static_cast<float>(x)
#define KX_F16_BITS_TO_F32(bits) __half2float(__ushort_as_half((unsigned short)(bits)))
#define KX_F32_TO_F16_BITS(f) ((u32)__half_as_ushort(__float2half_rn(f)))
#define KX_F32_BITS(f) ((u32)__float_as_uint(f))
#define KX_BITS_F32(u) __uint_as_float((u32)(u))
typedef __half f16;

// Packed fp16 pairs in a u32 (first element in the low half); each op rounds once (IEEE RNE).
KX_INLINE u32 kx_hfma2_bits(u32 a, u32 b, u32 c) {
  const __half2 r = __hfma2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b),
                            *reinterpret_cast<const __half2*>(&c));
  return *reinterpret_cast<const u32*>(&r);
}
KX_INLINE u32 kx_hadd2_bits(u32 a, u32 b) {
  const __half2 r = __hadd2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
  return *reinterpret_cast<const u32*>(&r);
}
#define KX_HFMA2_BITS(a, b, c) kx_hfma2_bits((a), (b), (c))
#define KX_HADD2_BITS(a, b) kx_hadd2_bits((a), (b))
// c + the sum of the four bytes of u32 x.
#define KX_BYTE_SUM(x, c) __dp4a((u32)(x), 0x01010101u, (u32)(c))
// Fully unroll the loop that follows (constant trip count).
#define KX_UNROLL _Pragma("unroll")
// Unroll the loop that follows by 2 (a runtime trip count; the compiler adds the remainder).
#define KX_UNROLL_2 _Pragma("unroll 2")
// Keep the loop that follows rolled (its body holds registers the rest of the kernel needs).
#define KX_NO_UNROLL _Pragma("unroll 1")
// Funnel shifts of the 64-bit value hi:lo by s in [0, 31]: the high word after a left shift, the
// low word after a right shift (one SHF each).
#define KX_FUNNEL_L(lo, hi, s) __funnelshift_l((u32)(lo), (u32)(hi), (u32)(s))
#define KX_FUNNEL_R(lo, hi, s) __funnelshift_r((u32)(lo), (u32)(hi), (u32)(s))
// The low 16 bits of lo and of hi in one u32 (lo in the low half; one PRMT).
#define KX_PACK_LO16(lo, hi) __byte_perm((u32)(lo), (u32)(hi), 0x5410u)
// Whether pointer p allows 16-byte vector loads.
#define KX_ALIGNED16(p) ((reinterpret_cast<unsigned long long>(p) & 15ull) == 0)
// Byte n of the result is byte (s >> 4n) & 7 of the 8 bytes hi:lo (lo bytes 0-3); s a constant
// whose nibbles are all < 8 (one PRMT).
#define KX_BYTE_PERM(lo, hi, s) __byte_perm((u32)(lo), (u32)(hi), (u32)(s))

// Threadgroup memory that 16-byte asynchronous copies may target.
#define KX_HAS_ASYNC_COPY 1
#define KX_SHARED16(T, name, n) __shared__ __align__(16) T name[n]
// Asynchronous 16-byte copies global -> threadgroup memory (cp.async.cg: through L2 only, no
// registers held while in flight): KX_ASYNC_COPY16(base, i, src) copies 16 bytes at src to words
// i..i+3 of the threadgroup array base (16-byte aligned). KX_ASYNC_COMMIT closes the thread's
// current group of copies; KX_ASYNC_WAIT(n) (n a constant) returns once at most n of its groups
// are still in flight; a barrier after it makes every thread's completed copies visible.
KX_INLINE void kx_async_copy16(u32 dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
#define KX_ASYNC_COPY16(base, i, src) \
  kx_async_copy16((u32)__cvta_generic_to_shared(base) + 4u * (u32)(i), (const void*)(src))
#define KX_ASYNC_COMMIT() asm volatile("cp.async.commit_group;" ::: "memory")
#define KX_ASYNC_WAIT(n) asm volatile("cp.async.wait_group %0;" ::"n"(n) : "memory")

// ldmatrix: four 8 x 8 matrices of 16-bit elements from threadgroup memory. Lane l gives the
// address of row l % 8 of matrix l / 8 (16 bytes, 16-byte aligned) as word i of base; lane
// (q, c) = (l / 4, l % 4) receives in r[m] row q's elements 2c, 2c + 1 of matrix m (_TRANS:
// column q's elements at rows 2c, 2c + 1), first element in the low half: the MMA's fragments.
#define KX_LDMATRIX_X4(base, i, r)                                                                     \
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"                        \
               : "=r"((r)[0]), "=r"((r)[1]), "=r"((r)[2]), "=r"((r)[3])                             \
               : "r"((u32)__cvta_generic_to_shared(base) + 4u * (u32)(i)))
#define KX_LDMATRIX_X4_TRANS(base, i, r)                                                               \
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"                  \
               : "=r"((r)[0]), "=r"((r)[1]), "=r"((r)[2]), "=r"((r)[3])                             \
               : "r"((u32)__cvta_generic_to_shared(base) + 4u * (u32)(i)))

// Tensor-core tile product. KX_HAS_MMA_F16 says whether KX_MMA_F16_F32 exists (Metal: 0, bodies
// then use per-lane FMAs). KX_MMA_F16_F32(c, a0..a3, b0, b1): c[0..3] += A·B for one
// mma.m16n8k16 (PTX fragment layouts; a*, b* packed fp16 pairs, c an lvalue float[4]).
#define KX_HAS_MMA_F16 1
#define KX_MMA_F16_F32(c, a0, a1, a2, a3, b0, b1)                                                   \
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, " \
      "{%0,%1,%2,%3};"                                                                               \
      : "+f"((c)[0]), "+f"((c)[1]), "+f"((c)[2]), "+f"((c)[3])                                      \
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1))
// The same with bf16 operands (mma.m16n8k16 .bf16: the same fragment layouts).
#define KX_MMA_BF16_F32(c, a0, a1, a2, a3, b0, b1)                                                   \
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, " \
      "{%0,%1,%2,%3};"                                                                                 \
      : "+f"((c)[0]), "+f"((c)[1]), "+f"((c)[2]), "+f"((c)[3])                                        \
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1))
