"""Benchmark 4, serving over HTTP: guidellm (the vLLM project's load generator) drives each server with
synthetic prompts of a fixed token count and forced output lengths at concurrencies 1 to 32; our server
(`paged-backend serve`), `transformers serve --continuous-batching` and the reservation baseline behind our
HTTP app run side by side on the same weights, KV budget and threads, and llama.cpp's `llama-server` on a GGUF
of the same weights at equal precision, in interleaved rounds (A, B, C, A, B, C, ...). Rows are medians with their range; ratios are paired within a round. The cores each server kept
busy during each concurrency are read from /proc while it runs."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from paged_backend.benchmarks.paper.engine_runs import set_threads
from paged_backend.benchmarks.paper.guidellm_env import GUIDELLM_VERSION, guidellm_executable
from paged_backend.benchmarks.paper.llama_cpp import LlamaCpp, prepare
from paged_backend.benchmarks.paper.guidellm_run import GuidellmLoad, read_report, run_guidellm, scenario
from paged_backend.benchmarks.harness.repeat import interleaved_order
from paged_backend.benchmarks.harness.report import BenchmarkSpec
from paged_backend.benchmarks.harness.server_process import CpuSampler, ServerProcess, launch, wait_ready
from paged_backend.benchmarks.paper.serving_rows import check_serving, serving_table, summarize_serving
from paged_backend.benchmarks.paper.serving_systems import (COMPILED, LLAMA_CPP_SYSTEMS, SERVED_SYSTEMS, ServedSystem,
                                                            gguf_type, llama_cpp_system, llama_slot_context,
                                                            paged_system, reservation_system, served_model_dir,
                                                            transformers_system)


@dataclass
class ServingConfig:
    """Defaults are the documented run (see SIZES)."""

    model: str = "smollm2"
    systems: Tuple[str, ...] = SERVED_SYSTEMS
    concurrencies: Tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    prompt_tokens: int = 128
    output_tokens: int = 64
    min_requests: int = 8           # requests per concurrency: max(min_requests, requests_per_stream x streams)
    requests_per_stream: int = 2
    kv_slots: int = 3072
    block_size: int = 16
    max_model_len: Optional[int] = None
    max_batch_tokens: int = 2048
    repetitions: int = 3
    seed: int = 0
    threads: Optional[int] = 2
    dtype: str = "float32"
    request_timeout_s: float = 600.0
    # llama.cpp's KV: "equal" (the page's rule of equal KV memory), kv_slots in as many slots of exactly a request's
    # tokens as fit (its server cannot preempt: a shared pool that fills fails every running request), the streams
    # beyond them queuing; or "own", a whole request's slot (with room to spare) for every stream (what its users
    # run given the memory; more KV than kv_slots at high concurrency)
    llama_cpp_kv: str = "equal"

    def __post_init__(self) -> None:
        self.systems, self.concurrencies = tuple(self.systems), tuple(self.concurrencies)
        known = SERVED_SYSTEMS + (COMPILED,) + LLAMA_CPP_SYSTEMS
        unknown = set(self.systems) - set(known + ("pow2", "max"))
        if unknown or not self.systems:
            raise ValueError(f"unknown systems {sorted(unknown)}; use {known} (and pow2, max)")
        for name in self.llama_cpp_systems():
            gguf_type(name, self.dtype)          # refuses a llama.cpp peer of unequal precision
        if not self.concurrencies or min(self.concurrencies) < 1:
            raise ValueError(f"concurrencies must be positive, got {self.concurrencies}")
        if self.kv_slots % self.block_size:
            raise ValueError(f"kv_slots={self.kv_slots} is not a multiple of block_size={self.block_size}")
        if self.llama_cpp_kv not in ("own", "equal"):
            raise ValueError(f"llama_cpp_kv must be own or equal, got {self.llama_cpp_kv!r}")
        if self.llama_cpp_systems() and self.llama_cpp_slots() < 1:
            raise ValueError(f"llama_cpp_kv=equal: kv_slots={self.kv_slots} hold no llama.cpp slot of "
                             f"{self.llama_slot_context()} tokens")

    def llama_slot_context(self) -> int:
        """Tokens per llama.cpp slot: with its own budget a whole request and room to spare; on ours exactly a
        request's tokens, as our servers hold (llama.cpp counts guidellm's prompts as ours do: its usage reports
        exactly prompt_tokens)."""
        if self.llama_cpp_kv == "equal" and self.max_model_len is None:
            return self.prompt_tokens + self.output_tokens
        return llama_slot_context(self.prompt_tokens, self.output_tokens, self.max_model_len)

    def llama_cpp_slots(self) -> int:
        """llama.cpp's parallel slots: one per stream, or with llama_cpp_kv=equal those of kv_slots' tokens."""
        streams = max(self.concurrencies)
        if self.llama_cpp_kv == "own":
            return streams
        return min(streams, self.kv_slots // self.llama_slot_context())

    def llama_cpp_systems(self) -> List[str]:
        return [name for name in self.systems if name in LLAMA_CPP_SYSTEMS]

    def requests(self) -> List[int]:
        return [max(self.min_requests, self.requests_per_stream * c) for c in self.concurrencies]


ANCHOR = {"model": "smollm2", "systems": SERVED_SYSTEMS + (COMPILED, "llama.cpp"), "concurrencies": (1, 2, 4, 8, 16, 32),
          "prompt_tokens": 128, "output_tokens": 64, "kv_slots": 3072, "block_size": 16, "repetitions": 3,
          "threads": 2, "dtype": "float32"}
# The half-precision comparison: our bfloat16 against llama.cpp's bf16 GGUF and its f16 GGUF (its fastest 16-bit
# path on a CPU that converts f16 cheaply), transformers serve in bfloat16 beside them.
ANCHOR_HALF = {**ANCHOR, "systems": ("paged", COMPILED, "hf-serve", "llama.cpp", "llama.cpp-f16"), "dtype": "bfloat16"}
# One concurrency and one round (each guidellm sweep costs seconds of start-up whatever its size), with KV for two
# of the four concurrent requests, so every server meets memory pressure.
QUICK = {"model": "tiny-llama", "concurrencies": (4,), "prompt_tokens": 16, "output_tokens": 8, "min_requests": 4,
         "requests_per_stream": 1, "kv_slots": 64, "repetitions": 1, "threads": 1}
SIZES = {"quick": QUICK, "anchor": ANCHOR, "anchor-half": ANCHOR_HALF}


def _llama_cpp(config: ServingConfig, model_dir: Path) -> Optional[LlamaCpp]:
    """Build llama-server and convert the model for the llama.cpp systems asked for (each once; None if none)."""
    kinds = sorted({gguf_type(name, config.dtype) for name in config.llama_cpp_systems()})
    return prepare(model_dir, kinds) if kinds else None


def _systems(config: ServingConfig, model_dir: Path, threads: int, llama: Optional[LlamaCpp]) -> List[ServedSystem]:
    limit = config.max_model_len
    built = []
    for name in config.systems:
        if name in LLAMA_CPP_SYSTEMS:
            kind = gguf_type(name, config.dtype)
            built.append(llama_cpp_system(name, llama.server, llama.gguf[kind], kind, threads,
                                          config.llama_cpp_slots(), config.llama_slot_context(), config.model))
        elif name in ("paged", COMPILED):
            built.append(paged_system(model_dir, config.kv_slots, config.block_size, limit, config.dtype,
                                      compiled=name == COMPILED))
        elif name == "hf-serve":
            built.append(transformers_system(model_dir, config.kv_slots, config.block_size, config.max_batch_tokens,
                                             config.dtype))
        else:
            built.append(reservation_system(model_dir, name, config.kv_slots, limit, config.dtype))
    return built


def round_load(load: GuidellmLoad, rep: int) -> GuidellmLoad:
    """Round `rep`'s load: prompts of a seed of its own, the same for every system in the round (ratios pair
    within a round), so no server answers a round from prompts cached in the rounds before (llama.cpp's server
    keeps prompts' KV in host memory: with one seed for all rounds its time to first token fell from 186 ms in
    round 1 to 37-41 ms in rounds 2 and 3)."""
    return replace(load, seed=load.seed + rep)


def _model_id(server: ServerProcess) -> str:
    import httpx

    models = httpx.get(server.base_url + "/v1/models", timeout=30).json()
    return models["data"][0]["id"]


def _warm_up(server: ServerProcess, system: ServedSystem, model_id: str, config: ServingConfig) -> None:
    """One request of the benchmark's shape, so first-call costs stay out of the measurement."""
    import httpx

    body = {"model": model_id, "prompt": "Hello " * config.prompt_tokens, "max_tokens": config.output_tokens,
            **system.force_length(config.output_tokens)}
    reply = httpx.post(server.base_url + "/v1/completions", json=body, timeout=config.request_timeout_s)
    if reply.status_code != 200:
        raise RuntimeError(f"{system.name}: warm-up request failed: HTTP {reply.status_code} {reply.text[:300]}")


def _start_all(systems: List[ServedSystem], env: Dict[str, str]) -> Dict[str, ServerProcess]:
    """Launch every server at once (they load in parallel), then wait for each; idle servers use no CPU."""
    servers: Dict[str, ServerProcess] = {}
    try:
        for system in systems:
            servers[system.name] = launch(system.argv, system.ready_pattern, {**env, **system.env})
        for system in systems:
            wait_ready(servers[system.name], ready_timeout=system.ready_timeout_s)
    except BaseException:
        _stop_all(servers)
        raise
    return servers


def _stop_all(servers: Dict[str, ServerProcess]) -> Dict[str, Optional[int]]:
    return {name: server.stop() for name, server in servers.items()}


def run_serving(config: ServingConfig, scratch_dir: Path) -> dict:
    """Run the guidellm sweeps; guidellm's scenarios, logs and full reports go under `scratch_dir`/guidellm."""
    threads = set_threads(config.threads)
    executable = guidellm_executable()          # before any server starts: a first build takes minutes
    model_dir = served_model_dir(config.model)
    llama = _llama_cpp(config, model_dir)     # before any server starts: a first build takes 15-30 minutes
    work_dir = Path(scratch_dir) / "guidellm"
    systems = _systems(config, model_dir, threads, llama)
    load = GuidellmLoad(config.concurrencies, config.requests(), config.prompt_tokens, config.output_tokens,
                        config.seed, config.request_timeout_s)
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    servers = _start_all(systems, env)
    runs: List[dict] = []
    try:
        ids = {}
        for system in systems:
            ids[system.name] = _model_id(servers[system.name])
            _warm_up(servers[system.name], system, ids[system.name], config)
        by_name = {s.name: s for s in systems}
        for rep, name in interleaved_order([s.name for s in systems], config.repetitions):
            server, system = servers[name], by_name[name]
            tag = f"{name}-round{rep}"
            spec = scenario(server.base_url, ids[name], str(model_dir), system.force_length(config.output_tokens),
                            round_load(load, rep), work_dir / f"{tag}.json")
            began = time.perf_counter()
            with CpuSampler(server.proc.pid) as sampler:
                report = run_guidellm(executable, spec, work_dir, tag, timeout_s=_timeout(config))
            for row in read_report(report):
                row.update(system=name, repetition=rep,
                           busy_cores=sampler.busy_cores(row["start_time"], row["end_time"]),
                           machine_busy_cores=sampler.machine_busy_cores(row["start_time"], row["end_time"]))
                runs.append(row)
            print(f"  round {rep + 1}/{config.repetitions} {name}: concurrencies {list(config.concurrencies)} in "
                  f"{time.perf_counter() - began:.0f} s", flush=True)
    finally:
        exits = _stop_all(servers)
    return {"benchmark": "serving", "config": asdict(config), "conditions": {"threads": threads},
            "guidellm": GUIDELLM_VERSION, "model_dir": str(model_dir), "requests_per_concurrency": config.requests(),
            "servers": {s.name: {"label": s.label, "argv": s.argv[1:], "force_length": s.force_length(
                config.output_tokens)} for s in systems},
            "llama_cpp": llama.record() if llama else None, "server_exit_codes": exits, "order": [[r, n] for r, n in interleaved_order(
                [s.name for s in systems], config.repetitions)],
            "runs": runs, "rows": summarize_serving(runs, [s.name for s in systems], config.concurrencies)}


def _timeout(config: ServingConfig) -> float:
    """A generous bound on one guidellm sweep: every request alone at a slow pace, plus start-up."""
    return 300.0 + sum(config.requests()) * config.output_tokens * 2.0


SPEC = BenchmarkSpec("serving", ServingConfig, run_serving, check_serving, serving_table, "plot_serving", SIZES,
                     documented_size="anchor", uses_scratch_dir=True)
