"""The compiled decode-attention kernel against attention written out in torch."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hisr_core.rollout.cpu import decode_attention
from hisr_core.rollout.cpu.decode_attention import attend, supported

pytestmark = pytest.mark.skipif(decode_attention.kernel() is None,
                                reason="the kernel needs an x86-64 CPU with AVX-512 or AVX2 "
                                       "and FMA, and a C++ compiler")


@pytest.fixture(params=["1", "avx2"])
def build(request, monkeypatch) -> int:
    """Each build of the kernel this CPU runs (its best; the 8-lane AVX2 one): its lanes."""
    if request.param not in ("1", *decode_attention.vector_isas(decode_attention._cpu_flags())):
        pytest.skip(f"this CPU cannot run the {request.param} build")
    monkeypatch.setenv(decode_attention.SWITCH, request.param)
    module = decode_attention.kernel()
    assert module is not None
    return module.lanes()


def reference(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: torch.Tensor,
              lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """One query row at a time: softmax(scale q Kᵀ) V over the row's first ``length``
    columns, each KV head repeated for its query heads. Shape as :func:`attend`."""
    groups = q.shape[1] // key.shape[1]
    out = []
    for r in range(len(q)):
        k = key[rows[r], :, :lengths[r]].double().repeat_interleave(groups, 0)
        v = value[rows[r], :, :lengths[r]].double().repeat_interleave(groups, 0)
        p = torch.softmax(q[r, :, None].double() @ k.transpose(1, 2) * scale, -1)
        out.append((p @ v)[:, 0])
    return torch.stack(out).float()


@pytest.mark.parametrize(("head_dim", "groups", "dtype"), list(itertools.product(
    (32, 64, 128), (1, 2, 4, 8), (torch.float32, torch.bfloat16))))
def test_matches_attention_written_out(build, head_dim, groups, dtype):
    """Every build, served head size, group and cache dtype; lengths below, at and above the
    blocks of 16 (or 8) scores the kernel sums together, rows read in any order and more than
    once."""
    assert supported(head_dim, groups, dtype)
    g = torch.Generator().manual_seed(head_dim * groups)
    kv_heads, n_rows, columns = 2, 5, 70
    key = (3 * torch.randn(n_rows, kv_heads, columns + 1, head_dim, generator=g)).to(dtype)
    value = torch.randn(n_rows, kv_heads, columns + 1, head_dim, generator=g).to(dtype)
    rows = torch.tensor([4, 0, 2, 2, 1, 3, 0])
    lengths = torch.tensor([1, 2, 15, 16, 17, 33, 70])
    q = torch.randn(len(rows), kv_heads * groups, head_dim, generator=g)
    # The cache's own layout: each head's columns contiguous, rows strided past a spare column.
    k, v = key[:, :, :columns], value[:, :, :columns]
    got = attend(q, k, v, rows, lengths, 0.3)
    want = reference(q, k, v, rows, lengths, 0.3)
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_reads_nothing_past_a_rows_length(build):
    """Columns past each row's length (here NaN) and other rows do not change the output."""
    g = torch.Generator().manual_seed(0)
    key, value = torch.randn(2, 2, 40, 32, generator=g), torch.randn(2, 2, 40, 32, generator=g)
    q = torch.randn(2, 4, 32, generator=g)
    rows, lengths = torch.tensor([0, 1]), torch.tensor([9, 21])
    before = attend(q, key, value, rows, lengths, 32 ** -0.5)
    key[0, :, 9:], value[0, :, 9:], key[1, :, 21:], value[1, :, 21:] = (float("nan"),) * 4
    torch.testing.assert_close(attend(q, key, value, rows, lengths, 32 ** -0.5), before)
    alone = attend(q[1:], key[1:], value[1:], torch.tensor([0]), lengths[1:], 32 ** -0.5)
    torch.testing.assert_close(alone, before[1:])


def test_bfloat16_query_comes_back_bfloat16(build):
    key = value = torch.randn(1, 1, 8, 32, dtype=torch.bfloat16)
    q = torch.randn(1, 2, 32, dtype=torch.bfloat16)
    out = attend(q, key, value, torch.tensor([0]), torch.tensor([8]), 1.0)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference(q.float(), key, value, torch.tensor([0]),
                                                      torch.tensor([8]), 1.0),
                               atol=1e-2, rtol=1e-2)


def test_bad_input_is_an_error_naming_it():
    key = value = torch.randn(2, 1, 8, 32)
    q = torch.randn(1, 2, 32)
    with pytest.raises(RuntimeError, match="length 9 out of range"):
        attend(q, key, value, torch.tensor([0]), torch.tensor([9]), 1.0)
    with pytest.raises(RuntimeError, match="row 2 out of range"):
        attend(q, key, value, torch.tensor([2]), torch.tensor([1]), 1.0)
    with pytest.raises(RuntimeError, match="contiguous"):
        attend(q, torch.randn(2, 1, 32, 8).transpose(2, 3), value, torch.tensor([0]),
               torch.tensor([1]), 1.0)
    assert not supported(48, 2, torch.float32) and not supported(32, 3, torch.float32)
    assert not supported(32, 2, torch.float16)


def test_switched_off(monkeypatch):
    monkeypatch.setenv(decode_attention.SWITCH, "0")
    assert decode_attention.kernel() is None and not supported(32, 2, torch.float32)
    monkeypatch.setenv(decode_attention.SWITCH, "avx3")
    with pytest.raises(ValueError, match="HISR_DECODE_KERNEL='avx3': expected one of 0, 1, avx2"):
        decode_attention.kernel()


def test_the_builds_a_cpu_runs(monkeypatch):
    """The best build first; AVX2 alone needs FMA too; AVX-512 CPUs also run the AVX2 build;
    the route a run records names the build in use."""
    flags = "flags : fpu sse2 avx avx2 fma"
    assert decode_attention.vector_isas(flags) == ["avx2"]
    assert decode_attention.vector_isas(flags + " avx512f avx512bw") == ["avx512", "avx2"]
    assert decode_attention.vector_isas("flags : fpu sse2 avx avx2") == []
    best = decode_attention.vector_isas(decode_attention._cpu_flags())[0]
    assert decode_attention.route() == best
    assert decode_attention.kernel().lanes() == {"avx512": 16, "avx2": 8}[best]
    monkeypatch.setenv(decode_attention.SWITCH, "0")
    assert decode_attention.route() == "sdpa"


def test_a_lock_left_by_a_killed_build_is_removed(tmp_path):
    """torch waits forever on the lock of a build that died; an old one is removed (a recent
    one, maybe a build going on, stays), and the kernel (built already, copied here) loads."""
    module = decode_attention.kernel()
    build = Path(module.__file__).parent
    shutil.copytree(build, tmp_path / build.name)
    lock = tmp_path / build.name / "lock"
    lock.touch()
    old = time.time() - decode_attention.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    (tmp_path / "other_op").mkdir()
    (tmp_path / "other_op" / "lock").touch()
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    code = "from hisr_core.rollout.cpu.decode_attention import kernel; assert kernel() is not None"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120,
                   cwd=Path(__file__).resolve().parents[3])
    assert not lock.exists() and (tmp_path / "other_op" / "lock").exists()


def test_another_checkout_loads_the_same_build(tmp_path):
    """A second checkout of the project (a worktree, a test's copy of the repository) loads
    the build the first one made: nothing is recompiled (~30 s each time), because the build
    compiles a copy of the source kept in its own folder, not the checkout's file."""
    module = decode_attention.kernel()
    library = Path(module.__file__)
    built = library.stat().st_mtime_ns
    checkout = tmp_path / "checkout"
    shutil.copytree(Path(decode_attention.__file__).parents[3] / "hisr_core",
                    checkout / "hisr_core")
    code = ("import sys; from hisr_core.rollout.cpu import decode_attention as d; "
            "assert d.__file__.startswith(sys.argv[1]), d.__file__; "
            "assert d.kernel() is not None")
    subprocess.run([sys.executable, "-c", code, str(checkout)], check=True, timeout=300,
                   env={**os.environ, "PYTHONPATH": str(checkout)}, cwd=checkout)
    assert library.stat().st_mtime_ns == built, "the other checkout rebuilt the kernel"
