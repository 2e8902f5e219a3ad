"""`LLMEngine`: requests in, one scheduling step at a time, `RequestOutput`s out."""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Callable, Dict, List, Optional, Sequence as Seq, Union

import torch

from .beam_search import BeamSearchState, apply_beam_decisions
from .block_manager import BlockManager
from .cache_engine import CacheEngine, KVGeometry, kv_cache_torch_dtype, kv_geometry
from .config import EngineConfig
from .detokenizer import cut_at_stop, decode_new_text, find_stop_string, stop_string_in_candidate
from .errors import CannotFit, EngineDeadError, InvalidParameter, InvalidRequest, PromptTooLong
from .input_builder import prepare_inputs
from .loader import check_module_dtype
from .metrics import Counters, EngineStats
from .model_runner import ModelRunner
from .model_support import check_model_supported, uniform_window
from .output_builder import OutputBuilder
from .outputs import RequestOutput
from .sampler import SampleRequest, SampleResult, Sampler
from .sampling_params import RequestOutputKind, SamplingParams
from .scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from .structured_compiler import compiler_for
from .structured_matcher import GrammarState, accept_grammar
from .sequence import Sequence, SequenceGroup, SequenceStatus
from .sizing import KVCacheSize, size_kv_cache
from .step_inputs import Runner
from .streaming import DeltaTracker
from .token_constraints import constraint_processors, with_constraints

PromptType = Union[str, List[int]]
logger = logging.getLogger(__name__)


def _eos_ids(model, tokenizer) -> List[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _sample_generator(seed: int, index: int) -> torch.Generator:
    """The RNG of sample `index` of a seeded request: its own stream, so its tokens do not depend on when
    its siblings are sampled (they may be scheduled apart after a preemption)."""
    if index == 0:
        return torch.Generator(device="cpu").manual_seed(seed)
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest, "little"))


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


class LLMEngine:
    """The serving core: a scheduler and block manager over a paged KV cache and an HF model."""

    def __init__(self, model: Union[str, torch.nn.Module] = "smollm2", tokenizer=None,
                 dtype: Union[torch.dtype, str, None] = None, device: Union[str, torch.device] = "cpu",
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
        tp = self.config.parallel.tensor_parallel_size
        self.kv_size: KVCacheSize = size_kv_cache(cache, self.geometry, self.dtype, self.device, tp,
                                                  model_bytes=_module_bytes(self.model) // tp)
        self.sliding_window = uniform_window(self.model)  # every layer windowed: blocks behind it are released
        self.block_manager = BlockManager(cache.block_size, self.kv_size.num_blocks, self.kv_size.num_swap_blocks,
                                          cache.watermark, cache.enable_prefix_caching, self.sliding_window)
        self.scheduler = Scheduler(self.config.scheduler, self.block_manager)
        self.runner = self._make_runner()
        self.sampler = Sampler(self.config.seed)
        self.groups: Dict[str, SequenceGroup] = {}
        self.counters = Counters()
        self.outputs = OutputBuilder(self.tokenizer, self._stop_ids)
        self.errored: Optional[EngineDeadError] = None  # set when the engine cannot run another step
        self._deltas: Dict[str, DeltaTracker] = {}       # requests that want delta / final-only outputs
        self._token_step: Dict[str, int] = {}            # request -> step of its last generated token
        self._max_prompt_chars: Optional[int] = None

    # ---- construction ------------------------------------------------------------------------
    @staticmethod
    def _load(model, tokenizer, dtype, device, trust_remote_code):
        if isinstance(model, torch.nn.Module):
            check_module_dtype(model, dtype)
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

    def _make_runner(self) -> Runner:
        tp = self.config.parallel.tensor_parallel_size
        if tp > 1:
            from .distributed import TensorParallelRunner

            runner = TensorParallelRunner(self.model, self.geometry, self.kv_size, self.config, self.dtype,
                                          device=self.device, model_name=self._model_name,
                                          trust_remote_code=self._trust_remote_code)
            return runner
        cache = CacheEngine(self.geometry, self.config.cache.block_size, self.kv_size.num_blocks,
                            self.kv_size.num_swap_blocks,
                            kv_cache_torch_dtype(self.config.cache.kv_cache_dtype, self.dtype), self.device)
        return ModelRunner(self.model, cache)

    # ---- requests ----------------------------------------------------------------------------
    @property
    def max_prompt_chars(self) -> int:
        """Characters above which a text prompt cannot fit the context, whatever its tokens: no token spells
        more characters than the longest one in the vocabulary (four times that bound for tokenizers that
        normalize text, which may shorten it). Longer prompts are refused without tokenizing them."""
        if self._max_prompt_chars is None:
            longest = max((len(t) for t in self.tokenizer.get_vocab()), default=1) if self.tokenizer else 1
            backend = getattr(self.tokenizer, "backend_tokenizer", None)
            normalizes = backend is None or getattr(backend, "normalizer", None) is not None
            self._max_prompt_chars = self.max_model_len * max(longest, 1) * (4 if normalizes else 1)
        return self._max_prompt_chars

    def encode(self, prompt: PromptType, truncate: Optional[int] = None) -> List[int]:
        """Token ids of a prompt given as text or ids, validated (`truncate`: keep its last k tokens)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest("this engine has no tokenizer: pass prompts as token ids", param="prompt")
            if prompt == "":
                raise InvalidRequest("prompt is empty", param="prompt")
            if truncate is None and len(prompt) > self.max_prompt_chars:
                raise PromptTooLong(f"prompt has {len(prompt)} characters, more than any prompt that fits the "
                                    f"model's context of {self.max_model_len} tokens can have "
                                    f"({self.max_prompt_chars})", param="prompt")
            ids = list(self.tokenizer(prompt)["input_ids"])
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise InvalidRequest(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}",
                                 param="prompt")
        if not ids:
            raise InvalidRequest("prompt is empty (no tokens)", param="prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"prompt has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}",
                                 param="prompt")
        return ids[-truncate:] if truncate is not None else ids

    def validate_request(self, prompt: PromptType, params: SamplingParams) -> List[int]:
        """Token ids of a prompt (truncated as `params.truncate_prompt_tokens` says), or an `InvalidRequest`
        saying why the engine would refuse the request (`PromptTooLong`, `CannotFit`, `InvalidParameter`).
        Reads only configuration, so it is safe to call while a step runs in another thread."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"params must be SamplingParams, got {type(params).__name__}", param="params")
        ids = self.encode(prompt, params.truncate_prompt_tokens)
        if len(ids) >= self.max_model_len:
            raise PromptTooLong(f"prompt has {len(ids)} tokens; the model's context is {self.max_model_len} tokens "
                                f"and at least one must remain for output", param="prompt")
        self._check_params(params)
        if params.num_branches > self.config.scheduler.max_num_seqs:
            raise CannotFit(f"the request runs {params.num_branches} sequences at once (best_of / beam_width) "
                            f"but max_num_seqs is {self.config.scheduler.max_num_seqs}",
                            param="beam_width" if params.use_beam_search else "best_of")
        bm = self.block_manager
        needed = bm.blocks_for(len(ids) + 1)
        if needed > bm.num_blocks - bm.watermark_blocks:
            raise CannotFit(f"prompt of {len(ids)} tokens needs {needed} KV blocks but the cache holds only "
                            f"{bm.num_blocks} blocks of {bm.block_size} tokens", param="prompt")
        self._grammar(params)  # an invalid schema, regex or grammar is this request's InvalidParameter
        return ids

    def _check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: the vocabulary, the tokenizer and engine limits."""
        if params.stop_strings and self.tokenizer is None:
            raise InvalidParameter("stop strings need a tokenizer to match the text; this engine has none "
                                   "(use stop_token_ids)", param="stop")
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise InvalidParameter(f"stop_token_ids has token ids outside the vocabulary [0, {self.vocab_size}): "
                                   f"{bad[:5]}", param="stop_token_ids")
        limit = self.config.max_logprobs
        if params.logprobs is not None and params.logprobs > limit:
            raise InvalidParameter(f"logprobs={params.logprobs} is more than this engine returns (max_logprobs="
                                   f"{limit})", param="logprobs")
        constraint_processors(params, self.tokenizer, self.vocab_size)  # raises for ids outside the vocabulary

    def _grammar(self, params: SamplingParams) -> Optional[GrammarState]:
        """A fresh matcher state for the request's structured-output constraint (compiled once, cached)."""
        if params.structured_outputs is None:
            return None
        if self.tokenizer is None:
            raise InvalidParameter("structured outputs need a tokenizer; this engine has none",
                                   param="structured_outputs")
        compiler = compiler_for(self.tokenizer, self.vocab_size, self.eos_token_ids)
        try:
            return GrammarState(compiler.compile(params.structured_outputs))
        except InvalidParameter:
            raise
        except ValueError as exc:
            raise InvalidParameter(str(exc), param="structured_outputs") from None

    # ---- how many tokens a request may generate ------------------------------------------------
    def max_new_tokens(self, prompt_len: int, num_branches: int = 1) -> int:
        """How many new tokens each of `num_branches` sequences can still get after a prompt of `prompt_len`
        tokens: the room left in the context, and in the KV cache when the request runs alone (its full prompt
        blocks are shared; each sequence needs its own blocks after them; a model windowed on every layer
        releases the blocks behind its window). 0 or less: none."""
        bm = self.block_manager
        context_room = self.max_model_len - prompt_len
        if self.sliding_window is not None:  # a windowed sequence holds ceil(W / block) + 1 blocks at most
            held = -(-self.sliding_window // bm.block_size) + 1
            if held * max(num_branches, 1) <= bm.num_blocks:
                return context_room
        shared = prompt_len // bm.block_size
        per_branch = (bm.num_blocks - shared) // max(num_branches, 1)
        kv_room = (shared + per_branch) * bm.block_size - prompt_len
        return min(context_room, kv_room)

    def fit_max_tokens(self, prompt_len: int, params: SamplingParams, default: Optional[int] = None,
                       param: str = "max_tokens") -> SamplingParams:
        """`params` with `max_tokens` settled for a prompt of `prompt_len` tokens: its own value, else
        `default`, else all that fits; refused with `PromptTooLong` when it exceeds the context and with
        `CannotFit` when the request could not hold it in the KV cache even running alone. `param` is the
        name the caller's API gives max_tokens (for the error)."""
        wanted = params.max_tokens if params.max_tokens is not None else default
        room = self.max_new_tokens(prompt_len, params.num_branches)
        if wanted is None:
            if room < 1:
                raise PromptTooLong(f"no room is left for new tokens after {prompt_len} prompt tokens "
                                    f"(context length {self.max_model_len})", param="prompt")
            wanted = room
        if prompt_len + wanted > self.max_model_len:
            raise PromptTooLong(f"the prompt has {prompt_len} tokens and `{param}` is {wanted}: together they must "
                                f"be <= {self.max_model_len}, the model's context length", param=param)
        if wanted > room:
            bm = self.block_manager
            raise CannotFit(f"the prompt ({prompt_len} tokens) and `{param}`={wanted} for {params.num_branches} "
                            f"sequence(s) do not fit in the KV cache ({bm.num_blocks} blocks of {bm.block_size} "
                            f"tokens); at most {max(room, 0)} new tokens fit", param=param)
        return params if params.max_tokens == wanted else params.replace(max_tokens=wanted)

    def add_request(self, request_id: str, prompt: PromptType, params: Optional[SamplingParams] = None,
                    arrival_time: Optional[float] = None) -> None:
        """Queue a request; raises ValueError for bad input or a prompt that can never fit."""
        params = SamplingParams() if params is None else params
        if self.errored is not None:
            raise EngineDeadError(f"the engine cannot take requests: {self.errored}")
        if request_id in self.groups:
            raise InvalidRequest(f"request id {request_id!r} is already in use", param="request_id")
        ids = self.validate_request(prompt, params)
        params = with_constraints(params, self.tokenizer, self.vocab_size) or params
        group = SequenceGroup(request_id, prompt if isinstance(prompt, str) else None, ids, params,
                              arrival_time, self.eos_token_ids)
        if params.seed is not None:
            group.seqs[0].generator = _sample_generator(params.seed, 0)
        group.seqs[0].grammar = self._grammar(params)
        if params.use_beam_search:
            group.beam_state = BeamSearchState(
                params.beam_width, len(ids), self._max_length(group), float(params.length_penalty),
                params.early_stopping, self._stop_ids(params), record_scores=params.output_scores,
                stop_check=self._beam_stop_check(params))
        self.groups[request_id] = group
        if params.output_kind != RequestOutputKind.CUMULATIVE:
            self._deltas[request_id] = DeltaTracker(params)
        self.scheduler.add(group)

    def _max_length(self, group: SequenceGroup) -> int:
        max_tokens = group.sampling_params.max_tokens
        limit = self.max_model_len
        return limit if max_tokens is None else min(limit, len(group.prompt_token_ids) + max_tokens)

    def _stop_ids(self, params: SamplingParams) -> List[int]:
        return ([] if params.ignore_eos else list(self.eos_token_ids)) + list(params.stop_token_ids)

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
                outputs.append(self._finalize(group))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished()

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> List[RequestOutput]:
        """Schedule, run the model once, sample, and report every request that moved.

        A failure belongs to the request that caused it: an error while sampling or stopping one request
        fails that request only; a failed forward fails the step's requests and the others go on. Only a
        runner that cannot continue (`EngineDeadError`) fails everything, and the error is raised."""
        if self.errored is not None:
            raise EngineDeadError(f"the engine cannot run: {self.errored}")
        sched = self.scheduler.schedule()
        outputs = [self._finalize(g) for g in sched.failed]
        for group in sched.failed:
            logger.error("request %r failed: %s", group.request_id, group.error)
        if sched.scheduled or sched.blocks_to_swap_in or sched.blocks_to_swap_out or sched.blocks_to_copy:
            used = self.block_manager.num_blocks - self.block_manager.get_num_free_blocks()
            self.counters.peak_used_blocks = max(self.counters.peak_used_blocks, used)
            try:
                logits = self.runner.execute(self._step_inputs(sched))
            except EngineDeadError as exc:
                self._die(exc)
                raise
            except Exception as exc:  # noqa: BLE001 - the step's requests fail, the others go on
                return outputs + self._fail_step(sched, exc)
            self._process(sched, logits)
            self.counters.num_steps += 1
        self.scheduler.free_finished()
        return outputs + self._outputs_of(sched.scheduled)

    def _step_inputs(self, sched: SchedulerOutput):
        inputs = prepare_inputs(sched.scheduled, self.block_manager.block_tables, self.config.cache.block_size)
        inputs.swap_out, inputs.swap_in, inputs.copies = (sched.blocks_to_swap_out, sched.blocks_to_swap_in,
                                                          sched.blocks_to_copy)
        return inputs

    def _outputs_of(self, scheduled: List[ScheduledSeq]) -> List[RequestOutput]:
        """One output per request of the step: final (and forgotten) when it has finished or failed."""
        outputs, seen = [], set()
        for item in scheduled:
            group = item.group
            if group.request_id in seen or group.request_id not in self.groups:
                continue
            seen.add(group.request_id)
            output = self._finalize(group) if group.is_finished() else self._report(self.outputs.build(group))
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

    # ---- failures ----------------------------------------------------------------------------
    def _fail_group(self, group: SequenceGroup, error: str) -> None:
        """End one request with an error (its blocks are freed); logged once, counted as failed."""
        logger.error("request %r failed: %s", group.request_id, error)
        self.scheduler.fail(group, error)

    def _guarded(self, group: SequenceGroup, what: str, action: Callable[[], None]) -> None:
        """Run one request's part of the step; an exception fails that request alone."""
        try:
            action()
        except Exception as exc:  # noqa: BLE001 - the error belongs to this request only
            self._fail_group(group, f"{what} failed: {type(exc).__name__}: {exc}")

    def _fail_step(self, sched: SchedulerOutput, exc: Exception) -> List[RequestOutput]:
        """The forward failed: its requests (every running one, and those swapped out by this step, whose
        blocks may be half moved) fail; waiting and earlier swapped requests are untouched."""
        error = f"the model step failed: {type(exc).__name__}: {exc}"
        logger.error("step failed; failing the %d requests it ran", len(self.scheduler.running), exc_info=exc)
        victims = list(self.scheduler.running) + [g for g in sched.preempted if g in self.scheduler.swapped]
        for group in victims:
            self._fail_group(group, error)
        return [self._finalize(group) for group in victims]

    def _die(self, exc: EngineDeadError) -> None:
        """The runner cannot continue: every request fails and the engine takes no more."""
        self.errored = exc
        logger.error("the engine cannot continue: %s", exc)
        for group in list(self.groups.values()):
            self.scheduler.fail(group, f"the engine failed: {exc}")
            self._finalize(group)

    def _process(self, sched: SchedulerOutput, logits: torch.Tensor) -> None:
        samplers: List[ScheduledSeq] = []
        now = time.monotonic()
        for item in sched.scheduled:
            seq = item.seq
            if item.samples:
                samplers.append(item)
            if item.num_tokens > 1 or seq.num_computed_tokens < seq.prompt_len:
                self.counters.num_prompt_tokens += item.num_tokens
            end = seq.num_computed_tokens + item.num_tokens
            self.counters.num_recomputed_tokens += max(0, min(end, seq.max_computed_tokens) - seq.num_computed_tokens)
            seq.max_computed_tokens = max(seq.max_computed_tokens, end)
            seq.num_computed_tokens = end
            self.block_manager.mark_computed(seq)
            self.block_manager.release_out_of_window(seq)
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
        return SampleRequest(params, item.seq, 1 if group.branched else params.best_of, item.seq.generator,
                             self._stop_ids(params) if params.min_tokens else [])

    def _sample(self, items: List[ScheduledSeq], logits: torch.Tensor) -> None:
        requests = [self._sample_request(item) for item in items]
        try:
            results: List[Optional[SampleResult]] = list(self.sampler.sample(logits, requests))
        except Exception:  # noqa: BLE001 - find the request at fault: sample the rows one by one
            results = [self._sample_alone(item, logits[i:i + 1], request)
                       for i, (item, request) in enumerate(zip(items, requests))]
        for item, result in zip(items, results):
            if result is not None:
                self._guarded(item.group, "generating the next token",
                              lambda item=item, result=result: self._take_sample(item, result))

    def _sample_alone(self, item: ScheduledSeq, row: torch.Tensor, request: SampleRequest) -> Optional[SampleResult]:
        try:
            return self.sampler.sample(row, [request])[0]
        except Exception as exc:  # noqa: BLE001 - the error belongs to this request only
            self._fail_group(item.group, f"sampling failed: {type(exc).__name__}: {exc}")
            return None

    def _take_sample(self, item: ScheduledSeq, result: SampleResult) -> None:
        group, seq = item.group, item.seq
        if not group.branched:
            group.branched = True
            seed = group.sampling_params.seed
            for j in range(1, len(result.token_ids)):
                child = seq.fork()
                child.generator = None if seed is None else _sample_generator(seed, j)
                self.block_manager.fork(seq, child)
                group.seqs.append(child)
                self._append(group, child, result, j)
        self._append(group, seq, result, 0)

    def _append(self, group: SequenceGroup, seq: Sequence, result, j: int) -> None:
        params = group.sampling_params
        seq.append_token(result.token_ids[j], result.logprobs[j])
        accept_grammar(seq)
        if result.top_logprobs is not None:
            seq.output_logprobs.append(result.top_logprobs[j])
        if result.scores is not None:
            seq.output_scores.append((result.logits, result.scores))
        self._note_token(group)
        new_text = decode_new_text(self.tokenizer, seq, params.skip_special_tokens) if params.detokenize else ""
        self._check_stop(group, seq, new_text)

    def _note_token(self, group: SequenceGroup) -> None:
        now = time.monotonic()
        metrics = group.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        elif self._token_step.get(group.request_id) != self.counters.num_steps:  # once per step and request
            self.counters.observe("time_per_output_token_seconds", now - metrics.last_token_time)
        self._token_step[group.request_id] = self.counters.num_steps
        metrics.last_token_time = now
        self.counters.num_generated_tokens += 1

    def _check_stop(self, group: SequenceGroup, seq: Sequence, new_text: str) -> None:
        params = group.sampling_params
        token = seq.token_ids[-1]
        if seq.grammar is not None and seq.grammar.is_terminated:  # the structured output is complete
            seq.status = SequenceStatus.FINISHED_STOPPED
            return
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
                    stop = found[0]
                    seq.output_text = cut_at_stop(seq.output_text, len(new_text), stop,
                                                  params.include_stop_str_in_output)
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
        try:
            log_probs = self.sampler.beam_log_probs(logits, requests)
        except Exception:  # noqa: BLE001 - find the request at fault: one row at a time
            log_probs = None
        touched: Dict[str, SequenceGroup] = {}
        for i, item in enumerate(items):
            if item.group.is_finished():
                continue
            row = log_probs[i] if log_probs is not None else self._beam_row(item, logits[i:i + 1], requests[i])
            if row is None:
                continue
            state: BeamSearchState = item.group.beam_state
            state.pending[item.seq.seq_id] = row
            if state.record_scores:
                state.pending_logits[item.seq.seq_id] = logits[i].to(torch.float32)
            touched[item.group.request_id] = item.group
        for group in touched.values():
            self._guarded(group, "the beam search step", lambda group=group: self._beam_advance(group))

    def _beam_row(self, item: ScheduledSeq, row: torch.Tensor, request: SampleRequest) -> Optional[torch.Tensor]:
        try:
            return self.sampler.beam_log_probs(row, [request])[0]
        except Exception as exc:  # noqa: BLE001 - the error belongs to this request only
            self._fail_group(item.group, f"beam scoring failed: {type(exc).__name__}: {exc}")
            return None

    def _beam_advance(self, group: SequenceGroup) -> None:
        """Step the beam search once every live beam has its log-probs."""
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
        """The last output of a finished, aborted or failed request (as its output_kind asks); forgets it."""
        group.metrics.finished_time = time.monotonic()
        self.groups.pop(group.request_id, None)
        self._token_step.pop(group.request_id, None)
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
            kv_usage=1.0 - bm.get_num_free_blocks() / bm.num_blocks,
            kv_token_utilization=filled / slots if slots else 1.0,
            prefix_cache_hit_rate=cache.hit_rate if cache else 0.0,
            prefix_cache_queries=cache.num_queries if cache else 0,
            prefix_cache_hits=cache.num_hits if cache else 0,
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
            histograms=self.counters.histogram_snapshots())

    def shutdown(self) -> None:
        """Release worker processes (tensor parallelism) and the KV cache; the engine is unusable afterwards."""
        self.runner.shutdown()
