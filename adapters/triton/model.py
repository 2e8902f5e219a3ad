"""`TritonPythonModel`: the Triton model serving paged-backend's `AsyncLLMEngine`, loaded either as the
Python-based backend `paged_backend` (`backend: "paged_backend"` in config.pbtxt, as Triton's vLLM backend
is loaded) or from a model's own `1/model.py`.

Decoupled: `execute` parses each request and hands it to the engine service, then returns None; responses
(one per engine step when streaming, else one) go through the request's response sender, the last flagged
`TRITONSERVER_RESPONSE_COMPLETE_FINAL`. Bad input gets an error response for that request only. The engine
arguments come from `model.json` (vLLM's names); the instance's kind and device id choose its device. An
engine that cannot continue makes the model unload itself (Triton then reports it not ready; this needs
`--model-control-mode=explicit`, as the vLLM backend's health check does) and answers UNAVAILABLE.
Importable only inside Triton's stub, where `triton_python_backend_utils` exists.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from paged_backend import AsyncLLMEngine

from .custom_metrics import TritonEngineMetrics, create_metrics
from .engine_loop import INTERNAL, INVALID_ARG, UNAVAILABLE, EngineService, RequestError
from .model_json import load_model_options
from .multi_lora import load_multi_lora
from .placement import engine_kwargs, place
from .repository import input_configs, output_configs
from .request_inputs import FLAG_INPUTS, REFUSED_INPUTS, parse_generate_request
from .trtllm_inputs import TRTLLM_TENSORS, trtllm_input_configs

INPUT_NAMES = ("text_input", "sampling_parameters") + FLAG_INPUTS + tuple(REFUSED_INPUTS) + tuple(TRTLLM_TENSORS)


def _triton_error(error: RequestError):
    code = getattr(pb_utils.TritonError, error.code, pb_utils.TritonError.INTERNAL)
    return pb_utils.TritonError(error.message, code)


class TritonRequestHandle:
    """One Triton request: its cancellation flag and its response sender."""

    def __init__(self, request) -> None:
        self.request = request
        self.sender = request.get_response_sender()

    def is_cancelled(self) -> bool:
        return bool(self.request.is_cancelled())

    def send(self, arrays: Optional[Dict[str, np.ndarray]], error: Optional[RequestError], final: bool) -> None:
        tensors = [pb_utils.Tensor(name, array) for name, array in (arrays or {}).items()]
        response = pb_utils.InferenceResponse(output_tensors=tensors,
                                              error=None if error is None else _triton_error(error))
        self.sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)


def _use_environment_python() -> None:
    """Inside the stub `sys.executable` is not a Python interpreter; tensor-parallel workers are started
    with it, so point it at the environment's python (first on PATH, as the server's set-up arranges)."""
    if not Path(sys.executable).name.startswith("python"):
        found = shutil.which("python3") or shutil.which("python")
        if found:
            sys.executable = found


class TritonPythonModel:
    """The model Triton loads for a repository written by `paged-backend triton-repo` (or by hand)."""

    @classmethod
    def auto_complete_config(cls, auto_complete_model_config):
        """Fill in the tensors, the decoupled policy and max_batch_size 0 when config.pbtxt omits them; with a
        `max_batch_size` set (Triton's OpenAI frontend), also the TensorRT-LLM-style inputs."""
        config = auto_complete_model_config.as_dict()
        have_inputs = {entry["name"] for entry in config.get("input", [])}
        have_outputs = {entry["name"] for entry in config.get("output", [])}
        batched = bool(config.get("max_batch_size"))  # kept when set: 1 takes TensorRT-LLM-style [1, 1] tensors
        for entry in input_configs() + (trtllm_input_configs() if batched else []):
            if entry["name"] not in have_inputs:
                auto_complete_model_config.add_input(entry)
        for entry in output_configs():
            if entry["name"] not in have_outputs:
                auto_complete_model_config.add_output(entry)
        auto_complete_model_config.set_model_transaction_policy(dict(decoupled=True))
        if not batched:
            auto_complete_model_config.set_max_batch_size(0)
        return auto_complete_model_config

    def initialize(self, args: Dict[str, str]) -> None:
        self.logger = pb_utils.Logger
        self.model_config = json.loads(args["model_config"])
        self.name = args["model_name"]
        self.metrics: Optional[TritonEngineMetrics] = None
        self.service: Optional[EngineService] = None
        self.adapters = None   # name -> LoRARequest from multi_lora.json when model.json enables LoRA
        self._unloading = False
        try:
            self._initialize(args)
        except Exception as exc:
            self.logger.log_error(f"[paged_backend] failed to load model {self.name!r}: {exc}")
            raise

    def _version_dir(self, args: Dict[str, str]) -> Path:
        get_model_dir = getattr(pb_utils, "get_model_dir", None)
        if get_model_dir is not None:
            return Path(get_model_dir())
        return Path(args["model_repository"]) / args["model_version"]

    def _initialize(self, args: Dict[str, str]) -> None:
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise ValueError("paged_backend models must use the decoupled transaction policy "
                             "(model_transaction_policy { decoupled: true } in config.pbtxt)")
        options = load_model_options(self._version_dir(args))
        placement = place(options, args.get("model_instance_kind", "CPU"),
                          int(args.get("model_instance_device_id", 0) or 0), self.model_config)
        if options.ignored:
            self.logger.log_info(f"[paged_backend] model.json options with no meaning for this engine, ignored: "
                                 f"{', '.join(sorted(options.ignored))}")
        kwargs = engine_kwargs(options, placement)
        self.logger.log_info(f"[paged_backend] loading {options.model!r} on {placement.device} (dtype "
                             f"{options.dtype}, {placement.sharing} instance(s) on this device) with engine "
                             f"options {kwargs}")
        _use_environment_python()
        tokenizer = None
        if options.tokenizer is not None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(options.tokenizer, local_files_only=True,
                                                      trust_remote_code=options.trust_remote_code)
        if options.engine.get("enable_lora"):
            self.adapters = load_multi_lora(self._version_dir(args))
        engine = AsyncLLMEngine(options.model, tokenizer=tokenizer, **kwargs)
        if self.adapters:
            asyncio.run(self._load_adapters(engine))
        # vLLM's rule: custom metrics when config.pbtxt asks for them and model.json does not disable stats
        if self._config_flag("REPORT_CUSTOM_METRICS", default=False) and not options.disable_log_stats:
            self.metrics = create_metrics(pb_utils, {"model": self.name, "version": args["model_version"]},
                                          self.logger)
        self.service = EngineService(engine, self.logger,
                                     on_stats=self.metrics.update if self.metrics is not None else None,
                                     on_dead=self._unload).start()
        stats = engine.get_stats()
        self.logger.log_info(f"[paged_backend] model {self.name!r} ready: {stats.num_blocks} KV blocks of "
                             f"{stats.block_size} tokens, {stats.num_swap_blocks} swap blocks, "
                             f"context {engine.max_model_len} tokens, dtype {engine.dtype}, "
                             f"{torch.get_num_threads()} torch threads")

    async def _load_adapters(self, engine: AsyncLLMEngine) -> None:
        """Read and check every adapter of multi_lora.json now: one that cannot serve fails the model's loading
        with the reason, instead of every request that names it."""
        for lora in self.adapters.values():
            await engine.add_lora(lora)
        self.logger.log_info(f"[paged_backend] LoRA adapters of {self.name!r}: {', '.join(self.adapters)}")

    def _config_flag(self, key: str, default: bool) -> bool:
        value = self.model_config.get("parameters", {}).get(key, {}).get("string_value")
        return default if value is None else value.strip().lower() == "true"

    def _unload(self, reason: BaseException) -> None:
        """The engine cannot continue: ask Triton to unload this model, so that it reports it not ready
        (works in explicit model-control mode; otherwise the model stays loaded and answers UNAVAILABLE)."""
        if self._unloading:
            return
        self._unloading = True
        self.logger.log_error(f"[paged_backend] the engine of model {self.name!r} cannot continue ({reason}); "
                              f"unloading the model")

        def unload() -> None:
            try:
                pb_utils.unload_model(self.name)
            except Exception as exc:  # noqa: BLE001 - e.g. not in explicit model-control mode
                self.logger.log_error(f"[paged_backend] could not unload model {self.name!r}: {exc}")

        threading.Thread(target=unload, name="paged-triton-unload", daemon=True).start()

    @staticmethod
    def _inputs(request) -> Dict[str, Any]:
        inputs = {}
        for name in INPUT_NAMES:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            inputs[name] = None if tensor is None else tensor.as_numpy()
        return inputs

    @staticmethod
    def _parameters(request) -> Optional[str]:
        read = getattr(request, "parameters", None)
        return read() if read is not None else None

    def execute(self, requests: List[Any]) -> None:
        """Hand every request to the engine; all responses are sent later through its sender."""
        for request in requests:
            handle = TritonRequestHandle(request)
            dead = self.service.engine_dead()
            if dead is not None:
                self.service.send(handle, None, RequestError(f"the model is unavailable: the engine cannot "
                                                             f"continue: {dead}", UNAVAILABLE), True)
                self._unload(dead)
                continue
            try:
                parsed = parse_generate_request(self._inputs(request), self._parameters(request), self.adapters)
            except ValueError as exc:
                self.service.send(handle, None, RequestError(str(exc), INVALID_ARG), True)
                continue
            except Exception as exc:  # noqa: BLE001 - answer this request, keep serving the others
                self.logger.log_error(f"[paged_backend] reading a request failed: {traceback.format_exc()}")
                self.service.send(handle, None, RequestError(f"cannot read the request: {exc}", INTERNAL), True)
                continue
            self.service.submit(parsed, handle, name=request.request_id())
        return None

    def finalize(self) -> None:
        """Abort what is in flight (final error responses), stop the engine, drop the metrics."""
        self.logger.log_info(f"[paged_backend] finalizing model {self.name!r}")
        if self.service is not None:
            self.service.shutdown()
            self.service = None
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
