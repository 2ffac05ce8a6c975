"""ar_lab.perf.op_count: which PyTorch calls compute (a kernel) and which only describe memory
(chapter 04)."""

import torch

from ar_lab.base.errors import BadType, BadValue
from ar_lab.model.gpt import GPT, GPTConfig
from ar_lab.perf.op_count import count_ops, decode_step_ops, pass_ops
from tests.raising import raises


def test_views_and_attribute_reads_do_not_compute_in_place_and_out_do():
    x, out = torch.randn(4, 6), torch.empty(4, 6)

    def work():
        y = x.view(6, 4).transpose(0, 1)  # two views
        assert x[0].shape == (6,)  # a slice (a view) and an attribute read
        z = torch.add(x, 1)  # a new tensor
        z.mul_(2)  # in place
        z[1] = 0  # in place, through an operator
        torch.mul(x, 2, out=out)  # into memory the caller gave
        return y

    got = count_ops(work)
    assert got.computing == {"add": 1, "mul_": 1, "__setitem__": 1, "mul": 1}
    assert got.calls - got.computing == {"view": 1, "transpose": 1, "__getitem__": 1, "__get__": 1}


def test_a_pass_calls_the_same_operations_for_any_number_of_positions():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=16)).eval()
    one, many = pass_ops(model, 1), pass_ops(model, 16)
    assert one == many
    assert one.computing["linear"] == 2 * 4 + 1  # four per block, then the (tied) output layer
    lean, forward = decode_step_ops(model, lean=True), decode_step_ops(model, lean=False)
    assert lean.computing["addmv"] == 2 * 4 and "linear" not in lean.computing
    # the new key and value written into each layer's cache
    assert forward.computing["copy_"] == 2 * 2
    with raises(BadValue, 'positions'):
        pass_ops(model, 0)
    with raises(BadType, 'fn'):
        count_ops(42)


def test_library_kernels_names_the_operators_run_and_keeps_stderr_clean(capfd):
    from ar_lab.perf.op_count import library_kernels

    a = torch.randn(4, 4)
    assert "aten::mm" in library_kernels(lambda: a @ a)
    assert library_kernels(lambda: None) == []
    assert capfd.readouterr().err == ""  # the profiler's start and stop lines are dropped
