"""The LoRA op on the CPU: a step's tokens grouped by adapter slot, and the grouped deltas equal the per-token
definition `y[t] += scale * B @ (A @ x[t])` (float64); the hooks leave the model alone outside a step."""

from __future__ import annotations

import pytest
import torch

from paged_backend.kernels.lora import lora_backend, lora_delta_dense, lora_delta_grouped, plan_lora, slot_columns


def test_plan_groups_tokens_by_slot_stably_and_leaves_out_the_base_model():
    plan = plan_lora(torch.tensor([2, -1, 0, 2, 2, -1, 0]))
    assert plan.num_tokens == 7 and plan.num_lora_tokens == 5
    assert plan.order.tolist() == [2, 6, 0, 3, 4]
    assert [(s.slot, s.start, s.end) for s in plan.segments] == [(0, 0, 2), (2, 2, 5)]
    assert plan.seg_starts.tolist() == [0, 2, 5] and plan.seg_slots.tolist() == [0, 2] and plan.max_segment == 3
    assert plan_lora(torch.full((5,), -1)) is None


def test_plan_reads_a_contiguous_run_as_a_slice():
    plan = plan_lora(torch.tensor([-1, 1, 1, 1, 0, -1, 0]))
    rows = {s.slot: s.rows for s in plan.segments}
    assert rows[1] == slice(1, 4)
    assert isinstance(rows[0], torch.Tensor) and rows[0].tolist() == [4, 6]


def _dense(y, x, slots, weights):
    out = y.clone()
    for t, slot in enumerate(slots):
        if slot >= 0 and weights[slot] is not None:
            a, b, scale = weights[slot]
            out[t] += scale * (b @ (a @ x[t]))
    return out


@pytest.mark.parametrize("slots", [[0, 1, -1, 1, 0, 2, 2, 2], [1] * 9, [-1, 0, -1]])
def test_grouped_deltas_equal_the_per_token_definition(slots):
    generator = torch.Generator().manual_seed(len(slots))
    x = torch.randn(len(slots), 12, generator=generator, dtype=torch.float64)
    y = torch.randn(len(slots), 10, generator=generator, dtype=torch.float64)
    weights = [(torch.randn(r, 12, generator=generator, dtype=torch.float64),
                torch.randn(10, r, generator=generator, dtype=torch.float64), s) for r, s in ((2, 0.5), (5, 2.0))]
    weights.append(None)   # slot 2's adapter does not target this layer
    out = y.clone()
    lora_delta_grouped(out, x, plan_lora(torch.tensor(slots)), weights)
    torch.testing.assert_close(out, _dense(y, x, slots, weights), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("slots", [[0, 1, -1, 1, 0, 2, 2, 2], [-1, -1], [2]])
def test_dense_deltas_equal_the_per_token_definition(slots):
    """Every slot's A and scale * B side by side, each token keeping its own slot's columns: the same deltas."""
    generator = torch.Generator().manual_seed(7 + len(slots))
    max_rank, ranks, scales = 6, (2, 5, 0), (0.5, 2.0, 0.0)
    x = torch.randn(len(slots), 12, generator=generator, dtype=torch.float64)
    y = torch.randn(len(slots), 10, generator=generator, dtype=torch.float64)
    a_cat = torch.zeros(3 * max_rank, 12, dtype=torch.float64)
    b_cat = torch.zeros(10, 3 * max_rank, dtype=torch.float64)
    weights = []
    for slot, (rank, scale) in enumerate(zip(ranks, scales)):
        if rank == 0:
            weights.append(None)   # slot 2's adapter does not target this layer
            continue
        a = torch.randn(rank, 12, generator=generator, dtype=torch.float64)
        b = torch.randn(10, rank, generator=generator, dtype=torch.float64)
        a_cat[slot * max_rank:slot * max_rank + rank], b_cat[:, slot * max_rank:slot * max_rank + rank] = a, b * scale
        weights.append((a, b, scale))
    columns = slot_columns(torch.tensor(slots), 3, max_rank, torch.float64)
    assert columns.shape == (len(slots), 18) and columns.sum().item() == max_rank * sum(s >= 0 for s in slots)
    out = y.clone()
    lora_delta_dense(out, x, columns, a_cat, b_cat)
    torch.testing.assert_close(out, _dense(y, x, slots, weights), rtol=1e-12, atol=1e-12)


def test_the_cpu_takes_a_pytorch_path_and_float64_never_takes_triton(monkeypatch):
    from paged_backend.worker.lora_layers import DENSE_MAX_COLUMNS, lora_mode

    monkeypatch.delenv("PAGED_BACKEND_KERNELS", raising=False)
    assert lora_backend(torch.empty(0)) == "torch"
    assert lora_mode(torch.empty(0), 4, 16) == "dense"
    assert lora_mode(torch.empty(0), 4, DENSE_MAX_COLUMNS // 4 + 1) == "grouped"
    monkeypatch.setenv("PAGED_BACKEND_KERNELS", "triton")
    assert lora_backend(torch.empty(0, dtype=torch.float32)) == "triton"
    assert lora_backend(torch.empty(0, dtype=torch.float64)) == "torch"


def test_hooks_add_nothing_outside_a_step_and_leave_with_the_runner(tmp_path):
    """The hooks run only inside `LoRALayers.step`; once the runner shuts down (or is dropped) they are gone,
    so the user's model computes what it computed before."""
    import gc

    from conftest import get_model
    from lora_adapters import ADAPTER_SPECS, make_adapter
    from paged_backend import LLMEngine, LoRARequest, SamplingParams

    model, tok = get_model("tiny-llama", torch.float64)
    ids = torch.tensor([tok("Hello there").input_ids])
    before = model(input_ids=ids).logits
    lora = LoRARequest("a", 1, str(make_adapter("tiny-llama", ADAPTER_SPECS["tiny-llama"][0], tmp_path / "a", 1)))
    for drop in ("shutdown", "garbage"):
        engine = LLMEngine(model, tokenizer=tok, enable_lora=True, num_blocks=16)
        engine.add_request("r", ids[0].tolist(), SamplingParams(max_tokens=2, temperature=0), lora_request=lora)
        while engine.has_unfinished_requests():
            engine.step()
        assert any(m._forward_hooks for m in model.modules())
        assert torch.equal(model(input_ids=ids).logits, before)   # the hooks are idle outside a step
        if drop == "shutdown":
            engine.shutdown()
        del engine
        gc.collect()
        assert not any(m._forward_hooks for m in model.modules())
