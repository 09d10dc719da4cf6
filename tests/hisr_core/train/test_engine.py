"""The training engine: backend and dtype choice, schedule, parameter groups, LoRA, saving."""

from __future__ import annotations

import copy
import importlib.util
import itertools
import math
import sys
from pathlib import Path

import pytest
import torch

from hisr_core.agent.models import build_builtin, load_model, load_tokenizer
from hisr_core.agent.prompts import PromptBuilder
from hisr_core.config import LoraParams
from hisr_core.train import engine as training
from hisr_core.train.engine import (
    BackendError,
    apply_lora,
    init_distributed,
    param_groups,
    replace_folder,
    resolve_backend,
    resolve_dtype,
    warmup_cosine,
)
from hisr_core.train.sft import encode_trajectories, train_sft
from tests.hisr_core.train.sft_worker import GRAMMAR, corpus, make_rows, sft_params


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_builtin("builtin:tiny", corpus(make_rows(40, seed=0)), 0,
                         tmp_path_factory.mktemp("tiny"))


# -- backend and dtype -----------------------------------------------------------------------------
def test_unknown_backend_names_the_choices():
    with pytest.raises(BackendError, match=r"'gpu'.*auto, torch, deepspeed"):
        resolve_backend("gpu")


def test_missing_deepspeed_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # makes `import deepspeed` fail
    with pytest.raises(BackendError, match=r"pip install -e \.\[gpu\]"):
        resolve_backend("deepspeed")
    # auto never fails: without DeepSpeed (or without a GPU) it trains with plain torch.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_backend("auto") == "torch"


def test_auto_backend_on_cpu_is_torch(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_backend("auto") == "torch"
    assert resolve_backend("torch") == "torch"


def test_resolve_dtype(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_dtype("auto") == torch.float32
    assert resolve_dtype("bfloat16") == torch.bfloat16
    assert resolve_dtype(torch.float32) == torch.float32
    with pytest.raises(ValueError, match="float16"):
        resolve_dtype("float16")


def test_auto_dtype_is_bfloat16_on_a_gpu_that_has_it(monkeypatch):
    """The GPU path of ``model.dtype: auto``: bfloat16 where CUDA supports it, float32 on an
    older GPU (no bfloat16) as on a CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto") == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto") == torch.float32


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="DeepSpeed is not installed (extra gpu)")
def test_auto_backend_on_a_gpu_is_deepspeed(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_backend("auto") == "deepspeed"


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="DeepSpeed is not installed (extra gpu)")
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_deepspeed_reads_the_config_as_built(stage, dtype):
    """The config the engine gives DeepSpeed on a GPU (ZeRO-2/3, bfloat16), parsed by
    DeepSpeed's own reader: the stage, bf16 on exactly for a bfloat16 model (never fp16 with
    its loss scaling), the batch sizes and clipping."""
    from deepspeed.runtime.config import DeepSpeedConfig

    spec = training.OptimSpec(lr=1e-3, weight_decay=0.0, warmup_ratio=0.0, min_lr_ratio=1.0,
                              max_grad_norm=0.5, grad_accum=4, micro_batch_size=8,
                              total_steps=10, zero_stage=stage)
    config = DeepSpeedConfig(training.deepspeed_config(spec, dtype, 1))
    assert config.zero_enabled and config.zero_optimization_stage == stage
    assert config.bfloat16_config.enabled == (dtype == torch.bfloat16)
    assert not config.float16_config.enabled
    assert (config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps,
            config.train_batch_size, config.gradient_clipping) == (8, 4, 32, 0.5)


def test_single_process_needs_no_process_group(monkeypatch):
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    info = init_distributed()
    assert (info.rank, info.world_size, info.local_rank) == (0, 1, 0) and info.is_main
    assert not torch.distributed.is_initialized()


# -- optimisation pieces ---------------------------------------------------------------------------
def test_warmup_cosine_by_hand():
    # 10 steps, 2 warm-up: steps 0,1 ramp to 1/2, 2/2; cosine over steps 2..9 (7 intervals)
    # from 1 to min 0.1; midway (step 5.5, not a step) it would be 0.55.
    lrs = [warmup_cosine(s, 10, 2, 0.1) for s in range(10)]
    assert lrs[0] == pytest.approx(0.5) and lrs[1] == pytest.approx(1.0)
    assert lrs[2] == pytest.approx(1.0) and lrs[9] == pytest.approx(0.1)
    # step 4: progress 2/7 → 0.1 + 0.9 * (1 + cos(2π/7)) / 2
    assert lrs[4] == pytest.approx(0.1 + 0.45 * (1 + math.cos(2 * math.pi / 7)))
    assert all(a >= b for a, b in itertools.pairwise(lrs[1:]))
    # no warm-up: the first step runs at the full rate; one step only: full rate too.
    assert warmup_cosine(0, 5, 0, 0.0) == pytest.approx(1.0)
    assert warmup_cosine(0, 1, 0, 0.3) == pytest.approx(1.0)


def test_no_weight_decay_on_biases_and_norms():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    model[0].bias.requires_grad_(False)
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and [p.shape for p in decay["params"]] == [(4, 4)]
    assert no_decay["weight_decay"] == 0.0
    assert {id(p) for p in no_decay["params"]} == {id(model[1].weight), id(model[1].bias)}


# -- saving ----------------------------------------------------------------------------------------
def test_replace_folder_keeps_the_old_one_until_the_new_one_is_complete(tmp_path):
    out = tmp_path / "model"
    replace_folder(out, lambda d: (d.mkdir(), (d / "weights").write_text("old")))

    def crash(d: Path) -> None:
        d.mkdir()
        (d / "weights").write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        replace_folder(out, crash)
    assert (out / "weights").read_text() == "old"
    replace_folder(out, lambda d: (d.mkdir(), (d / "weights").write_text("new")))
    assert (out / "weights").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temporary leftovers


def test_lora_trains_only_adapters_and_saves_a_plain_merged_model(tiny_dir, tmp_path):
    tokenizer = load_tokenizer(tiny_dir)
    model = load_model(tiny_dir)
    assert apply_lora(model, LoraParams(enabled=False)) is model
    torch.manual_seed(0)
    peft_model = apply_lora(model, LoraParams(enabled=True, r=4, alpha=8, dropout=0.0,
                                              target_modules=["q_proj", "v_proj"]))
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters()}
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)

    sequences = encode_trajectories(make_rows(8, seed=1), PromptBuilder(tokenizer), GRAMMAR)
    out = tmp_path / "merged"
    train_sft(peft_model, tokenizer, sequences, sft_params("torch", 4, 3, lr=1e-2), "float32",
              progress=False, out_dir=out)

    for name, p in peft_model.named_parameters():
        changed = not torch.equal(before[name], p.detach())
        assert changed == (name in trainable), name

    assert not (out / "adapter_config.json").exists()
    loaded = load_model(out).eval()
    assert type(loaded).__name__ == "LlamaForCausalLM"
    merged = copy.deepcopy(peft_model).merge_and_unload().eval()
    peft_model.eval()
    ids = torch.tensor([sequences[0].input_ids[:64]])
    with torch.no_grad():
        expected = merged(input_ids=ids).logits
        torch.testing.assert_close(loaded(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
        # ... and the live adapter model computes the same function.
        torch.testing.assert_close(peft_model(input_ids=ids).logits, expected,
                                   rtol=1e-4, atol=1e-4)


def test_engine_module_imports_nothing_of_the_pipeline():
    source = Path(training.__file__).read_text()
    for name in ("prefect", "mlflow", "dvc"):
        assert f"import {name}" not in source
