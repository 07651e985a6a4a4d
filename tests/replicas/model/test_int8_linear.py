"""int8 draft weights (``int8_linear``): the product of the rounded weights to float32 rounding,
each row's result the same bit for bit whatever else the step holds and however many threads run,
and rounding within half a step of each row's scale."""

import pytest
import torch
import torch.nn.functional as F

from specserve.replicas.model import int8_linear
from specserve.replicas.model.int8_linear import Int8Linear, quantize_rows

pytestmark = pytest.mark.skipif(int8_linear.library() is None, reason="no C compiler: int8 drafts stay float32")


@pytest.fixture(scope="module")
def weight():
    torch.manual_seed(0)
    w = torch.randn(1536, 580) / 24   # a width that is not a multiple of the kernel's lanes
    w[7] = 0.0                        # an all-zero row
    return w, torch.randn(1536)


def test_rounding_is_symmetric_per_row_within_half_a_step(weight):
    w, _ = weight
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.shape == (w.shape[0],)
    assert int(q.abs().amax()) == 127 and scale[7] == 1.0 and not q[7].any()
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, int8_linear.MAX_ROWS, int8_linear.MAX_ROWS + 1])
def test_equals_f_linear_of_the_rounded_weights(weight, rows):
    w, b = weight
    x = torch.randn(rows, w.shape[1])
    for bias in (None, b):
        linear = Int8Linear(w, bias)
        torch.testing.assert_close(linear(x), F.linear(x, linear.dequantized, bias), rtol=1e-5, atol=1e-5)
    # and close to the float32 weights' product: what the draft computed before rounding
    torch.testing.assert_close(Int8Linear(w, b)(x), F.linear(x, w, b), rtol=0.05, atol=0.05)


def test_a_rows_result_does_not_depend_on_the_other_rows_or_the_threads(weight):
    w, b = weight
    linear = Int8Linear(w, b)
    x = torch.randn(int8_linear.MAX_ROWS, w.shape[1])
    full = linear(x)
    for i in range(len(x)):
        assert torch.equal(linear(x[i:i + 1])[0], full[i]), f"row {i} alone differs"
        assert torch.equal(linear(x[max(0, i - 2):i + 3])[min(i, 2)], full[i])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(linear(x), full)
    finally:
        torch.set_num_threads(threads)


def test_shapes_strides_and_what_it_takes(weight):
    w, b = weight
    linear = Int8Linear(w, b)
    x = torch.randn(2, 3, w.shape[1])
    assert linear(x).shape == (2, 3, w.shape[0])
    strided = torch.randn(4, 1200)[:, 10:10 + w.shape[1]]
    torch.testing.assert_close(linear(strided), linear(strided.contiguous()), rtol=0, atol=0)
    assert Int8Linear.takes(w) and not Int8Linear.takes(w.to(torch.bfloat16))
