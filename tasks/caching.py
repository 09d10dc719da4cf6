"""Prefect tasks with explicit cache keys, whose results and written files are persisted in the
data area, so a stage rerun after a failure (from the command line, the Prefect UI or
``dvc repro``) resumes from the tasks that had finished.

A task's cache key hashes (``cache_key``):
- the source of the project's code (``hisr_core`` and ``tasks``: a change anywhere reruns,
  as DVC's code deps do),
- the params sections the task reads (not the whole file: a PPO key does not rerun SFT),
- the content of its input files and folders,
- every other argument's value, except those named ``ignore`` (an MLflow run id).

Its outputs (files or folders it writes) are copied into ``<cache>/files/<key>/`` when it
finishes (copies, not links: a later in-place write to an output must not reach the cache);
on a cache hit, outputs that are missing (``dvc repro`` deletes a stage's outputs before it
reruns it) or differ from what the call wrote are restored from there. The cache
folder is ``<data>/cache/prefect`` (``use_cache_dir``; results under ``results/``).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from hisr_core.config import Params
from hisr_core.contracts import write_json

_CACHE_ENV = "HISR_CACHE_DIR"
MANIFEST = "outputs.json"
_ROOT = Path(__file__).resolve().parents[1]


def use_cache_dir(folder: Path) -> None:
    """Persist task results and outputs of this process's flows under ``folder``."""
    os.environ[_CACHE_ENV] = str(Path(folder).resolve())


def cache_dir() -> Path:
    return Path(os.environ.get(_CACHE_ENV) or Path("data/cache/prefect").resolve())


#: File hashes already computed in this process, by (path, inode, size, modification time), as
#: DVC's state does: a call's key is needed before and after it runs; a model is read once.
_FILE_HASHES: dict[tuple[str, int, int, int], str] = {}


def content_hash(path: Path) -> str:
    """SHA-256 of a file's bytes, or of a folder's (relative name, file hash) pairs;
    ``"missing"`` if there is nothing at ``path``."""
    path = Path(path)
    if path.is_file():
        stat = path.stat()
        known = (str(path.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns)
        if known not in _FILE_HASHES:
            digest = hashlib.sha256()
            with path.open("rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
            _FILE_HASHES[known] = digest.hexdigest()
        return _FILE_HASHES[known]
    if path.is_dir():
        parts = [(p.relative_to(path).as_posix(), content_hash(p))
                 for p in sorted(path.rglob("*")) if p.is_file()]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()
    return "missing"


@functools.lru_cache(maxsize=1)
def code_hash() -> str:
    """Hash of every Python source of ``hisr_core`` and ``tasks``."""
    files = sorted([*(_ROOT / "hisr_core").rglob("*.py"), *(_ROOT / "tasks").rglob("*.py")])
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.relative_to(_ROOT).as_posix().encode())
        digest.update(f.read_bytes())
    return digest.hexdigest()


def _value(value: Any, sections: Sequence[str]) -> Any:
    if isinstance(value, Params):
        return {s: value.model_dump(mode="json")[s] for s in sections}
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, Path):
        return str(value)
    return value


def cache_key(name: str, arguments: dict[str, Any], inputs: Sequence[str],
              sections: Sequence[str], ignore: Sequence[str]) -> str:
    """The key of a call of task ``name`` with ``arguments`` (see the module docstring)."""
    blob: dict[str, Any] = {"task": name, "code": code_hash()}
    for arg, value in sorted(arguments.items()):
        if arg in ignore:
            continue
        if arg in inputs and value is not None:
            blob[arg] = {"path": str(value), "content": content_hash(Path(value))}
        else:
            blob[arg] = _value(value, sections)
    text = json.dumps(blob, sort_keys=True, default=repr)
    return f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:32]}"


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _copy_tree(src: Path, dst: Path) -> None:
    """``dst`` becomes a copy of ``src`` (file or folder), written under a temporary name
    first."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent)) / "x"
    if src.is_dir():
        shutil.copytree(src, tmp)
    else:
        shutil.copy2(src, tmp)
    _remove(dst)
    os.replace(tmp, dst)
    tmp.parent.rmdir()


def outside_failure(_task: Any, _run: Any, state: Any) -> bool:
    """Retry only what failed outside the project: a server that did not answer after the
    backend's own request retries, a lost connection, a timeout. A bug fails at once."""
    from hisr_core.retry import BackendError, retryable

    exc = state.result(raise_on_failure=False)
    if isinstance(exc, BackendError):
        return exc.__cause__ is not None and retryable(exc.__cause__)
    return isinstance(exc, (ConnectionError, TimeoutError))


class CachedTask:
    """A Prefect task with :func:`cache_key`, persisted results and restored outputs.

    Call it like the function (inside a flow); ``.fn`` is the plain function (for the
    non-zero ranks of a multi-process run, which run no Prefect)."""

    def __init__(self, fn: Callable[..., Any], name: str, inputs: Sequence[str],
                 outputs: Sequence[str], sections: Sequence[str], ignore: Sequence[str],
                 retries: int) -> None:
        from prefect import task

        self.fn, self.name = fn, name
        self.inputs, self.outputs = tuple(inputs), tuple(outputs)
        self.sections, self.ignore = tuple(sections), tuple(ignore)
        self.signature = inspect.signature(fn)
        unknown = {*inputs, *outputs, *ignore} - set(self.signature.parameters)
        if unknown:
            raise TypeError(f"{name}: no argument named {sorted(unknown)}")
        functools.update_wrapper(self, fn)

        def key_fn(_context: Any, parameters: dict[str, Any]) -> str:
            return self.key(parameters)

        @functools.wraps(fn)
        def body(*args: Any, **kwargs: Any) -> Any:
            arguments = self._bind(args, kwargs)
            # The task makes its outputs whole: nothing of an earlier call's stays behind.
            for out in self.outputs:
                if arguments[out] is not None:
                    _remove(Path(arguments[out]))
            value = fn(*args, **kwargs)
            self._snapshot(self.key(arguments), arguments)
            return value

        self.task = task(body, name=name, cache_key_fn=key_fn, persist_result=True,
                         retries=retries, retry_delay_seconds=10 if retries else 0,
                         retry_condition_fn=outside_failure if retries else None)

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    def key(self, arguments: dict[str, Any]) -> str:
        full = self.signature.bind_partial(**arguments)
        full.apply_defaults()
        return cache_key(self.name, dict(full.arguments), self.inputs, self.sections,
                         self.ignore)

    def _files(self, key: str) -> Path:
        return cache_dir() / "files" / key

    def _snapshot(self, key: str, arguments: dict[str, Any]) -> None:
        """Copy the outputs the call wrote into ``files/<key>/``; the manifest (their content
        hashes) goes last, so a snapshot without one is incomplete."""
        folder = self._files(key)
        written = {o: content_hash(Path(arguments[o])) for o in self.outputs
                   if arguments[o] is not None and Path(arguments[o]).exists()}
        for out in written:
            _copy_tree(Path(arguments[out]), folder / out)
        write_json({"outputs": written}, folder / MANIFEST)

    def _restore(self, key: str, arguments: dict[str, Any]) -> bool:
        """Make every output the call wrote match its snapshot (missing ones, and ones a
        later call overwrote); False if the snapshot is gone or incomplete."""
        manifest = self._files(key) / MANIFEST
        if not manifest.is_file():
            return False
        for out, digest in json.loads(manifest.read_text())["outputs"].items():
            saved, path = self._files(key) / out, Path(arguments[out])
            if not saved.exists():
                return False
            if content_hash(path) != digest:
                _copy_tree(saved, path)
        return True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        arguments = self._bind(args, kwargs)
        storage = cache_dir() / "results"  # a local folder (Prefect takes a Path as such)
        # Under torchrun or the deepspeed launcher the other ranks run ``.fn`` and meet rank
        # 0 in collectives: rank 0 must run too, so the cache is written but not read.
        refresh = {"refresh_cache": True} if int(os.environ.get("WORLD_SIZE", "1")) > 1 else {}
        result = self.task.with_options(result_storage=storage, **refresh)(*args, **kwargs)
        if not self._restore(self.key(arguments), arguments):
            # A cached result whose written files are gone (the cache folder was cleaned).
            result = self.task.with_options(result_storage=storage, refresh_cache=True)(
                *args, **kwargs)
        return result


def cached_task(name: str, *, inputs: Sequence[str] = (), outputs: Sequence[str] = (),
                sections: Sequence[str] = (), ignore: Sequence[str] = (),
                retries: int = 0) -> Callable[[Callable[..., Any]], CachedTask]:
    """Decorator: ``fn`` as a :class:`CachedTask`. ``inputs``/``outputs`` name the path
    arguments read/written, ``sections`` the params sections read (of a ``Params``
    argument), ``ignore`` arguments left out of the key; ``retries`` for work that can fail
    for outside reasons (a server)."""
    def wrap(fn: Callable[..., Any]) -> CachedTask:
        return CachedTask(fn, name, inputs, outputs, sections, ignore, retries)
    return wrap
