"""Packed documents without a mask (orthon.pretrain.run_attention): each document's queries over its own
keys give the output and gradients of SDPA with the document mask, for whole sequences and for a
context-parallel rank's runs, rows with different documents, a document spanning two runs; documents
that are not contiguous fall back to the mask."""
import pytest
import torch
import torch.nn.functional as F

from orthon.pretrain.attention import document_mask
from orthon.pretrain.run_attention import PieceAttention, document_pieces

pytestmark = pytest.mark.usefixtures("one_thread")


def _docs(lengths_per_row):
    return torch.tensor([[d for d, n in enumerate(lengths) for _ in range(n)] for lengths in lengths_per_row])


@pytest.mark.parametrize("runs", [[(0, 37)], [(0, 9), (28, 37)], [(9, 19), (19, 28)]])
def test_pieces_equal_the_document_mask(runs):
    torch.manual_seed(0)
    k_docs = _docs([[5, 20, 12], [37]])  # row 0: three documents (the middle one spans runs), row 1: one
    B, S, H, D = 2, 37, 3, 8
    slots = torch.cat([torch.arange(a, b) for a, b in runs])
    q = torch.randn(B, H, len(slots), D, requires_grad=True)
    k, v = (torch.randn(B, H, S, D, requires_grad=True) for _ in range(2))
    mask = document_mask(k_docs[:, slots], k_docs, slots).unsqueeze(1)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    pieces = document_pieces(runs, k_docs)
    # Row 0's queries cut at every document edge and run edge, row 1's at run edges alone.
    assert sum(1 for p in pieces if p[0] == 1) == len(runs)
    got = PieceAttention.apply(q, k, v, pieces, 0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    for name, g, w in zip("qkv", got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=name)


def test_pieces_are_hand_checked_and_scattered_documents_fall_back():
    # Run [4, 10) over documents [0, 6) and [6, 12): queries 4-5 see keys 0-5, queries 6-9 keys 6-9.
    assert document_pieces([(4, 10)], _docs([[6, 6]])) == [(0, 0, 2, 0, 6), (0, 2, 6, 6, 10)]
    assert document_pieces([(0, 4)], torch.tensor([[0, 1, 0, 1]])) is None
