"""The sparse-attention kernels equal the torch functions they replace: the indexer's causal top-k exactly
(integer-valued inputs make every score exact, so any summation order gives the same selection), the
gathered latent attention and its gradients up to float summation order; a model trained through them
equals the same model on the torch path; where they cannot run, callers fall back."""
import os
import shutil

import pytest
import torch

import orthon.pretrain.attention as A
from orthon.core.native import cpu_has_avx2_fma
from orthon.pretrain import sparse_kernels as SK
from kernel_support import assert_falls_back_with_one_message, loss_and_grads, tiny_dsa_model

needs_kernel = pytest.mark.skipif(SK.native.load() is None, reason=f"sparse kernels: {SK.native.why_unavailable}")


def test_the_kernels_build_where_they_can():
    """A C error in the source would otherwise only show as every kernel test skipping."""
    if not (cpu_has_avx2_fma() and shutil.which("cc")) or os.environ.get("ORTHON_SPARSE_KERNELS") == "0":
        pytest.skip("no AVX2 / FMA or no C compiler here")
    assert SK.native.load() is not None, SK.native.why_unavailable


def _random_selection(B, T, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.stack([torch.randperm(max(t + 1, K), generator=g)[:K] for t in range(T)]) for _ in range(B)])
    return idx, idx <= torch.arange(T)[None, :, None]


@needs_kernel
# The tiny model's; GLM-5's latent widths; heads past a multiple of four (combined one by one); widths not
# a multiple of 16 (the four-head combine does not apply).
@pytest.mark.parametrize("H,D,R,K", [(4, 80, 64, 64), (2, 576, 512, 16), (5, 48, 32, 24), (6, 88, 72, 16)])
def test_latent_attention_equals_torch_forward_and_backward(H, D, R, K):
    torch.manual_seed(0)
    B, T = 2, 150
    q = torch.randn(B, T, H, D, requires_grad=True)
    latent = torch.randn(B, T, D, requires_grad=True)
    idx, visible = _random_selection(B, T, K)
    visible[0, 100:, :3] = False  # keys a document boundary hides
    ref = A._GatheredLatentAttention.apply(q, latent, idx, visible[:, :, None, :], 0.1, R)
    out = SK.latent_attention(q, latent, idx, visible, 0.1, R)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, latent), grad)
    grads = torch.autograd.grad(out, (q, latent), grad)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # A key no query selected gets no gradient; one selected only by invisible slots neither.
    unused = torch.ones(B * T, dtype=torch.bool)
    unused[(idx + torch.arange(B)[:, None, None] * T)[visible]] = False
    assert unused.any() and grads[1].reshape(B * T, D)[unused].abs().max() == 0


@needs_kernel
def test_latent_attention_declines_what_it_cannot_run():
    q, latent = torch.randn(1, 4, 2, 20), torch.randn(1, 4, 20)  # width not a multiple of 8
    idx = torch.zeros(1, 4, 2, dtype=torch.long)
    assert SK.latent_attention(q, latent, idx, idx >= 0, 0.1, 16) is None
    assert SK.latent_attention(torch.randn(1, 4, 2, 16), torch.randn(1, 4, 16), idx, idx >= 0, 0.1, 16) is not None


def _exact_inputs(B, T, n, d, seed):
    g = torch.Generator().manual_seed(seed)
    def small(*shape):  # multiples of 1/4 in [-3/4, 3/4]: every product and sum below is exact in fp32
        return torch.randint(-3, 4, shape, generator=g).float() / 4
    return small(B, T, n, d), small(B, T, n), small(B, T, d)


@needs_kernel
@pytest.mark.parametrize("T,k", [(200, 64), (64, 64), (33, 8)])
def test_causal_topk_equals_select_topk_exactly(T, k):
    B, n, d = 2, 4, 32
    q, w, keys = _exact_inputs(B, T, n, d, seed=T)
    scores = A.index_scores(q, w, keys, 0.25)
    slots = torch.arange(T)
    assert torch.equal(SK.causal_topk(q, w, keys, k, 0.25), A.select_topk(scores, slots, k))
    # Packed documents: causal within each; rows short of k visible keys end with the same invisible ones.
    docs = torch.cumsum(torch.rand(B, T, generator=torch.Generator().manual_seed(1)) < 0.05, dim=1)
    want = A.select_topk(scores, slots, k, A.document_mask(docs, docs, slots))
    assert torch.equal(SK.causal_topk(q, w, keys, k, 0.25, docs), want)
    unordered = SK.causal_topk(q, w, keys, k, 0.25, docs, ordered=False)
    assert torch.equal(unordered.sort(-1).values, want.sort(-1).values)
    # Exact ties are many here (ReLU zeros): the lower position wins, as deterministic_topk orders them.
    assert (scores == 0).float().mean() > 0.05


@needs_kernel
def test_causal_topk_needs_k_at_most_t():
    q, w, keys = _exact_inputs(1, 8, 2, 8, seed=0)
    assert SK.causal_topk(q, w, keys, 9, 0.25) is None


@needs_kernel
@pytest.mark.parametrize("packed", [False, True])
def test_training_through_the_kernels_equals_the_torch_path(monkeypatch, packed):
    """Loss and every gradient of a 3-layer DSA model (IndexShare on its last layer) at 96 tokens with
    index_topk 16: the kernels' path (gathered, the default on CPU) against the torch path (masked SDPA,
    torch's top-k)."""
    model = tiny_dsa_model()
    ids = torch.randint(0, 64, (2, 97), generator=torch.Generator().manual_seed(3))
    docs = torch.cumsum(torch.rand(2, 96, generator=torch.Generator().manual_seed(4)) < 0.03, dim=1) if packed else None
    loss, grads = loss_and_grads(model, ids, docs)
    monkeypatch.setattr(SK.native, "lib", None)  # as if unbuildable: every caller takes its torch path
    model.runtime.sparse_impl = "mask"
    ref_loss, ref_grads = loss_and_grads(model, ids, docs)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-3, atol=2e-5, msg=name)


def test_disabled_kernels_fall_back_with_one_message():
    assert_falls_back_with_one_message(
        "from orthon.pretrain import sparse_kernels as SK;"
        "q = torch.ones(1, 4, 2, 8); idx = torch.zeros(1, 4, 2, dtype=torch.long);"
        "print(SK.latent_attention(q, torch.ones(1, 4, 8), idx, idx >= 0, 0.1, 8),"
        " SK.causal_topk(torch.ones(1, 4, 2, 8), torch.ones(1, 4, 2), torch.ones(1, 4, 8), 2, 0.1))",
        "ORTHON_SPARSE_KERNELS", "sparse attention kernels")


@needs_kernel
def test_results_do_not_depend_on_the_thread_count():
    """Each output element is summed in one fixed order whatever the threads: a DDP rank (one thread under
    torchrun) and one process (two) must train the same weights."""
    torch.manual_seed(0)
    B, T, H, D, R, K = 2, 90, 4, 80, 64, 16
    q = torch.randn(B, T, H, D, requires_grad=True)
    latent = torch.randn(B, T, D, requires_grad=True)
    idx, visible = _random_selection(B, T, K)
    grad = torch.randn(B, T, H, R)
    qi, wi, ki = torch.randn(B, T, 2, 16), torch.randn(B, T, 2), torch.randn(B, T, 16)
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            out = SK.latent_attention(q, latent, idx, visible, 0.1, R)
            results.append((out, *torch.autograd.grad(out, (q, latent), grad), SK.causal_topk(qi, wi, ki, K, 0.2)))
    finally:
        torch.set_num_threads(threads)
    for one, three in zip(*results):
        assert torch.equal(one, three)
