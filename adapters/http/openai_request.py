"""OpenAI request bodies (completions, chat): OpenAI's limits where its specification states them, then
the body under vLLM's names through the engine's request contract (`sampling_params_from_dict`,
`validate`, `fit_max_tokens`), so every parameter means what it means to vLLM.

OpenAI's parameters plus vLLM's extras (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `min_tokens`,
`stop_token_ids`, `include_stop_str_in_output`, `skip_special_tokens`, `allowed_token_ids`, `bad_words`,
`truncate_prompt_tokens`, `use_beam_search`, `length_penalty`, `early_stopping`, and structured output:
`structured_outputs`, `guided_*`, see openai_structured.py). A `model` that names one of the server's LoRA
adapters (loras.py) runs the request with it. `response_format` constrains both routes; the
chat route also takes `tools` (openai_tools.py). `max_tokens` defaults to 16 for completions (OpenAI's
documented default) and to all that fits the context and KV cache for chat; `null` means all that fits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from paged_backend import RequestOutputKind, SamplingParams, ValidatedRequest, load_json, sampling_params_from_dict
from paged_backend.errors import InvalidRequest, PromptTooLong

from .body import StrictBody
from .context import ServerContext
from .errors import ValidationFailed, fail, refusal
from .openai_structured import structured_outputs_value
from .openai_tools import EarlierToolCall, ToolChoice, ToolDefinition, ToolPlan, plan_tools

# OpenAI's documented limits
MAX_COMPLETION_LOGPROBS = 5
MAX_TOP_LOGPROBS = 20
MAX_N = 128
MAX_BEST_OF = 20
MAX_STOP = 4
MAX_LOGIT_BIAS = 100.0
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
    ignore_eos: Optional[bool] = None
    min_tokens: Optional[int] = None
    stop_token_ids: Optional[List[int]] = None
    include_stop_str_in_output: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    spaces_between_special_tokens: Optional[bool] = None
    allowed_token_ids: Optional[List[int]] = None
    bad_words: Optional[List[str]] = None
    truncate_prompt_tokens: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    use_beam_search: bool = False
    length_penalty: Optional[float] = None
    early_stopping: Optional[Union[bool, str]] = None
    # structured output (openai_structured.py)
    response_format: Optional[Dict[str, Any]] = None
    structured_outputs: Optional[Dict[str, Any]] = None
    guided_json: Optional[Union[str, Dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[List[str]] = None
    guided_grammar: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None
    guided_decoding_backend: Optional[str] = None


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
    tool_calls: Optional[List[EarlierToolCall]] = None  # an assistant's earlier calls
    tool_call_id: Optional[str] = None                  # a tool's answer to one of them


class ChatRequest(SamplingFields):
    messages: List[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[List[ToolDefinition]] = None
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: Optional[bool] = None
    add_generation_prompt: bool = True


@dataclass
class OpenAIPlan:
    """A validated request: one prepared engine request per prompt."""

    requests: List[ValidatedRequest]
    stream: bool
    include_usage: bool
    logprobs: Optional[int]        # completions: top-k per position; chat: top_logprobs
    echo_texts: Optional[List[str]] = None
    tools: ToolPlan = field(default_factory=lambda: ToolPlan("none"))
    model: Optional[str] = None    # the name replies carry: the adapter's, else the served model's

    @property
    def prompts(self) -> List[List[int]]:
        return [r.prompt_token_ids for r in self.requests]

    @property
    def params(self) -> List[SamplingParams]:
        return [r.params for r in self.requests]

    @property
    def n(self) -> int:
        return self.requests[0].params.n


def _range(value, name: str, low: float, high: float) -> None:
    if value is not None and not low <= value <= high:
        fail(f"`{name}` must be between {low} and {high}, got {value}", name)


def _check_common(req: SamplingFields) -> None:
    """OpenAI's documented limits; everything else is the engine's contract."""
    _range(req.temperature, "temperature", 0.0, 2.0)
    _range(req.top_p, "top_p", 0.0, 1.0)
    _range(req.presence_penalty, "presence_penalty", -2.0, 2.0)
    _range(req.frequency_penalty, "frequency_penalty", -2.0, 2.0)
    _range(req.n, "n", 1, MAX_N)
    _range(req.best_of, "best_of", 1, MAX_BEST_OF)
    if req.max_tokens is not None and req.max_tokens < 1:
        fail(f"`max_tokens` must be at least 1, got {req.max_tokens}", "max_tokens")
    if req.best_of is not None and req.best_of < req.n:
        fail(f"`best_of` ({req.best_of}) must be >= `n` ({req.n})", "best_of")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOP:
        fail(f"`stop` takes up to {MAX_STOP} sequences, got {len(stops)}", "stop")
    if any(s == "" for s in stops):
        fail("`stop` strings must not be empty", "stop")
    for key, bias in (req.logit_bias or {}).items():
        if not key.strip().isdigit():
            fail(f"`logit_bias` keys must be token ids, got {key!r}", "logit_bias")
        _range(bias, "logit_bias", -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
    if req.stream_options is not None and not req.stream:  # vLLM's (and OpenAI's) rule
        fail("`stream_options` can only be used when `stream` is true", "stream_options")
    if req.stream and req.best_of is not None and req.best_of > req.n:
        fail("`best_of` > `n` cannot be streamed", "best_of")
    if req.stream and req.use_beam_search:
        fail("beam search cannot be streamed", "use_beam_search")


_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_whitespace_pattern")
_VLLM_FIELDS = ("n", "best_of", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty", "seed", "stop", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
                "min_tokens", "skip_special_tokens", "spaces_between_special_tokens", "allowed_token_ids", "bad_words",
                "truncate_prompt_tokens", "prompt_logprobs", "use_beam_search", "length_penalty", "early_stopping")


def vllm_values(req: SamplingFields, max_tokens: Optional[int], logprobs: Optional[int],
                structured: Optional[dict] = None) -> Dict[str, Any]:
    """The request under vLLM's names (what `sampling_params_from_dict` reads)."""
    values: Dict[str, Any] = {name: getattr(req, name) for name in _VLLM_FIELDS}
    values.update(max_tokens=max_tokens, logprobs=logprobs, structured_outputs=structured)
    if req.logit_bias:
        values["logit_bias"] = {int(k): v for k, v in req.logit_bias.items()}
    return values


def _settle(ctx: ServerContext, req: SamplingFields, prompts: list, max_tokens: Optional[int],
            logprobs: Optional[int], default: Optional[int], prompt_param: str,
            tool_schema: Optional[dict] = None) -> List[ValidatedRequest]:
    """One prepared engine request per prompt through the engine's contract (the parameters are checked and
    prepared once for all prompts); refusals in OpenAI's terms."""
    structured, source = structured_outputs_value(req.structured_outputs, {g: getattr(req, g) for g in _GUIDED},
                                                  req.response_format, tool_schema)
    names = {"prompt": prompt_param, "structured_outputs": source or "structured_outputs", "lora_request": "model"}
    try:
        base = sampling_params_from_dict(vllm_values(req, max_tokens, logprobs, structured),
                                         output_kind=RequestOutputKind.DELTA if req.stream else
                                         RequestOutputKind.CUMULATIVE)
        lora = ctx.loras.resolve(req.model)
        return [ctx.engine.fit(r, default=default) for r in ctx.engine.prepare_many(prompts, base, lora)]
    except InvalidRequest as exc:
        failed = refusal(exc, names)
        if exc.param == "structured_outputs" and source not in (None, "structured_outputs"):
            failed.message = f"`{source}`: {failed.message}"  # the engine names its own field
        raise failed from None


def _completion_prompts(prompt) -> list:
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompts = [list(prompt)]
    else:
        prompts = list(prompt)
    if not prompts:
        fail("`prompt` must not be empty", "prompt")
    return prompts


def plan_completion(ctx: ServerContext, req: CompletionRequest) -> OpenAIPlan:
    """Validate a /v1/completions request and build its SamplingParams (blocking: tokenizes)."""
    _check_common(req)
    if req.suffix:
        fail("`suffix` is not supported by this server", "suffix", "unsupported_parameter")
    _range(req.logprobs, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    if req.echo and req.logprobs is not None:
        fail("`echo` with `logprobs` is not supported: prompt logprobs are not computed", "echo",
              "unsupported_parameter")
    requests = _settle(ctx, req, _completion_prompts(req.prompt), req.max_tokens, req.logprobs, None, "prompt")
    echo = [ctx.tokenizer.decode(r.prompt_token_ids) for r in requests] if req.echo else None
    return OpenAIPlan(requests, req.stream, _include_usage(req), req.logprobs, echo, model=_reply_model(ctx, req))


def _reply_model(ctx: ServerContext, req: SamplingFields) -> str:
    """The model name a reply carries: the adapter's when the request named one, else the served model's."""
    return req.model if ctx.loras.resolve(req.model) is not None else ctx.model_name


def _include_usage(req: SamplingFields) -> bool:
    return bool(req.stream and req.stream_options is not None and req.stream_options.include_usage)


def _message_text(message: ChatMessage, i: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            fail(f"messages[{i}]: only text content parts are supported, got {part.type!r}", "messages")
        parts.append(part.text)
    return "".join(parts)


def _template_tool_calls(calls: List[EarlierToolCall]) -> List[Dict[str, Any]]:
    """An assistant message's earlier calls as chat templates expect them: `arguments` as an object (as vLLM
    passes them; the API carries a JSON string)."""
    shaped = []
    for call in calls:
        shaped_call = call.model_dump(exclude_none=True)
        arguments = call.function.arguments
        if isinstance(arguments, str):
            try:
                shaped_call["function"]["arguments"] = load_json(arguments, "arguments")
            except ValueError:
                pass  # not JSON: the template gets the string as sent
        shaped.append(shaped_call)
    return shaped


def _template_message(message: ChatMessage, i: int) -> Dict[str, Any]:
    rendered: Dict[str, Any] = {"role": message.role, "content": _message_text(message, i)}
    if message.name is not None:
        rendered["name"] = message.name
    if message.tool_calls:
        rendered["tool_calls"] = _template_tool_calls(message.tool_calls)
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def chat_prompt(ctx: ServerContext, req: ChatRequest, tools: Optional[List[Dict[str, Any]]] = None,
                continue_final_message: bool = False) -> str:
    """The conversation (and the tools, if any) rendered with the model's chat template."""
    if not req.messages:
        fail("`messages` must not be empty", "messages")
    if getattr(ctx.tokenizer, "chat_template", None) is None:
        fail("this model's tokenizer has no chat template; use /v1/completions", "messages")
    messages = [_template_message(m, i) for i, m in enumerate(req.messages)]
    chars = sum(len(m["content"]) + len(m["role"]) for m in messages) + len(json.dumps(tools or []))
    if chars > ctx.engine.max_prompt_chars:
        raise refusal(PromptTooLong(f"the messages have {chars} characters, more than any prompt that fits the "
                                    f"context can have ({ctx.engine.max_prompt_chars})", param="messages"))
    try:
        return ctx.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                 add_generation_prompt=req.add_generation_prompt,
                                                 continue_final_message=continue_final_message)
    except Exception as exc:  # noqa: BLE001 - template errors are the caller's messages being off
        raise ValidationFailed(f"the chat template rejected the messages: {exc}", param="messages") from None


def plan_chat(ctx: ServerContext, req: ChatRequest) -> OpenAIPlan:
    """Validate a /v1/chat/completions request, apply the chat template, build SamplingParams (blocking)."""
    _check_common(req)
    tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, ctx.tokenizer)
    if tools.calls_tools and req.use_beam_search:
        fail("tool calls cannot be combined with beam search", "use_beam_search")
    if req.top_logprobs is not None:
        _range(req.top_logprobs, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if not req.logprobs:
            fail("`top_logprobs` needs `logprobs` set to true", "top_logprobs")
    if req.max_completion_tokens is not None and req.max_completion_tokens < 1:
        fail(f"`max_completion_tokens` must be at least 1, got {req.max_completion_tokens}", "max_completion_tokens")
    text = chat_prompt(ctx, req, tools.tools)
    try:  # the template already holds the special tokens; a text far beyond the context is refused early
        prompt = ctx.engine.encode(text, req.truncate_prompt_tokens, add_special_tokens=False)
    except InvalidRequest as exc:
        raise refusal(exc, {"prompt": "messages"}) from None
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    requests = _settle(ctx, req, [prompt], requested, logprobs, None, "messages", tools.schema)
    return OpenAIPlan(requests, req.stream, _include_usage(req), logprobs, tools=tools, model=_reply_model(ctx, req))
