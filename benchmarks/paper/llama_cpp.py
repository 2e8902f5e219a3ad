"""The serving benchmark's setup step for llama.cpp: build `llama-server` for this CPU and convert the model to
the GGUF precisions it needs (each once, under the cache dir; see llama_cpp_build and llama_cpp_gguf), and what
the benchmark record says about them. `python -m paged_backend.benchmarks.paper.llama_cpp` does it ahead of time.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from paged_backend.benchmarks.paper.llama_cpp_build import (CMAKE_FLAGS, LLAMA_CPP_PYTHON_VERSION, build_server,
                                                            cpu_key, vendored_commit)
from paged_backend.benchmarks.paper.llama_cpp_gguf import GGUF_TYPES, convert, converter_pins


@dataclass
class LlamaCpp:
    """A built llama-server and the GGUF files of one model, by precision."""

    server: Path
    gguf: Dict[str, Path] = field(default_factory=dict)

    def record(self) -> dict:
        """Where it came from, for the benchmark record."""
        return {"llama_cpp_python_sdist": LLAMA_CPP_PYTHON_VERSION, "llama_cpp_commit": vendored_commit(),
                "cmake_flags": list(CMAKE_FLAGS), "cpu_key": cpu_key(), "server": str(self.server),
                "converter": "convert_hf_to_gguf.py", "converter_pins": converter_pins(),
                "gguf": {kind: str(path) for kind, path in self.gguf.items()}}


def prepare(model_dir: Path, outtypes: Sequence[str], jobs: Optional[int] = None) -> LlamaCpp:
    """Build llama-server (if not built for this CPU) and convert `model_dir` to each of `outtypes`."""
    unknown = [t for t in outtypes if t not in GGUF_TYPES]
    if unknown:
        raise ValueError(f"unknown GGUF precisions {unknown}; use {', '.join(GGUF_TYPES)}")
    server = build_server(jobs)
    return LlamaCpp(server, {kind: convert(model_dir, kind) for kind in outtypes})


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="build llama.cpp's server and convert a model to GGUF (once)")
    parser.add_argument("--model", default="smollm2", help="model preset or Hugging Face directory to convert")
    parser.add_argument("--outtypes", default=",".join(GGUF_TYPES), help="GGUF precisions, e.g. f32,f16,bf16")
    parser.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: all cores)")
    args = parser.parse_args(argv)
    from paged_backend.benchmarks.paper.serving_systems import served_model_dir

    built = prepare(served_model_dir(args.model), [t for t in args.outtypes.split(",") if t], args.jobs)
    print(f"llama-server: {built.server}")
    for kind, path in built.gguf.items():
        print(f"{kind} GGUF: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
