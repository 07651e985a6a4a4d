"""The float32 few-rows product (``small_gemm``): equal to ``F.linear`` to float32 rounding, and
each row's result the same bit for bit whatever else the step holds and however many threads run."""

import pytest
import torch
import torch.nn.functional as F

from specserve.replicas.model import small_gemm

pytestmark = pytest.mark.skipif(small_gemm.library() is None, reason="no C compiler: F.linear serves")


@pytest.fixture(scope="module")
def weight():
    torch.manual_seed(0)
    return torch.randn(1536, 576) / 24, torch.randn(1536)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 17, small_gemm.MAX_ROWS])
def test_equals_f_linear_to_float32_rounding(weight, rows):
    w, b = weight
    x = torch.randn(rows, 576)
    for bias in (None, b):
        torch.testing.assert_close(small_gemm.linear(x, w, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-5)


def test_a_rows_result_does_not_depend_on_the_other_rows_or_the_threads(weight):
    w, b = weight
    x = torch.randn(small_gemm.MAX_ROWS, 576)
    full = small_gemm.linear(x, w, b)
    for i in range(len(x)):
        assert torch.equal(small_gemm.linear(x[i:i + 1], w, b)[0], full[i]), f"row {i} alone differs"
        assert torch.equal(small_gemm.linear(x[max(0, i - 2):i + 3], w, b)[min(i, 2)], full[i])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(small_gemm.linear(x, w, b), full)
    finally:
        torch.set_num_threads(threads)


def test_shapes_strides_and_what_it_leaves_to_torch(weight):
    w, b = weight
    x = torch.randn(2, 3, 576)
    torch.testing.assert_close(small_gemm.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    strided = torch.randn(4, 1200)[:, 10:586]   # rows not contiguous with each other
    torch.testing.assert_close(small_gemm.linear(strided, w, b), F.linear(strided, w, b), rtol=1e-5, atol=1e-5)
    many = torch.randn(small_gemm.MAX_ROWS + 1, 576)   # a prefill chunk: torch's BLAS, exactly
    assert torch.equal(small_gemm.linear(many, w, b), F.linear(many, w, b))
    grad = torch.randn(2, 576, requires_grad=True)     # recording gradients: torch's, differentiable
    assert small_gemm.linear(grad, w, b).requires_grad
    assert not small_gemm.takes(w.to(torch.bfloat16)) and not small_gemm.takes(torch.randn(64, 64))
    assert not small_gemm.takes(w.t())                 # not contiguous
    assert isinstance(small_gemm.pays(), bool)
