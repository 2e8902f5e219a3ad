"""OpenAI request bodies (completions, chat) and their mapping to `SamplingParams`.

OpenAI's parameters plus vLLM's extras (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
`min_tokens`, `stop_token_ids`, `include_stop_str_in_output`, `skip_special_tokens`,
`use_beam_search`, `length_penalty`). `max_tokens` defaults to 16 for completions (OpenAI's
documented default) and to "until EOS or the context / KV cache limit" for chat.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

from paged_backend import SamplingParams

from .body import StrictBody
from .errors import ValidationFailed
from .generation import ServerContext, check_max_new_tokens, max_new_tokens_limit, prompt_ids

MAX_LOGPROBS = 20
MAX_N = 128
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class StreamOptions(StrictBody):
    include_usage: bool = False


class SamplingFields(StrictBody):
    """Fields both endpoints share."""

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, List[str]]] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    seed: Optional[int] = None
    logit_bias: Optional[Dict[str, float]] = None
    user: Optional[str] = None
    best_of: Optional[int] = None
    # vLLM extras
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: Optional[List[int]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    use_beam_search: bool = False
    length_penalty: float = 1.0


class CompletionRequest(SamplingFields):
    prompt: Union[str, List[str], List[int], List[List[int]]]
    max_tokens: Optional[int] = COMPLETIONS_DEFAULT_MAX_TOKENS
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None


class ContentPart(StrictBody):
    type: str
    text: Optional[str] = None


class ChatMessage(StrictBody):
    role: str
    content: Optional[Union[str, List[ContentPart]]] = None
    name: Optional[str] = None


class ChatRequest(SamplingFields):
    messages: List[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    response_format: Optional[Dict[str, Any]] = None
    tools: Optional[List[Any]] = None
    tool_choice: Optional[Any] = None
    add_generation_prompt: bool = True


@dataclass
class OpenAIPlan:
    """A validated request: one engine request per prompt, all with the same SamplingParams."""

    prompts: List[List[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: Optional[int]        # completions: top-k per position; chat: top_logprobs
    echo_texts: Optional[List[str]] = None


def _fail(message: str, param: str, code: str = "invalid_value") -> None:
    raise ValidationFailed(message, param=param, code=code)


def _range(value, name: str, low: float, high: float) -> None:
    if value is not None and not low <= value <= high:
        _fail(f"`{name}` must be between {low} and {high}, got {value}", name)


def _check_common(req: SamplingFields) -> None:
    _range(req.temperature, "temperature", 0.0, 2.0)
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        _fail(f"`top_p` must be in (0, 1], got {req.top_p}", "top_p")
    _range(req.presence_penalty, "presence_penalty", -2.0, 2.0)
    _range(req.frequency_penalty, "frequency_penalty", -2.0, 2.0)
    _range(req.n, "n", 1, MAX_N)
    if req.max_tokens is not None and req.max_tokens < 1:
        _fail(f"`max_tokens` must be at least 1, got {req.max_tokens}", "max_tokens")
    if req.best_of is not None and req.best_of < req.n:
        _fail(f"`best_of` ({req.best_of}) must be >= `n` ({req.n})", "best_of")
    if req.logit_bias:
        _fail("`logit_bias` is not supported by this server", "logit_bias", "unsupported_parameter")
    if req.seed is not None and not -(2 ** 63) <= req.seed < 2 ** 64:
        _fail("`seed` must fit in 64 bits", "seed")
    if req.stream and req.best_of is not None and req.best_of > req.n:
        _fail("`best_of` > `n` cannot be streamed", "best_of")
    if req.stream and req.use_beam_search:
        _fail("beam search cannot be streamed", "use_beam_search")
    if req.stop == "" or (isinstance(req.stop, list) and any(s == "" for s in req.stop)):
        _fail("`stop` strings must not be empty", "stop")


def _sampling_params(req: SamplingFields, max_tokens: int, logprobs: Optional[int]) -> SamplingParams:
    beam = req.use_beam_search
    width = (req.best_of or req.n) if beam else 1
    temperature = 0.0 if beam else (req.temperature if req.temperature is not None else 1.0)
    try:
        return SamplingParams(
            n=req.n, best_of=None if beam else req.best_of, temperature=temperature,
            top_p=req.top_p if req.top_p is not None else 1.0,
            top_k=-1 if req.top_k in (None, 0) else req.top_k,
            min_p=req.min_p if req.min_p is not None else 0.0,
            repetition_penalty=req.repetition_penalty if req.repetition_penalty is not None else 1.0,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output, ignore_eos=req.ignore_eos,
            max_tokens=max_tokens, min_tokens=req.min_tokens, logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens, beam_width=width, length_penalty=req.length_penalty)
    except ValueError as exc:
        raise ValidationFailed(str(exc)) from None


def _max_tokens(ctx: ServerContext, req: SamplingFields, prompts: List[List[int]], requested: Optional[int],
                name: str) -> int:
    branches = (req.best_of or req.n)
    longest = max(len(p) for p in prompts)
    if requested is None:
        allowed = max_new_tokens_limit(ctx, longest, branches)
        if allowed < 1:
            _fail(f"no room is left for new tokens after {longest} prompt tokens", "messages",
                  "context_length_exceeded")
        return allowed
    for p in prompts:
        check_max_new_tokens(ctx, len(p), requested, branches, name)
    return requested


def _completion_prompts(ctx: ServerContext, prompt) -> List[List[int]]:
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompts = [list(prompt)]
    else:
        prompts = list(prompt)
    if not prompts:
        _fail("`prompt` must not be empty", "prompt")
    return [prompt_ids(ctx, p) for p in prompts]


def plan_completion(ctx: ServerContext, req: CompletionRequest) -> OpenAIPlan:
    """Validate a /v1/completions request and build its SamplingParams."""
    _check_common(req)
    if req.suffix:
        _fail("`suffix` is not supported by this server", "suffix", "unsupported_parameter")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        _fail(f"`logprobs` must be between 0 and {MAX_LOGPROBS}, got {req.logprobs}", "logprobs")
    if req.echo and req.logprobs is not None:
        _fail("`echo` with `logprobs` is not supported: prompt logprobs are not computed", "echo",
              "unsupported_parameter")
    prompts = _completion_prompts(ctx, req.prompt)
    max_tokens = _max_tokens(ctx, req, prompts, req.max_tokens, "max_tokens")
    params = _sampling_params(req, max_tokens, req.logprobs)
    echo = [ctx.tokenizer.decode(p) for p in prompts] if req.echo else None
    return OpenAIPlan(prompts, params, req.stream, _include_usage(req), req.logprobs, echo)


def _include_usage(req: SamplingFields) -> bool:
    return bool(req.stream and req.stream_options is not None and req.stream_options.include_usage)


def _message_text(message: ChatMessage, i: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            _fail(f"messages[{i}]: only text content parts are supported, got {part.type!r}", "messages")
        parts.append(part.text)
    return "".join(parts)


def chat_prompt(ctx: ServerContext, req: ChatRequest) -> str:
    """The conversation rendered with the model's chat template."""
    if not req.messages:
        _fail("`messages` must not be empty", "messages")
    if getattr(ctx.tokenizer, "chat_template", None) is None:
        _fail("this model's tokenizer has no chat template; use /v1/completions", "messages")
    messages = [{"role": m.role, "content": _message_text(m, i)} for i, m in enumerate(req.messages)]
    try:
        return ctx.tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=req.add_generation_prompt)
    except Exception as exc:  # noqa: BLE001 - template errors are the caller's messages being off
        raise ValidationFailed(f"the chat template rejected the messages: {exc}", param="messages") from None


def plan_chat(ctx: ServerContext, req: ChatRequest) -> OpenAIPlan:
    """Validate a /v1/chat/completions request, apply the chat template, build SamplingParams."""
    _check_common(req)
    if req.tools:
        _fail("`tools` are not supported by this server", "tools", "unsupported_parameter")
    if req.response_format and req.response_format.get("type", "text") != "text":
        _fail("only `response_format` {\"type\": \"text\"} is supported", "response_format", "unsupported_parameter")
    if req.top_logprobs is not None:
        _range(req.top_logprobs, "top_logprobs", 0, MAX_LOGPROBS)
        if not req.logprobs:
            _fail("`top_logprobs` needs `logprobs` set to true", "top_logprobs")
    if req.max_completion_tokens is not None and req.max_completion_tokens < 1:
        _fail(f"`max_completion_tokens` must be at least 1, got {req.max_completion_tokens}", "max_completion_tokens")
    text = chat_prompt(ctx, req)
    ids = prompt_ids(ctx, list(ctx.tokenizer(text, add_special_tokens=False)["input_ids"]))
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = _max_tokens(ctx, req, [ids], requested, "max_tokens")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return OpenAIPlan([ids], _sampling_params(req, max_tokens, logprobs), req.stream, _include_usage(req),
                      logprobs)
