"""The compiled forward's graph pass that makes linear layers over the same input one kernel call
(`worker/linear_fusion.py`): which calls it groups, which it leaves, bit-identical results, and inductor's compiled
code calling the grouped operator. The engine's per-step counts: tests/test_compiled_forward.py."""

from __future__ import annotations

import operator

import pytest
import torch

from torch._inductor.custom_graph_pass import CustomGraphPass

from paged_backend.kernels import cpu_linear
from paged_backend.worker.kernel_linear import use_linear_kernel
from paged_backend.worker.linear_fusion import FuseSharedInputLinears, fuse_shared_input_linears

pytestmark = pytest.mark.skipif(not cpu_linear.op_available(), reason="no C++ compiler: the kernel cannot be built")

SINGLE = torch.ops.paged_backend.linear_rows.default
GROUPED = {torch.ops.paged_backend.linear_rows_2.default: 2, torch.ops.paged_backend.linear_rows_3.default: 3}


class Block(torch.nn.Module):
    """q, k and v over one normed input, gate and up over another, down alone; `late` reads the first input with
    a weight computed inside the graph after q's call."""

    def __init__(self, dtype=torch.float32) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.ParameterDict({name: torch.nn.Parameter((torch.randn(n, k, generator=g) * 0.1).to(dtype))
                                         for name, n, k in [("q", 24, 16), ("k", 8, 16), ("v", 8, 16),
                                                            ("gate", 32, 16), ("up", 32, 16), ("down", 16, 32),
                                                            ("late", 4, 16)]})
        self.bias = torch.nn.Parameter(torch.randn(8, generator=g).to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        q = SINGLE(h, self.w["q"], None, 0)
        late = SINGLE(h, self.w["late"] * q.sum(), None, 0)   # its weight depends on q: it cannot join q's call
        k = SINGLE(h, self.w["k"], self.bias, 0)
        v = SINGLE(h, self.w["v"], None, 0)
        m = (q[..., :16] + k.sum(-1, keepdim=True) + v.sum(-1, keepdim=True)).relu()
        mlp = SINGLE(m, self.w["gate"], None, 0) * SINGLE(m, self.w["up"], None, 0)
        return torch.cat([SINGLE(mlp, self.w["down"], None, 0), late], -1)


def _calls(graph: torch.fx.Graph, *targets) -> list:
    return [n for n in graph.nodes if n.op == "call_function" and n.target in targets]


def _traced(module: torch.nn.Module) -> torch.fx.GraphModule:
    """`module` traced, its parameters read at the top as in inductor's post-grad graph (where they are inputs;
    symbolic tracing reads each where it is first used)."""
    traced = torch.fx.symbolic_trace(module)
    top = next(n for n in traced.graph.nodes if n.op != "placeholder")
    for node in [n for n in traced.graph.nodes if n.op == "get_attr"]:
        if node is not top:
            top.prepend(node)
    traced.graph.lint()
    return traced


def test_the_pass_groups_the_calls_on_one_input_and_leaves_the_others():
    block = Block()
    traced = _traced(block)
    x = torch.randn(3, 16)
    with torch.no_grad():
        expected = block(x)
        assert fuse_shared_input_linears(traced.graph) == 3   # q, k, v -> 1; gate, up -> 1
        traced.graph.lint()
        traced.recompile()
        multis = _calls(traced.graph, *GROUPED)
        assert [GROUPED[n.target] for n in multis] == [3, 2]
        assert [getattr(a, "target", None) for a in multis[0].args[1:-1]] == ["w.q", None, "w.k", "bias", "w.v", None]
        assert [getattr(a, "target", None) for a in multis[1].args[1:-1]] == ["w.gate", None, "w.up", None]
        assert len(_calls(traced.graph, SINGLE)) == 2       # down (its own input) and late (a weight made later)
        assert all(user.target is operator.getitem for n in multis for user in n.users)
        calls = cpu_linear.kernel_calls()
        assert torch.equal(traced(x), expected)
        assert cpu_linear.kernel_calls() - calls == 4
        assert fuse_shared_input_linears(traced.graph) == 0   # nothing left to group


def test_more_calls_than_the_largest_group_are_split():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    weights = [graph.placeholder(f"w{i}") for i in range(6)]
    outs = [graph.call_function(SINGLE, (x, w, None, 0)) for w in weights]
    graph.output(tuple(outs))
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    inputs = [torch.randn(2, 8)] + [torch.randn(3 + i, 8) for i in range(6)]
    expected = module(*inputs)
    assert fuse_shared_input_linears(graph) == 4   # 6 -> linear_rows_4 and linear_rows_2
    module.recompile()
    assert [n.target for n in graph.nodes if n.op == "call_function" and n.target is not operator.getitem] == \
        [torch.ops.paged_backend.linear_rows_4.default, torch.ops.paged_backend.linear_rows_2.default]
    assert all(torch.equal(a, b) for a, b in zip(module(*inputs), expected))


def test_calls_with_another_row_limit_stay_apart():
    def two_limits(x, a, b):
        return SINGLE(x, a, None, 0) + SINGLE(x, b, None, 8)

    traced = torch.fx.symbolic_trace(two_limits)
    assert fuse_shared_input_linears(traced.graph) == 0 and len(_calls(traced.graph, SINGLE)) == 2


class _NoPass(CustomGraphPass):
    def __call__(self, graph: torch.fx.Graph) -> None:
        pass

    def uuid(self) -> bytes:
        return b"test-linear-fusion-no-pass"


def _compiled_run(block: torch.nn.Module, graph_pass, x: torch.Tensor):
    """The second call's output of `block` compiled with `graph_pass`, and its kernel calls."""
    compiled = torch.compile(block, fullgraph=True, options={"post_grad_custom_pre_pass": graph_pass})
    with torch.no_grad():
        compiled(x)
        calls = cpu_linear.kernel_calls()
        out = compiled(x)
    return out, cpu_linear.kernel_calls() - calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_inductor_compiles_the_grouped_operator_with_the_same_bits(dtype):
    """Through inductor with the pass (as the engine compiles): 4 kernel calls per forward instead of 7, every
    output bit as without the pass (inductor's own reductions may differ from eager's, so eager is not the
    reference); the pass has a stable uuid, so inductor's cache keeps the compiled graph across runs."""
    assert FuseSharedInputLinears().uuid() == FuseSharedInputLinears().uuid() != _NoPass().uuid()
    block = Block(dtype)
    x = torch.randn(2, 16).to(dtype)
    grouped, grouped_calls = _compiled_run(block, FuseSharedInputLinears(), x)
    torch._dynamo.reset()
    alone, alone_calls = _compiled_run(block, _NoPass(), x)
    assert (grouped_calls, alone_calls) == (4, 7)
    assert torch.equal(grouped, alone)


def test_linear_modules_swapped_for_the_kernel_are_grouped_when_compiled():
    """The engine's path: `nn.Linear`s become KernelLinear (use_linear_kernel), and the compiled graph of an
    attention-like block calls the kernel once for q, k and v. In bfloat16, which the kernel serves on every CPU
    (float32 not on Intel's, where MKL's product is kept)."""
    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v = (torch.nn.Linear(16, n, bias=False, dtype=torch.bfloat16) for n in (16, 8, 8))

        def forward(self, x):
            return self.q(x).sum(-1) + self.k(x).sum(-1) + self.v(x).sum(-1)

    module = Attention()
    assert use_linear_kernel(module) == 3
    for layer in (module.q, module.k, module.v):
        layer.kernel_max_rows = 0
    compiled = torch.compile(module, fullgraph=True,
                             options={"post_grad_custom_pre_pass": FuseSharedInputLinears()})
    with torch.no_grad():
        compiled(torch.randn(1, 16, dtype=torch.bfloat16))
        calls = cpu_linear.kernel_calls()
        compiled(torch.randn(1, 16, dtype=torch.bfloat16))
    assert cpu_linear.kernel_calls() - calls == 1
