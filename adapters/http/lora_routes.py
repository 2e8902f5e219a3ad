"""vLLM's LoRA routes: `POST /v1/load_lora_adapter` `{"lora_name", "lora_path"}` and `POST
/v1/unload_lora_adapter` `{"lora_name"}`, with vLLM's replies (a plain-text success line; 400 for a bad or
duplicate load, 404 for an unknown unload). A load reads and checks the adapter in a worker thread before it is
served; an unload stops new requests from naming it while requests already running with it finish."""

from __future__ import annotations

from typing import Optional

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from paged_backend.errors import InvalidRequest

from .body import StrictBody
from .context import context_of
from .errors import APIError, ValidationFailed, refusal

router = APIRouter(prefix="/v1")


class LoadLoRAAdapter(StrictBody):
    lora_name: Optional[str] = None
    lora_path: Optional[str] = None
    load_inplace: bool = False


class UnloadLoRAAdapter(StrictBody):
    lora_name: Optional[str] = None
    lora_int_id: Optional[int] = None


def _check_enabled(request: Request) -> None:
    if not context_of(request).loras.enabled:
        raise ValidationFailed("LoRA is not enabled: start the server with --enable-lora to load adapters",
                               param="lora_name", code="lora_not_enabled")


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Response:
    ctx = context_of(request)
    body = await ctx.read(request, LoadLoRAAdapter)
    _check_enabled(request)
    if not body.lora_name or not body.lora_path:
        raise ValidationFailed("Both 'lora_name' and 'lora_path' must be provided.", param="lora_name")
    served = ctx.loras
    async with served.lock:
        if body.lora_name in served.adapters and not body.load_inplace:
            raise ValidationFailed(f"The lora adapter '{body.lora_name}' has already been loaded.",
                                   param="lora_name", code="lora_already_loaded")
        try:
            lora = served.register(body.lora_name, body.lora_path)
            await ctx.engine.add_lora(lora)
        except InvalidRequest as exc:
            raise refusal(exc, {"lora_request": "lora_path"}) from None
        except ValueError as exc:
            raise ValidationFailed(str(exc), param="lora_name") from None
        replaced = served.adapters.get(body.lora_name)
        served.add(lora)
        if replaced is not None:
            await ctx.engine.remove_lora(replaced.lora_int_id)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    ctx = context_of(request)
    body = await ctx.read(request, UnloadLoRAAdapter)
    _check_enabled(request)
    if not body.lora_name:
        raise ValidationFailed("'lora_name' needs to be provided to unload a LoRA adapter.", param="lora_name")
    served = ctx.loras
    async with served.lock:
        lora = served.adapters.get(body.lora_name)
        if lora is None or (body.lora_int_id is not None and body.lora_int_id != lora.lora_int_id):
            raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", "not_found",
                           param="lora_name", code="lora_not_found")
        del served.adapters[body.lora_name]
        await ctx.engine.remove_lora(lora.lora_int_id)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
