"""GPU check of the Triton model's placement (needs CUDA; not collected by pytest).

A model whose config.pbtxt has `KIND_GPU` with `count: 2` on GPU 0 and whose model.json asks for vLLM's
`gpu_memory_utilization: 0.2` is initialized twice through `TritonPythonModel` (the real model code, with a
stand-in for Triton's `triton_python_backend_utils`), as Triton would with `model_instance_kind=GPU`,
`model_instance_device_id=0`. Checks: each instance runs on cuda:0; each KV cache is 0.2 / 2 of the GPU's
memory less the weights; both caches are really allocated; a request through `execute` gives the tokens
`LLM.generate` gives on the same GPU; a KIND_GPU instance whose model.json asks for the CPU is refused.

    PAGED_BACKEND_CACHE=<cache with v1/smollm2-tokenizer> python tests/triton_gpu_check.py [--out result.json]

`--cpu --utilization 0.01` runs the same path with KIND_CPU instances on the host (a dry run of this script).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import types
from pathlib import Path

import numpy as np
import torch

INSTANCES = 2


def fake_pb_utils(model_dir: Path) -> types.ModuleType:
    """The parts of triton_python_backend_utils the model uses."""
    pb = types.ModuleType("triton_python_backend_utils")

    class Logger:
        @staticmethod
        def log_info(message):
            print("I", message, flush=True)

        log_error = log_warn = log_info

    class TritonError:
        INTERNAL, INVALID_ARG, UNAVAILABLE, CANCELLED = "INTERNAL", "INVALID_ARG", "UNAVAILABLE", "CANCELLED"

        def __init__(self, message, code="INTERNAL"):
            self.message, self.code = message, code

    class Tensor:
        def __init__(self, name, array):
            self.name, self.array = name, array

        def as_numpy(self):
            return self.array

    class InferenceResponse:
        def __init__(self, output_tensors=(), error=None):
            self.tensors = {t.name: t.array for t in output_tensors}
            self.error = error

    pb.Logger, pb.TritonError, pb.Tensor, pb.InferenceResponse = Logger, TritonError, Tensor, InferenceResponse
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    pb.using_decoupled_model_transaction_policy = lambda config: True
    pb.get_model_dir = lambda: str(model_dir)
    pb.get_input_tensor_by_name = lambda request, name: request.inputs.get(name)
    pb.unload_model = lambda name: None
    return pb


class Sender:
    def __init__(self):
        self.responses, self.done = [], threading.Event()

    def send(self, response, flags=0):
        self.responses.append(response)
        if flags:
            self.done.set()


class Request:
    def __init__(self, pb, prompt: str, params: dict):
        self.inputs = {"text_input": pb.Tensor("text_input", np.array([prompt.encode()], dtype=np.object_)),
                       "sampling_parameters": pb.Tensor("sampling_parameters",
                                                        np.array([json.dumps(params).encode()], dtype=np.object_)),
                       "exclude_input_in_output": pb.Tensor("exclude_input_in_output", np.array([True]))}
        self.sender = Sender()

    def get_response_sender(self):
        return self.sender

    def is_cancelled(self):
        return False

    def request_id(self):
        return "gpu-check"

    def parameters(self):
        return "{}"


def args_for(name: str, config: dict, kind: str) -> dict:
    return {"model_config": json.dumps(config), "model_name": name, "model_instance_kind": kind,
            "model_instance_device_id": "0", "model_repository": "", "model_version": "1"}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--utilization", type=float, default=0.2)
    parser.add_argument("--cpu", action="store_true", help="dry run with KIND_CPU instances on the host")
    options = parser.parse_args()
    out, utilization, kind = options.out, options.utilization, "CPU" if options.cpu else "GPU"
    if kind == "GPU" and not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    folder = Path(tempfile.mkdtemp(prefix="triton-gpu-check-"))
    version_dir = folder / "m" / "1"
    version_dir.mkdir(parents=True)
    (version_dir / "model.json").write_text(json.dumps({"model": "tiny-llama", "gpu_memory_utilization": utilization,
                                                        "enforce_eager": True}))
    pb = fake_pb_utils(version_dir)
    sys.modules["triton_python_backend_utils"] = pb
    from paged_backend import LLM, SamplingParams
    from paged_backend.adapters.triton.model import TritonPythonModel

    from paged_backend.worker.sizing import total_memory

    config = {"name": "m", "instance_group": [{"kind": f"KIND_{kind}", "count": INSTANCES, "gpus": [0]}],
              "parameters": {}}
    device = torch.device("cuda:0" if kind == "GPU" else "cpu")
    total = total_memory(device)
    allocated = (lambda: torch.cuda.memory_allocated(0)) if kind == "GPU" else \
        (lambda: sum(m.service.engine.engine.kv_size.num_blocks * m.service.engine.engine.kv_size.bytes_per_block
                     for m in instances))
    instances = []
    before = allocated()
    for _ in range(INSTANCES):
        model = TritonPythonModel()
        model.initialize(args_for("m", config, kind))
        instances.append(model)
    engine = instances[0].service.engine
    weights = sum(t.numel() * t.element_size() for t in list(engine.engine.model.parameters()))
    bytes_per_block = engine.engine.kv_size.bytes_per_block
    expected_blocks = (int(utilization / INSTANCES * total) - weights) // bytes_per_block
    result = {"device": torch.cuda.get_device_name(0) if kind == "GPU" else "cpu", "total_gib": total / 2 ** 30,
              "devices": [str(m.service.engine.device) for m in instances],
              "num_blocks": [m.service.engine.get_stats().num_blocks for m in instances],
              "expected_blocks_each": expected_blocks,
              "allocated_gib": (allocated() - before) / 2 ** 30,
              "expected_kv_gib_total": INSTANCES * expected_blocks * bytes_per_block / 2 ** 30}
    params = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    request = Request(pb, "The capital of France is", params)
    instances[0].execute([request])
    assert request.sender.done.wait(120), "no final response"
    final = request.sender.responses[-1]
    assert final.error is None, final.error.message
    text = final.tensors["text_output"][0].decode()
    reference = LLM("tiny-llama", device=str(device), num_blocks=64).generate(
        ["The capital of France is"], SamplingParams(**params), use_tqdm=False)[0].outputs[0].text
    result.update(text=text, reference=reference)
    refused = None
    (version_dir / "model.json").write_text(json.dumps({"model": "tiny-llama", "device": "cpu"}))
    try:
        TritonPythonModel().initialize(args_for("m", config, "GPU"))
    except ValueError as exc:
        refused = str(exc)
    result["kind_gpu_with_cpu_refused"] = refused
    for model in instances:
        model.finalize()
    checks = {
        "on_its_device": all(d == ("cuda:0" if kind == "GPU" else "cpu") for d in result["devices"]),
        "kv_share_of_the_gpu": all(abs(n - expected_blocks) <= 1 for n in result["num_blocks"]),
        "kv_allocated": result["allocated_gib"] >= 0.99 * result["expected_kv_gib_total"],
        "tokens_equal_llm_generate": text == reference,
        "kind_gpu_with_cpu_refused": refused is not None and "KIND_GPU" in refused,
    }
    result["checks"] = checks
    print(json.dumps(result, indent=2))
    if out:
        Path(out).write_text(json.dumps(result, indent=2))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
