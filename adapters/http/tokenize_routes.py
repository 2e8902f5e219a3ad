"""`/tokenize` in TGI's shape and in vLLM's, and vLLM's `/detokenize`.

- TGI: `{"inputs": text}` -> `[{"id", "text", "start", "stop"}, ...]`.
- vLLM: `{"prompt": text, "add_special_tokens": true, "return_token_strs": false}` or a conversation
  `{"messages": [...], "add_generation_prompt": true, "continue_final_message": false, "add_special_tokens":
  false, "tools": [...]}` (rendered with the chat template) -> `{"count", "max_model_len", "tokens",
  "token_strs"}`; `/detokenize` `{"tokens": [ids]}` -> `{"prompt": text}`.

A body with `inputs` is TGI's; any other is vLLM's. Text far beyond the context is refused without being
tokenized whole, as for generation; errors have TGI's shape (these paths are not under /v1).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from paged_backend.errors import InvalidRequest, PromptTooLong

from .body import StrictBody, decode_json_object, validate_body
from .context import ServerContext, context_of
from .errors import ValidationFailed, refusal
from .openai_request import ChatMessage, chat_prompt
from .openai_tools import ToolDefinition

router = APIRouter()


class TGITokenizeRequest(StrictBody):
    inputs: str
    parameters: Optional[Dict[str, Any]] = None


class TokenizeCompletionRequest(StrictBody):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: Optional[bool] = False


class TokenizeChatRequest(StrictBody):
    model: Optional[str] = None
    messages: List[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: Optional[bool] = False
    tools: Optional[List[ToolDefinition]] = None


class DetokenizeRequest(StrictBody):
    model: Optional[str] = None
    tokens: List[int]


def tgi_tokens(ctx: ServerContext, text: str) -> List[dict]:
    """TGI's /tokenize reply (blocking). Text too long for any prompt is refused without tokenizing."""
    if text == "":
        raise ValidationFailed("`inputs` cannot be empty", param="inputs")
    if len(text) > ctx.engine.max_prompt_chars:
        raise ValidationFailed(f"`inputs` has {len(text)} characters, more than any prompt that fits the context "
                               f"can have ({ctx.engine.max_prompt_chars})", param="inputs",
                               code="context_length_exceeded")
    encoding = ctx.tokenizer(text, return_offsets_mapping=True)
    offsets = encoding.get("offset_mapping") or [(0, 0)] * len(encoding["input_ids"])
    return [{"id": tid, "text": text[start:stop], "start": start, "stop": stop}
            for tid, (start, stop) in zip(encoding["input_ids"], offsets)]


def _vllm_text(ctx: ServerContext, body) -> str:
    if isinstance(body, TokenizeChatRequest):
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
        return chat_prompt(ctx, body, tools, continue_final_message=body.continue_final_message)
    if body.prompt == "":
        raise ValidationFailed("`prompt` must not be empty", param="prompt")
    return body.prompt


def vllm_tokens(ctx: ServerContext, body) -> dict:
    """vLLM's /tokenize reply (blocking): the ids, their count and the context length."""
    param = "messages" if isinstance(body, TokenizeChatRequest) else "prompt"
    try:
        ids = ctx.engine.encode(_vllm_text(ctx, body), add_special_tokens=body.add_special_tokens)
        if len(ids) > ctx.max_model_len:
            raise PromptTooLong(f"the {param} have {len(ids)} tokens; the model's maximum context length is "
                                f"{ctx.max_model_len} tokens", param=param)
    except InvalidRequest as exc:
        raise refusal(exc, {"prompt": param}) from None
    strs = ctx.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids, "token_strs": strs}


def tokenize_body(ctx: ServerContext, raw: bytes):
    """The reply for a /tokenize body of either shape (blocking)."""
    data = decode_json_object(raw)
    if "inputs" in data:
        return tgi_tokens(ctx, validate_body(data, TGITokenizeRequest).inputs)
    model = TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest
    return vllm_tokens(ctx, validate_body(data, model))


def detokenize_body(ctx: ServerContext, raw: bytes) -> dict:
    """vLLM's /detokenize reply (blocking); ids outside the vocabulary are refused."""
    body = validate_body(decode_json_object(raw), DetokenizeRequest)
    vocab = len(ctx.tokenizer)
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise ValidationFailed(f"`tokens` has ids outside the tokenizer's vocabulary [0, {vocab}): {bad[:5]}",
                               param="tokens")
    return {"prompt": ctx.tokenizer.decode(body.tokens)}


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    ctx = context_of(request)
    return JSONResponse(await ctx.blocking(tokenize_body, ctx, await request.body()))


@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    ctx = context_of(request)
    return JSONResponse(await ctx.blocking(detokenize_body, ctx, await request.body()))
