"""The fixed-order float32 matmuls and the element-wise ops of batch-invariant mode: accurate
against a float64 reference, and a row's bits independent of the call's shape and threads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import batch_invariance, fixed_order_matmul


def _fresh(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(torch.seed() % 2**31))


@pytest.fixture(autouse=True)
def _two_threads_after():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("depth", [1, 48, 64, 67])
def test_both_kernels_match_a_float64_reference(depth):
    left, keys, values = _fresh(5, 33, depth), _fresh(5, 70, depth), _fresh(5, depth, 70)
    want_nt = torch.bmm(left.double(), keys.double().transpose(1, 2))
    want_nn = torch.bmm(left.double(), values.double())
    got_nt = fixed_order_matmul.dot_nt(left, keys).double()
    got_nn = fixed_order_matmul.dot_nn(left, values).double()
    # float32 sums of `depth` products of unit normals: a few ulps of the sum's magnitude.
    tolerance = 1e-6 * depth**0.5 * 8
    assert (got_nt - want_nt).abs().max() <= tolerance
    assert (got_nn - want_nn).abs().max() <= tolerance


@pytest.mark.parametrize("kernel", ["dot_nt", "dot_nn"])
def test_a_rows_bits_do_not_depend_on_rows_items_or_threads(kernel):
    fn = getattr(fixed_order_matmul, kernel)
    left = _fresh(40, 300, 64)
    right = _fresh(40, 256, 64) if kernel == "dot_nt" else _fresh(40, 64, 256)
    torch.set_num_threads(1)
    alone = fn(left[:1, :3], right[:1])
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for items in (1, 2, 7, 40):
            for rows in (3, 4, 17, 300):
                assert torch.equal(fn(left[:items, :rows], right[:items])[:1, :3], alone)


def test_float32_attention_matmuls_keep_a_rows_bits():
    """What deterministic mode checks before it serves float32 (torch's BLAS fails the same
    check on this CPU: it picks its float32 kernel by shape)."""
    batch_invariance.matmul_rows_keep_their_bits.cache_clear()
    assert batch_invariance.matmul_rows_keep_their_bits(torch.float32)


@pytest.mark.parametrize("name", ["sigmoid", "silu"])
def test_invariant_elementwise_ops_give_an_element_the_same_bits_wherever_it_lies(name):
    """torch's sigmoid and SiLU compute a tensor's last few elements with scalar code; in
    batch-invariant mode an element's value does not depend on its place in the tensor."""
    fn = getattr(batch_invariance, name)
    values = _fresh(100_003) * 4
    with batch_invariance.batch_invariant():
        whole = fn(values)
        for length in (1, 3, 7, 15, 17, 33, 1001):
            for start in (0, 5, 13, 31, 99_990):
                piece = values[start : start + length].clone()
                assert torch.equal(fn(piece), whole[start : start + length])
        # Rows of a strided view (an expert's gate columns), split across threads.
        strided = values[:99_990].view(-1, 30)[:, :17]
        assert torch.equal(fn(strided), whole[:99_990].view(-1, 30)[:, :17])
    reference = torch.sigmoid(values.double()) if name == "sigmoid" else F.silu(values.double())
    assert (whole.double() - reference).abs().max() <= 4e-7 * reference.abs().max()
