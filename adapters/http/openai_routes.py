"""OpenAI routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions.

Replies follow OpenAI's shapes (`choices`, `usage`, logprobs objects); streams are server-sent
`data: {...}` chunks ending with `data: [DONE]`, with a final usage chunk when
`stream_options.include_usage` is set. Any `model` name is accepted (as TGI does); one that names a LoRA
adapter runs the request with it and replies carry it, otherwise replies name the served model. `/v1/models`
lists the served model and its adapters (`parent`: the served model, `root`: the adapter's directory).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import AsyncIterator, Coroutine, Dict, List, Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from paged_backend import CompletionOutput, RequestOutput, ranked_logprobs

from .context import ServerContext, context_of
from .engine_requests import (ClosingStreamingResponse, TokenInfo, final_output, finite, merge, request_outputs,
                              sse_event, token_infos, unless_disconnected)
from .errors import APIError
from .openai_request import ChatRequest, CompletionRequest, OpenAIPlan, plan_chat, plan_completion
from .openai_tools import ToolCallStream, read_tool_calls

router = APIRouter(prefix="/v1")
FINGERPRINT = "paged-backend"


# ---- logprobs -----------------------------------------------------------------------------------
def _infos(ctx: ServerContext, comp: CompletionOutput) -> List[TokenInfo]:
    infos = []
    for i, tid in enumerate(comp.token_ids):
        top = comp.logprobs[i] if comp.logprobs is not None and i < len(comp.logprobs) else {}
        infos.append(TokenInfo(tid, ctx.decode_token(tid), finite(top.get(tid)), top))
    return infos


def completion_logprobs(ctx: ServerContext, infos: List[TokenInfo], offset: int) -> dict:
    """The legacy completions logprobs object: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, logprobs, tops, offsets = [], [], [], []
    for info in infos:
        text = ctx.decode_token(info.id)
        tokens.append(text)
        logprobs.append(info.logprob)
        tops.append({ctx.decode_token(t): finite(lp) for t, lp in ranked_logprobs(info.top)})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(ctx: ServerContext, infos: List[TokenInfo], k: int) -> dict:
    """The chat logprobs object: one entry per token with its top `k` alternatives."""
    def entry(token_id: int, logprob: Optional[float]) -> dict:
        text = ctx.decode_token(token_id)
        return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(i.id, i.logprob), "top_logprobs": [entry(t, lp) for t, lp in ranked_logprobs(i.top, k)]}
                        for i in infos]}


# ---- shared -------------------------------------------------------------------------------------
async def _gather(coros: List[Coroutine]) -> list:
    """Run coroutines together; the first failure cancels the rest (and aborts their requests)."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(c) for c in coros]
    except BaseExceptionGroup as grouped:  # noqa: F821 - builtin in 3.11
        raise grouped.exceptions[0] from None
    return [t.result() for t in tasks]


def _usage(plan: OpenAIPlan, completion_tokens: int) -> dict:
    prompt = sum(len(p) for p in plan.prompts)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens}


def _generated(outputs: List[RequestOutput]) -> int:
    return sum(len(c.token_ids) for out in outputs for c in out.outputs)


async def _run(request: Request, plan: OpenAIPlan, prefix: str) -> List[RequestOutput]:
    ctx = context_of(request)
    rid = uuid.uuid4().hex
    work = _gather([final_output(ctx, r, f"{prefix}-{rid}-{i}") for i, r in enumerate(plan.requests)])
    return await unless_disconnected(request, work)


async def _chunks(ctx: ServerContext, plan: OpenAIPlan, prefix: str, make_choice, header: dict) -> AsyncIterator[str]:
    """The SSE chunks of a streamed request: one per sequence and engine step (the engine reports deltas:
    new tokens and settled text), then usage, then [DONE]."""
    rid = uuid.uuid4().hex
    streams = [request_outputs(ctx, r, f"{prefix}-{rid}-{i}") for i, r in enumerate(plan.requests)]
    usage = {"usage": None} if plan.include_usage else {}
    generated = 0
    try:
        async for i, delta in merge(streams):
            for comp in delta.outputs:
                generated += len(comp.token_ids)
                for choice in make_choice(i, comp):
                    yield sse_event({**header, "choices": [choice], **usage})
        if plan.include_usage:
            yield sse_event({**header, "choices": [], "usage": _usage(plan, generated)})
    except APIError as exc:
        yield sse_event(exc.openai_body())
    yield "data: [DONE]\n\n"


async def _plan(request: Request, model, plan_fn) -> OpenAIPlan:
    ctx = context_of(request)
    body = await ctx.read(request, model)
    return await ctx.blocking(plan_fn, ctx, body)


def _stream_reply(chunks: AsyncIterator[str], slot) -> Response:
    return ClosingStreamingResponse(chunks, on_close=slot.release, media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# ---- routes -------------------------------------------------------------------------------------
@router.get("/models")
async def models(request: Request) -> Response:
    ctx = context_of(request)
    created = int(request.app.state.started_at)
    cards = [{"id": ctx.model_name, "object": "model", "created": created, "owned_by": "paged-backend",
              "root": ctx.model_name, "parent": None, "max_model_len": ctx.max_model_len}]
    for name in ctx.loras.names():
        cards.append({"id": name, "object": "model", "created": created, "owned_by": "paged-backend",
                      "root": ctx.loras.adapters[name].lora_path, "parent": ctx.model_name,
                      "max_model_len": ctx.max_model_len})
    return JSONResponse({"object": "list", "data": cards})


async def _serve(request: Request, model, plan_fn, stream_fn, reply_fn) -> Response:
    """Admit, plan (off the event loop) and answer one OpenAI request, streamed or not."""
    ctx = context_of(request)
    slot = ctx.acquire()
    try:
        plan = await _plan(request, model, plan_fn)
        if plan.stream:
            reply = _stream_reply(stream_fn(ctx, plan), slot)
            slot = None  # the streaming reply releases it
            return reply
        return reply_fn(ctx, plan, await _run(request, plan, "cmpl" if model is CompletionRequest else "chatcmpl"))
    finally:
        if slot is not None:
            slot.release()


@router.post("/completions")
async def completions(request: Request) -> Response:
    return await _serve(request, CompletionRequest, plan_completion, _completion_chunks, _completion_reply)


def _completion_header(ctx: ServerContext, plan: OpenAIPlan) -> dict:
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": plan.model or ctx.model_name, "system_fingerprint": FINGERPRINT}


def _completion_reply(ctx: ServerContext, plan: OpenAIPlan, outputs: List[RequestOutput]) -> Response:
    choices = []
    for i, output in enumerate(outputs):
        echo = plan.echo_texts[i] if plan.echo_texts else ""
        for comp in output.outputs:
            logprobs = completion_logprobs(ctx, _infos(ctx, comp), len(echo)) if plan.logprobs is not None else None
            choices.append({"index": i * plan.n + comp.index, "text": echo + comp.text, "logprobs": logprobs,
                            "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason})
    return JSONResponse({**_completion_header(ctx, plan), "choices": choices,
                         "usage": _usage(plan, _generated(outputs))})


def _completion_chunks(ctx: ServerContext, plan: OpenAIPlan) -> AsyncIterator[str]:
    echoed = set()
    offsets: Dict[int, int] = {}

    def make_choice(i: int, delta: CompletionOutput) -> List[dict]:
        index = i * plan.n + delta.index
        text = delta.text
        if plan.echo_texts and index not in echoed:
            echoed.add(index)
            text = plan.echo_texts[i] + text
        logprobs = None
        if plan.logprobs is not None:
            logprobs = completion_logprobs(ctx, token_infos(delta), offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + sum(len(t) for t in logprobs["tokens"])
        return [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": delta.finish_reason,
                 "stop_reason": delta.stop_reason}]

    return _chunks(ctx, plan, "cmpl", make_choice, _completion_header(ctx, plan))


@router.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _serve(request, ChatRequest, plan_chat, _chat_chunks, _chat_reply)


def _chat_header(ctx: ServerContext, plan: OpenAIPlan, kind: str) -> dict:
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
            "model": plan.model or ctx.model_name, "system_fingerprint": FINGERPRINT}


def _chat_message(plan: OpenAIPlan, comp: CompletionOutput) -> tuple:
    """(the choice's message, its finish reason): tool calls read from the text when the request uses tools."""
    if not plan.tools.calls_tools:
        return {"role": "assistant", "content": comp.text}, comp.finish_reason
    reply = read_tool_calls(plan.tools, comp.text, comp.finish_reason)
    message = {"role": "assistant", "content": reply.content}
    if reply.tool_calls is not None:
        message["tool_calls"] = reply.tool_calls
    return message, reply.finish_reason


def _chat_reply(ctx: ServerContext, plan: OpenAIPlan, outputs: List[RequestOutput]) -> Response:
    (output,) = outputs
    choices = []
    for comp in output.outputs:
        logprobs = chat_logprobs(ctx, _infos(ctx, comp), plan.logprobs) if plan.logprobs is not None else None
        message, finish_reason = _chat_message(plan, comp)
        choices.append({"index": comp.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
                        "stop_reason": comp.stop_reason})
    return JSONResponse({**_chat_header(ctx, plan, "chat.completion"), "choices": choices,
                         "usage": _usage(plan, _generated(outputs))})


def _chat_chunks(ctx: ServerContext, plan: OpenAIPlan) -> AsyncIterator[str]:
    started = set()
    tool_streams: Dict[int, ToolCallStream] = {}

    def deltas_of(delta: CompletionOutput) -> tuple:
        """(the chat deltas of an engine delta, its finish reason) for a plain or a tool-calling choice."""
        if not plan.tools.calls_tools:
            return ([{"content": delta.text}] if delta.text else []), delta.finish_reason
        stream = tool_streams.setdefault(delta.index, ToolCallStream(plan.tools))
        return stream.feed(delta.text, delta.finish_reason)

    def make_choice(i: int, delta: CompletionOutput) -> List[dict]:
        choices = []
        if delta.index not in started:
            started.add(delta.index)
            choices.append({"index": delta.index, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None})
        pieces, finish_reason = deltas_of(delta)
        logprobs = chat_logprobs(ctx, token_infos(delta), plan.logprobs) if plan.logprobs is not None else None
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            choices.append({"index": delta.index, "delta": piece, "logprobs": logprobs if last else None,
                            "finish_reason": finish_reason if last else None,
                            "stop_reason": delta.stop_reason if last else None})
        if not pieces and (finish_reason is not None or (plan.logprobs is not None and delta.token_ids)):
            choices.append({"index": delta.index, "delta": {}, "logprobs": logprobs, "finish_reason": finish_reason,
                            "stop_reason": delta.stop_reason})
        return choices

    return _chunks(ctx, plan, "chatcmpl", make_choice, _chat_header(ctx, plan, "chat.completion.chunk"))
