// compressor_raw: a ratio > 1 compressor's step front in one launch (docs/design.md#compressor-raw,
// docs/cache.md#open-groups). S new tokens at positions pos .. pos + S - 1 (pos = offset, a 0-d
// int32), P = pos mod ratio rows of the open group held in the raw rings raw_kv / raw_gate [B, Q, N]
// (fp32, position p at slot p mod Q). The new rows are, with PROJECT, a = fp32(x) · wkvᵀ and
// g = fp32(x) · wgateᵀ for x [B, S, K] and weights [N, K] as stored (fp32_gemv's threadgroups and
// sums, fp32_gemv.h, so fp32_gemv's bytes; template M = B · S, COLS, SPLIT, W as its launch), else
// the given fp32 rows kv / gate [B, S, N]. Outputs: kv_rows / gate_rows [B, P + S, N], the open
// group's held rows then the new ones (LayerCache.group_inputs' result; without ROWS, P = 0 and the
// given rows are the result: not written), and kv_ring / gate_ring, the rings with the last min(S, Q)
// new rows at their slots and every other slot copied (store_rows' result). Threadgroups of 256:
// with PROJECT first fp32_gemv's groups for wkv, then for wgate, storing each output in both places;
// then per ring and batch row the copy tasks of cr_copy_task. Inputs a template does not read are
// stand-ins (docs/design.md#absent-arguments).
KX_SHARED(float, sums, 8 * 8 * 4);
const u32 N = raw_kv_shape[2], Q = raw_kv_shape[1];
const i32 pos = KX_SCALAR(offset);
const u32 G = PROJECT ? fp32_gemv_groups<COLS, SPLIT>(N) : 0;
const u32 t = KX_TGID_X;
if (t < 2 * G) {
  const bool second = t >= G;
  const CrSink sink = {second ? gate_rows : kv_rows, second ? gate_ring : kv_ring, N, Q, (u32)S, (u32)P, pos};
  const u32 K = wkv_shape[1];
  fp32_gemv_group_into<M, COLS, SPLIT, W>(fp32_rows(x, K), second ? wgate : wkv, sink, N, K, sums, t - (second ? G : 0),
                                          KX_WARP, KX_LANE);
} else {
  const u32 L = Q + (ROWS ? P + (PROJECT ? 0 : S) : 0), c = t - 2 * G, tasks = (M / S) * L;
  const bool second = c >= tasks;
  cr_copy_task<S, P, PROJECT, ROWS>(c - (second ? tasks : 0), second ? raw_gate : raw_kv, second ? gate : kv,
                                    second ? gate_rows : kv_rows, second ? gate_ring : kv_ring, N, Q, pos, KX_LID_X);
}
