"""Tensor parallelism on torch.distributed (the paper's §4.6): one scheduler, N ranks with their own heads.

Rank 0 is the engine process: it runs the scheduler and block manager, broadcasts each step's inputs
(token ids, positions, slot mapping, block tables, context lengths, query starts, sample rows, block
swaps and copies) and runs its own shard; every other rank runs the same step on its shard and its
own KV cache. Row-parallel layers all-reduce over the default process group (gloo on CPU, NCCL on
CUDA); step messages go over a separate gloo group. Ranks are either spawned by the engine (one
subprocess per rank, rendezvous on a local TCPStore) or are the processes of a `torchrun` launch, in
which case ranks other than 0 call `maybe_run_worker_loop()` and never return from it.
"""

from __future__ import annotations

import copy
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from paged_backend.worker.child_python import python_command
from paged_backend.worker.cache_engine import kv_cache_torch_dtype
from paged_backend.worker.step_inputs import StepInputs
from paged_backend.worker.tp_sharding import build_plan, shard_model, weights_fingerprint
from paged_backend.worker.tp_worker import (CMD_REPORT, CMD_SHUTDOWN, HEADER_LEN, STORE_PREFIX, ProcessGroupComm,
                                            RankState, WorkerFailedError, WorkerSetup, destroy_groups, init_groups,
                                            pack_step, run_worker)

STARTUP_TIMEOUT_S = float(os.environ.get("PAGED_BACKEND_TP_STARTUP_TIMEOUT", "600"))
STEP_TIMEOUT_S = float(os.environ.get("PAGED_BACKEND_TP_TIMEOUT", "300"))
_WORKER_CODE = "from paged_backend.worker.tp_worker import spawned_worker_main; spawned_worker_main()"

__all__ = ["TensorParallelRunner", "WorkerFailedError", "maybe_run_worker_loop", "torchrun_env"]


def torchrun_env() -> Optional[Tuple[int, int, int]]:
    """(rank, world_size, local_rank) when this process belongs to a multi-process torchrun launch."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    world = int(os.environ["WORLD_SIZE"])
    if world <= 1:
        return None
    return int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))


def _torchrun_store():
    if dist.is_initialized():
        return dist.PrefixStore(STORE_PREFIX, dist.distributed_c10d._get_default_store())
    store, _, _ = next(dist.rendezvous("env://", timeout=timedelta(seconds=STARTUP_TIMEOUT_S)))
    store.set_timeout(timedelta(seconds=STARTUP_TIMEOUT_S))
    return dist.PrefixStore(STORE_PREFIX, store)


def maybe_run_worker_loop() -> None:
    """Under torchrun, ranks other than 0 serve steps here and exit the process; elsewhere a no-op.

    Call it first thing in any entry point that builds an engine (`paged-backend serve` does)."""
    env = torchrun_env()
    if env is None or env[0] == 0:
        return
    rank, world, local_rank = env
    code = run_worker(_torchrun_store(), rank, world, local_rank)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _Workers:
    """The spawned worker processes and a thread that notices when one dies."""

    def __init__(self, world_size: int, host: str, port: int) -> None:
        self.procs: Dict[int, subprocess.Popen] = {}
        self.failure: Optional[str] = None
        self.closing = False
        for rank in range(1, world_size):
            args = [*python_command(), "-c", _WORKER_CODE, host, str(port), str(rank), str(world_size), str(os.getpid())]
            self.procs[rank] = subprocess.Popen(args, stdin=subprocess.DEVNULL)
        self._thread = threading.Thread(target=self._watch, daemon=True, name="tp-worker-monitor")
        self._thread.start()

    def dead(self) -> Optional[Tuple[str, int]]:
        """(description, rank) of the first worker that has exited, if any."""
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                return f"tensor-parallel worker rank {rank} (pid {proc.pid}) {_describe_exit(code)}", rank
        return None

    def _watch(self) -> None:
        while not self.closing and self.failure is None:
            found = self.dead()
            if found is not None and not self.closing:
                self.failure = found[0]
                if dist.is_initialized() and dist.get_backend() == "nccl":
                    try:  # unblock rank 0 if it waits in an NCCL collective for the dead rank
                        dist.distributed_c10d._abort_process_group()
                    except Exception:  # noqa: BLE001
                        pass
                return
            time.sleep(0.2)

    def stop(self, grace_s: float = 10.0) -> None:
        """Wait for workers to exit after a shutdown message; kill those that do not."""
        self.closing = True
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


class _Session:
    """What must be released when the runner goes away: workers, process groups, the weights file.

    Held by a `weakref.finalize`, so an engine dropped or left open at interpreter exit still tells its
    workers to stop instead of leaving them blocked."""

    def __init__(self) -> None:
        self.control = None
        self.created_default = False
        self.workers: Optional[_Workers] = None
        self.tmpdir: Optional[str] = None
        self.lock = threading.Lock()
        self.failed = False

    def healthy(self) -> bool:
        return not self.failed and (self.workers is None or self.workers.failure is None)

    def close(self) -> None:
        healthy = self.healthy()
        if self.control is not None and healthy:
            header = torch.zeros(HEADER_LEN, dtype=torch.int64)
            header[0] = CMD_SHUTDOWN
            try:
                with self.lock:
                    dist.broadcast(header, src=0, group=self.control)
            except Exception:  # noqa: BLE001 - workers already gone; they are reaped below
                pass
        if self.workers is not None:
            self.workers.stop(grace_s=10.0 if healthy else 1.0)
        destroy_groups(self.control, self.created_default)
        self.control = None
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)


class TensorParallelRunner:
    """Rank 0's model runner: broadcasts each step to the workers, runs its own shard, returns full logits."""

    def __init__(self, model: torch.nn.Module, geometry, kv_size, config, dtype: torch.dtype,
                 device: Optional[torch.device] = None, model_name: Optional[str] = None,
                 trust_remote_code: bool = False) -> None:
        self.world_size = config.parallel.tensor_parallel_size
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.plan = build_plan(model, self.world_size)  # refuse unsplittable models before starting anything
        self.torchrun = torchrun_env()
        self._check_launch(model_name)
        self._session = _Session()
        self._finalizer = weakref.finalize(self, self._session.close)
        self._step = 0
        self._failure: Optional[str] = None
        setup = self._setup(model, geometry, kv_size, config.cache.block_size, dtype, model_name,
                            trust_remote_code)
        setup.kv_dtype = kv_cache_torch_dtype(config.cache.kv_cache_dtype, dtype)
        try:
            self._start(setup)
            shard = model if model_name is not None else copy.deepcopy(model)
            self.model = shard_model(shard.to("cpu"), self.plan, 0).to(self.device).eval()
            self.state = RankState(self.model, setup, 0, self.device)
            self._wait_for("ready", "load the model")
        except BaseException:
            self.shutdown()
            raise

    # ---- start-up -----------------------------------------------------------------------------------
    def _check_launch(self, model_name: Optional[str]) -> None:
        if self.torchrun is None:
            if dist.is_initialized():
                raise ValueError("a torch.distributed process group already exists in this process (another "
                                 "tensor-parallel engine?); shut it down first, or launch every rank with torchrun")
            return
        rank, world, _ = self.torchrun
        if rank != 0:
            raise ValueError(f"torchrun rank {rank} must not build an engine: call "
                             f"paged_backend.worker.tp_runner.maybe_run_worker_loop() first on every rank")
        if world != self.world_size:
            raise ValueError(f"launched by torchrun with WORLD_SIZE={world} but tensor_parallel_size="
                             f"{self.world_size}; they must be equal")
        if model_name is None:
            raise ValueError("under torchrun every rank loads the model itself: pass a preset name or a model "
                             "directory, not an nn.Module")

    def _setup(self, model, geometry, kv_size, block_size: int, dtype, model_name, trust_remote_code) -> WorkerSetup:
        weights_file = None
        if model_name is None:  # a caller's module: hand its weights to the spawned workers through a file
            self._session.tmpdir = tempfile.mkdtemp(prefix="paged_backend_tp_")
            weights_file = os.path.join(self._session.tmpdir, "weights.pt")
            torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, weights_file)
        device = self.device
        backend = os.environ.get("PAGED_BACKEND_TP_BACKEND") or ("nccl" if device.type == "cuda" else "gloo")
        return WorkerSetup(
            world_size=self.world_size, model_name=model_name, weights_file=weights_file,
            model_class=type(model) if model_name is None else None,
            model_config=model.config if model_name is None else None, trust_remote_code=trust_remote_code,
            dtype=dtype, device_type=device.type, device_index_base=device.index or 0, backend=backend,
            geometry=geometry, block_size=block_size, num_blocks=kv_size.num_blocks,
            num_swap_blocks=kv_size.num_swap_blocks, timeout_s=STEP_TIMEOUT_S,
            fingerprint=weights_fingerprint(model) if model_name is not None else None)

    def _start(self, setup: WorkerSetup) -> None:
        if self.torchrun is None:
            self._master_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                               timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
            self.store = dist.PrefixStore(STORE_PREFIX, self._master_store)
            self.store.set("setup", pickle.dumps(setup))
            self._session.workers = _Workers(self.world_size, "127.0.0.1", self._master_store.port)
        else:
            self.store = _torchrun_store()
            self.store.set("setup", pickle.dumps(setup))
        self._wait_for("hello", "start")
        self._session.control, self._session.created_default = init_groups(self.store, 0, setup, self.device)

    def _wait_for(self, key: str, what: str) -> None:
        """Wait until every worker has set `key/<rank>`, failing fast on a dead worker or a reported error."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        pending = set(range(1, self.world_size))
        while pending:
            self._raise_if_failed(f"while the workers {what}", poll_store=True)
            pending = {r for r in pending if not self.store.check([f"{key}/{r}"])}
            if pending and time.monotonic() > deadline:
                raise WorkerFailedError(f"tensor-parallel workers {sorted(pending)} did not {what} within "
                                        f"{STARTUP_TIMEOUT_S:.0f} s (PAGED_BACKEND_TP_STARTUP_TIMEOUT)")
            if pending:
                time.sleep(0.05)

    # ---- failures -----------------------------------------------------------------------------------
    def _worker_errors(self) -> Dict[int, str]:
        """rank -> the error a failing worker wrote to the store before exiting."""
        errors = {}
        for rank in range(1, self.world_size):
            try:
                if self.store.check([f"error/{rank}"]):
                    errors[rank] = self.store.get(f"error/{rank}").decode(errors="replace")
            except Exception:  # noqa: BLE001 - the store itself may be unreachable
                break
        return errors

    def _diagnosis(self, wait_s: float = 0.0) -> Optional[str]:
        """What went wrong with the workers: a dead process and/or the error a worker reported."""
        deadline = time.monotonic() + wait_s
        workers = self._session.workers
        while True:
            dead = workers.dead() if workers is not None else None
            errors = self._worker_errors()
            if dead or errors or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if dead is not None:
            rank = dead[1]
            return f"{dead[0]}: {errors[rank]}" if rank in errors else dead[0]
        return "; ".join(f"tensor-parallel worker rank {r} failed: {e}" for r, e in errors.items()) or None

    def _error(self) -> WorkerFailedError:
        self._session.failed = True
        return WorkerFailedError(f"{self._failure}; the tensor-parallel engine cannot continue: shut it down "
                                 f"and start a new one")

    def _raise_if_failed(self, when: str = "", poll_store: bool = False) -> None:
        if self._failure is None:
            workers = self._session.workers
            if not poll_store and (workers is None or workers.failure is None):
                return
            found = self._diagnosis()
            if found is None:
                return
            self._failure = f"{found} {when}".strip()
        raise self._error()

    def _fail(self, exc: BaseException) -> WorkerFailedError:
        found = self._diagnosis(wait_s=3.0)
        seen = f"rank 0 saw {type(exc).__name__}: {str(exc).strip()[:300]}"
        self._failure = f"{found} during step {self._step} ({seen})" if found else \
            f"tensor-parallel step {self._step} failed: {seen}"
        return self._error()

    # ---- steps --------------------------------------------------------------------------------------
    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Send the step to every rank, run rank 0's shard, return the full logits of the sampled rows."""
        if not self._finalizer.alive:
            raise WorkerFailedError("the tensor-parallel runner is shut down")
        self._raise_if_failed()
        self._step += 1
        header, payload = pack_step(inputs, self._step)
        session = self._session
        try:
            with session.lock:
                dist.broadcast(header, src=0, group=session.control)
                dist.broadcast(payload, src=0, group=session.control)
            logits = self.state.run(inputs, self._step, ProcessGroupComm(None))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception as exc:  # noqa: BLE001 - any failure inside a collective means a rank is gone
            raise self._fail(exc) from exc
        return logits

    def worker_reports(self) -> List[Dict[str, Any]]:
        """Every rank's report (rank order, rank 0 first): KV cache shapes, steps and block-table digests."""
        self._raise_if_failed()
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        header[0] = CMD_REPORT
        reports: List[Any] = [None] * self.world_size
        session = self._session
        try:
            with session.lock:
                dist.broadcast(header, src=0, group=session.control)
                dist.gather_object(self.state.report(), reports, dst=0, group=session.control)
        except Exception as exc:  # noqa: BLE001
            raise self._fail(exc) from exc
        return reports

    @property
    def worker_pids(self) -> Dict[int, int]:
        """rank -> pid of the spawned workers (empty under torchrun)."""
        workers = self._session.workers
        return {r: p.pid for r, p in workers.procs.items()} if workers is not None else {}

    def shutdown(self) -> None:
        """Stop every worker (a shutdown message, then a kill after a grace period); leave the process groups."""
        self._finalizer()
        release = getattr(getattr(getattr(self, "state", None), "cache", None), "release", None)
        if release is not None:  # rank 0's own KV cache goes too
            release()
