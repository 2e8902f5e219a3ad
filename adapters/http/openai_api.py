"""OpenAI routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions.

Replies follow OpenAI's shapes (`choices`, `usage`, logprobs objects); streams are server-sent
`data: {...}` chunks ending with `data: [DONE]`, with a final usage chunk when
`stream_options.include_usage` is set. Any `model` name is accepted (as TGI does); replies name
the served model.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import AsyncIterator, Coroutine, Dict, List, Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from paged_backend import CompletionOutput, RequestOutput

from .body import parse_body
from .errors import APIError
from .generation import (ClosingStreamingResponse, OutputTracker, ServerContext, TokenInfo, final_output, finite,
                         merge, request_outputs, unless_disconnected)
from .openai_params import ChatRequest, CompletionRequest, OpenAIPlan, plan_chat, plan_completion

router = APIRouter(prefix="/v1")
FINGERPRINT = "paged-backend"


def _ctx(request: Request) -> ServerContext:
    return request.app.state.ctx


# ---- logprobs -----------------------------------------------------------------------------------
def _infos(ctx: ServerContext, comp: CompletionOutput) -> List[TokenInfo]:
    infos = []
    for i, tid in enumerate(comp.token_ids):
        top = comp.logprobs[i] if comp.logprobs is not None and i < len(comp.logprobs) else {}
        infos.append(TokenInfo(tid, ctx.decode_token(tid), finite(top.get(tid)), top))
    return infos


def _ranked(top: Optional[Dict[int, float]], k: int) -> List[tuple]:
    return sorted((top or {}).items(), key=lambda kv: kv[1], reverse=True)[:k]


def completion_logprobs(ctx: ServerContext, infos: List[TokenInfo], offset: int) -> dict:
    """The legacy completions logprobs object: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, logprobs, tops, offsets = [], [], [], []
    for info in infos:
        text = ctx.decode_token(info.id)
        tokens.append(text)
        logprobs.append(info.logprob)
        tops.append({ctx.decode_token(t): finite(lp) for t, lp in _ranked(info.top, len(info.top or {}))})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(ctx: ServerContext, infos: List[TokenInfo], k: int) -> dict:
    """The chat logprobs object: one entry per token with its top `k` alternatives."""
    def entry(token_id: int, logprob: Optional[float]) -> dict:
        text = ctx.decode_token(token_id)
        return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(i.id, i.logprob), "top_logprobs": [entry(t, lp) for t, lp in _ranked(i.top, k)]}
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


def _usage(plan: OpenAIPlan, outputs: List[Optional[RequestOutput]]) -> dict:
    prompt = sum(len(p) for p in plan.prompts)
    completion = sum(len(c.token_ids) for out in outputs if out is not None for c in out.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(payload) -> str:
    return "data: " + json.dumps(payload, ensure_ascii=False) + "\n\n"


def _stops_to_hold(plan: OpenAIPlan) -> List[str]:
    return [] if plan.params.include_stop_str_in_output else plan.params.stop_strings


async def _run(request: Request, plan: OpenAIPlan, prefix: str) -> List[RequestOutput]:
    ctx = _ctx(request)
    rid = uuid.uuid4().hex
    slot = ctx.acquire()
    try:
        work = _gather([final_output(ctx, ids, plan.params, f"{prefix}-{rid}-{i}")
                        for i, ids in enumerate(plan.prompts)])
        return await unless_disconnected(request, work)
    finally:
        slot.release()


async def _chunks(ctx: ServerContext, plan: OpenAIPlan, prefix: str, make_choice, header: dict,
                  finals: List[Optional[RequestOutput]]) -> AsyncIterator[str]:
    """The SSE chunks of a streamed request: one per update, then usage, then [DONE]."""
    rid = uuid.uuid4().hex
    streams = [request_outputs(ctx, ids, plan.params, f"{prefix}-{rid}-{i}") for i, ids in enumerate(plan.prompts)]
    trackers = [OutputTracker(_stops_to_hold(plan)) for _ in plan.prompts]
    usage = {"usage": None} if plan.include_usage else {}
    try:
        async for i, output in merge(streams):
            if output.finished:
                finals[i] = output
            for update in trackers[i].update(output):
                for choice in make_choice(i, update):
                    yield _sse({**header, "choices": [choice], **usage})
        if plan.include_usage:
            yield _sse({**header, "choices": [], "usage": _usage(plan, finals)})
    except APIError as exc:
        yield _sse(exc.openai_body())
    yield "data: [DONE]\n\n"


def _stream_reply(request: Request, chunks: AsyncIterator[str]) -> Response:
    slot = _ctx(request).acquire()
    return ClosingStreamingResponse(chunks, on_close=slot.release, media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# ---- routes -------------------------------------------------------------------------------------
@router.get("/models")
async def models(request: Request) -> Response:
    ctx = _ctx(request)
    return JSONResponse({"object": "list", "data": [
        {"id": ctx.model_name, "object": "model", "created": int(request.app.state.started_at),
         "owned_by": "paged-backend", "max_model_len": ctx.max_model_len}]})


@router.post("/completions")
async def completions(request: Request) -> Response:
    ctx = _ctx(request)
    plan = plan_completion(ctx, await parse_body(request, CompletionRequest))
    header = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
              "model": ctx.model_name, "system_fingerprint": FINGERPRINT}
    n = plan.params.n
    if plan.stream:
        return _stream_reply(request, _completion_chunks(ctx, plan, header))
    outputs = await _run(request, plan, "cmpl")
    choices = []
    for i, output in enumerate(outputs):
        echo = plan.echo_texts[i] if plan.echo_texts else ""
        for comp in output.outputs:
            logprobs = completion_logprobs(ctx, _infos(ctx, comp), len(echo)) if plan.logprobs is not None else None
            choices.append({"index": i * n + comp.index, "text": echo + comp.text, "logprobs": logprobs,
                            "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason})
    return JSONResponse({**header, "choices": choices, "usage": _usage(plan, outputs)})


def _completion_chunks(ctx: ServerContext, plan: OpenAIPlan, header: dict) -> AsyncIterator[str]:
    n = plan.params.n
    echoed = set()
    offsets: Dict[int, int] = {}

    def make_choice(i: int, update) -> List[dict]:
        index = i * n + update.index
        text = update.text
        if plan.echo_texts and index not in echoed:
            echoed.add(index)
            text = plan.echo_texts[i] + text
        logprobs = None
        if plan.logprobs is not None:
            logprobs = completion_logprobs(ctx, update.tokens, offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + sum(len(t) for t in logprobs["tokens"])
        if not text and update.finish_reason is None and not update.tokens:
            return []
        return [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": update.finish_reason}]

    return _chunks(ctx, plan, "cmpl", make_choice, header, [None] * len(plan.prompts))


@router.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    ctx = _ctx(request)
    plan = plan_chat(ctx, await parse_body(request, ChatRequest))
    created = int(time.time())
    chat_id = f"chatcmpl-{uuid.uuid4().hex}"
    if plan.stream:
        header = {"id": chat_id, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name,
                  "system_fingerprint": FINGERPRINT}
        return _stream_reply(request, _chat_chunks(ctx, plan, header))
    (output,) = await _run(request, plan, "chatcmpl")
    choices = []
    for comp in output.outputs:
        logprobs = chat_logprobs(ctx, _infos(ctx, comp), plan.logprobs) if plan.logprobs is not None else None
        choices.append({"index": comp.index, "message": {"role": "assistant", "content": comp.text},
                        "logprobs": logprobs, "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason})
    return JSONResponse({"id": chat_id, "object": "chat.completion", "created": created, "model": ctx.model_name,
                         "system_fingerprint": FINGERPRINT, "choices": choices, "usage": _usage(plan, [output])})


def _chat_chunks(ctx: ServerContext, plan: OpenAIPlan, header: dict) -> AsyncIterator[str]:
    started = set()

    def make_choice(i: int, update) -> List[dict]:
        choices = []
        if update.index not in started:
            started.add(update.index)
            choices.append({"index": update.index, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None})
        if update.text or update.finish_reason is not None or (plan.logprobs is not None and update.tokens):
            logprobs = chat_logprobs(ctx, update.tokens, plan.logprobs) if plan.logprobs is not None else None
            delta = {"content": update.text} if update.text else {}
            choices.append({"index": update.index, "delta": delta, "logprobs": logprobs,
                            "finish_reason": update.finish_reason})
        return choices

    return _chunks(ctx, plan, "chatcmpl", make_choice, header, [None])
