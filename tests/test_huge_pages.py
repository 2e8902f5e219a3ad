"""worker/huge_pages.py: a CPU model's large weights moved into one mapping advised MADV_HUGEPAGE, values,
Parameter objects and ties kept, each with its own storage, untouched where they share storage or are small;
the engine moves them once, and its greedy tokens equal those of an engine without the move."""

from __future__ import annotations

import gc

import pytest
import torch

from paged_backend import LLM, SamplingParams
from paged_backend.worker import huge_pages
from paged_backend.worker.loader import load_model

THP = huge_pages.transparent_huge_pages() in ("always", "madvise")


class Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = torch.nn.Linear(256, 512)                    # 512 KiB weight: moved; its 2 KiB bias stays
        self.other = torch.nn.Linear(512, 256, bias=False)      # moved
        self.tied = torch.nn.Linear(512, 256, bias=False)
        self.tied.weight = self.other.weight                    # one Parameter twice: moved once, still tied
        whole = torch.randn(2, 256, 256)
        self.register_buffer("half_a", whole[0])                # views of one storage: stay where they are
        self.register_buffer("half_b", whole[1])
        self.small = torch.nn.Parameter(torch.randn(16))         # below the size limit: stays


def test_weights_move_with_their_values_objects_and_ties(monkeypatch):
    monkeypatch.setenv(huge_pages.ENV, "1")
    toy = Toy()
    before = {name: t.detach().clone() for name, t in [*toy.named_parameters(), *toy.named_buffers()]}
    params = dict(toy.named_parameters())
    pointers = {name: t.data_ptr() for name, t in [*toy.named_parameters(), *toy.named_buffers()]}
    moved = huge_pages.move_weights_to_huge_pages(toy)
    if not THP:
        assert moved.tensors == 0 and all(t.data_ptr() == pointers[n] for n, t in toy.named_parameters())
        return
    assert moved.tensors == 2 and moved.bytes == (512 * 256 + 256 * 512) * 4
    assert moved.huge_bytes >= 2 << 20, "the kernel backed none of the mapping with huge pages"
    for name, tensor in [*toy.named_parameters(), *toy.named_buffers()]:
        assert torch.equal(tensor, before[name]), name
    assert dict(toy.named_parameters()) == params                         # the same Parameter objects
    assert toy.tied.weight is toy.other.weight
    changed = {n for n, t in [*toy.named_parameters(), *toy.named_buffers()] if t.data_ptr() != pointers[n]}
    assert changed == {"big.weight", "other.weight"}
    storages = {toy.big.weight.untyped_storage().data_ptr(), toy.other.weight.untyped_storage().data_ptr()}
    assert len(storages) == 2 and toy.big.weight.untyped_storage().nbytes() == 512 * 256 * 4
    assert huge_pages.move_weights_to_huge_pages(toy).tensors == 0          # once per model


@pytest.mark.skipif(not THP, reason="this kernel lends no transparent huge pages")
def test_a_moved_weight_outlives_its_model():
    toy = Toy()
    assert huge_pages.move_weights_to_huge_pages(toy).tensors == 2
    weight, expected = toy.big.weight, toy.big.weight.detach().clone()
    del toy
    gc.collect()
    weight.data.add_(1.0)                                                   # the mapping is still there
    assert torch.equal(weight, expected + 1.0)


def test_the_environment_turns_it_off(monkeypatch):
    monkeypatch.setenv(huge_pages.ENV, "0")
    toy = Toy()
    pointer = toy.big.weight.data_ptr()
    assert huge_pages.move_weights_to_huge_pages(toy).tensors == 0 and toy.big.weight.data_ptr() == pointer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_an_engine_moves_the_weights_once_and_its_tokens_do_not_change(monkeypatch, dtype):
    prompts = ["The paged cache", "Blocks of keys and values"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    monkeypatch.setenv(huge_pages.ENV, "0")
    model, tokenizer = load_model("tiny-llama", dtype=dtype)
    plain = [o.outputs[0].token_ids for o in LLM(model, tokenizer=tokenizer, num_blocks=32).generate(
        prompts, params, use_tqdm=False)]
    monkeypatch.setenv(huge_pages.ENV, "1")
    model, tokenizer = load_model("tiny-llama", dtype=dtype)
    llm = LLM(model, tokenizer=tokenizer, num_blocks=32)
    moved = llm.engine.runner.huge_pages
    assert (moved.tensors > 0) == THP
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == plain
    assert LLM(model, tokenizer=tokenizer, num_blocks=32).engine.runner.huge_pages.tensors == 0


def test_info_says_where_the_weights_are(monkeypatch):
    from paged_backend.worker.model_info import kernel_lines

    for setting, expected in (("1", "in transparent huge pages" if THP else "in 4 KiB pages"),
                              ("0", "in 4 KiB pages")):
        monkeypatch.setenv(huge_pages.ENV, setting)
        [line] = [line for line in kernel_lines(torch.device("cpu")) if line.startswith("weights:")]
        assert expected in line and huge_pages.transparent_huge_pages() in line, line


def test_a_cpu_kv_cache_is_zeros_in_huge_pages(monkeypatch):
    from paged_backend.worker.cache_engine import CacheEngine, KVGeometry

    for setting in ("1", "0"):
        monkeypatch.setenv(huge_pages.ENV, setting)
        for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
            cache = CacheEngine(KVGeometry(2, 2, 64), 16, 512, 4, dtype, torch.device("cpu"))   # 4-16 MiB
            assert cache.kv.shape == (2, 2, 512, 16, 2, 64) and cache.kv.dtype == dtype
            assert not cache.kv.float().any() and cache.kv.is_contiguous()
            in_mapping = huge_pages._huge_bytes(cache.kv.data_ptr()) >= cache.kv.numel() * cache.kv.element_size()
            assert in_mapping == (setting == "1" and THP), (setting, dtype)
            cache.kv_caches[1][0][3, 5] = 1.0                      # the layers' views write into it
            assert cache.kv[1, 0, 3, 5].float().eq(1.0).all()
