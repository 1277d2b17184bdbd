// compressor_raw's work (compressor_raw.metal: what it computes; docs/design.md#compressor-raw): the
// raw rings' slots and the copies of one row by a threadgroup of 256 threads.
#pragma once

// Slot of position pos + s in a ring of Q rows: (pos + s) mod Q as MLX's integer % computes it (the
// sign of the divisor), so a position before 0 (never asked for) would still land in the ring.
KX_INLINE u32 cr_slot(i32 pos, i32 s, u32 Q) {
  const i32 r = (pos + s) % (i32)Q;
  return (u32)(r < 0 ? r + (i32)Q : r);
}

// Row `j` of the S new rows that ring slot q receives (store_rows keeps the last keep = min(S, Q)
// rows, at slots (pos + s) mod Q), or S where the slot keeps its old row.
KX_INLINE u32 cr_new_row(u32 q, i32 pos, u32 S, u32 Q) {
  const u32 keep = S < Q ? S : Q;
  const u32 j = (q + Q - cr_slot(pos, (i32)(S - keep), Q)) % Q;
  return j < keep ? S - keep + j : S;
}

// The projections' outputs stored where a step wants them (fp32_gemv.h's output-sink contract): output
// n of row m = b · S + s to the open group's row P + s of batch b ([B, P + S, N]) and, for a row the
// ring keeps, to its slot of the new ring ([B, Q, N]).
struct CrSink {
  KX_DEVICE float* rows;
  KX_DEVICE float* ring;
  u32 N, Q, S, P;
  i32 pos;
  KX_INLINE void store(u32 m, u32 n, float v) const {
    const u32 b = m / S, s = m % S;
    rows[((u64)b * (P + S) + P + s) * N + n] = v;
    const u32 keep = S < Q ? S : Q;
    if (s >= S - keep) ring[((u64)b * Q + cr_slot(pos, (i32)s, Q)) * N + n] = v;
  }
};

// One row of N floats from src to dst, thread lid taking elements lid, lid + 256, ...
KX_INLINE void cr_copy(const KX_DEVICE float* src, KX_DEVICE float* dst, u32 N, u32 lid) {
  for (u32 d = lid; d < N; d += 256) dst[d] = src[d];
}

// Copy task c of one rings' pair (0: kv, 1: gate), per batch row b: its Q ring slots (the old row, or
// with given rows the new row that reaches the slot: a projected row is stored by its threadgroup),
// then with ROWS the open group's P held rows (ring slots (pos - P + p) mod Q of the ring as it was)
// and with given rows its S new rows.
template <int S, int P, int PROJECT, int ROWS>
KX_INLINE void cr_copy_task(u32 c, const KX_DEVICE float* ring_in, const KX_DEVICE float* given,
                            KX_DEVICE float* rows, KX_DEVICE float* ring, u32 N, u32 Q, i32 pos, u32 lid) {
  const u32 L = Q + (ROWS ? P + (PROJECT ? 0 : S) : 0);
  const u32 b = c / L, r = c % L;
  const u64 rb = (u64)b * (P + S);
  if (r < Q) {
    const u32 s = cr_new_row(r, pos, S, Q);
    if (s == S) {
      cr_copy(ring_in + ((u64)b * Q + r) * N, ring + ((u64)b * Q + r) * N, N, lid);
    } else if (!PROJECT) {
      cr_copy(given + ((u64)b * S + s) * N, ring + ((u64)b * Q + r) * N, N, lid);
    }
  } else if (r < Q + P) {
    const u32 p = r - Q;
    cr_copy(ring_in + ((u64)b * Q + cr_slot(pos, (i32)p - P, Q)) * N, rows + (rb + p) * N, N, lid);
  } else {
    const u32 s = r - Q - P;
    cr_copy(given + ((u64)b * S + s) * N, rows + (rb + P + s) * N, N, lid);
  }
}
