// The count by which a launch's last threadgroup finishes the others' work (docs/design.md#grid-finish).
#pragma once

// A FINISH launch's count (KX_HAS_GRID_FINISH; exl3_gemv, the expert kernels, hc_site, moe_gate):
// after this threadgroup's partial sums are stored, whether it is the last of `arrivals`
// threadgroups to store partials for counters[i]; that last one sets the counter back to 0 (each
// launch leaves its counters at 0 for the next) and may then read every arrival's partials
// (through L2). Every thread of the threadgroup calls it (tid: its
// index in the one-dimensional threadgroup); last: 1 word of threadgroup memory.
KX_INLINE bool grid_finish_arrival(const KX_DEVICE u32* counters, u64 i, u32 arrivals, KX_THREADGROUP u32* last,
                                   u32 tid) {
  KX_GRID_FENCE();  // this thread's partial sums, visible to every threadgroup before the count
  KX_BARRIER();
  if (tid == 0) {
    last[0] = KX_ATOMIC_INC(counters + i) + 1 == arrivals ? 1u : 0u;
    if (last[0]) KX_ATOMIC_ZERO(counters + i);
  }
  KX_BARRIER();
  const bool is_last = last[0] != 0u;
  if (is_last) KX_GRID_FENCE();
  return is_last;
}
