"""Request intake: prompts encoded and checked, parameters checked against the model and the cache, and
how many new tokens a prompt can still get. Reads only configuration, so fronts may call it while a step runs.

A request is checked once: `validate` returns `ValidatedRequest`s (the prompt's token ids, and the work the
parameters need done once: token constraints built, grammar compiled), which the engine queues as they are.
Fronts validate in worker threads and hand the result on, so nothing is tokenized or compiled on an event loop.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, List, Optional, Sequence, Tuple, Union

from paged_backend.core.block_manager import BlockManager
from paged_backend.config import EngineConfig
from paged_backend.engine.lora_manager import refuse_lora
from paged_backend.engine.lora_request import LoRARequest
from paged_backend.errors import CannotFit, InvalidParameter, InvalidRequest, PromptTooLong
from paged_backend.sampling_params import SamplingParams
from paged_backend.structured.compiler import CompiledConstraint, compiler_for
from paged_backend.structured.matcher import GrammarState
from paged_backend.sampling.token_constraints import constraint_processors

if TYPE_CHECKING:
    from paged_backend.engine.lora_manager import LoRAManager

PromptType = Union[str, List[int]]
# A text prompt is tokenized in growing prefixes (this many characters per context token first, then four
# times more each round), so a prompt far beyond the context is refused after tokenizing about a context's worth.
_PROBE_CHARS_PER_TOKEN = 8


@dataclass(frozen=True)
class ValidatedRequest:
    """A request the engine has checked and prepared (`LLMEngine.prepare_request`): the prompt's token ids,
    its parameters, the logits processors of its token constraints and its compiled grammar. The engine queues
    it without checking it again; only `max_tokens` may change afterwards (`with_max_tokens`)."""

    prompt: Optional[str]
    prompt_token_ids: List[int]
    params: SamplingParams
    constraints: Tuple[Callable, ...] = ()
    grammar: Optional[CompiledConstraint] = None
    lora_request: Optional[LoRARequest] = None   # its adapter (checked and read), None for the base model
    cache_salt: Optional[str] = None             # vLLM's: prefix-cache blocks are shared only under the same salt

    def with_max_tokens(self, max_tokens: int) -> "ValidatedRequest":
        """The same request with `max_tokens` set (re-checked against the other parameters)."""
        if max_tokens == self.params.max_tokens:
            return self
        return dataclasses.replace(self, params=self.params.replace(max_tokens=max_tokens))

    def engine_params(self) -> SamplingParams:
        """The parameters the engine runs: the request's, with its constraints' processors appended."""
        if not self.constraints:
            return self.params
        return self.params.replace(logits_processors=list(self.params.logits_processors) + list(self.constraints))

    def cache_key(self) -> Optional[bytes]:
        """Where the prompt's block hashes start: the adapter and the salt, or None (the shared root)."""
        if self.lora_request is None and self.cache_salt is None:
            return None
        digest = hashlib.sha256(self.lora_request.cache_key() if self.lora_request is not None else b"base")
        if self.cache_salt is not None:
            digest.update(b"\0salt\0" + self.cache_salt.encode("utf-8"))
        return digest.digest()

    def grammar_state(self) -> Optional[GrammarState]:
        """A fresh matcher for the request's grammar (None without structured outputs)."""
        return GrammarState(self.grammar) if self.grammar is not None else None


class RequestIntake:
    """What the engine checks before it queues a request."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, eos_token_ids: List[int],
                 config: EngineConfig, block_manager: BlockManager, sliding_window: Optional[int],
                 loras: Optional["LoRAManager"] = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.config = config
        self.block_manager = block_manager
        self.sliding_window = sliding_window
        self.loras = loras
        self._max_prompt_chars: Optional[int] = None
        _ = self.max_prompt_chars  # reads the whole vocabulary (a few hundred ms holding the GIL): not mid-serving

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

    def encode(self, prompt: PromptType, truncate: Optional[int] = None, add_special_tokens: bool = True) -> List[int]:
        """Token ids of a prompt given as text or ids, validated (`truncate`: keep its last k tokens). Without
        `truncate`, a text whose first part already holds the whole context is refused (`PromptTooLong`)
        without tokenizing the rest."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest("this engine has no tokenizer: pass prompts as token ids", param="prompt")
            if prompt == "":
                raise InvalidRequest("prompt is empty", param="prompt")
            if truncate is None and len(prompt) > self.max_prompt_chars:
                raise PromptTooLong(f"prompt has {len(prompt)} characters, more than any prompt that fits the "
                                    f"model's context of {self.max_model_len} tokens can have "
                                    f"({self.max_prompt_chars})", param="prompt")
            ids = self._tokenize(prompt, add_special_tokens, bounded=truncate is None)
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

    def _tokenize(self, text: str, add_special_tokens: bool, bounded: bool) -> List[int]:
        """The text's token ids. `bounded`: tokenize growing prefixes, each cut after a whitespace (so the words
        before the cut tokenize as in the whole text), and refuse the text as soon as one holds the context."""
        size = self.max_model_len * _PROBE_CHARS_PER_TOKEN
        while bounded and size < len(text):
            cut = max(text.rfind(" ", 0, size), text.rfind("\n", 0, size))
            if cut <= 0:
                break  # no whitespace to cut at: tokenize the whole text (bounded by max_prompt_chars)
            count = len(self.tokenizer(text[:cut], add_special_tokens=add_special_tokens)["input_ids"])
            if count >= self.max_model_len:
                raise PromptTooLong(f"prompt has more than {count} tokens (counted in its first {cut} of {len(text)} "
                                    f"characters); the model's context is {self.max_model_len} tokens and at least "
                                    f"one must remain for output", param="prompt")
            size *= 4
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def validate(self, prompts: Sequence[PromptType], params: SamplingParams,
                 lora_request: Optional[LoRARequest] = None, cache_salt: Optional[str] = None) -> List[ValidatedRequest]:
        """One `ValidatedRequest` per prompt (all with `params`, `lora_request` and `cache_salt`; the work is done
        once), or an `InvalidRequest` saying why the engine would refuse them (`PromptTooLong`, `CannotFit`,
        `InvalidParameter`, an adapter that cannot be read or does not fit the model). Reads only configuration
        (and the adapter's files), so it is safe to call while a step runs in another thread."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"params must be SamplingParams, got {type(params).__name__}", param="params")
        ids = [self._prompt_ids(prompt, params) for prompt in prompts]
        self._check_params(params)
        if params.num_branches > self.config.scheduler.max_num_seqs:
            raise CannotFit(f"the request runs {params.num_branches} sequences at once (best_of / beam_width) "
                            f"but max_num_seqs is {self.config.scheduler.max_num_seqs}",
                            param="beam_width" if params.use_beam_search else "best_of")
        constraints = tuple(constraint_processors(params, self.tokenizer, self.vocab_size))
        grammar = self.compile_grammar(params)  # an invalid schema, regex or grammar is an InvalidParameter
        self._check_lora(lora_request)
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidParameter(f"cache_salt must be a non-empty string, got {cache_salt!r}", param="cache_salt")
        return [ValidatedRequest(prompt if isinstance(prompt, str) else None, prompt_ids, params, constraints, grammar,
                                 lora_request, cache_salt)
                for prompt, prompt_ids in zip(prompts, ids)]

    def _check_lora(self, lora_request: Optional[LoRARequest]) -> None:
        """The adapter read and fitted to the model, or refused (LoRA not enabled, unreadable, not fitting)."""
        if self.loras is None:
            refuse_lora(lora_request)
        elif lora_request is not None:
            self.loras.check(lora_request)

    def validate_request(self, prompt: PromptType, params: SamplingParams) -> List[int]:
        """Token ids of a prompt (truncated as `params.truncate_prompt_tokens` says), or the `InvalidRequest`
        the engine would refuse the request with (see `validate`)."""
        return self.validate([prompt], params)[0].prompt_token_ids

    def _prompt_ids(self, prompt: PromptType, params: SamplingParams) -> List[int]:
        """The prompt's token ids, checked against the context and the KV cache."""
        truncate = params.truncate_prompt_tokens
        if truncate is not None and truncate > self.max_model_len:  # vLLM's rule
            raise PromptTooLong(f"truncate_prompt_tokens={truncate} is greater than the model's context of "
                                f"{self.max_model_len} tokens; select a smaller truncation size",
                                param="truncate_prompt_tokens")
        ids = self.encode(prompt, truncate)
        if len(ids) >= self.max_model_len:
            raise PromptTooLong(f"prompt has {len(ids)} tokens; the model's context is {self.max_model_len} tokens "
                                f"and at least one must remain for output", param="prompt")
        bm = self.block_manager
        needed = bm.blocks_for(len(ids) + 1)
        if needed > bm.num_blocks - bm.watermark_blocks:
            raise CannotFit(f"prompt of {len(ids)} tokens needs {needed} KV blocks but the cache holds only "
                            f"{bm.num_blocks} blocks of {bm.block_size} tokens", param="prompt")
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

    def compile_grammar(self, params: SamplingParams) -> Optional[CompiledConstraint]:
        """The request's structured-output constraint, compiled (once per constraint: cached)."""
        if params.structured_outputs is None:
            return None
        if self.tokenizer is None:
            raise InvalidParameter("structured outputs need a tokenizer; this engine has none",
                                   param="structured_outputs")
        compiler = compiler_for(self.tokenizer, self.vocab_size, self.eos_token_ids)
        try:
            return compiler.compile(params.structured_outputs)
        except InvalidParameter:
            raise
        except ValueError as exc:
            raise InvalidParameter(str(exc), param="structured_outputs") from None

    # ---- how many tokens a request may generate ------------------------------------------------
    def fit_request(self, request: ValidatedRequest, default: Optional[int] = None,
                    param: str = "max_tokens") -> ValidatedRequest:
        """`request` with `max_tokens` settled for its prompt (see `fit_max_tokens`)."""
        fitted = self.fit_max_tokens(len(request.prompt_token_ids), request.params, default, param)
        return request.with_max_tokens(fitted.max_tokens)

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
