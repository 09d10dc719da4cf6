"""The documentation names only things that exist.

Checked in README.md, CHANGELOG.md and every Markdown file under docs/:

- **params keys**: an inline code span that is a dotted key whose first part is a section of
  ``params.yaml`` (``rollout.kv_dtype``, also ``rollout.backend: openai`` or ``ppo.lr=1e-4``)
  must be a field of the config models (``hisr_core/config.py``, which ``params.yaml`` is
  validated against; below a free-form mapping such as ``env.options`` any key is allowed).
  So must every key set with ``-S`` / ``--set-param`` in a code span or block.
- **repository paths**: a word in a code span or block that contains ``/`` and starts with a
  top-level folder or file of the repository (``hisr_core/rollout/hf.py``,
  ``benchmarks/results/x.json``, ``docs/engine.md``) must exist, and so must the target of
  every relative Markdown link (resolved from the linking file). Exempt: paths under ``data/``
  (the pipeline's outputs), ``.cache/`` and ``.venv*`` (made at run time), and words holding a
  placeholder or pattern (``<``, ``*``, ``{``, ``$``, ``...``).
- **modules**: ``python -m M`` / ``--module M`` and dotted ``hisr_core.``, ``tasks.`` or
  ``flows.`` names must be modules of the repository (a trailing name must be defined there).

Also: README.md stays within 10 KiB, no document points at a METHOD.md file (the method is
docs/method.md), and the generated key reference in docs/configuration.md is up to date.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from hisr_core.config import Params

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md")])
README_LIMIT = 10_240

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)
SPAN = re.compile(r"`((?:[^`\n]|\n(?!\n))+)`")  # may wrap a line, not a paragraph
LINK = re.compile(r"\]\(([^)\s]+)\)")
KEY = re.compile(r"^([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+)(?:\s*[:=].*)?$")
SET_PARAM = re.compile(r"(?:-S|--set-param)\s+['\"]?([a-z_][\w.]*)=")
MODULE_ARG = re.compile(r"(?:-m|--module)\s+([A-Za-z_][\w.]*)")
DOTTED_NAME = re.compile(r"^((?:hisr_core|tasks|flows)(?:\.\w+)+)$")
FILE_SUFFIX = re.compile(r"\.(py|md|yaml|yml|json|csv|png|html|parquet|safetensors|txt|sh)$")
PLACEHOLDER = ("<", "*", "{", "$", "...")
EXEMPT_PREFIXES = ("data/", ".cache/", ".venv")
REPO_DIRS = {"docs", "hisr_core", "tasks", "flows", "tests", "scripts", "benchmarks", "profiles"}
SECTIONS = set(Params.model_fields)


def _doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def _code(text: str) -> tuple[list[str], list[str]]:
    """(inline code spans, fenced code blocks) of a Markdown text."""
    blocks = FENCE.findall(text)
    return [" ".join(s.split()) for s in SPAN.findall(FENCE.sub("", text))], blocks


def _key_exists(key: str) -> bool:
    model: type[BaseModel] = Params
    parts = key.split(".")
    for i, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:
            return False
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            model = annotation
            continue
        # A leaf: nothing may follow, except below a free-form mapping (env.options.*).
        return i == len(parts) - 1 or getattr(annotation, "__origin__", None) is dict
    return True


def _params_keys(spans: list[str], blocks: list[str]) -> set[str]:
    keys = set()
    for span in spans:
        match = KEY.match(span.strip())
        if match and match.group(1).split(".")[0] in SECTIONS \
                and not FILE_SUFFIX.search(match.group(1)):
            keys.add(match.group(1))
    for code in [*spans, *blocks]:
        keys.update(k for k in SET_PARAM.findall(code) if k.split(".")[0] in SECTIONS)
    return keys


def _repo_paths(spans: list[str], blocks: list[str]) -> set[str]:
    top = {p.name for p in ROOT.iterdir()} | REPO_DIRS
    paths = set()
    for code in [*spans, *blocks]:
        for word in re.split(r"[\s\"'(),;=`]+", code):
            word = word.rstrip(".:")
            if "/" not in word or "://" in word or any(p in word for p in PLACEHOLDER):
                continue
            if word.split("/")[0] not in top or word.startswith(EXEMPT_PREFIXES):
                continue
            paths.add(word)
    return paths


def _links(doc: Path, text: str) -> set[str]:
    """Relative link targets of ``doc``, as paths relative to the repository root."""
    targets = set()
    for target in LINK.findall(FENCE.sub("", text)):
        if "://" in target or target.startswith(("#", "mailto:")):
            continue
        resolved = (doc.parent / target.split("#")[0]).resolve()
        rel = resolved.relative_to(ROOT).as_posix() if resolved.is_relative_to(ROOT) else target
        if not rel.startswith(EXEMPT_PREFIXES):
            targets.add(rel)
    return targets


def _module_exists(name: str) -> bool:
    """``a.b.c`` is a module or package of the repository, or ``a.b`` is one defining ``c``."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:cut])
        source = base.with_suffix(".py") if base.with_suffix(".py").is_file() \
            else base / "__init__.py"
        if not source.is_file():
            continue
        rest = parts[cut:]
        if not rest:
            return True
        if len(rest) > 2:
            return False
        pattern = rf"^\s*(?:def|class)\s+{rest[0]}\b|^{rest[0]}\s*[:=]"
        return re.search(pattern, source.read_text(encoding="utf-8"), re.MULTILINE) is not None
    return False


def _modules(spans: list[str], blocks: list[str]) -> set[str]:
    names = {m for code in [*spans, *blocks] for m in MODULE_ARG.findall(code)}
    names |= {m.group(1) for span in spans if (m := DOTTED_NAME.match(span.strip()))}
    return names


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_named_params_keys_exist(doc: Path) -> None:
    spans, blocks = _code(doc.read_text(encoding="utf-8"))
    missing = sorted(k for k in _params_keys(spans, blocks) if not _key_exists(k))
    assert not missing, f"{_doc_id(doc)} names params keys that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_named_paths_exist(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    spans, blocks = _code(text)
    named = _repo_paths(spans, blocks) | _links(doc, text)
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"{_doc_id(doc)} names files that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_named_modules_exist(doc: Path) -> None:
    spans, blocks = _code(doc.read_text(encoding="utf-8"))
    missing = sorted(m for m in _modules(spans, blocks) if not _module_exists(m))
    assert not missing, f"{_doc_id(doc)} names modules that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_no_method_file_reference(doc: Path) -> None:
    assert "METHOD.md" not in doc.read_text(encoding="utf-8"), \
        f"{_doc_id(doc)} points at METHOD.md; the method is docs/method.md"


def test_readme_is_short() -> None:
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_LIMIT, f"README.md is {size} bytes, over {README_LIMIT}"


def test_docs_cover_what_the_readme_links() -> None:
    """The documents the README promises are there (a sanity check on DOCS itself)."""
    names = {_doc_id(d) for d in DOCS}
    for name in ("docs/method.md", "docs/engine.md", "docs/configuration.md",
                 "docs/operations.md", "docs/results.md", "CHANGELOG.md"):
        assert name in names


def test_config_reference_is_current() -> None:
    spec = importlib.util.spec_from_file_location("config_reference",
                                                  ROOT / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    doc = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert module.embedded(doc) == module.reference().strip("\n"), (
        "docs/configuration.md's key reference is out of date: run "
        "python scripts/config_reference.py --write")


@pytest.mark.parametrize("wrong, check", [
    ("`rollout.snap_actions`", test_named_params_keys_exist),
    ("`dvc exp run -S ppo.lr_critic=1`", test_named_params_keys_exist),
    ("`hisr_core/rollout/nowhere.py`", test_named_paths_exist),
    ("[x](docs/nowhere.md)", test_named_paths_exist),
    ("```\npython -m flows.nowhere\n```", test_named_modules_exist),
    ("`hisr_core.rewards.sprm.nowhere`", test_named_modules_exist),
])
def test_checks_catch_wrong_names(tmp_path: Path, wrong: str, check) -> None:
    """Each check fails on a document naming something that does not exist."""
    doc = tmp_path / "probe.md"
    doc.write_text(f"# probe\n\n{wrong}\n", encoding="utf-8")
    with pytest.raises(AssertionError):
        check(doc)
