"""TGI request bodies: TGI's own validation rules, then TGI's names translated onto vLLM's parameter dict
and the engine's request contract (`sampling_params_from_dict`, `validate`, `fit_max_tokens`).

Decoding follows TGI: sampling when `do_sample` is true or any warper is set (`temperature` != 1,
`top_k`, `top_p`); greedy otherwise. `best_of > 1` needs a sampling request by TGI's router rule (`do_sample`
or any of `temperature`, `top_k`, `top_p`, `typical_p` given, `temperature: 1.0` included) and always samples.
Stop sequences stay in the generated text, as in TGI.
`max_new_tokens` absent means 100 (TGI's default); `null` means all that fits the context and KV cache.
`grammar` constrains the output to a JSON schema or a regex (tgi_grammar.py). `adapter_id` names one of the
server's LoRA adapters (loras.py; the served model's name or none: the base model).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from pydantic import Field

from paged_backend import RequestOutputKind, SamplingParams, ValidatedRequest, sampling_params_from_dict
from paged_backend.errors import InvalidRequest

from .body import StrictBody
from .context import ServerContext
from .errors import fail, refusal
from .tgi_grammar import grammar_constraint, invalid

MAX_BEST_OF = 4
MAX_STOP_SEQUENCES = 4
MAX_TOP_N_TOKENS = 5
DEFAULT_MAX_NEW_TOKENS = 100  # TGI's default when max_new_tokens is absent
_U64 = 2 ** 64
# the engine's parameter names -> TGI's, for errors
TGI_NAMES = {"max_tokens": "max_new_tokens", "logprobs": "top_n_tokens", "prompt": "inputs", "n": "best_of",
             "truncate_prompt_tokens": "truncate", "lora_request": "adapter_id"}


class TGIParameters(StrictBody):
    adapter_id: Optional[str] = None
    best_of: Optional[int] = None
    decoder_input_details: bool = False
    details: bool = False
    do_sample: bool = False
    frequency_penalty: Optional[float] = None
    grammar: Optional[Any] = None
    max_new_tokens: Optional[int] = None
    repetition_penalty: Optional[float] = None
    return_full_text: Optional[bool] = None
    seed: Optional[int] = None
    stop: Optional[List[str]] = None
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_n_tokens: Optional[int] = None
    top_p: Optional[float] = None
    truncate: Optional[int] = None
    typical_p: Optional[float] = None
    watermark: bool = False


class TGIRequest(StrictBody):
    inputs: str
    parameters: Optional[TGIParameters] = Field(default=None)
    stream: bool = False

    @property
    def params(self) -> TGIParameters:
        return self.parameters if self.parameters is not None else TGIParameters()


@dataclass
class TGIPlan:
    """A validated TGI request, ready to run (`request` is the engine's prepared request)."""

    inputs: str
    request: ValidatedRequest
    best_of: int
    seed: Optional[int]
    details: bool
    decoder_input_details: bool
    top_n_tokens: int
    return_full_text: bool

    @property
    def prompt_ids(self) -> List[int]:
        return self.request.prompt_token_ids

    @property
    def params(self) -> SamplingParams:
        return self.request.params


def is_sampling(p: TGIParameters) -> bool:
    """TGI samples when asked to, or when any warper would change the distribution."""
    return bool(p.do_sample or (p.temperature is not None and p.temperature != 1.0) or p.top_k is not None
                or p.top_p is not None or p.typical_p is not None)


def asks_for_sampling(p: TGIParameters) -> bool:
    """TGI's router rule for `best_of > 1`: sampling, or any warper given (`temperature` 1.0 included)."""
    return bool(p.do_sample or p.temperature is not None or p.top_k is not None or p.top_p is not None
                or p.typical_p is not None)


def samples(p: TGIParameters, best_of: int) -> bool:
    """Whether the request samples: as TGI decides, and always for `best_of > 1` (which the router accepted
    as a sampling request; identical greedy candidates would be pointless)."""
    return is_sampling(p) or best_of > 1


def _check_unsupported(p: TGIParameters) -> None:
    if p.typical_p is not None:
        fail("`typical_p` is not supported by this server", "typical_p")
    if p.watermark:
        fail("`watermark` is not supported by this server", "watermark")


def _adapter(ctx: ServerContext, p: TGIParameters):
    """The LoRA adapter `adapter_id` names (None for the base model: no id, or the served model's name)."""
    if p.adapter_id is None or p.adapter_id == ctx.model_name:
        return None
    lora = ctx.loras.resolve(p.adapter_id)
    if lora is None:
        known = ", ".join(ctx.loras.names()) or "none"
        fail(f"`adapter_id` {p.adapter_id!r} is not one of this server's adapters ({known})", "adapter_id")
    return lora


def _check_ranges(p: TGIParameters, best_of: int, stream: bool) -> None:
    if best_of < 1 or best_of > MAX_BEST_OF:
        fail(f"`best_of` must be > 0 and <= {MAX_BEST_OF}. Given: {best_of}", "best_of")
    if best_of > 1 and not asks_for_sampling(p):
        fail("you must use sampling when `best_of` is > 1", "best_of")
    if best_of > 1 and p.seed is not None:
        fail("`seed` must not be set when `best_of` > 1", "seed")
    if best_of > 1 and stream:
        fail("`best_of` != 1 is not supported when streaming tokens", "best_of")
    if p.decoder_input_details and stream:
        fail("`decoder_input_details` == true is not supported when streaming tokens", "decoder_input_details")
    if p.temperature is not None and p.temperature <= 0:
        fail("`temperature` must be strictly positive", "temperature")
    if p.repetition_penalty is not None and p.repetition_penalty <= 0:
        fail("`repetition_penalty` must be strictly positive", "repetition_penalty")
    if p.frequency_penalty is not None and not -2.0 <= p.frequency_penalty <= 2.0:
        fail("`frequency_penalty` must be >= -2.0 and <= 2.0", "frequency_penalty")
    if p.top_p is not None and not 0.0 < p.top_p < 1.0:
        fail("`top_p` must be > 0.0 and < 1.0", "top_p")
    if p.top_k is not None and p.top_k <= 0:
        fail("`top_k` must be strictly positive", "top_k")
    if p.max_new_tokens is not None and p.max_new_tokens <= 0:
        fail("`max_new_tokens` must be strictly positive", "max_new_tokens")
    stops = p.stop or []
    if len(stops) > MAX_STOP_SEQUENCES:
        fail(f"`stop` supports up to {MAX_STOP_SEQUENCES} stop sequences. Given: {len(stops)}", "stop")
    if any(s == "" for s in stops):
        fail("`stop` sequences must not be empty", "stop")
    if p.seed is not None and not 0 <= p.seed < _U64:
        fail("`seed` must be an unsigned 64-bit integer", "seed")
    if p.top_n_tokens is not None and not 0 <= p.top_n_tokens <= MAX_TOP_N_TOKENS:
        fail(f"`top_n_tokens` must be >= 0 and <= {MAX_TOP_N_TOKENS}. Given: {p.top_n_tokens}", "top_n_tokens")


def vllm_values(p: TGIParameters, best_of: int, seed: Optional[int]) -> Dict[str, Any]:
    """TGI's parameters under vLLM's names (what `sampling_params_from_dict` reads)."""
    sampling = samples(p, best_of)
    values: Dict[str, Any] = {
        "n": best_of, "best_of": best_of, "temperature": (p.temperature or 1.0) if sampling else 0.0,
        "repetition_penalty": p.repetition_penalty, "frequency_penalty": p.frequency_penalty, "seed": seed,
        "stop": list(p.stop or []) or None, "include_stop_str_in_output": True, "logprobs": p.top_n_tokens or 0,
        "max_tokens": p.max_new_tokens, "truncate_prompt_tokens": p.truncate,
        "structured_outputs": grammar_constraint(p.grammar)}
    if sampling:
        values.update(top_k=p.top_k, top_p=p.top_p)
    return values


def plan_tgi(ctx: ServerContext, request: TGIRequest, stream: bool) -> TGIPlan:
    """Validate a TGI request as TGI would and build its SamplingParams (blocking: tokenizes)."""
    p = request.params
    best_of = p.best_of if p.best_of is not None else 1
    _check_unsupported(p)
    _check_ranges(p, best_of, stream)
    if request.inputs == "":
        fail("`inputs` cannot be empty", "inputs")
    max_input = ctx.max_model_len - 1
    if p.truncate is not None and not 0 < p.truncate <= max_input:
        fail(f"`truncate` must be strictly positive and less than {max_input}. Given: {p.truncate}", "truncate")
    seed = (p.seed if p.seed is not None else random.getrandbits(63)) if samples(p, best_of) else None
    kind = RequestOutputKind.DELTA  # streamed or not, replies are built from the engine's per-step deltas
    default = None if "max_new_tokens" in p.model_fields_set else DEFAULT_MAX_NEW_TOKENS
    try:
        params = sampling_params_from_dict(vllm_values(p, best_of, seed), output_kind=kind)
        prepared = ctx.engine.fit(ctx.engine.prepare(request.inputs, params, _adapter(ctx, p)), default=default,
                                  param="max_new_tokens")
    except InvalidRequest as exc:
        if exc.param == "structured_outputs":  # the grammar did not compile
            raise invalid(re.sub(r"^invalid structured_outputs\.\w+: ", "", str(exc))) from None
        raise refusal(exc, TGI_NAMES) from None
    return TGIPlan(request.inputs, prepared, best_of, seed, p.details, p.decoder_input_details,
                   p.top_n_tokens or 0, bool(p.return_full_text))
