"""Non-temporal weight prefetch in the linear kernel (kernels/cpu_linear.cpp, `stream_weights`): a process-wide
hint that a compiled forward turns on when its model's weights exceed the last-level cache. The sums must not
change with it, in the paths that read each weight once (one row of x: row by row and in tiles; two rows of
bfloat16: tiles) nor in the blocked product beside them, and the decision follows the model's size."""

from __future__ import annotations

import pytest
import torch

from paged_backend.kernels import cpu_linear
from paged_backend.worker.kernel_linear import stream_kernel_weights

pytestmark = pytest.mark.skipif(not cpu_linear.op_available(), reason="the linear kernel does not build here")


@pytest.fixture
def restore_streaming():
    before = cpu_linear.streaming()
    yield
    cpu_linear.set_streaming(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,k", [(1, 576), (1, 1536), (1, 2304), (2, 576), (5, 1536)])
def test_streamed_products_have_the_same_bits(restore_streaming, dtype, rows, k):
    g = torch.Generator().manual_seed(rows * 1000 + k)
    weight = (torch.randn(200, k, generator=g) * 0.05).to(dtype)
    x = torch.randn(rows, k, generator=g).to(dtype)
    outs = {}
    for on in (False, True):
        cpu_linear.set_streaming(on)
        assert cpu_linear.streaming() is on
        outs[on] = torch.ops.paged_backend.linear_rows(x, weight, None, 0 if dtype == torch.float32 else 256)
    assert torch.equal(outs[False], outs[True])
    assert torch.allclose(outs[True].double(), x.double() @ weight.double().T, rtol=2e-2, atol=2e-2)


def test_streaming_follows_the_weights_against_the_cache(restore_streaming, monkeypatch):
    assert cpu_linear.stream_weights(100, cache_bytes=50) and not cpu_linear.stream_weights(50, cache_bytes=50)
    llc = cpu_linear.last_level_cache_bytes()
    assert llc is None or llc >= 2**20   # Linux reports the L2 or L3 on any CPU the tests run on
    monkeypatch.setattr(cpu_linear, "last_level_cache_bytes", lambda: None)
    assert not cpu_linear.stream_weights(10**12)   # an unknown cache: no streaming
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64, bias=False))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    monkeypatch.setattr(cpu_linear, "last_level_cache_bytes", lambda: weight_bytes - 1)
    assert stream_kernel_weights(model) and cpu_linear.streaming()
    monkeypatch.setattr(cpu_linear, "last_level_cache_bytes", lambda: weight_bytes)
    assert not stream_kernel_weights(model) and not cpu_linear.streaming()


def test_last_level_cache_is_the_largest_size_sysfs_reports(tmp_path):
    for index, size in enumerate(["32K", "32K", "1024K", "32768K"]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    (tmp_path / "index4").mkdir()   # no size file: skipped
    assert cpu_linear.last_level_cache_bytes(str(tmp_path)) == 32 * 2**20
    assert cpu_linear.last_level_cache_bytes(str(tmp_path / "missing")) is None
