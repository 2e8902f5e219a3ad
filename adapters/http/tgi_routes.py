"""Text Generation Inference routes: /generate, /generate_stream, / (compat), /info, /health (/tokenize is in
tokenize_routes.py, beside vLLM's shape of it).

Responses are shaped as TGI returns them: `generated_text` plus `details` (finish_reason
"length" / "eos_token" / "stop_sequence", tokens with id, text, logprob, special); streams are
server-sent events, one per token, the last one carrying `generated_text` (and `details`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Dict, List, Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

import paged_backend
from paged_backend import CompletionOutput, ranked_logprobs

from .context import ServerContext, Slot, context_of
from .engine_requests import (ClosingStreamingResponse, TokenInfo, request_outputs, sse_event, token_infos,
                              unless_disconnected)
from .errors import APIError
from .tgi_request import MAX_BEST_OF, MAX_STOP_SEQUENCES, MAX_TOP_N_TOKENS, TGIPlan, TGIRequest, plan_tgi

router = APIRouter()


def tgi_finish_reason(comp: CompletionOutput) -> str:
    """TGI's finish reason from ours: a stop string -> "stop_sequence", EOS or a stop token -> "eos_token"."""
    if comp.finish_reason == "length":
        return "length"
    if isinstance(comp.stop_reason, str):
        return "stop_sequence"
    return "eos_token"


def _token(ctx: ServerContext, info: TokenInfo) -> dict:
    special = info.id in ctx.special_ids
    text = ctx.decode_token(info.id) if special else info.text
    return {"id": info.id, "text": text, "logprob": info.logprob, "special": special}


def _top_tokens(ctx: ServerContext, info: TokenInfo, n: int) -> List[dict]:
    return [{"id": tid, "text": ctx.decode_token(tid), "logprob": lp, "special": tid in ctx.special_ids}
            for tid, lp in ranked_logprobs(info.top, n)]


def _prefill(ctx: ServerContext, plan: TGIPlan) -> List[dict]:
    """The input tokens; their logprobs are not computed by this engine, so they are null."""
    if not plan.decoder_input_details:
        return []
    return [{"id": tid, "text": ctx.decode_token(tid), "logprob": None} for tid in plan.prompt_ids]


@dataclass
class Sequence:
    """One returned sequence, gathered from the engine's deltas."""

    text: str = ""
    tokens: List[TokenInfo] = field(default_factory=list)
    final: Optional[CompletionOutput] = None

    def add(self, delta: CompletionOutput) -> List[TokenInfo]:
        """Take one delta; returns its tokens (the delta's text is the piece of its last token)."""
        infos = token_infos(delta)
        self.text += delta.text
        self.tokens += infos
        if delta.finish_reason is not None:
            self.final = delta
        return infos


def _sequence_details(ctx: ServerContext, plan: TGIPlan, seq: Sequence) -> dict:
    comp, tokens = seq.final, seq.tokens
    details = {"finish_reason": tgi_finish_reason(comp), "generated_tokens": len(tokens),
               "seed": plan.seed, "prefill": _prefill(ctx, plan), "tokens": [_token(ctx, t) for t in tokens]}
    if plan.top_n_tokens:
        details["top_tokens"] = [_top_tokens(ctx, t, plan.top_n_tokens) for t in tokens]
    return details


def _full_text(plan: TGIPlan, text: str) -> str:
    return plan.inputs + text if plan.return_full_text else text


async def generate_response(ctx: ServerContext, plan: TGIPlan) -> dict:
    """Run a request to the end and shape the reply as TGI's `/generate` does."""
    seqs: Dict[int, Sequence] = {}
    async for delta in request_outputs(ctx, plan.request, f"tgi-{uuid.uuid4().hex}"):
        for comp in delta.outputs:
            seqs.setdefault(comp.index, Sequence()).add(comp)
    ranked = sorted(seqs.values(), key=lambda q: q.final.cumulative_logprob, reverse=True)
    best = ranked[0]
    reply = {"generated_text": _full_text(plan, best.text)}
    if plan.details or plan.decoder_input_details:
        details = _sequence_details(ctx, plan, best)
        if plan.best_of > 1:
            details["best_of_sequences"] = [{"generated_text": _full_text(plan, q.text),
                                             **_sequence_details(ctx, plan, q)} for q in ranked[1:]]
        reply["details"] = details
    return reply


async def stream_events(ctx: ServerContext, plan: TGIPlan) -> AsyncIterator[str]:
    """One server-sent event per generated token (the engine reports deltas: new tokens and settled text);
    the last event carries generated_text and details."""
    seq, index = Sequence(), 0
    try:
        async for delta in request_outputs(ctx, plan.request, f"tgi-{uuid.uuid4().hex}"):
            for comp in delta.outputs:  # best_of is 1 when streaming: one sequence
                infos = seq.add(comp)
                for k, info in enumerate(infos):
                    index += 1
                    event = {"index": index, "token": _token(ctx, info), "generated_text": None, "details": None}
                    if plan.top_n_tokens:
                        event["top_tokens"] = _top_tokens(ctx, info, plan.top_n_tokens)
                    if comp.finish_reason is not None and k == len(infos) - 1:
                        event["generated_text"] = _full_text(plan, seq.text)
                        if plan.details:
                            event["details"] = {"finish_reason": tgi_finish_reason(comp),
                                                "generated_tokens": len(seq.tokens), "seed": plan.seed,
                                                "input_length": len(plan.prompt_ids)}
                    yield sse_event(event, prefix="data:")
    except APIError as exc:
        yield sse_event(exc.tgi_body(), prefix="data:")


def streaming_reply(ctx: ServerContext, plan: TGIPlan, slot: Slot) -> Response:
    return ClosingStreamingResponse(stream_events(ctx, plan), on_close=slot.release, media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _generate(request: Request, stream: bool, compat: bool) -> Response:
    ctx = context_of(request)
    slot = ctx.acquire()
    try:
        body = await ctx.read(request, TGIRequest)
        stream = stream or (compat and body.stream)
        plan = await ctx.blocking(plan_tgi, ctx, body, stream)
        if stream:
            reply = streaming_reply(ctx, plan, slot)
            slot = None  # the streaming reply releases it
            return reply
        reply = await unless_disconnected(request, generate_response(ctx, plan))
    finally:
        if slot is not None:
            slot.release()
    return JSONResponse([reply] if compat else reply)


@router.post("/generate")
async def generate(request: Request) -> Response:
    return await _generate(request, stream=False, compat=False)


@router.post("/generate_stream")
async def generate_stream(request: Request) -> Response:
    return await _generate(request, stream=True, compat=False)


@router.post("/")
async def compat_generate(request: Request) -> Response:
    """What TGI's Python client posts to: `stream` in the body picks streaming."""
    return await _generate(request, stream=False, compat=True)


def model_info(ctx: ServerContext) -> dict:
    stats = ctx.engine.get_stats()
    engine = ctx.engine
    return {
        "model_id": ctx.model_name, "model_sha": None, "model_dtype": str(engine.dtype),
        "model_device_type": engine.device.type, "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": ctx.max_concurrent_requests, "max_best_of": MAX_BEST_OF,
        "max_stop_sequences": MAX_STOP_SEQUENCES, "max_top_n_tokens": MAX_TOP_N_TOKENS,
        "max_input_tokens": ctx.max_model_len - 1, "max_input_length": ctx.max_model_len - 1,
        "max_total_tokens": ctx.max_model_len, "max_batch_total_tokens": stats.num_blocks * stats.block_size,
        "max_client_batch_size": 1, "validation_workers": ctx.validation_workers,
        "kv_cache": {"num_blocks": stats.num_blocks, "block_size": stats.block_size,
                     "num_swap_blocks": stats.num_swap_blocks},
        "router": "paged-backend", "version": paged_backend.__version__, "sha": None, "docker_label": None,
    }


@router.get("/info")
async def info(request: Request) -> Response:
    return JSONResponse(model_info(context_of(request)))


@router.get("/health")
async def health(request: Request) -> Response:
    errored: Optional[BaseException] = getattr(context_of(request).engine, "errored", None)
    if errored is not None:
        return JSONResponse({"error": f"unhealthy: {errored}", "error_type": "healthcheck"}, status_code=503)
    return Response(status_code=200)
