// metal_ext backend header: a CPU simulator (tests only). The same KX_* names as backend_metal.h /
// backend_cuda.h, so the kernel bodies compile unchanged with g++ and run here: every GPU thread is
// a fiber (ucontext), threadgroup barriers and SIMD exchanges are cooperative switches, threadgroup
// memory is one arena per threadgroup. It checks the bodies' logic (indexing, fragment layouts,
// synchronisation, exact integer/fp16 arithmetic), not GPU timing or memory models.
//   KX_HAS_MMA_F16 is set by the build (-D): 1 simulates the CUDA configuration (mma.m16n8k16 with
//   the PTX fragment layouts, float64 accumulation rounded once; asynchronous global->threadgroup
//   copies that land only when waited for), 0 the Metal one (per-lane FMAs, no asynchronous copies).
// Not exact where a GPU is not: KX_HFMA2_BITS/KX_HADD2_BITS round through double/float first
// (exact for the EXL3 codebooks, whose sums fit in 21 bits) and the MMA accumulates in double.
#pragma once
#include <ucontext.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#define KX_SIM 1
typedef uint32_t u32;
typedef uint16_t u16;
typedef uint8_t u8;
typedef int32_t i32;
typedef uint64_t u64;
typedef int64_t i64;
using Shape = std::array<int32_t, 10>;

#define KX_DEVICE
#define KX_THREADGROUP
#define KX_INLINE inline

// ---- simulated machine state (one threadgroup at a time) ---------------------------------------
struct SimCopy {
  unsigned char* dst;
  unsigned char data[16];
  int group;  // -1 until committed
};
struct SimFiber {
  ucontext_t ctx;
  u32 lid;
  int wait;  // 0 runnable, 1 threadgroup barrier, 2 SIMD-group sync
  bool done;
  size_t shared_offset;
  std::vector<SimCopy> copies;  // asynchronous copies issued and not yet landed
  int groups;                   // groups committed so far
};
inline std::vector<SimFiber> sim_fibers;
inline SimFiber* sim_cur = nullptr;
inline ucontext_t sim_main_ctx;
inline u32 sim_tgid[3], sim_tgsize[3];
inline std::vector<unsigned char> sim_arena(64 * 1024);
inline std::vector<u64> sim_xchg;            // [threads] SIMD exchange slots
inline std::vector<std::array<u32, 10>> sim_mma_regs;  // [threads] a0..a3, b0, b1, c0..c3 bits

[[noreturn]] inline void sim_fail(const std::string& what) {
  std::fprintf(stderr, "SIM ERROR: %s\n", what.c_str());
  std::exit(3);
}

inline void sim_yield(int wait) {
  sim_cur->wait = wait;
  swapcontext(&sim_cur->ctx, &sim_main_ctx);
}

#define KX_TID_X (sim_tgid[0] * sim_tgsize[0] + sim_cur->lid)
#define KX_TID_Y (sim_tgid[1])
#define KX_TID_Z (sim_tgid[2])
#define KX_LID_X (sim_cur->lid)
#define KX_TGID_X (sim_tgid[0])
#define KX_TGID_Y (sim_tgid[1])
#define KX_TGID_Z (sim_tgid[2])
#define KX_TG_SIZE_X (sim_tgsize[0])
#define KX_LANE (sim_cur->lid & 31u)
#define KX_WARP (sim_cur->lid >> 5)
#define KX_SIMD_WIDTH 32

#define KX_BARRIER() sim_yield(1)
#define KX_SIMD_BARRIER() sim_yield(2)

template <typename T>
inline T* sim_shared(size_t n) {
  size_t off = (sim_cur->shared_offset + 15) & ~size_t(15);
  sim_cur->shared_offset = off + n * sizeof(T);
  if (sim_cur->shared_offset > sim_arena.size()) sim_fail("threadgroup memory over 64 KiB");
  return reinterpret_cast<T*>(sim_arena.data() + off);
}
#define KX_SHARED(T, name, n) T* name = sim_shared<T>(n)

template <typename T>
inline T sim_shuffle_to(T v, u32 src_lane) {
  static_assert(sizeof(T) <= 8, "shuffle of a wide type");
  u64 bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  const u32 base = sim_cur->lid & ~31u;
  sim_xchg[sim_cur->lid] = bits;
  sim_yield(2);
  const u64 got = sim_xchg[base + (src_lane & 31u)];
  sim_yield(2);
  T out;
  std::memcpy(&out, &got, sizeof(T));
  return out;
}
#define KX_SHUFFLE_XOR(v, m) sim_shuffle_to((v), (sim_cur->lid & 31u) ^ (u32)(m))
#define KX_SHUFFLE(v, lane) sim_shuffle_to((v), (u32)(lane))

// ---- arithmetic -------------------------------------------------------------------------------
#define KX_FMA(a, b, c) std::fmaf((a), (b), (c))
#define KX_EXP(x) std::exp((float)(x))
#define KX_LOG(x) std::log((float)(x))
#define KX_ROPE_COS(x) std::cos((float)(x))
#define KX_ROPE_SIN(x) std::sin((float)(x))
#define KX_ROPE_INV(p) ((float)(1.0 / (double)(p)))
#define KX_SCALAR(x) ((x)[0])
// Threadgroups run one after another: plain read-modify-writes are the atomics.
#define KX_HAS_GRID_FINISH 1
#define KX_GRID_FENCE()
inline u32 sim_atomic_inc(const u32* p) { return (*const_cast<u32*>(p))++; }
#define KX_ATOMIC_INC(p) sim_atomic_inc((const u32*)(p))
#define KX_ATOMIC_ZERO(p) (*const_cast<u32*>((const u32*)(p)) = 0u)
#define KX_LOAD_CG(p) (*(p))
#define KX_SQRT(x) std::sqrt((float)(x))
#define KX_FMAX(a, b) std::fmaxf((a), (b))
#define KX_RINT(x) std::nearbyint((float)(x))  // the default rounding mode: half to even
#define KX_ISNAN(x) std::isnan(x)
#define KX_ISINF(x) std::isinf(x)
#define KX_INF_F32 (INFINITY)
#define KX_NAN_F32 (NAN)
#define KX_POPCOUNT(x) ((u32)__builtin_popcount((u32)(x)))
#define KX_LOAD_F32X4(p, v)                                         \
  do {                                                              \
    if (((uintptr_t)(p)) % 16 != 0) sim_fail("KX_LOAD_F32X4: unaligned"); \
    for (int kx_i = 0; kx_i < 4; kx_i++) (v)[kx_i] = (p)[kx_i];      \
  } while (0)

#define KX_LOAD_F32X4_CG(p, v) KX_LOAD_F32X4(p, v)
#define KX_LOAD_X4(VT, p, v) KX_LOAD_F32X4(p, v)  // element-wise copies: VT only names the type
#define KX_LOAD_U32X4(p, v)                                         \
  do {                                                              \
    if (((uintptr_t)(p)) % 16 != 0) sim_fail("KX_LOAD_U32X4: unaligned"); \
    for (int kx_i = 0; kx_i < 4; kx_i++) (v)[kx_i] = (p)[kx_i];      \
  } while (0)

struct uint4 {
  u32 x, y, z, w;
};
struct float4 {
  float x, y, z, w;
};

template <typename T>
inline T min(T a, T b) { return b < a ? b : a; }
template <typename T>
inline T max(T a, T b) { return a < b ? b : a; }

inline float sim_f16_to_f32(u32 bits) {
  _Float16 h;
  const u16 b = (u16)bits;
  std::memcpy(&h, &b, 2);
  return (float)h;
}
inline u32 sim_f32_to_f16(float f) {
  const _Float16 h = (_Float16)f;  // round to nearest even
  u16 b;
  std::memcpy(&b, &h, 2);
  return b;
}
inline u32 sim_f32_bits(float f) { u32 u; std::memcpy(&u, &f, 4); return u; }
inline float sim_bits_f32(u32 u) { float f; std::memcpy(&f, &u, 4); return f; }

struct sim_half {
  u16 bits;
  sim_half() = default;
  sim_half(float f) : bits((u16)sim_f32_to_f16(f)) {}
  operator float() const { return sim_f16_to_f32(bits); }
};
struct sim_bf16 {
  u16 bits;
  sim_bf16() = default;
  sim_bf16(float f) {
    u32 u = sim_f32_bits(f);
    u = std::isnan(f) ? (u | 0x00400000u) : u + 0x7FFFu + ((u >> 16) & 1u);
    bits = (u16)(u >> 16);
  }
  operator float() const { return sim_bits_f32((u32)bits << 16); }
};
typedef sim_half f16;

#define KX_TO_F32(x) static_cast<float>(x)
#define KX_F16_BITS_TO_F32(bits) sim_f16_to_f32((u32)(bits))
#define KX_F32_TO_F16_BITS(f) sim_f32_to_f16((float)(f))
#define KX_F32_BITS(f) sim_f32_bits(f)
#define KX_BITS_F32(u) sim_bits_f32((u32)(u))

inline u32 sim_hfma2_bits(u32 a, u32 b, u32 c) {
  u32 r = 0;
  for (int h = 0; h < 2; h++) {
    const double v = std::fma((double)sim_f16_to_f32(a >> (16 * h)), (double)sim_f16_to_f32(b >> (16 * h)),
                              (double)sim_f16_to_f32(c >> (16 * h)));
    r |= sim_f32_to_f16((float)v) << (16 * h);
  }
  return r;
}
inline u32 sim_hadd2_bits(u32 a, u32 b) {
  u32 r = 0;
  for (int h = 0; h < 2; h++)
    r |= sim_f32_to_f16(sim_f16_to_f32(a >> (16 * h)) + sim_f16_to_f32(b >> (16 * h))) << (16 * h);
  return r;
}
#define KX_HFMA2_BITS(a, b, c) sim_hfma2_bits((a), (b), (c))
#define KX_HADD2_BITS(a, b) sim_hadd2_bits((a), (b))
#define KX_BYTE_SUM(x, c) ((u32)(((x) & 0xFFu) + (((x) >> 8) & 0xFFu) + (((x) >> 16) & 0xFFu) + ((u32)(x) >> 24) + (c)))
inline u32 sim_funnel_l(u32 lo, u32 hi, u32 s) {
  if (s > 31) sim_fail("funnel shift by more than 31");
  return (u32)(((((u64)hi) << 32) | (u64)lo) << s >> 32);
}
inline u32 sim_funnel_r(u32 lo, u32 hi, u32 s) {
  if (s > 31) sim_fail("funnel shift by more than 31");
  return (u32)(((((u64)hi) << 32) | (u64)lo) >> s);
}
// Fully unroll the loop that follows (constant trip count).
#define KX_UNROLL
#define KX_UNROLL_2
#define KX_NO_UNROLL
#define KX_FUNNEL_L(lo, hi, s) sim_funnel_l((u32)(lo), (u32)(hi), (u32)(s))
#define KX_FUNNEL_R(lo, hi, s) sim_funnel_r((u32)(lo), (u32)(hi), (u32)(s))
#define KX_PACK_LO16(lo, hi) ((((u32)(lo)) & 0xFFFFu) | (((u32)(hi)) << 16))
#define KX_ALIGNED16(p) ((reinterpret_cast<unsigned long long>(p) & 15ull) == 0)
// Byte n of the result is byte (s >> 4n) & 7 of the 8 bytes hi:lo (lo bytes 0-3); a selector
// nibble of 8 or more (PRMT's sign-replicate mode) is refused.
inline u32 sim_byte_perm(u32 lo, u32 hi, u32 s) {
  const u64 v = ((u64)hi << 32) | lo;
  u32 r = 0;
  for (u32 n = 0; n < 4; n++) {
    if ((s >> (4 * n)) & 8u) sim_fail("KX_BYTE_PERM selector nibble over 7");
    r |= (u32)((v >> (8 * ((s >> (4 * n)) & 7u))) & 0xFFu) << (8 * n);
  }
  return r;
}
#define KX_BYTE_PERM(lo, hi, s) sim_byte_perm((u32)(lo), (u32)(hi), (u32)(s))

// ---- asynchronous copies ------------------------------------------------------------------------
// Modelled as on CUDA (cp.async): the source is read when the copy is issued, the destination is
// poisoned (0xFF) until the copy lands, and copies land only when KX_ASYNC_WAIT lets their group
// complete. A body that reads copied data without wait + barrier reads the poison.
#define KX_SHARED16(T, name, n) KX_SHARED(T, name, n)
// The CUDA configuration (MMA) has asynchronous copies, the Metal one (per-lane FMAs) has not.
#define KX_HAS_ASYNC_COPY KX_HAS_MMA_F16
inline void sim_async_copy16(void* dst, const void* src) {
  auto* d = (unsigned char*)dst;
  if ((d - sim_arena.data()) % 16 || d < sim_arena.data() || d + 16 > sim_arena.data() + sim_arena.size())
    sim_fail("asynchronous copy to an unaligned or non-threadgroup address");
  if ((uintptr_t)src % 16) sim_fail("asynchronous copy from an unaligned source");
  SimCopy c{d, {}, -1};
  std::memcpy(c.data, src, 16);
  std::memset(d, 0xFF, 16);
  sim_cur->copies.push_back(c);
}
inline void sim_async_commit() {
  for (auto& c : sim_cur->copies)
    if (c.group < 0) c.group = sim_cur->groups;
  sim_cur->groups++;
}
inline void sim_async_wait(int pending) {
  std::vector<SimCopy> keep;
  for (auto& c : sim_cur->copies) {
    if (c.group >= 0 && c.group < sim_cur->groups - pending) std::memcpy(c.dst, c.data, 16);
    else keep.push_back(c);
  }
  sim_cur->copies = keep;
}
#define KX_ASYNC_COPY16(base, i, src) sim_async_copy16((void*)((u32*)(base) + (i)), (const void*)(src))
#define KX_ASYNC_COMMIT() sim_async_commit()
#define KX_ASYNC_WAIT(n) sim_async_wait(n)

// mma.sync.m16n8k16.row.col.f32.f16.f16.f32 over the SIMD group, from the PTX fragment layouts:
// lane (g = lane/4, c = lane%4) holds A[g][2c..2c+1], A[g+8][2c..], A[g][2c+8..], A[g+8][2c+8..]
// (a0..a3), B[2c..2c+1][g], B[2c+8..2c+9][g] (b0, b1), C[g][2c..2c+1], C[g+8][2c..2c+1] (c[0..3]).
inline float sim_bf16_bits_to_f32(u32 bits) { return sim_bits_f32((bits & 0xFFFFu) << 16); }
inline void sim_mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1, bool bf16 = false) {
  float (*cvt)(u32) = bf16 ? sim_bf16_bits_to_f32 : sim_f16_to_f32;
  const u32 lid = sim_cur->lid, base = lid & ~31u;
  sim_mma_regs[lid] = {a0, a1, a2, a3, b0, b1, sim_f32_bits(c[0]), sim_f32_bits(c[1]), sim_f32_bits(c[2]),
                       sim_f32_bits(c[3])};
  sim_yield(2);
  double A[16][16], B[16][8];
  for (u32 l = 0; l < 32; l++) {
    const auto& r = sim_mma_regs[base + l];
    const u32 g = l >> 2, cc = l & 3u;
    for (int h = 0; h < 2; h++) {
      A[g][2 * cc + h] = cvt(r[0] >> (16 * h));
      A[g + 8][2 * cc + h] = cvt(r[1] >> (16 * h));
      A[g][2 * cc + 8 + h] = cvt(r[2] >> (16 * h));
      A[g + 8][2 * cc + 8 + h] = cvt(r[3] >> (16 * h));
      B[2 * cc + h][g] = cvt(r[4] >> (16 * h));
      B[2 * cc + 8 + h][g] = cvt(r[5] >> (16 * h));
    }
  }
  const u32 g = (lid & 31u) >> 2, cc = lid & 3u;
  float d[4];
  for (int i = 0; i < 4; i++) {
    const u32 row = g + 8 * (i >> 1), col = 2 * cc + (i & 1);
    double s = c[i];
    for (int k = 0; k < 16; k++) s += A[row][k] * B[k][col];
    d[i] = (float)s;
  }
  sim_yield(2);
  for (int i = 0; i < 4; i++) c[i] = d[i];
}
// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16 over the SIMD group (backend_cuda.h): every
// lane's row address is exchanged, then lane (q, c) gathers its two elements of each matrix.
inline void sim_ldmatrix(const u32* base, u32 i, u32* r, bool trans) {
  const auto* p = (const unsigned char*)(base + i);
  if ((p - sim_arena.data()) % 16 || p < sim_arena.data() || p + 16 > sim_arena.data() + sim_arena.size())
    sim_fail("ldmatrix row address unaligned or outside threadgroup memory");
  const u32 lid = sim_cur->lid, lane = lid & 31u, q = lane >> 2, c = lane & 3u;
  sim_xchg[lid] = (u64)(uintptr_t)p;
  sim_yield(2);
  auto elem = [&](u32 src_lane, u32 e) {
    u16 h;
    std::memcpy(&h, (const unsigned char*)(uintptr_t)sim_xchg[(lid & ~31u) + src_lane] + 2 * e, 2);
    return (u32)h;
  };
  u32 out[4];
  for (u32 m = 0; m < 4; m++)
    out[m] = trans ? elem(8 * m + 2 * c, q) | elem(8 * m + 2 * c + 1, q) << 16
                   : elem(8 * m + q, 2 * c) | elem(8 * m + q, 2 * c + 1) << 16;
  sim_yield(2);
  for (u32 m = 0; m < 4; m++) r[m] = out[m];
}
#define KX_LDMATRIX_X4(base, i, r) sim_ldmatrix((const u32*)(base), (u32)(i), (r), false)
#define KX_LDMATRIX_X4_TRANS(base, i, r) sim_ldmatrix((const u32*)(base), (u32)(i), (r), true)

#ifndef KX_HAS_MMA_F16
#error "build with -DKX_HAS_MMA_F16=0 or 1"
#endif
#if KX_HAS_MMA_F16
#define KX_MMA_F16_F32(c, a0, a1, a2, a3, b0, b1) sim_mma((c), (a0), (a1), (a2), (a3), (b0), (b1))
#define KX_MMA_BF16_F32(c, a0, a1, a2, a3, b0, b1) sim_mma((c), (a0), (a1), (a2), (a3), (b0), (b1), true)
#endif

// ---- launching ----------------------------------------------------------------------------------
inline void (*sim_thread_fn)() = nullptr;

inline void sim_fiber_entry() {
  sim_thread_fn();
  if (!sim_cur->copies.empty()) sim_fail("a thread finished with asynchronous copies still in flight");
  sim_cur->done = true;
}

// Run grid (in threads) / threadgroup the CUDA way: whole threadgroups, ceil(grid / tg) of them.
inline void sim_launch(const u32 grid[3], const u32 tg[3], void (*fn)()) {
  if (tg[1] != 1 || tg[2] != 1 || tg[0] % 32 != 0) sim_fail("bodies are written for 1-D threadgroups of whole SIMD groups");
  const u32 threads = tg[0];
  static std::vector<std::vector<char>> stacks;
  if (stacks.size() < threads) stacks.resize(threads, std::vector<char>(128 * 1024));
  sim_fibers.assign(threads, SimFiber{});
  sim_xchg.assign(threads, 0);
  sim_mma_regs.assign(threads, {});
  sim_thread_fn = fn;
  for (int d = 0; d < 3; d++) sim_tgsize[d] = tg[d];
  const u32 groups[3] = {(grid[0] + tg[0] - 1) / tg[0], (grid[1] + tg[1] - 1) / tg[1], (grid[2] + tg[2] - 1) / tg[2]};
  for (u32 z = 0; z < groups[2]; z++)
    for (u32 y = 0; y < groups[1]; y++)
      for (u32 x = 0; x < groups[0]; x++) {
        sim_tgid[0] = x, sim_tgid[1] = y, sim_tgid[2] = z;
        std::memset(sim_arena.data(), 0xFF, sim_arena.size());  // poison: NaN floats, NaN halves
        for (u32 i = 0; i < threads; i++) {
          SimFiber& f = sim_fibers[i];
          f = SimFiber{};
          f.lid = i;
          getcontext(&f.ctx);
          f.ctx.uc_stack.ss_sp = stacks[i].data();
          f.ctx.uc_stack.ss_size = stacks[i].size();
          f.ctx.uc_link = &sim_main_ctx;
          makecontext(&f.ctx, sim_fiber_entry, 0);
        }
        while (true) {
          for (auto& f : sim_fibers)
            if (!f.done && f.wait == 0) {
              sim_cur = &f;
              swapcontext(&sim_main_ctx, &f.ctx);
            }
          u32 done = 0, at_barrier = 0;
          bool released = false;
          for (u32 w = 0; w < threads / 32; w++) {
            u32 syncing = 0, lane_done = 0;
            for (u32 l = 0; l < 32; l++) {
              syncing += sim_fibers[32 * w + l].wait == 2;
              lane_done += sim_fibers[32 * w + l].done;
            }
            if (syncing == 32) {
              for (u32 l = 0; l < 32; l++) sim_fibers[32 * w + l].wait = 0;
              released = true;
            } else if (syncing) {
              sim_fail("SIMD-group exchange with only part of the group (divergent lanes)");
            }
            done += lane_done;
          }
          if (released) continue;
          for (auto& f : sim_fibers) at_barrier += f.wait == 1;
          if (done == threads) break;
          if (at_barrier + done != threads) sim_fail("deadlock");
          if (done) sim_fail("threadgroup barrier after some threads returned");
          for (auto& f : sim_fibers) f.wait = 0;
        }
      }
}
