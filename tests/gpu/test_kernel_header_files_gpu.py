"""CUDA kernel headers as files (docs/design.md#kernel-header-files) on the device: NVRTC compiles the
one-line #include MLX is handed, and the example launches of kernels with small and large headers
give the same bytes as from the header text inline (every other GPU test runs every kernel from its
header file)."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_dsv41 import kernels
from mlx_dsv41.kernels import header_files as hf

pytestmark = pytest.mark.gpu
kernels.load_all()


def _run(k, calls, setting, monkeypatch, capfd):
    monkeypatch.setenv(hf.ENV_VAR, setting)
    monkeypatch.setattr(k, "_built", {})
    outs = []
    for i, call in enumerate(calls):
        # Outputs NaN-filled where the call sets no fill: a launch's 1-element stand-in output
        # (exl3_gemv's second without FINISH) is never written and would hold whatever memory it got
        # (the device run of 96dcfe8 compared such bytes: 0.0 against 1.414)
        fill = {} if call.get("init_value") is not None else {"init_value": float("nan")}
        res = k(**(call | fill), verbose=i == 0)
        mx.eval(res)
        # an output the launch leaves out (docs/design.md#absent-arguments) is None either way
        outs.append(
            [None if r is None else np.array(r.astype(mx.float32) if r.dtype == mx.bfloat16 else r) for r in res]
        )
    return outs, capfd.readouterr().out


@pytest.mark.parametrize("name", ["fp32_gemv", "hc_site", "rope_pair", "moe_gate", "exl3_gemv"])
def test_a_header_file_gives_the_inline_bytes(name, tmp_path, monkeypatch, capfd):
    if kernels.backend() != "cuda":
        pytest.skip("header files are CUDA's")
    k = kernels.REGISTRY[name]
    calls = k.examples()
    by_file, printed = _run(k, calls, str(tmp_path), monkeypatch, capfd)
    assert f'#include "{tmp_path.resolve()}/{name}-' in printed  # what NVRTC compiled
    inline, printed = _run(k, calls, "inline", monkeypatch, capfd)
    assert '#include "' + str(tmp_path.resolve()) not in printed
    for a, b in zip(by_file, inline):
        for x, y in zip(a, b):
            assert (x is None and y is None) or (x.dtype == y.dtype and x.tobytes() == y.tobytes())
