"""Every command README.md and docs/*.md show runs, at a small size, through this checkout's .venv.

`documented_commands()` reads the commands out of the Markdown; COMMANDS says, for each, how it runs here at a
small size: the documented text with the values in SMALL swapped for small ones (tiny models, the CPU, free
loopback ports, temporary folders), or an explicit command that keeps every option the documented one names.
A documented command missing from COMMANDS fails the test by name, so a newly documented command is run too.

Kinds: "exit" runs to the end and must exit 0; "http" (`paged-backend serve`) and "triton"
(`paged-backend triton-serve`) must print their ready line, answer a generate request over HTTP, and exit 0
with no process left once the server gets SIGTERM; "nodes" starts the command twice, as node 0 and node 1 of a
two-node torchrun launch, node 0 serving HTTP. A command whose real run belongs to another test (a benchmark at
its smoke size, the torchrun generate check) names that test in `covered_by`; this test checks that the test
exists and that the command parses.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

from documented_commands import ROOT, documented_commands
from paged_backend.adapters.ports import free_port
from paged_backend.adapters.triton.tritonserver_process import children_of

BIN = Path(sys.executable).parent      # the .venv's bin: paged-backend, torchrun
TINY = "tiny-llama"


@dataclass(frozen=True)
class Run:
    """How a documented command runs here."""

    kind: str                          # exit, http, triton, nodes; or covered (see covered_by)
    text: Optional[str] = None         # the command at small size; None: the documented text with SMALL applied
    covered_by: str = ""               # "path::test" that runs it at its smoke size instead


# Values swapped in every documented command: (pattern, replacement). `{port}` becomes a free loopback port outside
# the kernel's ephemeral range each time (`free_port`), `{model_dir}` a saved tiny-llama, `{tmp}` this run's
# scratch folder.
SMALL: List[Tuple[str, str]] = [
    (r"\bsmollm2\b", TINY),
    (r"(?<!\S)(path/to/hf-model|/models/llama|DIR)(?!\S)", "{model_dir}"),
    (r"--device cuda\b", "--device cpu"),
    (r"--dtype bfloat16\b", "--dtype float32"),
    (r"--port 8000\b", "--port {port}"),
    (r"--tensor-parallel-size \d+", "--tensor-parallel-size 2"),
    (r"(?<!\S)(repo/|\./model_repository)(?!\S)", "{tmp}/model_repository"),
    (r"(?<!\S)/opt/tritonserver/backends(?!\S)", "{tmp}/backends"),
    (r"--kv-cache-memory 1GiB\b", "--kv-cache-memory 16MiB"),
    (r"\$\(which paged-backend\)", "{bin}/paged-backend"),
    (r"/adapters/sql-lora\b", "{adapter_dir}"),
    (r"(?<!\S)lora-repo/(?!\S)", "{tmp}/lora_repository"),
]
TRITON_PORTS = " --http-port {port} --grpc-port {port} --metrics-port {port}"
SERVE = ("paged-backend serve DIR --host 127.0.0.1 --port 8000 --api-key KEY --max-num-seqs 8 --num-blocks 192 "
         "--block-size 16 --swap-space 0 --device cuda --dtype bfloat16 --tensor-parallel-size 4")
TRITON_REPO = "paged-backend triton-repo repo/ --model smollm2 --kv-cache-memory 16MiB"
TRITON_SERVE = "paged-backend triton-serve --model-repository repo/" + TRITON_PORTS
QUICK = "tests/test_benchmarks_quick.py::test_quick_{}_benchmark"

COMMANDS: Dict[str, Run] = {
    # make targets (MODEL, SERVE_ARGS, TRITON_ARGS, TESTS and BENCH are the Makefile's own knobs)
    "make install": Run("exit"),
    "make run": Run("http", "make run MODEL=tiny-llama SERVE_ARGS='--port {port} --kv-cache-memory 16MiB'"),
    "make test": Run("exit", "make test TESTS=tests/test_triton_repo_cli.py PYTEST_ARGS=-q"),
    "make triton": Run("triton", "make triton MODEL=tiny-llama TRITON_ARGS='--kv-cache-memory 16MiB"
                                 + TRITON_PORTS + "'"),
    "make bench": Run("covered", covered_by=QUICK.format("waste")),     # make bench BENCH="waste --quick ..."
    # paged-backend info / generate
    "paged-backend info smollm2": Run("exit"),
    "paged-backend info": Run("exit", "paged-backend info smollm2"),
    "paged-backend info MODEL": Run("exit", "paged-backend info smollm2"),
    'paged-backend generate "prompt" --n 2 --temperature 0.8': Run(
        "exit", 'paged-backend generate "prompt" --n 2 --temperature 0.8 --model smollm2 --max-tokens 4 '
                '--kv-cache-memory 16MiB'),
    # paged-backend serve: one run holds every option the docs show it with (a tensor-parallel pair of processes)
    "paged-backend serve smollm2 --port 8000": Run("http", SERVE),
    "paged-backend serve": Run("http", SERVE),
    "paged-backend serve smollm2": Run("http", SERVE),
    "paged-backend serve [MODEL] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [engine options]": Run("http", SERVE),
    "paged-backend serve DIR --num-blocks 192 --block-size 16 --swap-space 0": Run("http", SERVE),
    "paged-backend serve path/to/hf-model --device cuda --dtype bfloat16 --tensor-parallel-size 4": Run("http", SERVE),
    "paged-backend serve --help": Run("exit"),
    "paged-backend serve smollm2 --dtype bfloat16 --compile blocking": Run(     # compiles before it listens
        "http", "paged-backend serve DIR --host 127.0.0.1 --port 8000 --dtype bfloat16 --compile blocking "
                "--max-num-seqs 2 --num-blocks 32"),
    "paged-backend serve smollm2 --port 8000 --speculative-config "
    "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'": Run("http"),
    "paged-backend serve smollm2 --enable-lora --max-loras 4 --lora-modules sql-lora=/adapters/sql-lora": Run(
        "http", "paged-backend serve DIR --host 127.0.0.1 --port 8000 --num-blocks 192 --enable-lora --max-loras 4 "
                "--max-lora-rank 8 --lora-modules sql-lora=/adapters/sql-lora"),
    "torchrun --standalone --nproc-per-node 4 $(which paged-backend) serve /models/llama --device cuda --dtype "
    "bfloat16 --tensor-parallel-size 4 --port 8000": Run(
        "http", "torchrun --standalone --nproc-per-node 2 $(which paged-backend) serve /models/llama --device cuda "
                "--dtype bfloat16 --tensor-parallel-size 4 --port 8000 --num-blocks 32"),
    "torchrun --nnodes 2 --nproc-per-node 4 --node-rank $NODE_RANK --master-addr $HEAD_IP --master-port 29500 "
    "$(which paged-backend) serve /models/llama --device cuda --dtype bfloat16 --tensor-parallel-size 8 --port "
    "8000": Run("nodes", "torchrun --nnodes 2 --nproc-per-node 1 --node-rank $NODE_RANK --master-addr 127.0.0.1 "
                         "--master-port {port} $(which paged-backend) serve /models/llama --device cuda --dtype "
                         "bfloat16 --tensor-parallel-size 8 --port 8000 --num-blocks 32"),
    'torchrun --standalone --nproc-per-node 2 $(which paged-backend) generate --model tiny-opt '
    '--tensor-parallel-size 2 "The paged cache"': Run(
        "covered", covered_by="tests/test_distributed.py::test_torchrun_launch_of_the_cli_matches_single_process"),
    # Triton: the repository first (README and docs/triton.md write the same folder), then the servers
    "paged-backend triton-repo repo/ --model smollm2": Run("exit", TRITON_REPO),
    "paged-backend triton-repo": Run("exit", TRITON_REPO),
    "paged-backend triton-repo repo/ --model smollm2 --max-batch-size 1": Run("exit", TRITON_REPO + " --max-batch-size 1"),
    "paged-backend triton-repo ./model_repository --model smollm2 --name paged_llm --kv-cache-memory 1GiB "
    "--max-num-seqs 64 --enable-prefix-caching [--instance-count 2] [--kind KIND_GPU]": Run(
        "exit", "paged-backend triton-repo ./model_repository --model smollm2 --name paged_llm --kv-cache-memory 1GiB "
                "--max-num-seqs 64 --enable-prefix-caching --instance-count 1 --kind KIND_CPU"),
    "paged-backend triton-repo lora-repo/ --model smollm2 --enable-lora --max-loras 2 --lora-modules "
    "sql-lora=/adapters/sql-lora": Run(
        "exit", "paged-backend triton-repo lora-repo/ --model smollm2 --kv-cache-memory 16MiB --enable-lora "
                "--max-loras 2 --max-lora-rank 8 --lora-modules sql-lora=/adapters/sql-lora"),
    "paged-backend triton-backend /opt/tritonserver/backends": Run("exit"),
    "paged-backend triton-serve --model-repository repo/": Run("triton", TRITON_SERVE),
    "paged-backend triton-serve --model-repository ./model_repository": Run("triton", TRITON_SERVE),
    # benchmarks: each runs at its smoke size, through `make bench`, in tests/test_benchmarks_quick.py
    "paged-backend bench docs": Run("exit", "paged-backend bench docs --no-plot --docs-dir {tmp}/docs"),
    "paged-backend bench --help": Run("exit"),
    "paged-backend bench throughput --size anchor": Run("covered", covered_by=QUICK.format("throughput")),
    "paged-backend bench throughput --quick": Run("covered", covered_by=QUICK.format("throughput")),
    "paged-backend bench sharing": Run("covered", covered_by=QUICK.format("sharing")),
    **{f"paged-backend bench {name} --documented": Run("covered", covered_by=QUICK.format(name.replace("-", "_")))
       for name in ("waste", "throughput", "sharing", "serving", "serving-half", "overhead", "structured")},
    "paged-backend bench recompute-policies --documented": Run(
        "covered", covered_by="tests/test_benchmarks_quick.py::test_quick_recompute_policies_study"),
    "paged-backend bench busy-threads --documented": Run(
        "covered", covered_by="tests/test_benchmarks_quick.py::test_quick_busy_threads_study"),
    "paged-backend bench busy-cores --documented": Run(
        "covered", covered_by="tests/test_benchmarks_quick.py::test_quick_busy_cores_study"),
    "paged-backend bench lora --documented": Run(
        "covered", covered_by="tests/test_benchmarks_quick.py::test_quick_lora_study"),
    "paged-backend bench speculative --documented": Run("covered", covered_by=QUICK.format("speculative")),
    "paged-backend bench speculative": Run("covered", covered_by=QUICK.format("speculative")),
    "paged-backend bench host-overhead --documented": Run(
        "covered", covered_by="tests/test_benchmarks_quick.py::test_quick_host_overhead_study"),
    "paged-backend bench host-overhead --documented --allow-dirty": Run(   # the before record's own command
        "covered", covered_by="tests/test_benchmarks_quick.py::test_quick_host_overhead_study"),
    "paged-backend bench compiled-decode --documented": Run(
        "covered", covered_by="tests/test_benchmarks_quick.py::test_quick_compiled_decode_study"),
    "paged-backend bench step-profile --documented": Run(
        "covered", covered_by="tests/test_benchmarks_quick.py::test_quick_step_profile_records_the_step_call_tree"),
}
# runs whose commands need another's output first
NEEDS = {TRITON_SERVE: [TRITON_REPO]}


# ---- the table against the docs ------------------------------------------------------------------------------
def test_every_documented_command_has_a_small_run():
    documented = documented_commands()
    missing = [f"{c.where}: {c.text}" for c in documented.values() if c.text not in COMMANDS]
    assert not missing, "documented commands with no entry in COMMANDS (say how each runs at a small size):\n" + \
        "\n".join(missing)
    stale = [text for text in COMMANDS if text not in documented]
    assert not stale, f"COMMANDS entries the docs no longer show: {stale}"


def _words(text: str) -> List[str]:
    return shlex.split(text.replace("$(which paged-backend)", "paged-backend"))


def _program(words: List[str]) -> int:
    """Where paged-backend stands in a command (after torchrun's options under torchrun)."""
    return next(i for i, w in enumerate(words) if w == "paged-backend" or w.endswith("/paged-backend"))


def _subcommand(text: str) -> List[str]:
    """`make TARGET` or `paged-backend SUB` (for torchrun: the paged-backend command it starts)."""
    words = _words(text)
    if words[0] == "make":
        return words[:2]
    at = _program(words)
    return ["paged-backend", words[at + 1]]


def _flags(text: str) -> set:
    return {w.split("=")[0] for w in _words(text.replace("[", " ").replace("]", " ")) if w.startswith("--")}


@pytest.mark.parametrize("documented", sorted(COMMANDS), ids=sorted(COMMANDS))
def test_a_small_run_keeps_the_documented_command_and_its_options(documented):
    run = COMMANDS[documented]
    if run.kind == "covered":
        path, name = run.covered_by.split("::")
        assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), run.covered_by
        _parse(_substituted(documented, {"model_dir": "m", "tmp": "t", "bin": str(BIN)}))
        return
    text = run.text or documented
    assert _subcommand(text) == _subcommand(documented)
    assert _flags(documented) <= _flags(text), f"the small run drops {_flags(documented) - _flags(text)}"


def _parse(text: str) -> None:
    """The command parses (paged-backend's parser; make's dry run)."""
    words = _words(text)
    if words[0] == "make":
        done = subprocess.run(["make", "-n", *words[1:]], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return
    from paged_backend.cli import build_parser

    argv = words[_program(words) + 1:]
    try:
        build_parser(argv).parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"`{text}` does not parse (exit {exc.code})") from None


# ---- running them -------------------------------------------------------------------------------------------
def _substituted(text: str, places: Dict[str, str]) -> str:
    for pattern, replacement in SMALL:
        text = re.sub(pattern, replacement, text)
    text = text.replace("{model_dir}", places["model_dir"]).replace("{tmp}", places["tmp"])
    text = text.replace("{bin}", places["bin"]).replace("{adapter_dir}", places.get("adapter_dir", "a"))
    while "{port}" in text:
        text = text.replace("{port}", str(free_port()), 1)
    return text


def _argv(text: str) -> List[str]:
    words = shlex.split(text)
    if words[0] in ("paged-backend", "torchrun"):
        words[0] = str(BIN / words[0])
    elif words[0] == "make":
        words.append(f"PYTHON={sys.executable}")
    return words


def _env() -> Dict[str, str]:
    return dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
                OMP_NUM_THREADS="1", TQDM_DISABLE="1", PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")


class Launched:
    """A command in a session of its own, its output collected line by line."""

    def __init__(self, argv: List[str], env: Dict[str, str]) -> None:
        self.argv = argv
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, text=True, start_new_session=True)
        self.lines: List[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    @property
    def output(self) -> str:
        return f"$ {shlex.join(self.argv)}\n" + "".join(self.lines)[-6000:]

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = next((m for m in map(re.compile(pattern).search, list(self.lines)) if m), None)
            if found:
                return found
            if self.proc.poll() is not None:
                self._reader.join(5)
                raise AssertionError(f"exited with {self.proc.returncode} before {pattern!r}:\n{self.output}")
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} after {timeout:.0f} s:\n{self.output}")

    def processes(self) -> List[int]:
        """This command's process and all its descendants."""
        family = [self.proc.pid]
        for pid in family:          # grows while it is walked
            family += children_of(pid)
        return family

    def server_pid(self) -> int:
        """The paged-backend process that serves: the one running the paged-backend script (rank 0 under
        torchrun), not make or torchrun around it."""
        for pid in self.processes():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            script = next((arg for arg in cmdline[1:] if not arg.startswith(b"-")), b"")
            rank = next((e[5:] for e in environ if e.startswith(b"RANK=")), b"0")
            if script.endswith(b"paged-backend") and rank == b"0":
                return pid
        raise AssertionError(f"no paged-backend process among {self.processes()}:\n{self.output}")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout:.0f} s:\n{self.output}") from None

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self._reader.join(5)


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def _post(url: str, body: dict, headers: Optional[Dict[str, str]] = None) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200
        return json.loads(response.read())


def _ask(kind: str, ready: re.Match, argv: List[str]) -> None:
    """One generate request over HTTP to the server that printed `ready`."""
    if kind == "triton":
        reply = _post(f"{ready.group(1)}/v2/models/paged_llm/generate",
                      {"text_input": "The capital of France is", "parameters": {"max_tokens": 4}})
        assert isinstance(reply["text_output"], str) and reply["text_output"], reply
        return
    key = argv[argv.index("--api-key") + 1] if "--api-key" in argv else None
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    reply = _post(f"{ready.group(1)}/generate", {"inputs": "The capital of France is",
                                                 "parameters": {"max_new_tokens": 4}}, headers)
    assert isinstance(reply["generated_text"], str), reply


READY = {"http": r"ready on (http://\S+)", "nodes": r"ready on (http://\S+)", "triton": r"ready: HTTP (http://\S+)"}


def _serve(kind: str, text: str) -> None:
    """Start a server command, ask it once, SIGTERM its server process: it and every process it started end."""
    env = _env()
    texts = [text.replace("$NODE_RANK", str(rank)) for rank in (0, 1)] if kind == "nodes" else [text]
    launched = [Launched(_argv(t), env) for t in texts]
    try:
        ready = launched[0].wait_for(READY[kind], timeout=300)
        _ask(kind, ready, launched[0].argv)
        family = [pid for one in launched for pid in one.processes()]
        os.kill(launched[0].server_pid(), signal.SIGTERM)
        for one in launched:
            assert one.wait(120) == 0, one.output
        deadline = time.monotonic() + 30
        while any(map(_alive, family)) and time.monotonic() < deadline:
            time.sleep(0.2)
        alive = [pid for pid in family if _alive(pid)]
        assert not alive, f"processes left after SIGTERM: {alive}\n{launched[0].output}"
    finally:
        for one in launched:
            one.kill()


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> Dict[str, str]:
    """The scratch folder, a saved tiny-llama, and a copy of docs/ for `bench docs` to rewrite."""
    import shutil

    from paged_backend.benchmarks.micro.lora import write_adapter
    from paged_backend.worker.loader import load_model

    tmp = tmp_path_factory.mktemp("documented")
    model, tokenizer = load_model(TINY)
    model.save_pretrained(tmp / "tiny-llama-dir")
    tokenizer.save_pretrained(tmp / "tiny-llama-dir")
    shutil.copytree(ROOT / "docs", tmp / "docs")
    adapter = write_adapter(model, tmp / "sql-lora", rank=8, targets=("q_proj", "v_proj"), seed=0)
    return {"model_dir": str(tmp / "tiny-llama-dir"), "tmp": str(tmp), "bin": str(BIN), "adapter_dir": str(adapter)}


@pytest.fixture(scope="module")
def fresh_install() -> None:
    """The make targets depend on `make install`; a stale .venv would reinstall inside the test."""
    done = subprocess.run(["make", "-q", "install"], cwd=ROOT, capture_output=True, timeout=60)
    assert done.returncode == 0, ".venv is older than the Makefile or pyproject.toml: run `make install` first"


def _run(text: str, kind: str, places: Dict[str, str]) -> None:
    """Run one small command (what it needs first, first); raises AssertionError with its output on failure."""
    for needed in NEEDS.get(text, []):
        _run(needed, "exit", places)
    concrete = _substituted(text, places)
    if kind == "exit":
        done = subprocess.run(_argv(concrete), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300,
                              stdin=subprocess.DEVNULL)
        assert done.returncode == 0, f"$ {concrete}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    else:
        _serve(kind, concrete)


RUNS = sorted({(run.text or doc, run.kind) for doc, run in COMMANDS.items() if run.kind != "covered"},
              key=lambda r: (r[1] != "exit", r[0]))


def _outcome(text: str, kind: str, places: Dict[str, str]) -> Optional[str]:
    try:
        _run(text, kind, places)
    except AssertionError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="module")
def outcomes(request, places, fresh_install) -> Dict[str, Optional[str]]:
    """The selected runs, two at a time (each process on one thread): the commands that exit first, then the
    servers; text -> None, or why it failed."""
    from concurrent.futures import ThreadPoolExecutor

    selected = {item.callspec.params["text"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_documented_command_runs"}
    found: Dict[str, Optional[str]] = {}
    with ThreadPoolExecutor(2) as pool:
        for phase in ([r for r in RUNS if r[1] == "exit"], [r for r in RUNS if r[1] != "exit"]):
            wanted = [(text, kind) for text, kind in phase if text in selected]
            found.update(zip([t for t, _ in wanted], pool.map(lambda r: _outcome(*r, places), wanted)))
    return found


@pytest.mark.slow
@pytest.mark.parametrize("text, kind", RUNS, ids=[text for text, _ in RUNS])
def test_documented_command_runs(text, kind, outcomes):
    assert outcomes[text] is None, outcomes[text]
