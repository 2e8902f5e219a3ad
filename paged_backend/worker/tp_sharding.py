"""Megatron-style sharding of an unmodified Hugging Face model over tensor-parallel ranks.

Attention: query/key/value heads are split across ranks (column parallel), the output projection is
row parallel and its output all-reduced; the MLP is column then row parallel. Plans come from
transformers' `tp_plan` metadata when the model has one, or from built-in rules (OPT, GPT-2).
Embeddings, norms and the LM head stay replicated, so every rank ends with the full hidden states
and rank 0 samples from full logits. When a model has fewer KV heads than ranks (GQA), each rank
keeps a replica of the one KV head its query heads read.
"""

from __future__ import annotations

import hashlib
import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Protocol

import torch

from paged_backend.worker.cache_engine import kv_geometry
from paged_backend.worker.model_runner import attention_layers

# tp_plan styles that keep the module whole on every rank (correct, just not memory-saving).
REPLICATED_STYLES = frozenset({
    "replicate", "replicated_with_grad_allreduce", "embedding_rowwise", "embedding_colwise", "sequence_parallel",
    "colwise_gather_output", "colwise_rep", "rowwise_split_input", "rowwise_rep", "gather",
})
COLUMN_STYLES = {"colwise": 1, "packed_colwise": 2}  # style -> number of packed parts
ROW_STYLES = frozenset({"rowwise"})


class Communicator(Protocol):
    """What a sharded forward needs from the process group: an in-place sum over ranks."""

    def all_reduce(self, tensor: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class HeadLayout:
    """Attention head counts of the full model and of one rank."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    world_size: int

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.world_size

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.world_size)

    @property
    def replicates_kv(self) -> bool:
        return self.num_kv_heads < self.world_size


@dataclass(frozen=True)
class ShardRule:
    """How one Linear/Conv1D module is split: which output (column) or input (row) features a rank keeps."""

    module_name: str
    kind: str         # "column" or "row"
    layout: str       # "chunk", "packed", "kv_replica" (GQA with fewer KV heads than ranks), "gpt2_qkv"
    parts: int = 1    # packed parts for "packed" / "gpt2_qkv"

    def indices(self, size: int, rank: int, heads: HeadLayout) -> torch.Tensor:
        """Feature indices (of `size` along the split dimension) that `rank` keeps."""
        world = heads.world_size
        if self.layout == "kv_replica":
            head = rank * heads.num_kv_heads // world
            return torch.arange(head * heads.head_size, (head + 1) * heads.head_size)
        parts = self.parts if self.layout in ("packed", "gpt2_qkv") else 1
        part = size // parts
        local = part // world
        return torch.cat([torch.arange(p * part + rank * local, p * part + (rank + 1) * local) for p in range(parts)])


@dataclass
class ShardPlan:
    """Every module to split, and the head layout the splits follow."""

    rules: List[ShardRule]
    heads: HeadLayout
    source: str  # "tp_plan" or "built-in"


# ---- building a plan ----------------------------------------------------------------------------------
def _module_shapes(module: torch.nn.Module):
    """(out_features, in_features, transposed) of a Linear or transformers Conv1D."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"cannot shard {type(module).__name__}: expected a 2-D weight")
    transposed = type(module).__name__ == "Conv1D"
    out_f, in_f = (weight.shape[1], weight.shape[0]) if transposed else (weight.shape[0], weight.shape[1])
    return int(out_f), int(in_f), transposed


def _tp_plan_styles(model: torch.nn.Module) -> Dict[str, str]:
    """module name -> style, from the model's merged tp_plan (patterns with `*` for layer indices)."""
    plan = dict(getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None) or {})
    if not plan:
        base = getattr(model, "base_model", model)
        prefix = getattr(model, "base_model_prefix", "")
        for key, style in (getattr(model.config, "base_model_tp_plan", None) or {}).items():
            plan[f"{prefix}.{key}" if base is not model and prefix else key] = style
    names = [name for name, _ in model.named_modules()]
    styles: Dict[str, str] = {}
    for pattern, style in plan.items():
        regex = re.compile(re.escape(pattern).replace(r"\*", r"\d+"))
        for name in names:
            if regex.fullmatch(name):
                styles[name] = style
    return styles


def _builtin_styles(model: torch.nn.Module) -> Optional[Dict[str, str]]:
    """Our own plans for architectures without a tp_plan: OPT and GPT-2."""
    model_type = getattr(model.config, "model_type", "")
    table = {
        "opt": {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
                "self_attn.out_proj": "rowwise", "fc1": "colwise", "fc2": "rowwise"},
        "gpt2": {"attn.c_attn": "gpt2_qkv", "attn.c_proj": "rowwise", "mlp.c_fc": "colwise",
                 "mlp.c_proj": "rowwise"},
    }.get(model_type)
    if table is None:
        return None
    styles = {}
    for name, _ in model.named_modules():
        for suffix, style in table.items():
            if re.search(r"\.\d+\." + re.escape(suffix) + "$", name):
                styles[name] = style
    return styles


def _rule(name: str, style: str, module: torch.nn.Module, in_attention: bool, heads: HeadLayout) -> ShardRule:
    """One module's rule, checked against the head layout; ValueError when it cannot be split."""
    out_f, in_f, _ = _module_shapes(module)
    world, size = heads.world_size, heads.head_size
    if style == "gpt2_qkv":
        if out_f != 3 * heads.num_heads * size:
            raise ValueError(f"{name}: fused q/k/v of {out_f} features does not match {heads.num_heads} heads")
        return ShardRule(name, "column", "gpt2_qkv", 3)
    if style in ROW_STYLES:
        unit = size * world if in_attention else world
        if in_f % unit:
            raise ValueError(f"{name}: {in_f} input features cannot be split evenly over {world} ranks")
        return ShardRule(name, "row", "chunk")
    parts = COLUMN_STYLES[style]
    if in_attention and parts == 1 and heads.replicates_kv and out_f == heads.num_kv_heads * size:
        return ShardRule(name, "column", "kv_replica")
    if in_attention and heads.num_kv_heads != heads.num_heads and out_f not in (
            heads.num_heads * size, heads.num_kv_heads * size):
        raise ValueError(f"{name}: a fused projection of {out_f} features with grouped-query heads "
                         f"({heads.num_heads} query, {heads.num_kv_heads} KV) cannot be split by heads")
    unit = parts * world * (size if in_attention else 1)
    if out_f % unit:
        raise ValueError(f"{name}: {out_f} output features cannot be split evenly over {world} ranks")
    return ShardRule(name, "column", "packed" if parts > 1 else "chunk", parts)


def head_layout(model: torch.nn.Module, world_size: int) -> HeadLayout:
    """Head counts of `model`, validated for `world_size` ranks (ValueError names the problem)."""
    geometry = kv_geometry(model.config)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = HeadLayout(int(config.num_attention_heads), geometry.num_kv_heads, geometry.head_size, world_size)
    name = type(model).__name__
    if heads.num_heads % world_size:
        raise ValueError(f"{name} has {heads.num_heads} attention heads, which cannot be split evenly over "
                         f"tensor_parallel_size={world_size} ranks")
    kv = heads.num_kv_heads
    if (kv >= world_size and kv % world_size) or (kv < world_size and world_size % kv):
        raise ValueError(f"{name} has {kv} KV heads: tensor_parallel_size={world_size} must divide it or be "
                         f"a multiple of it")
    return heads


def build_plan(model: torch.nn.Module, world_size: int) -> ShardPlan:
    """The shard plan for `model` over `world_size` ranks; ValueError when the model cannot be split."""
    name = type(model).__name__
    heads = head_layout(model, world_size)
    styles, source = _tp_plan_styles(model), "tp_plan"
    if not styles:
        styles, source = _builtin_styles(model), "built-in"
    if not styles:
        raise ValueError(f"{name} has no tensor-parallel plan (transformers' tp_plan) and no built-in one "
                         f"(built-in: OPT, GPT-2); it cannot run with tensor_parallel_size={world_size}")
    modules = dict(model.named_modules())
    layers = attention_layers(model)
    attention_names = {n for n, m in modules.items() if id(m) in layers}
    rules = []
    for module_name, style in sorted(styles.items()):
        if style in REPLICATED_STYLES:
            continue
        if style not in COLUMN_STYLES and style not in ROW_STYLES and style != "gpt2_qkv":
            raise ValueError(f"{name}: tp_plan style {style!r} of {module_name} is not supported by paged-backend "
                             f"(supported: colwise, rowwise, packed_colwise, and replicated styles)")
        in_attention = any(module_name.startswith(a + ".") for a in attention_names)
        rules.append(_rule(module_name, style, modules[module_name], in_attention, heads))
    _check_attention_sharded(name, rules, attention_names, source)
    return ShardPlan(rules, heads, source)


def _check_attention_sharded(name: str, rules: List[ShardRule], attention_names, source: str) -> None:
    """Each rank must hold only its heads: every attention layer needs column-split q/k/v and a row-split output."""
    for attn in sorted(attention_names):
        kinds = {r.kind for r in rules if r.module_name.startswith(attn + ".")}
        if kinds != {"column", "row"}:
            raise ValueError(f"{name}: the {source} plan does not split the heads of {attn} (it keeps attention "
                             f"replicated), so each rank cannot hold only its own KV heads")


# ---- applying a plan ----------------------------------------------------------------------------------
_HEAD_ATTRIBUTES = {"num_heads": "q", "num_attention_heads": "q", "n_head": "q", "num_kv_heads": "kv",
                    "num_key_value_heads": "kv", "num_key_value_groups": "groups", "split_size": "width",
                    "embed_dim": "width", "all_head_size": "width"}


def _localize_attention(module: torch.nn.Module, heads: HeadLayout) -> None:
    """Make head-count attributes that an attention forward may reshape with match this rank's shard."""
    full = {"q": heads.num_heads, "kv": heads.num_kv_heads, "groups": heads.num_heads // heads.num_kv_heads,
            "width": heads.num_heads * heads.head_size}
    local = {"q": heads.local_heads, "kv": heads.local_kv_heads,
             "groups": heads.local_heads // heads.local_kv_heads, "width": heads.local_heads * heads.head_size}
    for attribute, what in _HEAD_ATTRIBUTES.items():
        if getattr(module, attribute, None) == full[what]:
            setattr(module, attribute, local[what])


def _shard_module(module: torch.nn.Module, rule: ShardRule, rank: int, heads: HeadLayout) -> None:
    out_f, in_f, transposed = _module_shapes(module)
    weight, bias = module.weight, getattr(module, "bias", None)
    with torch.no_grad():
        if rule.kind == "column":
            index = rule.indices(out_f, rank, heads).to(weight.device)
            new_weight = weight.index_select(1 if transposed else 0, index)
            new_bias = bias.index_select(0, index) if bias is not None else None
            new_out, new_in = int(index.numel()), in_f
        else:
            index = rule.indices(in_f, rank, heads).to(weight.device)
            new_weight = weight.index_select(0 if transposed else 1, index)
            new_bias = bias.clone() if bias is not None and rank == 0 else (
                torch.zeros_like(bias) if bias is not None else None)  # the bias is added once, by rank 0
            new_out, new_in = out_f, int(index.numel())
    module.weight = torch.nn.Parameter(new_weight.contiguous(), requires_grad=False)
    if bias is not None:
        module.bias = torch.nn.Parameter(new_bias.contiguous(), requires_grad=False)
    if transposed:
        module.nf = new_out
    else:
        module.out_features, module.in_features = new_out, new_in
    if rule.kind == "row":
        module.register_forward_hook(_all_reduce_output)


def shard_model(model: torch.nn.Module, plan: ShardPlan, rank: int) -> torch.nn.Module:
    """Split `model` in place for `rank`; row-parallel outputs are all-reduced inside `tensor_parallel_context`."""
    modules = dict(model.named_modules())
    for rule in plan.rules:
        _shard_module(modules[rule.module_name], rule, rank, plan.heads)
    layers = attention_layers(model)
    for module in model.modules():
        if id(module) in layers:
            _localize_attention(module, plan.heads)
    model._paged_backend_tp = (rank, plan.heads.world_size)
    return model


# ---- the all-reduce inside a forward ------------------------------------------------------------------
_local = threading.local()


@contextmanager
def tensor_parallel_context(comm: Communicator) -> Iterator[None]:
    """Route the row-parallel reductions of forwards run by this thread through `comm`."""
    previous = getattr(_local, "comm", None)
    _local.comm = comm
    try:
        yield
    finally:
        _local.comm = previous


def _all_reduce_output(module: torch.nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    comm = getattr(_local, "comm", None)
    if comm is None:
        raise RuntimeError(f"{type(module).__name__} is one rank's shard of a tensor-parallel model: it can only "
                           f"run inside the engine's tensor-parallel step")
    comm.all_reduce(output)
    return output


def weights_fingerprint(model: torch.nn.Module, samples: int = 4096) -> str:
    """A cheap bitwise digest of a model's parameters (strided samples), to check ranks loaded the same weights."""
    digest = hashlib.blake2b(digest_size=16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            flat = param.detach().reshape(-1)
            step = max(1, flat.numel() // samples)
            sample = flat[::step].contiguous().cpu()
            digest.update(name.encode())
            digest.update(str(tuple(param.shape)).encode())
            digest.update(sample.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
