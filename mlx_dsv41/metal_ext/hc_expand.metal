// hc_expand: new_j = post[j] · y + Σ_i comb[i][j] · old_i for (token KX_TID_Y, dim KX_TID_X)
// (docs/model.md#mhc expand: the streams mix with combᵀ), in fp32 with FMAs in stream order,
// rounded to T (hc.h: hc_expand_value). y [.., D], residual [.., HC, D]; post and comb are read in
// place from the site's mixes [.., (2+HC)·HC] = pre | post | comb. Template: T (residual and output
// dtype), HC.
const u32 d = KX_TID_X, t = KX_TID_Y;
const u32 D = y_shape[y_ndim - 1];
if (d < D) {
  HcVals<HC> s;
  for (int i = 0; i < HC; i++) s.v[i] = KX_TO_F32(residual[((u64)t * HC + i) * D + d]);
  const float yv = KX_TO_F32(y[(u64)t * D + d]);
  const KX_DEVICE float* row = mixes + (u64)t * (2 + HC) * HC;
  for (int j = 0; j < HC; j++)
    out[((u64)t * HC + j) * D + d] = hc_expand_value<T, HC>(s, yv, hc_comb_column<HC>(row, j), row[HC + j]);
}
