"""RoPE: the complex-multiply path equals the written-out rotation, and both keep dot products of
GLM-5's interleaved-pair rotation."""
import math

import pytest
import torch

from orthon.pretrain.layers import apply_rope, rope_cos_sin


def reference(x, cos, sin):
    """Each pair (x[2i], x[2i+1]) rotated by its angle, in place of the pair (fp64, by hand)."""
    out = x.clone()
    out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
    out[..., 1::2] = x[..., 1::2] * cos + x[..., 0::2] * sin
    return out


@pytest.mark.parametrize("heads", [None, 3])
def test_complex_path_equals_the_rotation(heads):
    torch.manual_seed(0)
    T, dim = 5, 8
    cos, sin = rope_cos_sin(torch.arange(T), dim, 10000.0, torch.float64)
    shape = (2, T, dim) if heads is None else (2, T, heads, dim)
    x = torch.randn(*shape, dtype=torch.float64)
    c, s = (cos, sin) if heads is None else (cos[:, :, None], sin[:, :, None])
    assert torch.equal(apply_rope(x, cos, sin), reference(x, c, s))


def test_strided_and_half_precision_inputs_take_the_real_form_with_the_same_layout():
    torch.manual_seed(0)
    cos, sin = rope_cos_sin(torch.arange(4), 6, 10000.0, torch.float32)
    wide = torch.randn(1, 4, 7)
    odd_offset = wide[..., 1:]  # storage offset 1: not viewable as complex pairs
    fast = apply_rope(odd_offset.contiguous(), cos, sin)
    slow = apply_rope(odd_offset, cos, sin)
    torch.testing.assert_close(slow, fast, rtol=0, atol=1e-6)
    half = apply_rope(odd_offset.contiguous().bfloat16(), cos.bfloat16(), sin.bfloat16())
    torch.testing.assert_close(half.float(), fast, rtol=2e-2, atol=2e-2)


def test_dot_products_depend_only_on_the_position_difference():
    """What attention needs: q_m . k_n after rotation is a function of m - n."""
    torch.manual_seed(1)
    q, k = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    cos, sin = rope_cos_sin(torch.arange(12), 8, 10000.0, torch.float64)
    rq = apply_rope(q.expand(1, 12, 8), cos, sin)[0]
    rk = apply_rope(k.expand(1, 12, 8), cos, sin)[0]
    # rope_cos_sin computes its angles in fp32: equal to about 1e-7.
    assert math.isclose(float(rq[7] @ rk[3]), float(rq[9] @ rk[5]), rel_tol=1e-6)
    assert math.isclose(float(rq[4] @ rk[4]), float(q @ k), rel_tol=1e-6)


def test_gradient_of_the_complex_path_is_the_inverse_rotation():
    torch.manual_seed(2)
    cos, sin = rope_cos_sin(torch.arange(3), 4, 10000.0, torch.float64)
    x = torch.randn(1, 3, 4, dtype=torch.float64, requires_grad=True)
    g = torch.randn(1, 3, 4, dtype=torch.float64)
    apply_rope(x, cos, sin).backward(g)
    assert torch.allclose(x.grad, reference(g, cos, -sin), rtol=0, atol=1e-14)
