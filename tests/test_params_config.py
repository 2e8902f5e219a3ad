"""SamplingParams and engine config validate at construction with errors that name the problem."""

import pytest

from paged_backend.config import CacheConfig, EngineConfig, SchedulerConfig, parse_memory
from paged_backend.errors import InvalidParameter
from paged_backend.sampling_params import SamplingParams


@pytest.mark.parametrize("kwargs, message", [
    (dict(n=0), "n must be"),
    (dict(n=2, best_of=1), "best_of"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2 ** 63), "top_k"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(seed=2 ** 64), "seed"),
    (dict(logit_bias={"5": 1.0}), "logit_bias"),
    (dict(logit_bias={5: float("nan")}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(bad_words=[""]), "bad_words"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(min_p=1.5), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(logprobs=-1), "logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(beam_width=4, temperature=0.7), "temperature=0"),
    (dict(beam_width=2, n=3, temperature=0), "n \\(3\\) must not exceed beam_width"),
    (dict(beam_width=0), "beam_width"),
    (dict(early_stopping="sometimes"), "early_stopping"),
    (dict(n=2, temperature=0), "needs sampling"),
    (dict(seed="x"), "seed"),
    (dict(stop="x", detokenize=False), "stop strings need detokenize=True"),
    (dict(max_tokens=2.5), "max_tokens"),
])
def test_invalid_sampling_params_raise(kwargs, message):
    with pytest.raises(InvalidParameter, match=message) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, ValueError) and info.value.param in SamplingParams.__dataclass_fields__


def test_top_k_zero_disables_top_k_as_in_vllm():
    assert SamplingParams(top_k=0).top_k == -1 == SamplingParams().top_k


def test_sampling_params_defaults_and_derived_values():
    p = SamplingParams()
    assert p.max_tokens is None and p.best_of == 1 and p.top_k == -1 and not p.is_greedy
    assert SamplingParams(stop="x").stop_strings == ["x"]
    beam = SamplingParams(beam_width=4, n=2, temperature=0)
    assert beam.use_beam_search and beam.num_branches == 4
    assert SamplingParams(n=3, best_of=5).num_branches == 5
    assert SamplingParams(n=2).replace(n=3).best_of == 3


@pytest.mark.parametrize("text, expected", [("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), (4096, 4096),
                                             ("2 gib", 2 * 2**30), ("100", 100)])
def test_parse_memory(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["lots", "-1MiB", "1PiB", 0])
def test_parse_memory_rejects(text):
    with pytest.raises(ValueError):
        parse_memory(text)


@pytest.mark.parametrize("given", ["0", "0GiB", 0])
def test_swap_space_zero_means_no_host_pool_as_vllms_flag(given):
    """`--swap-space 0` (a string from the command line) gives no host blocks: preempted requests recompute."""
    assert CacheConfig(swap_space=given).swap_space == 0
    with pytest.raises(ValueError, match="swap_space"):
        CacheConfig(swap_space=-1)


def test_config_validation():
    with pytest.raises(ValueError, match="power of two"):
        CacheConfig(block_size=12)
    with pytest.raises(ValueError, match="either num_blocks or kv_cache_memory"):
        CacheConfig(num_blocks=4, kv_cache_memory="1MiB")
    with pytest.raises(ValueError, match="either num_blocks or kv_cache_memory or gpu_memory_utilization"):
        CacheConfig(kv_cache_memory="1MiB", gpu_memory_utilization=0.5)
    for util in (0, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
            CacheConfig(gpu_memory_utilization=util)
    with pytest.raises(ValueError, match="max_logprobs"):
        EngineConfig.from_kwargs(max_logprobs=-1)
    with pytest.raises(ValueError, match="preemption_mode"):
        SchedulerConfig(preemption_mode="drop")
    with pytest.raises(ValueError, match="unknown engine option 'block_sizes'"):
        EngineConfig.from_kwargs(block_sizes=16)
    config = EngineConfig.from_kwargs(block_size=8, max_num_seqs=4, tensor_parallel_size=2, seed=3)
    assert config.cache.block_size == 8 and config.scheduler.max_num_seqs == 4
    assert config.parallel.tensor_parallel_size == 2 and config.seed == 3
