"""`LLMEngine`: requests in, one scheduling step at a time, `RequestOutput`s out."""

from __future__ import annotations

import logging
import time
from typing import Callable, Dict, List, Optional, Sequence as Seq, Union

import torch

from paged_backend import kernels
from paged_backend.sampling.beam_search import BeamSearchState
from paged_backend.core.block_manager import BlockManager
from paged_backend.worker.compute_thread import run_on_compute_thread
from paged_backend.worker.cache_engine import CacheEngine, KVGeometry, kv_cache_torch_dtype, kv_geometry
from paged_backend.config import CPU_ADMISSION_BACKOFF_STEPS, EngineConfig, SpeculativeConfig
from paged_backend.engine.detokenizer import stop_string_in_candidate
from paged_backend.errors import EngineDeadError, InvalidRequest
from paged_backend.engine.lora_manager import LoRAManager
from paged_backend.engine.lora_request import LoRARequest
from paged_backend.worker.loader import check_module_dtype
from paged_backend.engine.metrics import Counters, EngineStats, cache_config_info, observe_phases
from paged_backend.worker.lora_layers import LoRALayers
from paged_backend.worker.model_runner import ModelRunner
from paged_backend.worker.cuda_graphs import GraphConfig
from paged_backend.worker.model_support import check_model_supported, uniform_window
from paged_backend.engine.output_builder import OutputBuilder
from paged_backend.engine.outputs import RequestOutput
from paged_backend.engine.request_intake import PromptType, RequestIntake, ValidatedRequest
from paged_backend.sampling.sampler import Sampler
from paged_backend.sampling_params import RequestOutputKind, SamplingParams
from paged_backend.core.scheduler import Scheduler
from paged_backend.core.scheduler_output import ScheduledSeq
from paged_backend.core.sequence import SequenceGroup, SequenceStatus
from paged_backend.worker.sizing import KVCacheSize, size_kv_cache
from paged_backend.worker.step_inputs import Runner
from paged_backend.engine.step_loop import StepLoop
from paged_backend.engine.step_pipeline import LaunchedStep, StepWorker
from paged_backend.engine.spec_decode.policy import SpecPolicy
from paged_backend.engine.spec_decode.proposers import make_proposer
from paged_backend.engine.spec_decode.speculator import Speculator
from paged_backend.engine.spec_decode.verifier import DraftVerifier, SpecCounters
from paged_backend.engine.streaming import DeltaTracker
from paged_backend.engine.token_processor import TokenProcessor, sample_generator

logger = logging.getLogger(__name__)


def _eos_ids(model, tokenizer) -> List[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _module_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters and buffers."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def _max_model_len(model) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


class LLMEngine(StepLoop):
    """The serving core: a scheduler and block manager over a paged KV cache and an HF model; its step loop is
    `StepLoop` (step_loop.py)."""

    def __init__(self, model: Union[str, torch.nn.Module] = "smollm2", tokenizer=None,
                 dtype: Union[torch.dtype, str, None] = None, device: Union[str, torch.device] = "cpu",
                 trust_remote_code: bool = False, **engine_options) -> None:
        self.config = EngineConfig.from_kwargs(**engine_options)
        # overlapped: the whole construction (loading, the runner and its cache, kernel checks) runs on the compute
        # thread, as the steps' forwards will (compute_thread.py: one OpenMP team per process)
        if self.config.scheduler.async_scheduling:
            run_on_compute_thread(self._build, model, tokenizer, dtype, device, trust_remote_code)
        else:   # without overlap the steps run in the caller's thread: so does everything else
            self._build(model, tokenizer, dtype, device, trust_remote_code)

    def _build(self, model, tokenizer, dtype, device, trust_remote_code) -> None:
        tensor_parallel = self.config.parallel.tensor_parallel_size > 1
        # Under tensor parallelism a named model is loaded on the CPU and only rank 0's shard moves to the device.
        self._model_name = None if isinstance(model, torch.nn.Module) else str(model)
        self._trust_remote_code = trust_remote_code
        self.model, self.tokenizer = self._load(model, tokenizer, dtype, "cpu" if tensor_parallel else device,
                                                trust_remote_code)
        self.device = torch.device(device) if tensor_parallel else next(self.model.parameters()).device
        check_model_supported(self.model)
        self.dtype = next(self.model.parameters()).dtype
        self.eos_token_ids = _eos_ids(self.model, self.tokenizer)
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0] \
            if self.model.get_output_embeddings() is not None else self.model.config.vocab_size
        self.max_model_len = self._resolve_max_model_len()
        self.geometry: KVGeometry = kv_geometry(self.model.config)
        cache = self.config.cache
        tp = self.config.parallel.tensor_parallel_size
        self.kv_size: KVCacheSize = size_kv_cache(cache, self.geometry, self.dtype, self.device, tp,
                                                  model_bytes=_module_bytes(self.model) // tp)
        self.sliding_window = uniform_window(self.model)  # every layer windowed: blocks behind it are released
        self.block_manager = BlockManager(cache.block_size, self.kv_size.num_blocks, self.kv_size.num_swap_blocks,
                                          cache.watermark, cache.enable_prefix_caching, self.sliding_window)
        self.loras = self._make_lora_manager()
        if self.config.scheduler.admission_backoff_steps is None:   # see CPU_ADMISSION_BACKOFF_STEPS
            self.config.scheduler.admission_backoff_steps = CPU_ADMISSION_BACKOFF_STEPS if self.device.type == "cpu" else 0
        self.scheduler = Scheduler(self.config.scheduler, self.block_manager,
                                   self.config.lora.max_loras if self.loras is not None else None,
                                   swap_single=self.device.type == "cpu")
        self.runner = self._make_runner()
        self.kernels = kernels.kernels_in_use(self.device)  # which implementation runs each op (metrics, info)
        self.sampler = Sampler(self.config.seed)
        self.groups: Dict[str, SequenceGroup] = {}
        self.counters = Counters()
        self.outputs = OutputBuilder(self.tokenizer)
        self.errored: Optional[EngineDeadError] = None  # set when the engine cannot run another step
        self._deltas: Dict[str, DeltaTracker] = {}       # requests that want delta / final-only outputs
        self.intake = RequestIntake(self.tokenizer, self.vocab_size, self.max_model_len, self.eos_token_ids,
                                    self.config, self.block_manager, self.sliding_window, self.loras)
        self._cache_info = cache_config_info(self.config.cache, self.kv_size, self.sliding_window)
        self.tokens = TokenProcessor(self.block_manager, self.sampler, self.tokenizer,
                                     self.counters, self.eos_token_ids, self.max_model_len)
        self.spec_counters = SpecCounters()
        self.speculator: Optional[Speculator] = self._make_speculator()
        self._worker = StepWorker(threaded=self.config.scheduler.async_scheduling)
        self._inflight: Optional[LaunchedStep] = None   # the step launched ahead (overlapped scheduling)

    # ---- construction ------------------------------------------------------------------------
    @staticmethod
    def _load(model, tokenizer, dtype, device, trust_remote_code):
        if isinstance(model, torch.nn.Module):
            check_module_dtype(model, dtype)
            return model.eval(), tokenizer
        from paged_backend.worker.loader import load_model

        loaded, loaded_tokenizer = load_model(model, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
        return loaded, tokenizer if tokenizer is not None else loaded_tokenizer

    def _resolve_max_model_len(self) -> int:
        limit = _max_model_len(self.model)
        wanted = self.config.scheduler.max_model_len
        if wanted is not None and wanted > limit:
            raise ValueError(f"max_model_len={wanted} exceeds the model's context of {limit} tokens")
        return wanted or limit

    def _make_lora_manager(self) -> Optional[LoRAManager]:
        lora = self.config.lora
        if not lora.enable_lora:
            return None
        if self.config.parallel.tensor_parallel_size > 1:
            raise ValueError("enable_lora with tensor_parallel_size > 1 is not supported: LoRA adapters run on a "
                             "single device")
        return LoRAManager(lora, self.model)

    def _make_runner(self) -> Runner:
        tp = self.config.parallel.tensor_parallel_size
        if tp > 1:
            from paged_backend.worker.tp_runner import TensorParallelRunner

            runner = TensorParallelRunner(self.model, self.geometry, self.kv_size, self.config, self.dtype,
                                          device=self.device, model_name=self._model_name,
                                          trust_remote_code=self._trust_remote_code)
            return runner
        cache = CacheEngine(self.geometry, self.config.cache.block_size, self.kv_size.num_blocks,
                            self.kv_size.num_swap_blocks,
                            kv_cache_torch_dtype(self.config.cache.kv_cache_dtype, self.dtype), self.device)
        lora = self.config.lora
        layers = LoRALayers(self.model, lora.max_loras, lora.max_lora_rank) if self.loras is not None else None
        return ModelRunner(self.model, cache, layers, compile=self.config.compilation.compile,
                           graphs=self._decode_graphs(layers is not None))

    def _decode_graphs(self, lora: bool) -> Optional[GraphConfig]:
        """CUDA graphs for decode steps: on a CUDA device unless `enforce_eager`, compile or LoRA says otherwise."""
        compilation = self.config.compilation
        if self.device.type != "cuda" or compilation.enforce_eager or compilation.compile != "off" or lora:
            return None
        return GraphConfig(self.config.scheduler.max_num_seqs, self.max_model_len)

    def _make_speculator(self) -> Optional[Speculator]:
        """The proposer, policy and verifier of speculative decoding (`speculative_config`), or None."""
        spec = self.config.speculative
        if spec is None:
            self.tokens.verifier = None
            return None
        if self.sliding_window is not None:
            raise ValueError(f"speculative_config: {type(self.model).__name__} attends through a sliding window, "
                             "which speculative decoding does not support yet")
        proposer = make_proposer(spec, self)
        policy = SpecPolicy(spec.num_speculative_tokens, spec.disable_by_batch_size)
        self.tokens.verifier = DraftVerifier(self.tokens, policy, self.spec_counters)
        return Speculator(proposer, policy, self.block_manager, self.config.scheduler.max_num_batched_tokens)

    def set_speculative_config(self, value) -> None:
        """Turn speculative decoding on (vLLM's `speculative_config` dict), off (None) or change it, from the next
        step on (no step in progress ever holds draft tokens, so this is safe between steps; outputs of greedy
        requests do not change). The counters of `get_stats()` keep adding up."""
        spec = SpeculativeConfig.of(value)
        if spec == self.config.speculative:
            return
        previous, self.config.speculative = self.config.speculative, spec
        try:
            speculator = self._make_speculator()
        except Exception:
            self.config.speculative = previous
            self._make_speculator()
            raise
        if self.speculator is not None:
            self.speculator.close()
        self.speculator = speculator

    # ---- requests ----------------------------------------------------------------------------
    @property
    def max_prompt_chars(self) -> int:
        """Characters above which a text prompt cannot fit the context (refused without tokenizing it)."""
        return self.intake.max_prompt_chars

    def encode(self, prompt: PromptType, truncate: Optional[int] = None, add_special_tokens: bool = True) -> List[int]:
        """Token ids of a prompt given as text or ids, validated (`truncate`: keep its last k tokens; a text far
        beyond the context is refused before it is tokenized whole)."""
        return self.intake.encode(prompt, truncate, add_special_tokens)

    def decode_token(self, token_id: int) -> str:
        """The text of one token on its own, special tokens spelled out ("" without a tokenizer): how every front
        names a token in its logprobs."""
        return "" if self.tokenizer is None else self.tokenizer.decode([token_id], skip_special_tokens=False)

    def prepare_requests(self, prompts: Seq[PromptType], params: SamplingParams,
                         lora_request: Optional[LoRARequest] = None,
                         cache_salt: Optional[str] = None) -> List[ValidatedRequest]:
        """Check requests once and do their preparation (tokenizing, token constraints, grammar compilation,
        reading the LoRA adapter): one `ValidatedRequest` per prompt, all with `params`, to pass to
        `add_request`; an `InvalidRequest` saying why the engine would refuse them. `cache_salt` (vLLM's) keeps
        the requests' KV apart from others' in the prefix cache. Reads only configuration: safe while a step
        runs in another thread, so servers call it off their event loop."""
        return self.intake.validate(prompts, params, lora_request, cache_salt)

    def prepare_request(self, prompt: PromptType, params: SamplingParams, lora_request: Optional[LoRARequest] = None,
                        cache_salt: Optional[str] = None) -> ValidatedRequest:
        """`prepare_requests` for one prompt."""
        return self.intake.validate([prompt], params, lora_request, cache_salt)[0]

    def validate_request(self, prompt: PromptType, params: SamplingParams) -> List[int]:
        """Token ids of a prompt, or an `InvalidRequest` saying why the engine would refuse the request.
        Reads only configuration, so it is safe to call while a step runs in another thread."""
        return self.intake.validate_request(prompt, params)

    def max_new_tokens(self, prompt_len: int, num_branches: int = 1) -> int:
        """How many new tokens each of `num_branches` sequences can still get after a prompt (context and KV
        cache, the request running alone)."""
        return self.intake.max_new_tokens(prompt_len, num_branches)

    def fit_max_tokens(self, prompt_len: int, params: SamplingParams, default: Optional[int] = None,
                       param: str = "max_tokens") -> SamplingParams:
        """`params` with `max_tokens` settled for a prompt: its own value, else `default`, else all that fits;
        `PromptTooLong` / `CannotFit` when it cannot be had."""
        return self.intake.fit_max_tokens(prompt_len, params, default, param)

    def fit_request(self, request: ValidatedRequest, default: Optional[int] = None,
                    param: str = "max_tokens") -> ValidatedRequest:
        """A prepared request with `max_tokens` settled for its prompt (see `fit_max_tokens`)."""
        return self.intake.fit_request(request, default, param)

    def add_request(self, request_id: str, prompt: Union[PromptType, ValidatedRequest],
                    params: Optional[SamplingParams] = None, arrival_time: Optional[float] = None,
                    lora_request: Optional[LoRARequest] = None) -> None:
        """Queue a request: a prompt and its params (checked here) and LoRA adapter, or a `ValidatedRequest`
        from `prepare_request` (queued as it is); raises ValueError for bad input, an adapter that cannot be
        loaded or a prompt that can never fit."""
        if self.errored is not None:
            raise EngineDeadError(f"the engine cannot take requests: {self.errored}")
        if request_id in self.groups:
            raise InvalidRequest(f"request id {request_id!r} is already in use", param="request_id")
        if isinstance(prompt, ValidatedRequest):
            if params is not None or lora_request is not None:
                raise InvalidRequest("a prepared request carries its own params and lora_request; pass neither",
                                     param="params" if params is not None else "lora_request")
            request = prompt
        else:
            request = self.prepare_request(prompt, SamplingParams() if params is None else params, lora_request)
        self._queue(request_id, request, arrival_time)

    def _queue(self, request_id: str, request: ValidatedRequest, arrival_time: Optional[float]) -> None:
        params, ids = request.engine_params(), request.prompt_token_ids
        group = SequenceGroup(request_id, request.prompt, ids, params, arrival_time, self.eos_token_ids,
                              lora_request=request.lora_request, cache_salt=request.cache_key())
        group.seqs[0].max_len = self._max_length(group)
        if params.seed is not None:
            group.seqs[0].generator = sample_generator(params.seed, 0)
        group.seqs[0].grammar = request.grammar_state()
        if params.use_beam_search:
            group.beam_state = BeamSearchState(
                params.beam_width, len(ids), self._max_length(group), float(params.length_penalty),
                params.early_stopping, list(group.stop_ids), record_scores=params.output_scores,
                stop_check=self._beam_stop_check(params))
        self.groups[request_id] = group
        if params.output_kind != RequestOutputKind.CUMULATIVE:
            self._deltas[request_id] = DeltaTracker(params)
        self.scheduler.add(group)

    def _max_length(self, group: SequenceGroup) -> int:
        max_tokens = group.sampling_params.max_tokens
        limit = self.max_model_len
        return limit if max_tokens is None else min(limit, len(group.prompt_token_ids) + max_tokens)

    def _beam_stop_check(self, params: SamplingParams) -> Optional[Callable[[List[int], int], Optional[str]]]:
        """For beam search with stop strings: the stop string a candidate token completes, if any."""
        if not params.stop_strings:
            return None
        return lambda output_ids, token: stop_string_in_candidate(
            self.tokenizer, output_ids, token, params.stop_strings, params.skip_special_tokens)

    def abort_request(self, request_id: Union[str, Seq[str]]) -> List[RequestOutput]:
        """Stop requests and free their blocks; returns their final outputs (finish_reason "abort")."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        outputs = []
        for rid in ids:
            group = self.scheduler.abort(rid)
            if group is not None:
                if self.speculator is not None:
                    self.speculator.forget([group])   # a draft model's blocks for it are free at once
                outputs.append(self._finalize(group))
        if self._inflight is not None and not self.scheduler.has_unfinished():
            self._drain()  # the step launched ahead ran only aborted requests: nothing runs once the engine is idle
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished()

    def _outputs_of(self, scheduled: List[ScheduledSeq]) -> List[RequestOutput]:
        """One output per request of the step: final (and forgotten) when it has finished or failed."""
        outputs, seen = [], set()
        groups = self.groups
        for item in scheduled:
            group = item.group
            rid = group.request_id
            if rid in seen or groups.get(rid) is not group:
                continue
            seen.add(rid)
            if group.is_finished():
                output = self._finalize(group)
            elif group.sampling_params.output_kind == RequestOutputKind.FINAL_ONLY:
                continue  # nothing to report before the end: not even built
            else:
                output = self._report(self.outputs.build(group))
            if output is not None:
                outputs.append(output)
        return outputs

    def _report(self, output: RequestOutput) -> Optional[RequestOutput]:
        """The output as the request asked for it (`output_kind`): cumulative, a delta, or only the final one;
        None when there is nothing to report."""
        tracker = self._deltas.get(output.request_id)
        if tracker is None:
            return output
        if output.finished:
            del self._deltas[output.request_id]
        elif tracker.params.output_kind == RequestOutputKind.FINAL_ONLY:
            return None
        return tracker.update(output) if tracker.params.output_kind == RequestOutputKind.DELTA else output

    # ---- outputs -----------------------------------------------------------------------------
    def _finalize(self, group: SequenceGroup) -> RequestOutput:
        """The last output of a finished, aborted or failed request (as its output_kind asks); forgets it."""
        group.metrics.finished_time = time.monotonic()
        self.groups.pop(group.request_id, None)
        output = self.outputs.build(group, final=True)
        aborted = any(seq.status == SequenceStatus.FINISHED_ABORTED for seq in group.seqs)
        if group.error is not None:
            self.counters.num_requests_failed += 1
            self.counters.finish_reasons["error"] += 1
        else:
            self.counters.num_requests_finished += 1
            self.counters.num_requests_aborted += aborted
            reason = "abort" if aborted else (output.outputs[0].finish_reason if output.outputs else "abort")
            self.counters.finish_reasons[reason if reason in self.counters.finish_reasons else "stop"] += 1
            self._observe_request(group, output)
        return self._report(output)

    def _observe_request(self, group: SequenceGroup, output: RequestOutput) -> None:
        """Per-request histograms of a request that ended without an error."""
        m, observe = group.metrics, self.counters.observe
        if m.first_token_time is not None:
            observe("time_to_first_token_seconds", max(m.first_token_time - m.arrival_time, 0.0))
        if m.first_scheduled_time is not None:
            observe("request_queue_time_seconds", max(m.first_scheduled_time - m.arrival_time, 0.0))
        observe("e2e_request_latency_seconds", max(m.finished_time - m.arrival_time, 0.0))
        observe("request_prompt_tokens", len(group.prompt_token_ids))
        observe("request_generation_tokens", sum(len(c.token_ids) for c in output.outputs))
        observe("request_params_n", group.sampling_params.n)
        observe("request_params_best_of", group.sampling_params.num_branches)
        if group.sampling_params.max_tokens is not None:
            observe("request_params_max_tokens", group.sampling_params.max_tokens)
        observe_phases(self.counters, m, output)

    # ---- statistics --------------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        bm, sch = self.block_manager, self.scheduler
        running_seqs = [s for g in sch.running for s in g.unfinished_seqs()]
        filled, slots = bm.kv_usage(running_seqs)
        max_blocks_per_seq = max((bm.num_held_blocks(s) for s in running_seqs), default=0)
        cache = bm.prefix_cache
        return EngineStats(
            num_blocks=bm.num_blocks, num_free_blocks=bm.get_num_free_blocks(), num_swap_blocks=bm.num_swap_blocks,
            num_free_swap_blocks=bm.get_num_free_swap_blocks(), block_size=bm.block_size,
            num_running=len(sch.running), num_waiting=len(sch.waiting), num_swapped=len(sch.swapped),
            num_preemptions=sch.num_preemptions, num_swap_preemptions=sch.num_swap_preemptions,
            num_recompute_preemptions=sch.num_recompute_preemptions,
            kernels=dict(self.kernels),
            kv_usage=1.0 - bm.get_num_free_blocks() / bm.num_blocks,
            kv_token_utilization=filled / slots if slots else 1.0,
            prefix_cache_hit_rate=cache.hit_rate if cache else 0.0,
            prefix_cache_queries=cache.num_queries if cache else 0,
            prefix_cache_hits=cache.num_hits if cache else 0,
            prefix_cache_query_tokens=cache.num_queries * bm.block_size if cache else 0,
            prefix_cache_hit_tokens=cache.num_hits * bm.block_size if cache else 0,
            num_cached_prefill_tokens=bm.num_cached_prefill_tokens, num_copy_on_write=bm.num_copy_on_write,
            peak_used_blocks=self.counters.peak_used_blocks, max_blocks_per_seq=max_blocks_per_seq,
            num_prompt_tokens=self.counters.num_prompt_tokens,
            num_recomputed_tokens=self.counters.num_recomputed_tokens,
            num_generated_tokens=self.counters.num_generated_tokens, num_steps=self.counters.num_steps,
            num_requests_finished=self.counters.num_requests_finished,
            num_requests_failed=self.counters.num_requests_failed,
            num_requests_aborted=self.counters.num_requests_aborted,
            swap_usage=1.0 - bm.get_num_free_swap_blocks() / bm.num_swap_blocks if bm.num_swap_blocks else 0.0,
            finish_reasons=dict(self.counters.finish_reasons),
            histograms=self.counters.histogram_snapshots(), cache_config=self._cache_info,
            lora_info=self._lora_info(), num_lora_loads=self.loras.num_slot_loads if self.loras is not None else 0,
            spec_decode_num_drafts=self.spec_counters.num_drafts,
            spec_decode_num_draft_tokens=self.spec_counters.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec_counters.num_accepted_tokens,
            spec_decode_acceptance_rate=self.spec_counters.acceptance_rate,
            timestamp=time.time())

    def _lora_info(self) -> Dict[str, str]:
        """vLLM's `lora_requests_info` labels: the slots, and the adapters of running and of waiting requests."""
        sch = self.scheduler
        names = LoRAManager.adapter_names
        return {"max_lora": str(self.config.lora.max_loras if self.loras is not None else 0),
                "running_lora_adapters": names(sch.running),
                "waiting_lora_adapters": names(list(sch.waiting) + list(sch.swapped))}

    # ---- LoRA adapters (vLLM's names) --------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter ahead of its requests; False if it was loaded already."""
        return self._lora_manager().add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (requests still running with it read it again if they need it)."""
        return self._lora_manager().remove(lora_int_id)

    def list_loras(self) -> List[int]:
        """The ids of the adapters held on the host."""
        return self._lora_manager().list() if self.loras is not None else []

    @property
    def lora_enabled(self) -> bool:
        """Whether requests may name LoRA adapters (`enable_lora`)."""
        return self.loras is not None

    def _lora_manager(self) -> LoRAManager:
        if self.loras is None:
            raise ValueError("LoRA is not enabled: build the engine with enable_lora=True")
        return self.loras

    @property
    def overlapped(self) -> bool:
        """Whether steps overlap (`async_scheduling`): their forwards run on the compute thread."""
        return self._worker.threaded

    def shutdown(self) -> None:
        """Release worker processes (tensor parallelism) and the KV cache; the engine is unusable afterwards."""
        self._drain()
        self._worker.shutdown()
        if self.speculator is not None:
            self.speculator.close()
        self.runner.shutdown()
