"""llama.cpp's server as a peer in the serving benchmark, without building it (a build takes 15-30 minutes and
`make test` never starts one): the sdist, cmake, ninja and converter command lines, the per-CPU build folder,
the equal-precision pairing, the `llama-server` command, the rows and table it yields, and the sizes that run it.
The real build, conversion and a served row are checked by hand (docs/benchmarks.md says how)."""

from __future__ import annotations

from pathlib import Path

import pytest

from paged_backend.benchmarks.paper import llama_cpp_build as build
from paged_backend.benchmarks.paper import llama_cpp_gguf as gguf
from paged_backend.benchmarks.paper.serving import SPEC, ServingConfig, _llama_cpp
from paged_backend.benchmarks.paper.serving_rows import serving_table, summarize_serving
from paged_backend.benchmarks.paper.serving_systems import (LLAMA_READY, gguf_type, llama_cpp_system,
                                                            llama_slot_context)

CPUINFO = "processor\t: 0\nflags\t\t: fpu sse2 avx2 {extra}\nbogomips\t: 1\nprocessor\t: 1\nflags\t\t: other\n"


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_BACKEND_CACHE", str(tmp_path))
    monkeypatch.delenv("PAGED_BENCH_LLAMA_SERVER", raising=False)
    return tmp_path / f"llama.cpp-{build.LLAMA_CPP_PYTHON_VERSION}"


def test_sources_come_from_the_pinned_sdist_and_build_natively_for_this_cpu(cache):
    assert build.sdist_command(Path("/d"))[1:] == ["-m", "pip", "download", "--disable-pip-version-check", "--no-deps",
                                                   "--no-binary", ":all:", "llama-cpp-python==0.3.36", "-d", "/d"]
    cmake = build.cmake_command(Path("/s"), Path("/b"))
    assert cmake[:5] == ["cmake", "-S", "/s", "-B", "/b"]
    for flag in ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_CURL=OFF",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DBUILD_SHARED_LIBS=OFF"):
        assert flag in cmake
    assert cmake[cmake.index("-G") + 1] == "Ninja"
    assert build.ninja_command(Path("/b"), 2) == ["ninja", "-C", "/b", "-j2", "llama-server"]
    assert build.build_dir().parent == cache and build.build_dir().name == f"build-{build.cpu_key()}"


def test_a_native_build_is_keyed_by_the_cpus_flags_and_architecture():
    base = build.cpu_key(CPUINFO.format(extra=""), "x86_64")
    assert base == build.cpu_key(CPUINFO.format(extra=""), "x86_64") and len(base) == 12
    assert build.cpu_key(CPUINFO.format(extra="avx512f amx_tile"), "x86_64") != base
    assert build.cpu_key(CPUINFO.format(extra=""), "aarch64") != base
    assert build.cpu_key("", "x86_64") != base


def test_the_server_counts_as_built_only_when_its_build_completed(cache, tmp_path, monkeypatch):
    assert build.server_path() is None
    binary = build.build_dir() / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("")
    assert build.server_path() is None                    # an interrupted build: resumed, never run
    (build.build_dir() / build.DONE).touch()
    assert build.server_path() == binary
    monkeypatch.setenv("PAGED_BENCH_LLAMA_SERVER", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="PAGED_BENCH_LLAMA_SERVER=.*not an executable"):
        build.server_path()


def test_the_vendored_commit_is_read_from_the_releases_changelog_entry():
    changelog = ("# Changelog\n\n## [Unreleased]\n\n## [0.3.36]\n\n- feat: update llama.cpp to "
                 "ggml-org/llama.cpp@0c1e57098\n\n## [0.3.35]\n\n- feat: update llama.cpp to ggml-org/llama.cpp@4df29be4f\n")
    assert build.llama_cpp_commit(changelog) == "0c1e57098"
    assert build.llama_cpp_commit(changelog.replace("0.3.36", "0.3.99")) is None


def test_conversion_runs_llamas_converter_once_per_model_and_precision(cache, tmp_path):
    model = tmp_path / "smollm2"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    argv = gguf.convert_command(Path("/env/bin/python"), Path("/src"), model, "bf16", Path("/out.gguf"))
    assert argv == ["/env/bin/python", "/src/convert_hf_to_gguf.py", str(model), "--outtype", "bf16", "--outfile",
                    "/out.gguf"]
    with pytest.raises(ValueError, match="f32, f16, bf16.*'q4_0'"):
        gguf.convert_command(Path("p"), Path("s"), model, "q4_0", Path("o"))
    paths = {gguf.gguf_path(model, kind) for kind in gguf.GGUF_TYPES}
    assert len(paths) == 3 and all(p.parent == cache / "gguf" and p.name.startswith("smollm2-") for p in paths)
    other = tmp_path / "other" / "smollm2"
    other.mkdir(parents=True)
    (other / "config.json").write_text('{"model_type": "llama"}')
    assert gguf.gguf_path(other, "f32") != gguf.gguf_path(model, "f32")
    assert gguf.converter_env().parent == cache
    existing = gguf.gguf_path(model, "f32")
    existing.parent.mkdir(parents=True)
    existing.write_bytes(b"GGUF")
    assert gguf.convert(model, "f32") == existing and not (cache / "src").exists()   # reused: nothing downloaded


def test_llama_cpp_runs_at_the_precision_of_our_server():
    assert gguf_type("llama.cpp", "float32") == "f32"
    assert gguf_type("llama.cpp", "bfloat16") == "bf16"
    assert gguf_type("llama.cpp", "float16") == "f16"
    assert gguf_type("llama.cpp-f16", "bfloat16") == "f16"
    with pytest.raises(ValueError, match="half-precision peer"):
        gguf_type("llama.cpp-f16", "float32")
    with pytest.raises(ValueError, match="no GGUF of float64"):
        gguf_type("llama.cpp", "float64")
    with pytest.raises(ValueError, match="half-precision peer"):
        ServingConfig(systems=("paged", "llama.cpp-f16"), dtype="float32")


def test_the_llama_server_command_has_a_slot_per_stream_and_equal_kv_precision():
    system = llama_cpp_system("llama.cpp", Path("/b/llama-server"), Path("/g/m-f32.gguf"), "f32", threads=2,
                              slots=32, slot_context=256, alias="smollm2")
    argv = system.argv
    option = dict(zip(argv, argv[1:]))
    assert argv[0] == "/b/llama-server" and option["--model"] == "/g/m-f32.gguf" and option["--alias"] == "smollm2"
    assert (option["--host"], option["--port"]) == ("127.0.0.1", "0")
    assert option["--threads"] == option["--threads-batch"] == "2"
    assert (option["--parallel"], option["--ctx-size"]) == ("32", str(32 * 256))
    assert option["--cache-type-k"] == option["--cache-type-v"] == "f32"
    assert "--no-kv-unified" in argv and "--cont-batching" in argv
    assert system.force_length(64) == {"temperature": 0.0, "ignore_eos": True}
    line = "srv          main: listening on http://127.0.0.1:41234"
    assert LLAMA_READY.search(line).group(1) == "http://127.0.0.1:41234"
    assert llama_slot_context(128, 64, None) == 256 and llama_slot_context(128, 100, None) == 512
    assert llama_slot_context(128, 64, 1024) == 1024


def test_llama_cpp_rows_pair_with_ours_and_the_table_names_what_ran():
    runs = [{"system": s, "repetition": rep, "concurrency": 4, "output_tokens_per_s": tps, "requests_per_s": 1.0,
             "ttft_ms_median": 10.0, "itl_ms_mean": 5.0, "latency_s_median": 1.0, "busy_cores": 1.9,
             "requests_ok": 8, "requests_failed": 0, "min_output_tokens": 64, "max_output_tokens": 64,
             "min_prompt_tokens": 128, "max_prompt_tokens": 128}
            for rep, (ours, theirs) in enumerate([(100.0, 50.0), (90.0, 60.0)])
            for s, tps in (("paged", ours), ("llama.cpp", theirs))]
    rows = summarize_serving(runs, ["paged", "llama.cpp"], [4])
    peer = next(r for r in rows if r["system"] == "llama.cpp")
    assert peer["paged_ratio"]["values"] == [2.0, 1.5] and peer["label"].startswith("llama.cpp llama-server")
    system = llama_cpp_system("llama.cpp", Path("/b/llama-server"), Path("/g/m.gguf"), "f32", 2, 32, 256, "smollm2")
    config = {"prompt_tokens": 128, "output_tokens": 64, "model": "smollm2", "dtype": "float32", "kv_slots": 3072,
              "threads": 2, "repetitions": 2}
    result = {"rows": rows, "config": config, "guidellm": "0.8.1", "llama_cpp": {"llama_cpp_commit": "0c1e57098"},
              "servers": {"paged": {"argv": ["-m", "x"]}, "llama.cpp": {"argv": system.argv[1:]}}}
    table = serving_table(result)
    assert "llama.cpp at 0c1e57098: llama.cpp f32 GGUF and KV cache, 32 slots of 256 tokens" in table
    assert "1.75x (1.50-2.00)" in table                               # the paired ratios' median and range


def test_the_documented_sizes_run_llama_cpp_and_the_smoke_size_never_builds_it(cache):
    anchor, half, quick = SPEC.config("anchor"), SPEC.config("anchor-half"), SPEC.config("quick")
    assert "llama.cpp" in anchor.systems and anchor.dtype == "float32"
    assert {"llama.cpp", "llama.cpp-f16"} <= set(half.systems) and half.dtype == "bfloat16"
    assert "oracle" not in half.systems and half.concurrencies == anchor.concurrencies == (1, 2, 4, 8, 16, 32)
    assert quick.llama_cpp_systems() == [] and _llama_cpp(quick, Path("/nowhere")) is None
    assert not cache.exists()                          # nothing downloaded, built or converted


def test_the_bench_cli_takes_the_dtype_the_peer_is_paired_by():
    import argparse

    from paged_backend.benchmarks import cli as bench_cli

    parser = argparse.ArgumentParser()
    bench_cli.add_parser(parser.add_subparsers(), "bench")
    args = parser.parse_args(["bench", "serving", "--size", "anchor", "--dtype", "bfloat16", "--systems",
                              "paged,llama.cpp,llama.cpp-f16"])
    config = SPEC.config("anchor", **bench_cli._overrides(SPEC, args))
    assert config.dtype == "bfloat16" and config.llama_cpp_systems() == ["llama.cpp", "llama.cpp-f16"]


def test_our_compiled_server_runs_beside_the_peers_with_its_own_ratio_column():
    """`paged-compiled` is our server with `--compile blocking` (compiled before it listens); the documented sizes
    run it, and each peer's row gets its ratio to it, paired by round, beside the ratio to the eager server."""
    from paged_backend.benchmarks.paper.serving_systems import COMPILED, paged_system

    system = paged_system(Path("/m"), 3072, 16, None, "float32", compiled=True)
    assert system.name == COMPILED and system.argv[-2:] == ["--compile", "blocking"]
    assert "--compile" not in paged_system(Path("/m"), 3072, 16, None, "float32").argv
    assert COMPILED in SPEC.config("anchor").systems and COMPILED in SPEC.config("anchor-half").systems
    runs = [{"system": s, "repetition": rep, "concurrency": 1, "output_tokens_per_s": tps, "requests_per_s": 1.0,
             "ttft_ms_median": 10.0, "itl_ms_mean": 5.0, "latency_s_median": 1.0, "busy_cores": 1.9,
             "requests_ok": 8, "requests_failed": 0, "min_output_tokens": 64, "max_output_tokens": 64,
             "min_prompt_tokens": 128, "max_prompt_tokens": 128}
            for rep, values in enumerate([(30.0, 36.0, 40.0), (31.0, 33.0, 30.0)])
            for s, tps in zip(("paged", COMPILED, "llama.cpp"), values)]
    rows = summarize_serving(runs, ["paged", COMPILED, "llama.cpp"], [1])
    peer = next(r for r in rows if r["system"] == "llama.cpp")
    assert peer["compiled_ratio"]["values"] == [0.9, 1.1] and peer["paged_ratio"]["values"] == [0.75, 31 / 30]
    assert next(r for r in rows if r["system"] == COMPILED)["compiled_ratio"] is None
    config = {"prompt_tokens": 128, "output_tokens": 64, "model": "smollm2", "dtype": "float32", "kv_slots": 3072,
              "threads": 2, "repetitions": 2}
    table = serving_table({"rows": rows, "config": config, "guidellm": "0.8.1", "llama_cpp": None, "servers": {}})
    assert "compiled is x" in table and "1.00x (0.90-1.10)" in table
    with pytest.raises(ValueError, match="unknown systems"):
        ServingConfig(systems=("paged-fast",))


def test_each_round_sends_fresh_prompts_the_same_for_every_system():
    """Round r's scenario seeds guidellm's synthetic prompts with seed + r: a server's prompt cache (llama.cpp keeps
    prompts' KV in host memory) never answers a round from the round before, and systems pair on equal prompts."""
    from paged_backend.benchmarks.paper.guidellm_run import GuidellmLoad, scenario
    from paged_backend.benchmarks.paper.serving import round_load

    load = GuidellmLoad((1, 4), (8, 8), 128, 64, seed=5)
    seeds = [scenario("http://x", "m", "/tok", {}, round_load(load, rep), Path("/r.json"))["spec"]["seed"]["value"]
             for rep in range(3)]
    assert seeds == [5, 6, 7] and load.seed == 5


def test_each_server_is_waited_for_as_long_as_its_start_may_take(monkeypatch):
    """The compiled server compiles every batch bucket before it listens on a first start (minutes, more while
    the other servers load beside it): it is waited for longer than the others, which only load weights. A
    bench run once stopped it after the common 300 s."""
    from paged_backend.benchmarks.paper import serving
    from paged_backend.benchmarks.paper.serving_systems import paged_system

    waited = {}
    monkeypatch.setattr(serving, "launch", lambda argv, pattern, env: argv[0])
    monkeypatch.setattr(serving, "wait_ready", lambda server, ready_timeout=300.0: waited.update({server: ready_timeout}))
    eager = paged_system(Path("/m"), 3072, 16, None, "float32")
    compiled = paged_system(Path("/m"), 3072, 16, None, "float32", compiled=True)
    eager.argv[0], compiled.argv[0] = "eager", "compiled"
    serving._start_all([eager, compiled], {})
    assert waited["eager"] == 300.0 and waited["compiled"] >= 1800.0


def test_llama_cpp_on_our_kv_budget_reserves_the_whole_request_slots_that_fit(cache):
    """--llama-cpp-kv equal (the default): llama.cpp gets the other servers' KV slots, as many slots of exactly a
    request's tokens as they hold (it cannot preempt), so streams beyond them queue; own: a slot per stream."""
    import argparse

    from paged_backend.benchmarks import cli as bench_cli
    from paged_backend.benchmarks.paper.llama_cpp import LlamaCpp
    from paged_backend.benchmarks.paper.serving import _systems

    parser = argparse.ArgumentParser()
    bench_cli.add_parser(parser.add_subparsers(), "bench")
    args = parser.parse_args(["bench", "serving", "--size", "anchor", "--systems", "paged-compiled,llama.cpp",
                              "--concurrencies", "16,32", "--llama-cpp-kv", "own"])
    own = SPEC.config("anchor", **bench_cli._overrides(SPEC, args))
    equal = SPEC.config("anchor", systems=("paged-compiled", "llama.cpp"), concurrencies=(16, 32))
    assert (equal.llama_cpp_slots(), own.llama_cpp_slots()) == (16, 32)   # 3072 // (128 + 64), one per stream
    assert (equal.llama_slot_context(), own.llama_slot_context()) == (192, 256)
    llama = LlamaCpp(server=Path("/b/llama-server"), gguf={"f32": Path("/g/m-f32.gguf")})
    for config, slots, context in ((equal, 16, 192), (own, 32, 256)):
        peer = next(s for s in _systems(config, Path("/m"), 2, llama) if s.name == "llama.cpp")
        option = dict(zip(peer.argv, peer.argv[1:]))
        assert (option["--parallel"], option["--ctx-size"]) == (str(slots), str(slots * context))
        assert slots * context <= config.kv_slots or config.llama_cpp_kv == "own"
    with pytest.raises(ValueError, match="own or equal"):
        ServingConfig(llama_cpp_kv="same")
    with pytest.raises(ValueError, match="hold no llama.cpp slot"):
        ServingConfig(systems=("paged", "llama.cpp"), kv_slots=176, llama_cpp_kv="equal")
    assert not cache.exists()
