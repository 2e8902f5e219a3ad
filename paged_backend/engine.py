"""`LLMEngine`: requests in, one scheduling step at a time, `RequestOutput`s out."""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence as Seq, Union

import torch

from .beam_search import BeamSearchState, apply_beam_decisions
from .block_manager import BlockManager
from .cache_engine import CacheEngine, KVGeometry, kv_geometry
from .config import EngineConfig
from .detokenizer import decode_new_text, find_stop_string
from .metrics import Counters, EngineStats
from .model_runner import ModelRunner, prepare_inputs
from .model_support import check_model_supported
from .output_builder import OutputBuilder
from .outputs import RequestOutput
from .sampler import SampleRequest, Sampler
from .sampling_params import SamplingParams
from .scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from .sequence import Sequence, SequenceGroup, SequenceStatus
from .sizing import KVCacheSize, size_kv_cache

PromptType = Union[str, List[int]]


def _eos_ids(model, tokenizer) -> List[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _max_model_len(model) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


class LLMEngine:
    """The serving core: a scheduler and block manager over a paged KV cache and an HF model."""

    def __init__(self, model: Union[str, torch.nn.Module] = "smollm2", tokenizer=None,
                 dtype: torch.dtype = torch.float32, device: Union[str, torch.device] = "cpu",
                 trust_remote_code: bool = False, **engine_options) -> None:
        self.config = EngineConfig.from_kwargs(**engine_options)
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
        self.kv_size: KVCacheSize = size_kv_cache(cache, self.geometry, self.dtype, self.device,
                                                  self.config.parallel.tensor_parallel_size)
        self.block_manager = BlockManager(cache.block_size, self.kv_size.num_blocks, self.kv_size.num_swap_blocks,
                                          cache.watermark, cache.enable_prefix_caching)
        self.scheduler = Scheduler(self.config.scheduler, self.block_manager)
        self.runner = self._make_runner()
        self.sampler = Sampler(self.config.seed)
        self.groups: Dict[str, SequenceGroup] = {}
        self.counters = Counters()
        self.outputs = OutputBuilder(self.tokenizer, self._stop_ids)

    # ---- construction ------------------------------------------------------------------------
    @staticmethod
    def _load(model, tokenizer, dtype, device, trust_remote_code):
        if isinstance(model, torch.nn.Module):
            return model.eval(), tokenizer
        from .loader import load_model

        loaded, loaded_tokenizer = load_model(model, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
        return loaded, tokenizer if tokenizer is not None else loaded_tokenizer

    def _resolve_max_model_len(self) -> int:
        limit = _max_model_len(self.model)
        wanted = self.config.scheduler.max_model_len
        if wanted is not None and wanted > limit:
            raise ValueError(f"max_model_len={wanted} exceeds the model's context of {limit} tokens")
        return wanted or limit

    def _make_runner(self):
        tp = self.config.parallel.tensor_parallel_size
        if tp > 1:
            from .distributed import TensorParallelRunner

            runner = TensorParallelRunner(self.model, self.geometry, self.kv_size, self.config, self.dtype,
                                          device=self.device, model_name=self._model_name,
                                          trust_remote_code=self._trust_remote_code)
            if self._model_name is not None:
                self.model = runner.model  # rank 0's shard: the full model is not kept
            return runner
        cache = CacheEngine(self.geometry, self.config.cache.block_size, self.kv_size.num_blocks,
                            self.kv_size.num_swap_blocks, self.dtype, self.device)
        return ModelRunner(self.model, cache)

    # ---- requests ----------------------------------------------------------------------------
    def encode(self, prompt: PromptType) -> List[int]:
        """Token ids of a prompt given as text or ids, validated."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass prompts as token ids")
            if prompt == "":
                raise ValueError("prompt is empty")
            ids = list(self.tokenizer(prompt)["input_ids"])
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty (no tokens)")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        return ids

    def validate_request(self, prompt: PromptType, params: SamplingParams) -> List[int]:
        """Token ids of a prompt, or a ValueError naming why the engine would refuse the request.
        Reads only configuration, so it is safe to call while a step runs in another thread."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        ids = self.encode(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the model's context is {self.max_model_len} tokens "
                             f"and at least one must remain for output")
        if params.num_branches > self.config.scheduler.max_num_seqs:
            raise ValueError(f"the request runs {params.num_branches} sequences at once (best_of / beam_width) "
                             f"but max_num_seqs is {self.config.scheduler.max_num_seqs}")
        bm = self.block_manager
        needed = bm.blocks_for(len(ids) + 1)
        if needed > bm.num_blocks - bm.watermark_blocks:
            raise ValueError(f"prompt of {len(ids)} tokens needs {needed} KV blocks but the cache holds only "
                             f"{bm.num_blocks} blocks of {bm.block_size} tokens")
        return ids

    def add_request(self, request_id: str, prompt: PromptType, params: Optional[SamplingParams] = None,
                    arrival_time: Optional[float] = None) -> None:
        """Queue a request; raises ValueError for bad input or a prompt that can never fit."""
        params = SamplingParams() if params is None else params
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.validate_request(prompt, params)
        group = SequenceGroup(request_id, prompt if isinstance(prompt, str) else None, ids, params,
                              arrival_time, self.eos_token_ids)
        if params.seed is not None:
            group.generator = torch.Generator(device="cpu").manual_seed(params.seed)
        if params.use_beam_search:
            group.beam_state = BeamSearchState(
                params.beam_width, len(ids), self._max_length(group), float(params.length_penalty),
                params.early_stopping, self._stop_ids(params), record_scores=params.output_scores)
        self.groups[request_id] = group
        self.scheduler.add(group)

    def _max_length(self, group: SequenceGroup) -> int:
        max_tokens = group.sampling_params.max_tokens
        limit = self.max_model_len
        return limit if max_tokens is None else min(limit, len(group.prompt_token_ids) + max_tokens)

    def _stop_ids(self, params: SamplingParams) -> List[int]:
        return ([] if params.ignore_eos else list(self.eos_token_ids)) + list(params.stop_token_ids)

    def abort_request(self, request_id: Union[str, Seq[str]]) -> List[RequestOutput]:
        """Stop requests and free their blocks; returns their final outputs (finish_reason "abort")."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        outputs = []
        for rid in ids:
            group = self.scheduler.abort(rid)
            if group is not None:
                outputs.append(self._finalize(group))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished()

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> List[RequestOutput]:
        """Schedule, run the model once, sample, and report every request that moved."""
        sched = self.scheduler.schedule()
        outputs = [self._finalize(g) for g in sched.failed]
        inputs = prepare_inputs(sched.scheduled, self.block_manager.block_tables, self.config.cache.block_size)
        inputs.swap_out, inputs.swap_in, inputs.copies = (sched.blocks_to_swap_out, sched.blocks_to_swap_in,
                                                          sched.blocks_to_copy)
        if sched.scheduled or inputs.swap_in or inputs.swap_out or inputs.copies:
            used = self.block_manager.num_blocks - self.block_manager.get_num_free_blocks()
            self.counters.peak_used_blocks = max(self.counters.peak_used_blocks, used)
            logits = self.runner.execute(inputs)
            self._process(sched, logits)
            self.counters.num_steps += 1
        finished = {g.request_id for g in self.scheduler.free_finished()}
        seen = set()
        for item in sched.scheduled:
            group = item.group
            if group.request_id in seen or group.request_id not in self.groups:
                continue
            seen.add(group.request_id)
            outputs.append(self._finalize(group) if group.request_id in finished else self.outputs.build(group))
        return outputs

    def _process(self, sched: SchedulerOutput, logits: torch.Tensor) -> None:
        samplers: List[ScheduledSeq] = []
        now = time.monotonic()
        for item in sched.scheduled:
            seq = item.seq
            if item.samples:
                samplers.append(item)
            if item.num_tokens > 1 or seq.num_computed_tokens < seq.prompt_len:
                self.counters.num_prompt_tokens += item.num_tokens
            seq.num_computed_tokens += item.num_tokens
            self.block_manager.mark_computed(seq)
            if item.group.metrics.first_scheduled_time is None:
                item.group.metrics.first_scheduled_time = now
        rows = {id(item): i for i, item in enumerate(samplers)}
        normal = [item for item in samplers if not item.group.sampling_params.use_beam_search]
        if normal:  # every row in order (the usual case) needs no gathered copy of the logits
            self._sample(normal, logits if len(normal) == len(samplers) else
                         logits[[rows[id(item)] for item in normal]])
        beams = [item for item in samplers if item.group.sampling_params.use_beam_search]
        if beams:
            self._beam_search(beams, logits[[rows[id(item)] for item in beams]])

    def _sample_request(self, item: ScheduledSeq) -> SampleRequest:
        group = item.group
        params = group.sampling_params
        return SampleRequest(params, item.seq, 1 if group.branched else params.best_of, group.generator,
                             self._stop_ids(params) if params.min_tokens else [])

    def _sample(self, items: List[ScheduledSeq], logits: torch.Tensor) -> None:
        requests = [self._sample_request(item) for item in items]
        results = self.sampler.sample(logits, requests)
        for item, result in zip(items, results):
            group, seq = item.group, item.seq
            if not group.branched:
                group.branched = True
                for j in range(1, len(result.token_ids)):
                    child = seq.fork()
                    self.block_manager.fork(seq, child)
                    group.seqs.append(child)
                    self._append(group, child, result, j)
            self._append(group, seq, result, 0)

    def _append(self, group: SequenceGroup, seq: Sequence, result, j: int) -> None:
        params = group.sampling_params
        seq.append_token(result.token_ids[j], result.logprobs[j])
        if result.top_logprobs is not None:
            seq.output_logprobs.append(result.top_logprobs[j])
        if result.scores is not None:
            seq.output_scores.append((result.logits, result.scores))
        self._note_token(group)
        new_text = decode_new_text(self.tokenizer, seq, params.skip_special_tokens) if params.detokenize else ""
        self._check_stop(group, seq, new_text)

    def _note_token(self, group: SequenceGroup) -> None:
        now = time.monotonic()
        if group.metrics.first_token_time is None:
            group.metrics.first_token_time = now
        group.metrics.last_token_time = now
        self.counters.num_generated_tokens += 1

    def _check_stop(self, group: SequenceGroup, seq: Sequence, new_text: str) -> None:
        params = group.sampling_params
        token = seq.token_ids[-1]
        if seq.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                seq.status = SequenceStatus.FINISHED_STOPPED
                return
            if token in params.stop_token_ids:
                seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
                return
            if params.stop_strings and new_text:
                found = find_stop_string(seq.output_text, len(new_text), params.stop_strings)
                if found is not None:
                    stop, idx = found
                    seq.output_text = seq.output_text[: idx + len(stop) if params.include_stop_str_in_output else idx]
                    seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
                    return
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            seq.status = SequenceStatus.FINISHED_LENGTH
        elif len(seq) >= self.max_model_len:
            seq.status = SequenceStatus.FINISHED_LENGTH

    # ---- beam search -------------------------------------------------------------------------
    def _beam_search(self, items: List[ScheduledSeq], logits: torch.Tensor) -> None:
        requests = [SampleRequest(item.group.sampling_params, item.seq, 1, None,
                                  self._stop_ids(item.group.sampling_params)) for item in items]
        log_probs = Sampler.beam_log_probs(logits, requests)
        touched: Dict[str, SequenceGroup] = {}
        for i, item in enumerate(items):
            state: BeamSearchState = item.group.beam_state
            state.pending[item.seq.seq_id] = log_probs[i]
            if state.record_scores:
                state.pending_logits[item.seq.seq_id] = logits[i].to(torch.float32)
            touched[item.group.request_id] = item.group
        for group in touched.values():
            live = group.unfinished_seqs()
            state = group.beam_state
            if all(seq.seq_id in state.pending for seq in live):
                rows = torch.stack([state.pending.pop(seq.seq_id) for seq in live])
                if state.record_scores:
                    state.step_scores.append(rows.clone())
                    state.step_logits.append(torch.stack([state.pending_logits.pop(seq.seq_id) for seq in live]))
                self._beam_step(group, live, rows)

    def _beam_step(self, group: SequenceGroup, live: List[Sequence], log_probs: torch.Tensor) -> None:
        state: BeamSearchState = group.beam_state
        decisions = state.step(log_probs, [seq.output_token_ids for seq in live], [seq.beam_indices for seq in live])
        group.branched = True
        for _ in decisions:
            self._note_token(group)
        if state.done:
            for seq in live:
                seq.status = SequenceStatus.FINISHED_STOPPED
            return
        group.seqs = apply_beam_decisions(live, decisions, self.block_manager)

    # ---- outputs -----------------------------------------------------------------------------
    def _finalize(self, group: SequenceGroup) -> RequestOutput:
        """The last output of a finished, aborted or failed request; forgets it."""
        group.metrics.finished_time = time.monotonic()
        self.groups.pop(group.request_id, None)
        if group.error is not None:
            self.counters.num_requests_failed += 1
        else:
            self.counters.num_requests_finished += 1
        return self.outputs.build(group, final=True)

    # ---- statistics --------------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        bm, sch = self.block_manager, self.scheduler
        running_seqs = [s for g in sch.running for s in g.unfinished_seqs()]
        filled, slots = bm.token_slot_usage(running_seqs)
        cache = bm.prefix_cache
        return EngineStats(
            num_blocks=bm.num_blocks, num_free_blocks=bm.get_num_free_blocks(), num_swap_blocks=bm.num_swap_blocks,
            num_free_swap_blocks=bm.get_num_free_swap_blocks(), block_size=bm.block_size,
            num_running=len(sch.running), num_waiting=len(sch.waiting), num_swapped=len(sch.swapped),
            num_preemptions=sch.num_preemptions, num_swap_preemptions=sch.num_swap_preemptions,
            num_recompute_preemptions=sch.num_recompute_preemptions,
            kv_usage=1.0 - bm.get_num_free_blocks() / bm.num_blocks,
            kv_token_utilization=filled / slots if slots else 1.0,
            prefix_cache_hit_rate=cache.hit_rate if cache else 0.0,
            prefix_cache_queries=cache.num_queries if cache else 0,
            prefix_cache_hits=cache.num_hits if cache else 0,
            num_cached_prefill_tokens=bm.num_cached_prefill_tokens, num_copy_on_write=bm.num_copy_on_write,
            peak_used_blocks=self.counters.peak_used_blocks,
            num_prompt_tokens=self.counters.num_prompt_tokens,
            num_generated_tokens=self.counters.num_generated_tokens, num_steps=self.counters.num_steps,
            num_requests_finished=self.counters.num_requests_finished,
            num_requests_failed=self.counters.num_requests_failed)

    def shutdown(self) -> None:
        """Release worker processes (tensor parallelism) and the KV cache; the engine is unusable afterwards."""
        close = getattr(self.runner, "shutdown", None)
        if close is not None:
            close()
        cache = getattr(self.runner, "cache_engine", None)
        if cache is not None:
            cache.release()
