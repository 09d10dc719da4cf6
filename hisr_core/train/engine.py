"""The training engine shared by every stage that fits a model (SFT, SPRM, hindsight; PPO).

One small :class:`Engine` runs the same step code on two backends:

* ``torch``: a plain loop (``DistributedDataParallel`` when launched on several processes);
* ``deepspeed``: ``deepspeed.initialize`` with ZeRO (the default where a GPU is present).

The algorithm code calls only::

    with engine.micro_step(last=i == len(window) - 1):   # DDP no_sync / DeepSpeed boundary
        loss = engine.module(**batch)                     # the wrapped loss module
        engine.backward(loss)
    stats = engine.step()                                 # clip, AdamW, LR schedule
    engine.save(out_dir, tokenizer)                       # plain Hugging Face folder, rank 0

Gradient scaling is left entirely to the caller: :meth:`Engine.backward` never divides by the
number of accumulation steps (DeepSpeed's default does; it is switched off here), and both
backends average gradients over ranks. A caller that wants ``sum / global_count`` passes
``local_sum * world_size / global_count`` (see :mod:`hisr_core.train.fit`).

This module imports DeepSpeed only when that backend is chosen (it is the optional ``gpu`` extra).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import importlib.util
import logging
import math
import os
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hisr_core.config import LoraParams
from hisr_core.rollout.cpu.decode_attention import project_extensions_dir

Backend = Literal["torch", "deepspeed"]
BACKENDS = ("auto", "torch", "deepspeed")
GPU_EXTRA = "pip install -e .[gpu]"


class BackendError(ValueError):
    """The training backend is unknown or cannot be used here; the message says what to do."""


# -- backend, dtype, processes -------------------------------------------------------------------
def _deepspeed_importable() -> bool:
    try:
        return importlib.util.find_spec("deepspeed") is not None
    except ValueError:  # a module set to None in sys.modules
        return False


def import_deepspeed() -> ModuleType:
    """Import DeepSpeed, its JIT-compiled ops cached per project (``.cache/torch_extensions``).

    On a CPU, DeepSpeed compiles a shared-memory communication op the first time (about 1.5
    minutes on 2 cores); caching it under the working directory makes that a one-off.
    """
    project_extensions_dir()
    try:
        import deepspeed
    except ImportError as err:
        raise BackendError(
            "sft.backend 'deepspeed' needs the DeepSpeed package, which cannot be imported "
            f"({err}); install the GPU extra with `{GPU_EXTRA}`, or set backend: torch") from None
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    return deepspeed


def resolve_backend(backend: str) -> Backend:
    """``auto`` → DeepSpeed when a GPU is present and DeepSpeed is installed, else plain torch.

    An explicit ``deepspeed`` that cannot be imported is an error naming the extra to install.
    """
    if backend not in BACKENDS:
        raise BackendError(f"unknown training backend {backend!r}; expected one of "
                           f"{', '.join(BACKENDS)}")
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "deepspeed" if torch.cuda.is_available() and _deepspeed_importable() else "torch"
    import_deepspeed()
    return "deepspeed"


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    """``auto`` → bfloat16 on a GPU that supports it, float32 otherwise."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        cuda_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if cuda_bf16 else torch.float32
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; expected auto, {', '.join(table)}")
    return table[name]


class DistInfo(NamedTuple):
    """Where this process sits; ``world_size == 1`` means no other processes."""

    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> DistInfo:
    """Join the process group when launched by ``torchrun`` or the ``deepspeed`` launcher.

    With ``WORLD_SIZE > 1`` in the environment the default group is initialised (nccl on a GPU,
    gloo on a CPU) unless it already is; otherwise this is a single process and no group is made.
    A group made here is destroyed at exit (:func:`_destroy_group`).
    """
    if dist.is_available() and dist.is_initialized():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        return DistInfo(dist.get_rank(), dist.get_world_size(), local)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if world > 1:
        if torch.cuda.is_available():
            torch.cuda.set_device(local)
            dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        else:
            dist.init_process_group("gloo")
        _destroy_at_exit()
    return DistInfo(rank, world, local)


def _destroy_at_exit() -> None:
    atexit.unregister(_destroy_group)  # once, however many places made or joined the group
    atexit.register(_destroy_group)


def _destroy_group() -> None:
    """Destroy the default group while the interpreter is still whole. Left to interpreter
    finalization, gloo's worker threads can still hold work whose tensors need the GIL, and a
    rank then dies at exit with SIGABRT ("terminate called without an active exception")."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_deepspeed_distributed() -> DistInfo:
    """:func:`init_distributed`, then DeepSpeed's communication layer on top of that group.

    DeepSpeed needs a process group even for one process; when no launcher set the rendezvous
    variables, this process is declared rank 0 of 1 on a free local port.
    """
    deepspeed = import_deepspeed()
    if "WORLD_SIZE" not in os.environ:
        for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
                           "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
            os.environ.setdefault(key, value)
    info = init_distributed()
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    _destroy_at_exit()  # the group DeepSpeed made for one process too
    return info


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum ``values`` over all processes (a no-op for one process).

    Shape: any → same.
    """
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


# -- model pieces ----------------------------------------------------------------------------------
def apply_lora(model: nn.Module, lora: LoraParams | None) -> nn.Module:
    """Wrap ``model`` with LoRA adapters (peft); base weights frozen. A no-op when disabled."""
    if lora is None or not lora.enabled:
        return model
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=list(lora.target_modules), task_type="CAUSAL_LM")
    wrapped = get_peft_model(model, config)
    for p in wrapped.parameters():
        if getattr(p, OWN_LR, None) is not None:
            p.requires_grad_(True)  # peft froze everything but the adapters
    return wrapped


def unwrap_hf(model: nn.Module) -> nn.Module:
    """The Hugging Face model under a peft wrapper (its LoRA layers stay injected)."""
    return model.get_base_model() if isinstance(model, PeftModel) else model


_LOGIT_SCALES = ("final_logit_softcapping", "logit_scale", "output_multiplier",
                 "lm_head_multiplier", "logits_scaling")


def lm_parts(model: nn.Module, hooked: bool = False) -> tuple[nn.Module, nn.Linear] | None:
    """(backbone, LM head) of a causal LM whose logits are exactly ``head(backbone(x))``.

    Callers use them to project only the positions they score instead of the whole
    ``[B, T, V]`` logits. ``None`` for models that post-process logits (soft-capping, scaling);
    those go through the model's own forward. ``hooked``: also for a model whose forward hooks
    change the logits (:data:`LOGITS_HOOKED`), for a caller that applies them itself.
    """
    hf = unwrap_hf(model)
    if not isinstance(hf, PreTrainedModel) or (getattr(hf, LOGITS_HOOKED, False) and not hooked):
        return None
    backbone, head = hf.base_model, hf.get_output_embeddings()
    text_config = hf.config.get_text_config()
    scaled = any(getattr(text_config, a, None) not in (None, 1.0) for a in _LOGIT_SCALES)
    if backbone is hf or not isinstance(head, nn.Linear) or scaled:
        return None
    return backbone, head


#: A model carrying this attribute (true) changes its logits after the LM head in its own
#: forward (the hindsight pointer): :func:`lm_parts` leaves it to that forward.
LOGITS_HOOKED = "hisr_logits_hooked"

#: A parameter carrying this attribute (a float) trains at that peak learning rate instead of
#: the stage's, without weight decay, and stays trainable under LoRA (the hindsight gates).
OWN_LR = "own_lr"


def freeze_weights(model: nn.Module) -> nn.Module:
    """Leave trainable only the parameters with their own learning rate (:data:`OWN_LR`)."""
    for p in model.parameters():
        p.requires_grad_(getattr(p, OWN_LR, None) is not None)
    return model


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Trainable parameters in AdamW groups: matrices decay, biases and norm weights do not;
    parameters with :data:`OWN_LR` get a group with that learning rate each."""
    decay, no_decay, own = [], [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            if getattr(p, OWN_LR, None) is not None:
                own.append({"params": [p], "weight_decay": 0.0, "lr": getattr(p, OWN_LR)})
            else:
                (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}, *own]
    return [g for g in groups if g["params"]]


def warmup_cosine(step: int, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier of optimizer step ``step`` (0-based).

    Linear warm-up ``(step + 1) / warmup_steps`` (so the first step already moves the weights),
    then a cosine from 1 at step ``warmup_steps`` to ``min_lr_ratio`` at the last step.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - 1 - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


# -- the engine ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class OptimSpec:
    """What the engine needs from a stage's parameters (SFT and PPO sections fill it)."""

    lr: float
    weight_decay: float
    warmup_ratio: float
    min_lr_ratio: float
    max_grad_norm: float
    grad_accum: int
    micro_batch_size: int
    total_steps: int
    zero_stage: int = 2

    @property
    def warmup_steps(self) -> int:
        return math.ceil(self.warmup_ratio * self.total_steps)


def deepspeed_config(spec: OptimSpec, dtype: torch.dtype, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config of ``spec``; optimizer and schedule are passed in as torch objects
    (a plain ``torch.optim.AdamW`` keeps DeepSpeed from compiling its FusedAdam op)."""
    return {
        "train_micro_batch_size_per_gpu": spec.micro_batch_size,
        "gradient_accumulation_steps": spec.grad_accum,
        "train_batch_size": spec.micro_batch_size * spec.grad_accum * world_size,
        "gradient_clipping": spec.max_grad_norm,
        "zero_optimization": {"stage": spec.zero_stage},
        "bf16": {"enabled": dtype == torch.bfloat16},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


class Engine:
    """One backend's forward wrapper, optimizer and schedule behind the same four calls.

    Attributes:
        module: call this for the forward pass (the loss module, wrapped by DDP or DeepSpeed).
        model: the trainable model inside it (Hugging Face, possibly peft), what :meth:`save` writes.
        device: where batches go.
    """

    def __init__(self, module: nn.Module, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, backend: Backend,
                 dtype: torch.dtype, spec: OptimSpec, info: DistInfo, device: torch.device) -> None:
        self.module, self.model, self.optimizer, self.scheduler = module, model, optimizer, scheduler
        self.backend, self.dtype, self.spec, self.info, self.device = backend, dtype, spec, info, device
        self._trainable = [p for p in model.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def micro_step(self, last: bool) -> Iterator[None]:
        """Wrap the forward and backward of one micro-batch; ``last`` ends the accumulation window
        (only then are gradients reduced across ranks)."""
        with contextlib.ExitStack() as stack:
            if self.backend == "deepspeed":
                # Set explicitly every micro-batch so a short final window still ends in a step.
                self.module.set_gradient_accumulation_boundary(last)
            elif isinstance(self.module, nn.parallel.DistributedDataParallel) and not last:
                stack.enter_context(self.module.no_sync())
            if self.backend == "torch" and self.dtype != torch.float32:
                # fp32 master weights, low-precision compute (DeepSpeed casts the module itself).
                stack.enter_context(torch.autocast(self.device.type, dtype=self.dtype))
            yield

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss`` as given (no division by the accumulation steps)."""
        if self.backend == "deepspeed":
            self.module.backward(loss, scale_wrt_gas=False)
        else:
            loss.backward()

    def step(self) -> dict[str, float]:
        """Clip, update, advance the LR schedule, clear gradients; call once per window.

        Returns ``lr`` (the rate this update used) and ``grad_norm`` (before clipping).
        """
        lr = float(self.optimizer.param_groups[0]["lr"])
        if self.backend == "deepspeed":
            self.module.step()
            norm = self.module.get_global_grad_norm()
            grad_norm = float(norm) if norm is not None else float("nan")
        else:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self._trainable,
                                                             self.spec.max_grad_norm))
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        return {"lr": lr, "grad_norm": grad_norm}

    @contextlib.contextmanager
    def full_weights(self) -> Iterator[None]:
        """Inside, every rank sees the whole weights (ZeRO-3 gathers its partitions)."""
        if self.backend == "deepspeed" and self.spec.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(self.model.parameters()),
                                                   modifier_rank=None):
                yield
        else:
            yield

    def save(self, out_dir: str | Path, tokenizer: PreTrainedTokenizerBase | None = None,
             extra: Callable[[Path], None] | None = None) -> Path:
        """Write the model as a plain Hugging Face folder (LoRA merged) on rank 0, atomically
        (``extra(folder)`` adds files of its own, as in :func:`save_model_folder`).

        Collective: every rank must call it (ZeRO-3 gathers the partitioned weights first).
        """
        out_dir = Path(out_dir)
        with self.full_weights():
            if self.info.is_main:
                save_model_folder(self.model, out_dir, tokenizer, extra)
        barrier()
        return out_dir


def build_engine(module: nn.Module, spec: OptimSpec, backend: Backend, dtype: torch.dtype,
                 info: DistInfo, model: nn.Module | None = None) -> Engine:
    """Put ``module`` (a loss module holding ``model``; default: ``module`` itself) on its device
    with AdamW, the warm-up + cosine schedule, and the backend's wrapper."""
    model = module if model is None else model
    device = (torch.device("cuda", info.local_rank) if torch.cuda.is_available()
              else torch.device("cpu"))
    # Master weights in float32 whatever the checkpoint's dtype; bf16 is a compute dtype.
    module.to(device=device, dtype=torch.float32)
    optimizer = torch.optim.AdamW(param_groups(model, spec.weight_decay), lr=spec.lr,
                                  betas=(0.9, 0.999), eps=1e-8)
    schedule = functools.partial(warmup_cosine, total_steps=spec.total_steps,
                                 warmup_steps=spec.warmup_steps, min_lr_ratio=spec.min_lr_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    if backend == "deepspeed":
        deepspeed = import_deepspeed()
        wrapped, optimizer, _, scheduler = deepspeed.initialize(
            model=module, optimizer=optimizer, lr_scheduler=scheduler,
            config=deepspeed_config(spec, dtype, info.world_size), dist_init_required=False)
    elif info.world_size > 1:
        wrapped = nn.parallel.DistributedDataParallel(
            module, device_ids=[info.local_rank] if device.type == "cuda" else None)
    else:
        wrapped = module
    return Engine(wrapped, model, optimizer, scheduler, backend, dtype, spec, info, device)


# -- saving ----------------------------------------------------------------------------------------
def plain_state(model: nn.Module) -> tuple[PreTrainedModel, dict[str, torch.Tensor] | None]:
    """The Hugging Face model to save and its weights, LoRA adapters merged into the base.

    The merge is computed (``W + delta``) without touching the live model, so training can go
    on after a save. ``None`` weights: the model's own state dict (no adapters).
    """
    hf = unwrap_hf(model)
    if not isinstance(model, PeftModel):
        return hf, None
    lora_layers = {name: m for name, m in hf.named_modules() if isinstance(m, LoraLayer)}
    state: dict[str, torch.Tensor] = {}
    for key, value in hf.state_dict().items():
        if any(part.startswith("lora_") for part in key.split(".")):
            continue
        state[key.replace(".base_layer.", ".")] = value
    for name, layer in lora_layers.items():
        key = f"{name}.weight"
        weight = state[key]
        if not layer.merged:
            for adapter in layer.active_adapters:
                weight = weight + layer.get_delta_weight(adapter).to(weight.dtype)
        state[key] = weight.detach()
    return hf, state


def replace_folder(out_dir: Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp)`` on a temporary sibling folder, then rename it to ``out_dir``; an older
    ``out_dir`` is replaced only once the new folder is complete."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    for stale in (tmp, old):
        shutil.rmtree(stale, ignore_errors=True)
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out_dir.exists():
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def save_model_folder(model: nn.Module, out_dir: str | Path,
                      tokenizer: PreTrainedTokenizerBase | None = None,
                      extra: Callable[[Path], None] | None = None) -> Path:
    """Save ``model`` (LoRA merged) and ``tokenizer`` as a plain Hugging Face folder, atomically;
    ``extra(folder)`` adds files of its own (a reward or value head) before the folder appears."""
    hf, state = plain_state(model)

    def write(tmp: Path) -> None:
        hf.save_pretrained(tmp, state_dict=state)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if extra is not None:
            extra(tmp)

    return replace_folder(Path(out_dir), write)
