"""One tensor-parallel rank: its model shard, its KV cache (its heads only) and the step protocol.

Rank 0 (the engine) and every worker run `RankState.run` on the same `StepInputs`; rank 0 sends them
over a gloo "control" group as one int64 header plus one int64 payload per step, so the block tables
every rank uses are bytes of the same broadcast. Each rank keeps a digest of every step's block
tables so tests (and operators) can check that all ranks saw identical tables.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from paged_backend.worker.cache_engine import CacheEngine, KVGeometry
from paged_backend.errors import EngineDeadError
from paged_backend.worker.model_runner import ModelRunner
from paged_backend.worker.step_inputs import StepInputs
from paged_backend.worker.tp_sharding import build_plan, shard_model, tensor_parallel_context, weights_fingerprint

HEADER_LEN = 12
CMD_STEP, CMD_REPORT, CMD_SHUTDOWN = 1, 2, 3
CONTROL_TIMEOUT = timedelta(days=365)  # workers wait for the next step as long as the engine lives
MAX_DIGESTS = 100_000
STORE_PREFIX = "paged_backend/tp/"


class WorkerFailedError(EngineDeadError):
    """A tensor-parallel rank died or failed; the engine cannot continue."""


@dataclass
class WorkerSetup:
    """What rank 0 tells every worker at start-up (through the rendezvous store)."""

    world_size: int
    model_name: Optional[str]          # preset or path that every rank loads itself
    weights_file: Optional[str]        # or: the caller's nn.Module state dict, saved by rank 0
    model_class: Optional[type]
    model_config: Any
    trust_remote_code: bool
    dtype: torch.dtype
    device_type: str                   # "cpu" or "cuda"
    device_index_base: int
    backend: str                       # compute backend: gloo (CPU) or nccl (CUDA)
    geometry: KVGeometry               # the full model's; each rank holds its shard
    block_size: int
    num_blocks: int
    num_swap_blocks: int
    timeout_s: float
    fingerprint: Optional[str]         # rank 0's weight fingerprint before sharding (named models)
    kv_dtype: Optional[torch.dtype] = None   # what the KV cache stores (None: the model's dtype)

    def device_for(self, rank: int, local_rank: Optional[int]) -> torch.device:
        if self.device_type == "cpu":
            return torch.device("cpu")
        index = local_rank if local_rank is not None else self.device_index_base + rank
        return torch.device(self.device_type, index)


# ---- the step message ---------------------------------------------------------------------------------
def _pairs(items) -> torch.Tensor:
    flat = [int(x) for pair in items for x in pair]
    return torch.tensor(flat, dtype=torch.int64)


def pack_step(inputs: StepInputs, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(header, payload): every tensor of a step and its block swaps/copies as int64."""
    tables = inputs.block_tables
    parts = [inputs.input_ids, inputs.positions, inputs.slot_mapping, tables.reshape(-1), inputs.context_lens,
             inputs.query_start_loc, inputs.sample_indices, _pairs(inputs.swap_out.items()),
             _pairs(inputs.swap_in.items()), _pairs(inputs.copies)]
    payload = torch.cat([p.reshape(-1).to(torch.int64) for p in parts])
    header = torch.tensor([CMD_STEP, step, inputs.num_tokens, tables.shape[0], tables.shape[1],
                           inputs.sample_indices.numel(), len(inputs.swap_out), len(inputs.swap_in),
                           len(inputs.copies), payload.numel(), 0, 0], dtype=torch.int64)
    return header, payload


def unpack_step(header: torch.Tensor, payload: torch.Tensor) -> StepInputs:
    """The inverse of `pack_step`."""
    _, _, t, s, width, n, n_out, n_in, n_copy = (int(x) for x in header[:9])
    sizes = [t, t, t, s * width, s, s + 1, n, 2 * n_out, 2 * n_in, 2 * n_copy]
    chunks = torch.split(payload, sizes)
    i32 = torch.int32

    def pairs(chunk: torch.Tensor) -> List[Tuple[int, int]]:
        values = chunk.tolist()
        return list(zip(values[0::2], values[1::2]))

    return StepInputs(
        input_ids=chunks[0].clone(), positions=chunks[1].clone(), slot_mapping=chunks[2].clone(),
        block_tables=chunks[3].to(i32).reshape(s, width), context_lens=chunks[4].to(i32),
        query_start_loc=chunks[5].to(i32), sample_indices=chunks[6].clone(),
        swap_out=dict(pairs(chunks[7])), swap_in=dict(pairs(chunks[8])), copies=pairs(chunks[9]))


def block_table_digest(tables: torch.Tensor) -> str:
    return hashlib.blake2b(tables.to(torch.int32).contiguous().numpy().tobytes(), digest_size=8).hexdigest()


# ---- one rank -----------------------------------------------------------------------------------------
class ProcessGroupComm:
    """The all-reduce of row-parallel layers, over a torch.distributed group."""

    def __init__(self, group=None) -> None:
        self.group = group

    def all_reduce(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, group=self.group)


class RankState:
    """A model shard with its own paged KV cache (its heads), running the steps rank 0 broadcasts."""

    def __init__(self, model_shard: torch.nn.Module, setup: WorkerSetup, rank: int, device: torch.device) -> None:
        self.rank = rank
        geometry = setup.geometry.shard(setup.world_size)
        self.cache = CacheEngine(geometry, setup.block_size, setup.num_blocks, setup.num_swap_blocks,
                                 setup.kv_dtype or setup.dtype, device)
        self.runner = ModelRunner(model_shard, self.cache)
        self.digests: deque = deque(maxlen=MAX_DIGESTS)
        self.chain = hashlib.blake2b(digest_size=16)
        self.num_steps = 0

    def run(self, inputs: StepInputs, step: int, comm) -> torch.Tensor:
        digest = block_table_digest(inputs.block_tables)
        self.digests.append((step, digest))
        self.chain.update(digest.encode())
        self.num_steps += 1
        with tensor_parallel_context(comm):
            return self.runner.execute(inputs)

    def report(self) -> Dict[str, Any]:
        """What this rank holds and saw: KV cache shapes, steps, block-table digests."""
        return {"rank": self.rank, "pid": os.getpid(), "device": str(self.cache.kv.device),
                "kv_cache_shape": tuple(self.cache.kv.shape), "host_kv_cache_shape": tuple(self.cache.host_kv.shape),
                "kv_cache_bytes": self.cache.kv.numel() * self.cache.kv.element_size(),
                "num_kv_heads": self.cache.geometry.num_kv_heads, "num_steps": self.num_steps,
                "block_table_digests": list(self.digests), "digest_chain": self.chain.hexdigest()}


def load_shard(setup: WorkerSetup, rank: int, device: torch.device) -> torch.nn.Module:
    """Load the full model the way rank 0 did, check it is the same, keep this rank's shard on `device`."""
    if setup.model_name is not None:
        from paged_backend.worker.loader import load_model

        model, _ = load_model(setup.model_name, dtype=setup.dtype, device="cpu",
                              trust_remote_code=setup.trust_remote_code)
        mine = weights_fingerprint(model)
        if setup.fingerprint is not None and mine != setup.fingerprint:
            raise RuntimeError(f"rank {rank} loaded different weights for {setup.model_name!r} than rank 0 "
                               f"(fingerprint {mine} != {setup.fingerprint}); every rank must load the same model")
    else:
        model = setup.model_class._from_config(setup.model_config, dtype=setup.dtype)
        model.load_state_dict(torch.load(setup.weights_file, map_location="cpu", mmap=True, weights_only=True))
    shard_model(model, build_plan(model, setup.world_size), rank)
    return model.to(device).eval()


# ---- process groups -----------------------------------------------------------------------------------
def init_groups(store, rank: int, setup: WorkerSetup, device: torch.device):
    """Join the default group (the model's all-reduces) unless it exists, and make the gloo control group.

    Returns (control group, whether this call created the default group)."""
    created = False
    if not dist.is_initialized():
        kwargs = {"device_id": device} if setup.backend == "nccl" else {}
        dist.init_process_group(setup.backend, store=dist.PrefixStore("pg/", store), rank=rank,
                                world_size=setup.world_size, timeout=timedelta(seconds=setup.timeout_s), **kwargs)
        created = True
    elif dist.get_world_size() != setup.world_size:
        raise RuntimeError(f"the existing process group has {dist.get_world_size()} ranks, "
                           f"expected {setup.world_size}")
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return control, created


def destroy_groups(control, created: bool) -> None:
    for group in ([control] if control is not None else []) + ([None] if created else []):
        try:
            dist.destroy_process_group(group)
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass


# ---- the worker loop ----------------------------------------------------------------------------------
def _serve_steps(state: RankState, control, comm) -> None:
    """Receive and run steps until rank 0 says shut down."""
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    while True:
        dist.broadcast(header, src=0, group=control)
        command = int(header[0])
        if command == CMD_STEP:
            payload = torch.empty(int(header[9]), dtype=torch.int64)
            dist.broadcast(payload, src=0, group=control)
            state.run(unpack_step(header, payload), int(header[1]), comm)
        elif command == CMD_REPORT:
            dist.gather_object(state.report(), None, dst=0, group=control)
        elif command == CMD_SHUTDOWN:
            return
        else:
            raise RuntimeError(f"unknown command {command} from rank 0")


def _watch_parent(parent_pid: int) -> None:
    """A spawned worker exits when the engine process is gone (no orphans)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)
        time.sleep(0.5)


def run_worker(store, rank: int, world_size: int, local_rank: Optional[int] = None) -> int:
    """The whole life of a non-zero rank; returns its exit code. Failures are written to the store for rank 0."""
    control, created = None, False
    try:
        setup: WorkerSetup = pickle.loads(store.get("setup"))
        device = setup.device_for(rank, local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        store.set(f"hello/{rank}", str(os.getpid()))  # rank 0 joins the process group only after every hello
        control, created = init_groups(store, rank, setup, device)
        state = RankState(load_shard(setup, rank, device), setup, rank, device)
        store.set(f"ready/{rank}", "1")
        _serve_steps(state, control, ProcessGroupComm(None))
        return 0
    except BaseException as exc:  # noqa: BLE001 - report any failure to rank 0, then exit non-zero
        text = f"{type(exc).__name__}: {str(exc).strip()[:2000]}"
        traceback.print_exc()
        try:
            store.set(f"error/{rank}", text)
        except Exception:  # noqa: BLE001 - the store may be gone with rank 0
            pass
        return 1
    finally:
        destroy_groups(control, created)


def spawned_worker_main() -> None:
    """Entry point of a worker process started by the engine: argv = host port rank world parent_pid."""
    host, port, rank, world, parent = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \
        int(sys.argv[5])
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True, name="tp-parent-watch").start()
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=300))
    code = run_worker(dist.PrefixStore(STORE_PREFIX, store), rank, world)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
