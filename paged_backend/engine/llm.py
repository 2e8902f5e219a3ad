"""`LLM`: offline batch generation over the engine, with a progress bar."""

from __future__ import annotations

import itertools
import time
from typing import List, Optional, Sequence, Union

import torch

from paged_backend.engine.llm_engine import LLMEngine, PromptType
from paged_backend.engine.lora_request import LoRARequest
from paged_backend.engine.metrics import EngineStats
from paged_backend.engine.outputs import RequestOutput
from paged_backend.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """Generate for many prompts at once; all run through continuous batching."""

    def __init__(self, model: Union[str, torch.nn.Module] = "smollm2", tokenizer=None,
                 dtype: Union[torch.dtype, str, None] = None, device: Union[str, torch.device] = "cpu",
                 **engine_options) -> None:
        self.engine = LLMEngine(model, tokenizer=tokenizer, dtype=dtype, device=device, **engine_options)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_stats(self) -> EngineStats:
        return self.engine.get_stats()

    @staticmethod
    def _as_prompt_list(prompts) -> List[PromptType]:
        if isinstance(prompts, str):
            return [prompts]
        if isinstance(prompts, (list, tuple)) and all(isinstance(p, str) for p in prompts):
            return list(prompts)
        if isinstance(prompts, (list, tuple)) and all(isinstance(p, (list, tuple)) for p in prompts):
            return [list(p) for p in prompts]
        raise ValueError("prompts must be a string, a list of strings or a list of token-id lists")

    def generate(self, prompts: Union[str, Sequence[str], Sequence[Sequence[int]]],
                 sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
                 use_tqdm: bool = True,
                 lora_request: Optional[Union[LoRARequest, Sequence[Optional[LoRARequest]]]] = None
                 ) -> List[RequestOutput]:
        """Outputs in the order of the prompts; `lora_request` is one adapter for every prompt or one per prompt
        (None: the base model)."""
        prompt_list = self._as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"got {len(params_list)} sampling params for {len(prompt_list)} prompts")
        params_list = self._final_only(params_list)
        loras = self._per_prompt(lora_request, len(prompt_list))
        request_ids = [f"llm-{next(self._ids)}" for _ in prompt_list]
        try:
            for rid, prompt, params, lora in zip(request_ids, prompt_list, params_list, loras):
                self.engine.add_request(rid, prompt, params, lora_request=lora)
        except Exception:
            self.engine.abort_request([r for r in request_ids if r in self.engine.groups])
            raise
        return self._run(request_ids, use_tqdm)

    @staticmethod
    def _per_prompt(lora_request, count: int) -> List[Optional[LoRARequest]]:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * count
        loras = list(lora_request)
        if len(loras) != count:
            raise ValueError(f"got {len(loras)} lora requests for {count} prompts")
        return loras

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """`LLMEngine.add_lora`."""
        return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """`LLMEngine.remove_lora`."""
        return self.engine.remove_lora(lora_int_id)

    def list_loras(self) -> List[int]:
        """`LLMEngine.list_loras`."""
        return self.engine.list_loras()

    @staticmethod
    def _final_only(params_list: List[SamplingParams]) -> List[SamplingParams]:
        """Only final outputs are returned, so the engine need not build a cumulative one every step."""
        replaced = {}
        for params in params_list:
            if params.output_kind == RequestOutputKind.CUMULATIVE and id(params) not in replaced:
                replaced[id(params)] = params.replace(output_kind=RequestOutputKind.FINAL_ONLY)
        return [replaced.get(id(p), p) for p in params_list]

    def _run(self, request_ids: List[str], use_tqdm: bool) -> List[RequestOutput]:
        done = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(request_ids), desc="Generating", unit="req", dynamic_ncols=True)
        start, generated = time.perf_counter(), 0
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        generated += sum(len(c.token_ids) for c in out.outputs)
                        if bar is not None:
                            bar.update(1)
                            bar.set_postfix(out_tok_s=f"{generated / (time.perf_counter() - start):.1f}")
        except BaseException:
            self.engine.abort_request([r for r in request_ids if r in self.engine.groups])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[r] for r in request_ids]
