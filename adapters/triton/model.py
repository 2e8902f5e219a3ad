"""`TritonPythonModel`: Triton's Python-backend entry point, serving paged-backend's `AsyncLLMEngine`.

Decoupled: `execute` parses each request and hands it to the engine service, then returns None;
responses (one per step when streaming, else one) go through the request's response sender, the last
flagged `TRITONSERVER_RESPONSE_COMPLETE_FINAL`. Bad input gets an error response for that request only.
The engine options come from `model.json` in the model's version folder. Importable only inside
Triton's stub, where `triton_python_backend_utils` exists.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from paged_backend import AsyncLLMEngine

from .metrics import TritonEngineMetrics, create_metrics
from .options import load_model_options
from .params import FLAG_INPUTS, parse_generate_request
from .repo import input_configs, output_configs
from .service import INTERNAL, INVALID_ARG, EngineService, RequestError

INPUT_NAMES = ("text_input", "sampling_parameters") + FLAG_INPUTS


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


class TritonPythonModel:
    """The model Triton loads from `1/model.py` of a repository written by `paged-backend triton-repo`."""

    @classmethod
    def auto_complete_config(cls, auto_complete_model_config):
        """Fill in the tensors, the decoupled policy and max_batch_size 0 when config.pbtxt omits them."""
        config = auto_complete_model_config.as_dict()
        have_inputs = {entry["name"] for entry in config.get("input", [])}
        have_outputs = {entry["name"] for entry in config.get("output", [])}
        for entry in input_configs():
            if entry["name"] not in have_inputs:
                auto_complete_model_config.add_input(entry)
        for entry in output_configs():
            if entry["name"] not in have_outputs:
                auto_complete_model_config.add_output(entry)
        auto_complete_model_config.set_model_transaction_policy(dict(decoupled=True))
        auto_complete_model_config.set_max_batch_size(0)
        return auto_complete_model_config

    def initialize(self, args: Dict[str, str]) -> None:
        self.logger = pb_utils.Logger
        self.model_config = json.loads(args["model_config"])
        self.name = args["model_name"]
        self.metrics: Optional[TritonEngineMetrics] = None
        self.service: Optional[EngineService] = None
        try:
            self._initialize(args)
        except Exception as exc:
            self.logger.log_error(f"[paged_backend] failed to load model {self.name!r}: {exc}")
            raise

    def _initialize(self, args: Dict[str, str]) -> None:
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise ValueError("paged_backend models must use the decoupled transaction policy "
                             "(model_transaction_policy { decoupled: true } in config.pbtxt)")
        version_dir = Path(args["model_repository"]) / args["model_version"]
        options = load_model_options(version_dir)
        self.logger.log_info(f"[paged_backend] loading {options.model!r} ({options.dtype}, {options.device}) "
                             f"with engine options {options.engine}")
        engine = AsyncLLMEngine(options.model, **options.engine_kwargs())
        if self._config_flag("REPORT_CUSTOM_METRICS", default=True):
            self.metrics = create_metrics(pb_utils, {"model": self.name, "version": args["model_version"]},
                                          self.logger)
        self.service = EngineService(engine, self.logger,
                                     on_stats=self.metrics.update if self.metrics is not None else None).start()
        stats = engine.get_stats()
        self.logger.log_info(f"[paged_backend] model {self.name!r} ready: {stats.num_blocks} KV blocks of "
                             f"{stats.block_size} tokens, {stats.num_swap_blocks} swap blocks, "
                             f"context {engine.engine.max_model_len} tokens, {torch.get_num_threads()} torch threads")

    def _config_flag(self, key: str, default: bool) -> bool:
        value = self.model_config.get("parameters", {}).get(key, {}).get("string_value")
        return default if value is None else value.strip().lower() == "true"

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
            try:
                parsed = parse_generate_request(self._inputs(request), self._parameters(request))
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
