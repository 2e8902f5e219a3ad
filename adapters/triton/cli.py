"""`paged-backend triton-repo` (write a model repository), `paged-backend triton-backend` (install the
Python-based backend into a Triton backends folder) and `paged-backend triton-serve` (run Triton)."""

from __future__ import annotations

import argparse
import dataclasses
import signal
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Optional

from paged_backend import EngineConfig, add_engine_args, engine_kwargs

from .model_json import ModelOptions

LORA_OPTIONS = ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")


def add_parser(subparsers, name: str) -> None:
    """Register `triton-repo`, `triton-backend` or `triton-serve` (the name says which)."""
    if name == "triton-backend":
        p = subparsers.add_parser(name, help="install paged-backend's Python-based backend into a Triton backends "
                                             "folder (beside its python/ backend)")
        p.add_argument("backends_dir", help="Triton's --backend-directory, e.g. /opt/tritonserver/backends")
        p.set_defaults(func=run_backend)
    elif name == "triton-repo":
        p = subparsers.add_parser(name, help="write a Triton model repository serving a model with paged-backend")
        p.add_argument("out_dir", help="model repository folder (created if missing)")
        _add_model_args(p)
        p.set_defaults(func=run_repo)
    elif name == "triton-serve":
        p = subparsers.add_parser(name, help="run NVIDIA Triton Inference Server (from nvidia-pytriton) on a "
                                             "model repository, by default one generated for --model")
        p.add_argument("--model-repository", default=None,
                       help="existing repository to serve (default: write one for --model into a temporary folder)")
        _add_model_args(p)
        p.add_argument("--host", default="127.0.0.1", help="address to listen on")
        p.add_argument("--http-port", type=int, default=8000)
        p.add_argument("--grpc-port", type=int, default=8001)
        p.add_argument("--metrics-port", type=int, default=8002)
        p.add_argument("--no-metrics", action="store_true", help="run without the /metrics endpoint")
        p.add_argument("--log-verbose", type=int, default=0)
        p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the model to load")
        p.set_defaults(func=run_serve)
    else:
        raise ValueError(f"unknown Triton subcommand {name!r}")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="preset name or local Hugging Face model directory")
    p.add_argument("--name", default="paged_llm", help="model name in the repository (the URL's NAME)")
    p.add_argument("--no-custom-metrics", action="store_true", help="do not report the engine's metrics")
    p.add_argument("--layout", choices=("backend", "python"), default="backend",
                   help="backend: config.pbtxt names the paged_backend backend, as for Triton's vLLM backend "
                        "(default); python: a Python-backend model with its own 1/model.py")
    p.add_argument("--instance-count", type=int, default=1, help="model instances (they share the device's memory)")
    p.add_argument("--max-batch-size", type=int, choices=(0, 1), default=0,
                   help="1: also take the [1, 1] TensorRT-LLM-style tensors Triton's OpenAI frontend sends to "
                        "backends not named vllm (then every request needs the batch dimension)")
    p.add_argument("--kind", choices=("KIND_CPU", "KIND_GPU", "KIND_MODEL"), default="KIND_CPU",
                   help="instance kind: KIND_GPU runs each instance on its own GPU, KIND_CPU on the host, "
                        "KIND_MODEL where --device says (default: a GPU if there is one)")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) written to multi_lora.json, which requests pick with "
                        "lora_name in sampling_parameters; needs --enable-lora")
    add_engine_args(p)
    p.set_defaults(device=None)   # the instance kind's device unless --device is given


# The device model.json names for each instance kind when --device is not given: Triton places KIND_GPU
# instances on their own GPU and KIND_CPU ones on the host; KIND_MODEL leaves the choice to the model
# ("auto": the first GPU if there is one).
KIND_DEVICES = {"KIND_CPU": "cpu", "KIND_GPU": "cuda", "KIND_MODEL": "auto"}
_KIND_ACCEPTS = {"KIND_CPU": ("cpu", "auto"), "KIND_GPU": ("cuda", "auto")}


def instance_device(kind: str, device: Optional[str]) -> str:
    """The model.json device for `--kind` and `--device`; a ValueError when the two contradict each other."""
    if device is None or (kind in _KIND_ACCEPTS and device == "auto"):
        return KIND_DEVICES[kind]
    if kind in _KIND_ACCEPTS and device not in _KIND_ACCEPTS[kind]:
        raise ValueError(f"--device {device} contradicts --kind {kind} (its instances run on "
                         f"{KIND_DEVICES[kind]}); drop --device or use --kind KIND_MODEL")
    return device


def _engine_values(args: argparse.Namespace) -> Dict[str, Any]:
    """Every engine argument the parsed options give (what `generate` and `serve` pass to the engine), as the
    engine normalises them (sizes in bytes); the model, dtype and device are model.json keys of their own."""
    kwargs = engine_kwargs(args)
    for key in ("dtype", "device"):
        kwargs.pop(key)
    config = EngineConfig.from_kwargs(**kwargs)
    parts = [getattr(config, f.name) for f in dataclasses.fields(config)
             if dataclasses.is_dataclass(getattr(config, f.name))]   # the option groups (cache, scheduler, ...)
    parts.append(config)
    values = {key: next(getattr(part, key) for part in parts if hasattr(part, key)) for key in kwargs
              if key != "speculative_config"}
    if "speculative_config" in kwargs:   # written as given: vLLM's JSON object
        values["speculative_config"] = kwargs["speculative_config"]
    if not config.lora.enable_lora:   # model.json names LoRA only when it serves adapters
        values = {key: value for key, value in values.items() if key not in LORA_OPTIONS}
    return values


def model_options(args: argparse.Namespace) -> Dict[str, Any]:
    """The model.json content for parsed command-line options: the model, its dtype, the device of the
    instance kind, and every engine option under model.json's (vLLM's) names."""
    engine = {key: value for key, value in _engine_values(args).items() if value is not None}
    options = ModelOptions(model=args.model, dtype=args.dtype, device=instance_device(args.kind, args.device),
                           engine=engine)
    return options.to_json()


def _write(args: argparse.Namespace, out_dir: Path) -> Path:
    from .repository import write_model_repository

    return write_model_repository(out_dir, args.name, model_options(args),
                                  report_metrics=not args.no_custom_metrics, layout=args.layout,
                                  instance_count=args.instance_count, kind=args.kind,
                                  max_batch_size=args.max_batch_size, lora_modules=_lora_modules(args))


def _lora_modules(args: argparse.Namespace) -> Dict[str, str]:
    """`--lora-modules name=path ...` as multi_lora.json's object (absolute paths)."""
    if args.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    modules = {}
    for entry in args.lora_modules:
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {entry!r}: write name=path")
        if name in modules:
            raise ValueError(f"--lora-modules names adapter {name!r} twice")
        modules[name] = str(Path(path).expanduser().resolve())
    return modules


def run_repo(args: argparse.Namespace) -> int:
    model_dir = _write(args, Path(args.out_dir))
    files = ", ".join(str(p) for p in sorted(model_dir.rglob("*")) if p.is_file())
    print(f"wrote {files}")
    if args.layout == "backend":
        print("the server needs the paged_backend backend: paged-backend triton-backend <its backends folder> "
              "(triton-serve installs it itself)")
    print(f"serve it with: paged-backend triton-serve --model-repository {Path(args.out_dir)}")
    return 0


def run_backend(args: argparse.Namespace) -> int:
    from .repository import install_backend

    folder = install_backend(Path(args.backends_dir))
    print(f"installed {folder}/model.py; Triton loads it for models with backend: \"paged_backend\" "
          f"(the Python backend must be in {Path(args.backends_dir) / 'python'})")
    return 0


def _model_names(repository: Path, default: str) -> list:
    """The models of a repository (folders with a config.pbtxt), or `default` when none is found."""
    names = sorted(d.name for d in repository.iterdir() if (d / "config.pbtxt").is_file())
    return names or [default]


def run_serve(args: argparse.Namespace) -> int:
    from .tritonserver_process import ServerConfig, TritonServer

    repo_dir: Optional[tempfile.TemporaryDirectory] = None
    if args.model_repository is None:
        repo_dir = tempfile.TemporaryDirectory(prefix="paged-triton-repo-")
        _write(args, Path(repo_dir.name))
        repository = Path(repo_dir.name)
    else:
        repository = Path(args.model_repository)
        if not repository.is_dir():
            raise ValueError(f"model repository {repository} is not a folder")
    config = ServerConfig(model_repository=repository, host=args.host, http_port=args.http_port,
                          grpc_port=args.grpc_port, metrics_port=args.metrics_port,
                          allow_metrics=not args.no_metrics, log_verbose=args.log_verbose)
    server = TritonServer(config)
    stop = {"requested": False}
    previous: Dict[int, Any] = {}
    try:
        server.start()
        print(f"tritonserver starting on {repository} (log: {server.log_path})", flush=True)
        server.wait_ready(args.ready_timeout)
        previous = {sig: signal.signal(sig, lambda *_: stop.update(requested=True))
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        print(f"ready: HTTP http://{server.http_url}  gRPC {server.grpc_url}"
              + ("" if args.no_metrics else f"  metrics {server.metrics_url}"), flush=True)
        model = _model_names(repository, args.name)[0]
        print(f"try: curl -s -X POST http://{server.http_url}/v2/models/{model}/generate "
              f"-d '{{\"text_input\": \"The capital of France is\", \"parameters\": {{\"max_tokens\": 16, "
              f"\"temperature\": 0}}}}'", flush=True)
        while not stop["requested"] and server.is_running():
            time.sleep(0.5)
        if not stop["requested"]:
            print(f"tritonserver exited unexpectedly:\n{server.log_tail()}", flush=True)
    finally:
        server_code = server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if stop["requested"] and server_code != 0:
            print(f"tritonserver did not stop cleanly (exit {server_code}):\n{server.log_tail()}", flush=True)
        server.cleanup()
        if repo_dir is not None:
            repo_dir.cleanup()
    return 0 if stop["requested"] and server_code == 0 else 1
