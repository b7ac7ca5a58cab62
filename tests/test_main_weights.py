"""fp32 main weights for bf16 parameters (orthon.optim.main_weights): the bf16 parameters end each step as
the rounding of an fp32 run fed the same gradients, and updates too small for bf16 accumulate instead of
rounding away."""
import torch
from torch import nn

from orthon.optim.main_weights import MainWeightsOptimizer, with_main_weights
from orthon.optim.muon import Muon


def muon(lr):
    return lambda named: Muon([p for _, p in named], lr=lr, ns_dtype="fp32")


def bf16_param(seed=0, shape=(48, 32)):
    g = torch.Generator().manual_seed(seed)
    return nn.Parameter(torch.randn(shape, generator=g).bfloat16())


def test_each_step_is_the_rounding_of_the_fp32_run():
    w = bf16_param()
    reference = nn.Parameter(w.detach().float())
    opt = with_main_weights([("w", w)], muon(0.02))
    ref_opt = Muon([reference], lr=0.02, ns_dtype="fp32")
    assert isinstance(opt, MainWeightsOptimizer)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        grad = torch.randn(w.shape, generator=g).bfloat16()
        w.grad, reference.grad = grad.clone(), grad.float()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        assert w.grad is None and w.dtype == torch.bfloat16
        assert torch.equal(opt.pairs[0][1], reference)  # the fp32 copy is the fp32 run, bit for bit
        assert torch.equal(w, reference.detach().bfloat16())


def test_updates_below_bf16_resolution_accumulate_instead_of_vanishing():
    # Weights of 1.0 (bf16 steps of 2^-7 there) and updates of RMS lr x 0.2 = 2e-5: each is far below half
    # a step, so stepped in place the weights never move; through fp32 copies 300 of them add up.
    start = torch.ones(48, 32).bfloat16()
    grad = torch.randn(48, 32, generator=torch.Generator().manual_seed(2)).bfloat16()
    in_place, through_main = nn.Parameter(start.clone()), nn.Parameter(start.clone())
    plain, mained = Muon([in_place], lr=1e-4, ns_dtype="fp32"), with_main_weights([("w", through_main)], muon(1e-4))
    for _ in range(300):
        for p, opt in ((in_place, plain), (through_main, mained)):
            p.grad = grad.clone()
            opt.step()
    assert torch.equal(in_place, start)
    moved = (through_main.float() - start.float()).abs()
    assert moved.max() >= 2**-7 and torch.equal(through_main, mained.pairs[0][1].detach().bfloat16())


def test_state_round_trip_continues_the_run_exactly():
    grads = [torch.randn(48, 32, generator=torch.Generator().manual_seed(3 + i)).bfloat16() for i in range(6)]

    def run(w, opt, steps):
        for grad in steps:
            w.grad = grad.clone()
            opt.step()

    straight = bf16_param()
    opt = with_main_weights([("w", straight)], muon(0.02))
    run(straight, opt, grads)

    first = bf16_param()
    opt1 = with_main_weights([("w", first)], muon(0.02))
    run(first, opt1, grads[:3])
    state = opt1.state_dict()
    resumed = nn.Parameter(torch.zeros(48, 32).bfloat16())  # another start: the state brings the weights
    opt2 = with_main_weights([("w", resumed)], muon(0.02))
    opt2.load_state_dict(state)
    assert torch.equal(resumed, first)
    run(resumed, opt2, grads[3:])
    assert torch.equal(resumed, straight) and torch.equal(opt2.pairs[0][1], opt.pairs[0][1])


def test_fp32_parameters_are_stepped_as_they_are_and_main_grad_is_read_first():
    w32 = nn.Parameter(torch.randn(8, 8))
    assert isinstance(with_main_weights([("w", w32)], muon(0.02)), Muon)  # nothing to copy
    w = bf16_param(shape=(8, 8))
    w.tensor_model_parallel, w.partition_dim = True, 1  # megatron's marks travel to the copy
    opt = with_main_weights([("w", w)], muon(0.02))
    main = opt.pairs[0][1]
    assert main.dtype == torch.float32 and main.tensor_model_parallel and main.partition_dim == 1
    w.main_grad = torch.randn(8, 8)  # megatron's DDP: the fp32 gradient buffer, grad left None
    reference = nn.Parameter(w.detach().float())
    reference.grad = w.main_grad.clone()
    opt.step()
    Muon([reference], lr=0.02, ns_dtype="fp32").step()
    assert torch.equal(main, reference)
