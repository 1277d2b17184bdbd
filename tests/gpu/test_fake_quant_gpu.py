"""fake_quant on the GPU (issue 16: one launch for the eight of its plain-MLX twin), with the kernel
contract: the CPU twin's bytes (mlx_dsv41/model/fake_quant.py on the CPU stream) for the three uses
at Flash's widths, with NaN / inf where the twin puts them; outputs poisoned before launch with
guard rows untouched; five repeats byte-identical; the launch limit declared."""

import mlx.core as mx
import numpy as np
import pytest
from test_fake_quant_sim import CASES, _bits, inputs

from mlx_dsv41.kernels import fake_quant as fqk
from mlx_dsv41.model import fake_quant as fq

pytestmark = pytest.mark.gpu


def _twin_on_cpu(monkeypatch, twin, x):
    with monkeypatch.context() as m, mx.stream(mx.cpu):
        m.setattr(fq, "backend", lambda: "cpu")
        y = twin(x)
        return np.array(y.astype(mx.float32))


@pytest.mark.parametrize("i", range(len(CASES)))
@pytest.mark.parametrize("shape", [(3, 5, 128), (1, 1, 64, 512), (4, 7, 512)])
def test_the_gpu_kernel_gives_the_cpu_twins_bytes(monkeypatch, i, shape):
    dtype, block, mode, twin = CASES[i]
    x = inputs(i, dtype)
    if shape != (3, 5, 128):
        x = mx.array(np.resize(np.array(x.astype(mx.float32)), shape)).astype(dtype)
    assert fq._on_kernel(x, block)
    got = np.array(twin(x).astype(mx.float32))  # the GPU path: the kernel
    want = _twin_on_cpu(monkeypatch, twin, x)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(_bits(np.ascontiguousarray(got[~nan])), _bits(np.ascontiguousarray(want[~nan])))


def test_contract_poison_guards_repeats_and_limits(monkeypatch):
    x = inputs(3, mx.bfloat16)
    call = fqk.args(x, 32, fqk.FP4_UE8M0, init_value=float("nan"), guard=2)
    runs = [np.array(fqk.FAKE_QUANT(**call)[0].astype(mx.float32)) for _ in range(5)]
    assert all(np.array_equal(_bits(r), _bits(runs[0])) for r in runs)
    assert np.all(np.isnan(runs[0][-2:]))  # guard rows keep the poison
    # NaN exactly where the twin puts it (a block holding inf has scale inf: its finite values give 0 * inf)
    twin = _twin_on_cpu(monkeypatch, lambda v: fq.fake_quant_fp4(v, 32), x).reshape(15, 128)
    assert np.array_equal(np.isnan(runs[0][:-2]), np.isnan(twin))
    with pytest.raises(ValueError, match="declared limit"):
        fqk.FAKE_QUANT(**dict(fqk.args(x, 32, fqk.FP4_UE8M0), threadgroup=(512, 1, 1)))
