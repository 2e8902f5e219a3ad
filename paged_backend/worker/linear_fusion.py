"""A graph pass of the compiled forward: linear layers that read the same input become one kernel call.

A decoder layer reads its normed hidden state three times (q, k and v) and the MLP's input twice (gate and up);
each `paged_backend::linear_rows` call is a parallel region of its own, with its fork, join and a cold start of the
weight stream. After AOTAutograd (inductor's post-grad pre-pass) this pass replaces every group of such calls on
the same input with one `paged_backend::linear_rows_N` over their N weights: 211 kernel calls per smollm2
decode step become 121. Each output is the same dot product as before, so results are bit-identical. Works on the
traced graph, for any model family, without touching the model's code.
"""

from __future__ import annotations

import operator
from typing import Dict, List, Tuple

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from paged_backend.kernels import cpu_linear


def fuse_shared_input_linears(graph: torch.fx.Graph) -> int:
    """Replace each group of two or more `linear_rows` calls with the same input and row limit by
    `linear_rows_N` calls of up to the largest of `cpu_linear.GROUP_SIZES` weights each (each placed at its first
    call; a call whose weight or bias is computed after the group's first call stays alone); returns how many
    calls were merged away."""
    single = torch.ops.paged_backend.linear_rows.default
    order = {node: index for index, node in enumerate(graph.nodes)}
    groups: Dict[Tuple[torch.fx.Node, int], List[torch.fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is single and len(node.args) == 4 and not node.kwargs:
            groups.setdefault((node.args[0], node.args[3]), []).append(node)
    merged = 0
    largest = max(cpu_linear.GROUP_SIZES)
    for (x, max_rows), nodes in groups.items():
        first = nodes[0]
        nodes = [n for n in nodes if all(not isinstance(a, torch.fx.Node) or order[a] < order[first]
                                         for a in n.args[1:3])]
        if first not in nodes:
            continue
        for begin in range(0, len(nodes), largest):
            chunk = nodes[begin:begin + largest]
            if len(chunk) >= 2:
                _replace(graph, chunk[0], x, max_rows, chunk)
                merged += len(chunk) - 1
    return merged


def _replace(graph: torch.fx.Graph, where: torch.fx.Node, x, max_rows: int, nodes: List[torch.fx.Node]) -> None:
    """One `linear_rows_N` call before `where` in place of `nodes`, each output through a getitem."""
    target = getattr(torch.ops.paged_backend, f"linear_rows_{len(nodes)}").default
    args = (x, *[a for n in nodes for a in n.args[1:3]], max_rows)
    with graph.inserting_before(where):
        fused = graph.call_function(target, args)
        fused.meta["val"] = tuple(n.meta.get("val") for n in nodes)
        items = [graph.call_function(operator.getitem, (fused, index)) for index in range(len(nodes))]
    for node, item in zip(nodes, items):   # erased after the inserts: `where` may be one of them
        item.meta.update(node.meta)
        node.replace_all_uses_with(item)
        graph.erase_node(node)


class FuseSharedInputLinears(CustomGraphPass):
    """`fuse_shared_input_linears` as inductor's `post_grad_custom_pre_pass`; its uuid (the hash of this file and
    of cpu_linear.py, which defines the group sizes) keeps inductor's on-disk cache of compiled graphs valid across
    runs and new when the pass changes."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        fuse_shared_input_linears(graph)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__, cpu_linear.__file__))
