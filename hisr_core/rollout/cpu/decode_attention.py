"""Decode attention over a ragged KV cache as one compiled CPU kernel (``csrc/decode_attention.cpp``).

Decoding B rows at once on a CPU is bound by reading their KV caches. The kernel reads each
row's keys and values once and only up to that row's own length, for all the query heads that
share a KV head, and computes in float32 from a float32 or bfloat16 cache. It is built on first
use with the machine's C++ compiler for the machine's own CPU (x86-64 with AVX-512, or with
AVX2 and FMA: 16 or 8 float32 lanes; about 20 s on 2 cores, then cached under
``TORCH_EXTENSIONS_DIR``, by default ``.cache/torch_extensions`` in the working directory).
Anywhere it cannot be built, or with ``HISR_DECODE_KERNEL=0``, :func:`kernel` is None and
callers keep PyTorch's SDPA.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import time
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.cpp"
#: Set to ``0`` to never build or use the kernel, or to ``avx2`` to use its 8-lane build on a CPU
#: that also has AVX-512 (to test or time it); unset or ``1``, the best build the CPU runs.
SWITCH = "HISR_DECODE_KERNEL"
SWITCH_VALUES = ("0", "1", "avx2")
#: A build lock older than this (seconds) was left by a build that died.
STALE_LOCK_S = 600


def project_extensions_dir() -> Path:
    """Cache JIT-compiled torch extensions under the working directory
    (``.cache/torch_extensions``) unless ``TORCH_EXTENSIONS_DIR`` says otherwise, and remove
    the build locks that builds killed midway left there (torch would wait on them forever)."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.cwd() / ".cache" / "torch_extensions"))
    root = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    for lock in root.glob("*/lock"):
        with contextlib.suppress(OSError):  # a build that just finished took it away
            if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
                log.warning("removing the stale build lock %s", lock)
                lock.unlink()
    return root


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def vector_isas(flags: str) -> list[str]:
    """The builds of the kernel a CPU whose ``/proc/cpuinfo`` flags are ``flags`` can run, best
    first: ``avx512`` (16 float32 lanes), ``avx2`` (8, with FMA)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    have = set(flags.split())
    return [isa for isa, needs in (("avx512", {"avx512f"}), ("avx2", {"avx2", "fma"}))
            if needs <= have]


def _stable_source(build: Path) -> Path:
    """The kernel's source copied once into its build folder. Ninja rebuilds when the compile
    command changes, and the command names the source's path: built from each checkout's own
    copy (a worktree, a test's copy of the repository), the shared build would be redone,
    ~30 s, every time another checkout used it. The folder's name carries the source's hash,
    so the copy there never goes stale."""
    source = build / SOURCE.name
    if not source.is_file():
        build.mkdir(parents=True, exist_ok=True)
        tmp = source.with_name(f".{source.name}.{os.getpid()}.tmp")
        tmp.write_bytes(SOURCE.read_bytes())
        os.replace(tmp, source)
    return source


def kernel() -> ModuleType | None:
    """The compiled kernel (``supports(d, g, dtype)``, ``decode(...)``, ``lanes()``: see
    :func:`attend`), built once per process; None where it cannot run (not x86-64 with AVX-512
    or AVX2 and FMA, no compiler, ``HISR_DECODE_KERNEL=0``), with the reason logged once."""
    switch = os.environ.get(SWITCH, "1")
    if switch not in SWITCH_VALUES:
        raise ValueError(f"{SWITCH}={switch!r}: expected one of {', '.join(SWITCH_VALUES)}")
    if switch == "0":
        return None
    isas = _isas()
    return _build("avx2" if switch == "avx2" else isas[0] if isas else None)


@functools.cache
def _isas() -> tuple[str, ...]:
    return tuple(vector_isas(_cpu_flags()))


@functools.cache
def _build(isa: str | None) -> ModuleType | None:
    if isa not in _isas():
        log.info("decode-attention kernel: needs an x86-64 CPU with %s; using SDPA",
                 "AVX2 and FMA" if isa == "avx2" else "AVX-512 or AVX2 and FMA")
        return None
    from torch.utils.cpp_extension import load

    # Built with -march=native: the name carries the source, the CPU it was built for and the
    # vector width (the 8-lane build on an AVX-512 CPU turns AVX-512 off).
    name = f"hisr_decode_attention_{isa}_" + hashlib.sha256(
        SOURCE.read_bytes() + _cpu_flags().encode()).hexdigest()[:12]
    build = project_extensions_dir() / name
    if not any(build.glob("*.so")):
        # A print: INFO logs are hidden by default, and stages show prints (log_prints).
        print(f"building the CPU decode kernel (first use, ~30 s; cached in {build})",
              flush=True)
    narrow = ["-mno-avx512f"] if isa != _isas()[0] else []
    try:
        return load(name, [str(_stable_source(build))],
                    extra_cflags=["-O3", "-march=native", *narrow, "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as err:  # noqa: BLE001 - any build failure: fall back to SDPA
        log.warning("decode-attention kernel could not be built (%s); using SDPA",
                    str(err).splitlines()[0] if str(err) else type(err).__name__)
        return None


def route() -> str:
    """How decode tokens attend here: ``avx512`` or ``avx2`` (the kernel's build), or ``sdpa``.
    Runs that must generate alike (a study seed's) record it."""
    k = kernel()
    return {16: "avx512", 8: "avx2"}[k.lanes()] if k is not None else "sdpa"


def supported(head_dim: int, groups: int, *dtypes: torch.dtype) -> bool:
    """Whether :func:`attend` serves this head size, query heads per KV head, and caches of
    every one of ``dtypes`` here (building the kernel if need be)."""
    k = kernel()
    return k is not None and all(k.supports(head_dim, groups, str(d).removeprefix("torch."))
                                 for d in dtypes)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: torch.Tensor,
           lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of one query token per entry of ``rows`` over that cache row's first
    ``lengths`` columns: ``softmax(scale · q Kᵀ) V`` (query head h reads KV head
    ``h // (H / H_kv)``, as grouped-query attention repeats them). Needs :func:`supported`.

    Shape: query (R, H, D); key, value (N, H_kv, S, D) with each head's (S, D) contiguous
    (float32 or bfloat16); rows, lengths (R,) int64, 1 ≤ lengths ≤ S → (R, H, D) in query's
    dtype.
    """
    k = kernel()
    if k is None:
        raise RuntimeError("the decode-attention kernel is not available here")
    r, h, d = query.shape
    q = query.to(torch.float32).reshape(r, key.shape[1], h // key.shape[1], d).contiguous()
    out = k.decode(q, key, value, rows.contiguous(), lengths.contiguous(), float(scale))
    return out.reshape(r, h, d).to(query.dtype)
