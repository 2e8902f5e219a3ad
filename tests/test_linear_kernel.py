"""The linear kernel for few rows (`kernels/cpu_linear.cpp`) and its operator in the compiled forward
(`kernels/cpu_linear_op.cpp`, `worker/kernel_linear.py`): exact where the sums are exact, within one rounding
elsewhere, refusals by name, PyTorch's linear wherever the kernel does not apply. The engine's compiled steps:
tests/test_compiled_forward.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paged_backend.kernels import cpu_linear
from paged_backend.worker.kernel_linear import KernelLinear, use_linear_kernel

pytestmark = pytest.mark.skipif(not cpu_linear.op_available(), reason="no C++ compiler: the kernel cannot be built")

HALVES = [torch.bfloat16, torch.float16]
KINDS = HALVES + [torch.float32]
KIND_IDS = ["bf16", "fp16", "fp32"]


def _integers(shape, generator, low=-8, high=9) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=generator).to(torch.float64)


def kernel(x: torch.Tensor, w: torch.Tensor, b=None) -> torch.Tensor:
    """The operator with no row limit, checked to have run the kernel (not PyTorch's linear)."""
    calls = cpu_linear.kernel_calls()
    out = torch.ops.paged_backend.linear_rows(x, w, b, 0)
    assert cpu_linear.kernel_calls() == calls + 1
    return out


def _exact(x: torch.Tensor, w: torch.Tensor, b) -> torch.Tensor:
    out = x.double() @ w.double().T
    return (out if b is None else out + b.double()).to(w.dtype)


@pytest.mark.parametrize("dtype", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 12, 15, 16, 17, 20, 40, 48, 56])
# below the blocked product's first row count (16; with AVX-512 float32 2, bfloat16 3, float16 8): passes of dot
# products over each work item's weights (up to 8 rows with AVX-512, else 4); from there the blocked product (panels
# of two vectors of rows padded with zero rows, the last one of one vector or, with AVX-512, half a vector where no
# more rows are left: 17 and 20 take one vector and half of one in float32 and float16 with AVX-512, a padded panel
# of two otherwise; 40 half a vector, 48 one vector and 56 one and a half after a whole one with AVX-512); 576: a multiple of every vector width; 67 and 83: tails of vectors and of elements (one-row products read
# rows of up to 1024 elements one by one, four vectors at a time; bfloat16 through AVX512_BF16 up to 2048); 1100: rows
# long enough for the tiles at one row (float32, float16, and bfloat16 without AVX512_BF16); 2100: for all
@pytest.mark.parametrize("in_features", [576, 67, 83, 1100, 2100])
def test_integer_operands_give_the_exactly_rounded_sum(dtype, rows, in_features):
    """Small integers: every product and partial sum is exact in float32, so the result is the exact sum rounded
    once to the dtype, whatever the order of the additions; any misplaced row, column or tail element shows."""
    g = torch.Generator().manual_seed(rows * 1000 + in_features)
    out_features = 37   # odd: the kernel's last weight row is read alone
    for bias in (None, _integers((out_features,), g)):
        x = _integers((rows, in_features), g).to(dtype)
        w = _integers((out_features, in_features), g).to(dtype)
        b = None if bias is None else bias.to(dtype)
        got = kernel(x, w, b)
        assert got.dtype == dtype and got.shape == (rows, out_features)
        assert torch.equal(got, _exact(x, w, b))


@pytest.mark.parametrize("dtype", KINDS, ids=KIND_IDS)
def test_random_operands_are_within_one_rounding_of_the_exact_sum(dtype):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 1536, generator=g).to(dtype)
    w = (torch.randn(200, 1536, generator=g) * 0.05).to(dtype)
    b = torch.randn(200, generator=g).to(dtype)
    got, exact = kernel(x, w, b).double(), _exact(x, w, b).double()
    if dtype == torch.float32:   # float32 sums of 1536 products: within a few ulp of the scale of the terms
        assert ((got - exact).abs() <= 1e-5 * (x.double().abs() @ w.double().abs().T + b.double().abs())).all()
        return
    ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
    assert ((got - exact).abs() <= exact.abs() * ulp + 1e-6).all()
    assert (got == exact).float().mean() > 0.9   # float32 sums rarely round to another neighbour


@pytest.mark.parametrize("dtype", KINDS, ids=KIND_IDS)
def test_a_row_of_a_blocked_product_does_not_depend_on_its_neighbours(dtype):
    """From the blocked product's first row count on (16; with AVX-512 float32 2, bfloat16 3, float16 8), each output
    is one float32 sum over k in order, whatever the other rows and whether its panel is two vectors wide, one or
    half of one: a prompt's logits come out bit for bit the same alone or beside other prompts in a step, a decode
    batch's rows the same at any size."""
    first = cpu_linear.blocked_from_rows(dtype)
    assert first in (2, 3, 8, 16)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(56, 576, generator=g).to(dtype)
    w = (torch.randn(37, 576, generator=g) * 0.05).to(dtype)
    full = kernel(x, w)   # with AVX-512 a whole panel of 32 rows, then (float32) one of 16 and one of 8
    slices = [(0, 16), (0, 17), (16, 33), (23, 40), (1, 40), (0, 48), (32, 48), (5, 48), (0, 8), (32, 40), (40, 48),
              (0, 20), (4, 28), (30, 54), (1, 56), (0, 24), (31, 56)]
    slices += [(3, 3 + first), (10, 10 + first + 2)]
    for start, stop in slices:
        if stop - start >= first:
            assert torch.equal(kernel(x[start:stop], w), full[start:stop]), (start, stop)


@pytest.mark.parametrize("dtype", KINDS, ids=KIND_IDS)
def test_a_row_of_dot_products_does_not_depend_on_how_the_rows_are_split_into_passes(dtype):
    """Below the blocked product's first row count each output is one dot product over k whatever the other rows
    and the pass it falls in (up to 8 rows with AVX-512, 4 otherwise), except a pass of one row over rows of up to
    1024 elements, which reads them row by row in another order (dot_row): no slice here leaves one row alone in a
    pass. (Float32 with AVX-512 has no such passes: from 2 rows on its products are blocked.)"""
    below = cpu_linear.blocked_from_rows(dtype) - 1
    g = torch.Generator().manual_seed(13)
    x = torch.randn(15, 576, generator=g).to(dtype)
    w = (torch.randn(37, 576, generator=g) * 0.05).to(dtype)
    candidates = [(0, 2), (1, 3), (2, 4), (0, 3), (1, 4), (2, 7), (3, 9), (4, 12), (7, 15), (1, 11), (8, 15)]
    slices = [(start, stop) for start, stop in candidates if stop <= below]
    full = kernel(x[:below], w) if below > 1 else None
    for start, stop in slices:
        assert torch.equal(kernel(x[start:stop], w), full[start:stop]), (start, stop)
    if below == 1:   # the first row count is 2: a pair is already the blocked product's, as in a larger call
        assert torch.equal(kernel(x[:2], w), kernel(x, w)[:2])


def test_strided_and_batched_inputs():
    """x may be a view with a row stride (a slice of wider rows) and have leading dimensions, at few rows and in
    the blocked product (2 x 10 rows)."""
    g = torch.Generator().manual_seed(3)
    w = _integers((16, 64), g).to(torch.bfloat16)
    for lead in (3, 10):
        wide = _integers((2, lead, 100), g).to(torch.bfloat16)
        x = wide[..., :64]
        got = kernel(x, w)
        assert got.shape == (2, lead, 16)
        assert torch.equal(got, _exact(x.reshape(2 * lead, 64), w, None).reshape(2, lead, 16))
    column = _integers((64, 2), g).to(torch.bfloat16)[:, 0]   # one row whose elements are strided
    assert torch.equal(kernel(column, w), _exact(column[None], w, None)[0])


def test_nan_and_infinity_propagate():
    x = torch.ones(1, 32, dtype=torch.bfloat16)
    w = torch.ones(3, 32, dtype=torch.bfloat16)
    w[1, 5] = float("nan")
    w[2, 7] = float("inf")
    got = kernel(x, w)
    assert got[0, 0] == 32 and torch.isnan(got[0, 1]) and got[0, 2] == float("inf")


@pytest.mark.parametrize("case", ["float64", "mixed dtypes", "no rows", "strided weight", "bias shape"])
def test_operands_the_kernel_does_not_take_get_pytorchs_linear(case):
    x = torch.ones(2, 8, dtype=torch.bfloat16)
    w = torch.ones(4, 8, dtype=torch.bfloat16)
    b = None
    if case == "float64":
        x, w = x.double(), w.double()
    elif case == "mixed dtypes":
        x = x.to(torch.float16)
    elif case == "no rows":
        x = torch.ones(0, 8, dtype=torch.bfloat16)
    elif case == "strided weight":
        w = torch.ones(8, 4, dtype=torch.bfloat16).T
    else:
        b = torch.ones(5, dtype=torch.bfloat16)
    # the operator runs PyTorch's linear there instead, bit for bit, and its kernel does not run (mixed dtypes and
    # a bias of the wrong shape are PyTorch's errors then)
    assert cpu_linear.op_available()
    calls = cpu_linear.kernel_calls()
    if case in ("float64", "no rows", "strided weight"):
        assert torch.equal(torch.ops.paged_backend.linear_rows(x, w, b, 0), F.linear(x, w, b))
    else:
        with pytest.raises(RuntimeError):
            torch.ops.paged_backend.linear_rows(x, w, b, 0)
    assert cpu_linear.kernel_calls() == calls


@pytest.mark.parametrize("dtype", KINDS, ids=KIND_IDS)
def test_the_operator_runs_the_kernel_up_to_its_row_limit(dtype):
    """Under a row limit the operator gives the unlimited kernel's bits in any leading shape, a bias included,
    and counts each run; above a positive row limit it is PyTorch's linear, bit for bit."""
    assert cpu_linear.op_available()
    g = torch.Generator().manual_seed(11)
    w = torch.randn(40, 96, generator=g).to(dtype)
    b = torch.randn(40, generator=g).to(dtype)
    for shape in [(1, 1, 96), (1, 3, 96), (8, 96), (2, 2, 2, 96), (1, 33, 96)]:
        x = torch.randn(*shape, generator=g).to(dtype)
        rows = x.numel() // 96
        for limit in (0, 8):
            calls = cpu_linear.kernel_calls()
            got = torch.ops.paged_backend.linear_rows(x, w, b, limit)
            assert got.shape == (*shape[:-1], 40)
            if limit and rows > limit:
                assert cpu_linear.kernel_calls() == calls and torch.equal(got, F.linear(x, w, b))
            else:
                assert cpu_linear.kernel_calls() == calls + 1 and torch.equal(got, kernel(x, w, b))


def test_the_row_limits_follow_onednns_native_half_precision_the_cpu_vendor_and_the_vector_width(monkeypatch):
    from paged_backend.kernels import cpu_features

    for onednn, kernel_bf16, amx, limit in ((True, False, False, cpu_linear.FEW_ROWS), (False, False, False, 0),
                                            (True, True, False, cpu_linear.NATIVE_BFLOAT16_ROWS),
                                            (True, True, True, cpu_linear.FEW_ROWS), (False, True, False, 0)):
        monkeypatch.setattr(cpu_features, "onednn_half_matmuls", lambda: {"bfloat16": onednn, "float16": False})
        monkeypatch.setattr(cpu_linear, "native_bfloat16", lambda: kernel_bf16)
        flags = "avx512f avx512_bf16" + (" amx_bf16" if amx else "")
        monkeypatch.setattr(cpu_features, "cpu_features",
                            lambda: cpu_features.parse_cpuinfo(f"flags\t: {flags}\n", "x86_64"))
        assert cpu_linear.max_rows(torch.bfloat16) == limit, (onednn, kernel_bf16, amx)
        assert cpu_linear.max_rows(torch.float16) == 0
    assert cpu_linear.cpu_vendor() in ("GenuineIntel", "AuthenticAMD", "")
    for vendor, bits, limit in (("GenuineIntel", 512, cpu_linear.FLOAT32_INTEL_ROWS), ("GenuineIntel", 256, None),
                                ("AuthenticAMD", 256, cpu_linear.FLOAT32_ROWS), ("AuthenticAMD", 512, 0),
                                ("", None, cpu_linear.FLOAT32_ROWS), ("", 512, 0)):
        monkeypatch.setattr(cpu_linear, "cpu_vendor", lambda: vendor)
        monkeypatch.setattr(cpu_features, "kernel_vector_bits", lambda: bits)
        assert cpu_linear.max_rows(torch.float32) == limit, (vendor, bits)
        layer = torch.nn.Linear(8, 8)
        assert use_linear_kernel(layer) == (limit is not None)
        assert type(layer) is (torch.nn.Linear if limit is None else KernelLinear)
    with pytest.raises(ValueError, match="bfloat16, float16 and float32"):
        cpu_linear.max_rows(torch.float64)



def test_use_linear_kernel_swaps_the_linears_it_serves_and_eager_calls_stay_pytorchs(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8).to(torch.bfloat16), torch.nn.Linear(8, 8).double(),
                                torch.nn.Linear(8, 8).to(torch.float16))
    assert use_linear_kernel(model) == 2
    assert [type(m) for m in model] == [KernelLinear, torch.nn.Linear, KernelLinear]
    calls = cpu_linear.kernel_calls()
    x = torch.randn(1, 8)
    assert torch.equal(model[0](x.bfloat16()), F.linear(x.bfloat16(), model[0].weight, model[0].bias))
    assert cpu_linear.kernel_calls() == calls   # eagerly: PyTorch's linear, the one compared with transformers
    off = torch.nn.Linear(8, 8).to(torch.bfloat16)
    monkeypatch.setenv("PAGED_BACKEND_LINEAR_KERNEL", "0")
    assert use_linear_kernel(off) == 0 and type(off) is torch.nn.Linear
    monkeypatch.setenv("PAGED_BACKEND_LINEAR_KERNEL", "maybe")
    with pytest.raises(ValueError, match="PAGED_BACKEND_LINEAR_KERNEL"):
        use_linear_kernel(off)


def group(x: torch.Tensor, weights, biases, max_rows: int = 0):
    """`linear_rows_N` over the weights (N = their count)."""
    args = [a for pair in zip(weights, biases) for a in pair]
    return getattr(torch.ops.paged_backend, f"linear_rows_{len(weights)}")(x, *args, max_rows)


@pytest.mark.parametrize("dtype", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("rows", [1, 3, 6, 20])
@pytest.mark.parametrize("threads", [1, 3])
def test_several_weights_over_one_input_are_each_the_single_product_bit_for_bit(dtype, rows, threads):
    """`linear_rows_N` (one call, one parallel region for a layer's q, k and v) gives each weight's output exactly
    as `linear_rows` alone, biases or not, however the threads share the weights' rows (17 and 40: row counts
    off the 16- and 24-row work items and the 4- and 6-row tiles)."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 67, generator=g).to(dtype)
    weights = [torch.randn(n, 67, generator=g).to(dtype) for n in (40, 8, 17, 5)]
    biases = [None, torch.randn(8, generator=g).to(dtype), torch.randn(17, generator=g).to(dtype), None]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for count in cpu_linear.GROUP_SIZES:
            calls = cpu_linear.kernel_calls()
            outs = group(x, weights[:count], biases[:count])
            assert cpu_linear.kernel_calls() == calls + 1 and len(outs) == count
            for out, w, b in zip(outs, weights, biases):
                assert out.shape == (rows, w.shape[0]) and torch.equal(out, kernel(x, w, b))
    finally:
        torch.set_num_threads(before)


def test_several_weights_fall_back_together():
    """Above the row limit every weight is PyTorch's linear; a weight the kernel does not take (strided) sends
    each weight through `linear_rows` alone."""
    g = torch.Generator().manual_seed(5)
    weights = [torch.randn(n, 32, generator=g).bfloat16() for n in (12, 4)]
    many = torch.randn(9, 32, generator=g).bfloat16()
    calls = cpu_linear.kernel_calls()
    outs = group(many, weights, [None, None], 8)
    assert cpu_linear.kernel_calls() == calls
    assert all(torch.equal(o, F.linear(many, w)) for o, w in zip(outs, weights))
    x = many[:2]
    strided = torch.randn(32, 6, generator=g).bfloat16().T
    outs = group(x, [*weights, strided], [None, None, None], 8)
    assert cpu_linear.kernel_calls() == calls + 2   # the two contiguous weights alone, the strided one PyTorch's
    assert [torch.equal(o, e) for o, e in zip(outs, [kernel(x, weights[0]), kernel(x, weights[1]),
                                                     F.linear(x, strided)])] == [True] * 3


@pytest.mark.parametrize("limit", [0, 8])
def test_the_compiled_graph_calls_the_operator(limit):
    """Traced (no code generated: aot_eager), a KernelLinear is the operator with its row limit."""
    layer = torch.nn.Linear(64, 32).to(torch.bfloat16)
    assert use_linear_kernel(layer) == 1
    assert layer.kernel_max_rows == cpu_linear.max_rows(torch.bfloat16)
    layer.kernel_max_rows = limit
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 64).bfloat16()
    many = torch.randn(9, 64).bfloat16()
    with torch.no_grad():
        expected = kernel(x, layer.weight, layer.bias)
        expected_many = (F.linear if limit else kernel)(many, layer.weight, layer.bias)   # PyTorch's above 8 rows
        calls = cpu_linear.kernel_calls()
        assert torch.equal(compiled(x), expected)
        assert cpu_linear.kernel_calls() == calls + 1
        assert torch.equal(compiled(many), expected_many)
    assert cpu_linear.kernel_calls() == calls + 1 + (limit == 0)


def test_bfloat16_subnormal_operands_count_as_zero_exactly_where_avx512_bf16_multiplies_them():
    """Built for AVX512_BF16, bfloat16 products go through `vdpbf16ps` (from two rows on, and at one row over rows
    of up to 2048 elements), which counts operands below float32's normal range as zero (PyTorch's float32 sums
    keep them); one row over longer rows, and every product in a build without it, stays float32 FMAs, which keep
    them."""
    from paged_backend.kernels.cpu_features import cpu_features

    native = cpu_linear.native_bfloat16()
    assert not native or cpu_features().has("avx512_bf16")   # the build follows the CPU (-march=native)
    for k in (64, 1088, 2112):
        w = torch.full((3, k), 2.0 ** 60, dtype=torch.bfloat16)
        for rows in (1, 2, 8, 16):
            x = torch.full((rows, k), 2.0 ** -130, dtype=torch.bfloat16)   # subnormal
            expected = 0.0 if native and (rows > 1 or k <= 2048) else k * 2.0 ** -70
            assert kernel(x, w).float().unique().tolist() == [expected], (k, rows, native)
