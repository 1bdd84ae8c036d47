"""A tenant's own Triton model repository: unpack an archive (tar.gz or zip) or copy a folder of the MSP's model
store into a staging folder, validate it, then move it into place. Pure Python (no Django).

Every refusal is a ``RepoError`` naming the file (``path``) or field and leaves nothing behind. Checked:

* archive members: absolute paths, ``..`` (path traversal), symlinks, hard links, device files / FIFOs, too
  many files, more expanded bytes than allowed (archive bombs: the bytes actually written are counted, never
  the sizes the headers claim);
* layout: ``<model>/config.pbtxt`` and ``<model>/<version>/...`` (a single wrapping folder is allowed);
* each ``config.pbtxt`` parsed with Triton's own protobuf schema (``triton.parse_model_config``): the name
  matches its folder, the backend (or platform) is one Tessera serves (``KNOWN_BACKENDS``; a tier may allow
  fewer, checked at deploy), every ``instance_group`` on the slice's one device (``gpus`` empty or ``[0]``), no
  host paths in ``parameters`` or ``default_model_filename``, the python/onnxruntime model file present,
  ensemble steps naming models of the same repository.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import stat
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, BinaryIO, TypeVar, overload

from marketplace.hardware import triton
from marketplace.hardware.triton import repository as triton_repository

KNOWN_BACKENDS = ("python", "onnxruntime", "vllm", "tensorrtllm", "ensemble")
PLATFORM_BACKENDS = {"ensemble": "ensemble", "onnxruntime_onnx": "onnxruntime"}
DEFAULT_MODEL_FILES = {"python": "model.py", "onnxruntime": "model.onnx"}
MODEL_DIR_VAR = "$$TRITON_MODEL_DIRECTORY"
CHUNK = 1024 * 1024


class RepoError(ValueError):
    """A refused repository: ``message`` names the problem, ``path`` the member or file, ``field`` the form field."""

    def __init__(self, message: str, *, path: str | None = None, field: str = "archive") -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path, self.field = path, field


@dataclass(frozen=True)
class Limits:
    max_files: int = 1000
    max_expanded_bytes: int = 4 * 1024**3


@dataclass
class RepoModel:
    name: str
    backend: str  # python, onnxruntime, vllm, tensorrtllm, ensemble
    max_batch_size: int
    inputs: list[dict]
    outputs: list[dict]
    versions: list[int]
    size_bytes: int
    memory_mb: int  # declared with the tessera_memory_mb parameter (0: not declared)
    steps: list[str] = field(default_factory=list)  # an ensemble's composing models
    decoupled: bool = False  # any number of responses per request (the gateway streams it)


@dataclass
class Repo:
    models: list[RepoModel]
    file_count: int
    size_bytes: int

    def as_json(self) -> list[dict]:
        return [asdict(m) for m in self.models]


# --------------------------------------------------------------------------------------------------
# Member checks
# --------------------------------------------------------------------------------------------------

def _clean_name(name: str) -> str | None:
    """The member's relative POSIX path; ``None`` for a folder entry; ``RepoError`` if it leaves the root."""
    if "\x00" in name:
        raise RepoError("a NUL byte in the file name", path=name.replace("\x00", "\\0"))
    norm = name.replace("\\", "/")
    if norm.startswith("/") or re.match(r"^[A-Za-z]:", norm):
        raise RepoError("absolute paths are not allowed", path=name)
    parts = [p for p in norm.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise RepoError("path traversal ('..') is not allowed", path=name)
    if not parts:
        return None
    return "/".join(parts)


class _Writer:
    """Writes members under ``root`` counting files and bytes against the limits."""

    def __init__(self, root: Path, limits: Limits) -> None:
        self.root, self.limits, self.files, self.bytes = root, limits, 0, 0

    def add_dir(self, rel: str) -> None:
        (self.root / rel).mkdir(parents=True, exist_ok=True)

    def add_file(self, rel: str, src: IO[bytes]) -> None:
        self.files += 1
        if self.files > self.limits.max_files:
            raise RepoError(f"too many files: more than {self.limits.max_files}", path=rel)
        target = self.root / rel
        if target.exists():
            raise RepoError("the file is in the archive twice", path=rel)
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as out:
            while True:
                chunk = src.read(CHUNK)
                if not chunk:
                    break
                self.bytes += len(chunk)
                if self.bytes > self.limits.max_expanded_bytes:
                    raise RepoError(f"the repository expands to more than {self.limits.max_expanded_bytes:,} bytes "
                                    "(the expanded-size limit)", path=rel)
                out.write(chunk)


def _extract_tar(fileobj: BinaryIO, w: _Writer) -> None:
    try:
        with tarfile.open(fileobj=fileobj, mode="r:*") as tar:
            for m in tar:
                rel = _clean_name(m.name)
                if m.issym():
                    raise RepoError("symlinks are not allowed", path=m.name)
                if m.islnk():
                    raise RepoError("hard links are not allowed", path=m.name)
                if m.ischr() or m.isblk() or m.isfifo() or m.isdev():
                    raise RepoError("device files and FIFOs are not allowed", path=m.name)
                if rel is None:
                    continue
                if m.isdir():
                    w.add_dir(rel)
                elif m.isfile():
                    if m.size > w.limits.max_expanded_bytes:
                        raise RepoError("the file is larger than the expanded-size limit", path=m.name)
                    src = tar.extractfile(m)
                    if src is None:  # never for a regular file
                        raise RepoError("only regular files and folders are allowed", path=m.name)
                    w.add_file(rel, src)
                else:
                    raise RepoError("only regular files and folders are allowed", path=m.name)
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise RepoError(f"not a valid tar.gz archive ({exc})") from None


def _extract_zip(fileobj: BinaryIO, w: _Writer) -> None:
    try:
        with zipfile.ZipFile(fileobj) as zf:
            infos = zf.infolist()
            for info in infos:
                rel = _clean_name(info.filename)
                mode = info.external_attr >> 16
                if stat.S_ISLNK(mode):
                    raise RepoError("symlinks are not allowed", path=info.filename)
                if mode and (stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
                    raise RepoError("device files and FIFOs are not allowed", path=info.filename)
                if rel is None:
                    continue
                if info.is_dir():
                    w.add_dir(rel)
                    continue
                with zf.open(info) as src:  # zipfile checks the CRC; _Writer counts the real bytes
                    w.add_file(rel, src)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, NotImplementedError) as exc:
        raise RepoError(f"not a valid zip archive ({exc})") from None


def _copy_tree(src_root: Path, w: _Writer) -> None:
    """A folder of the model store, with the same checks as an archive (lstat: links are never followed)."""
    for dirpath, dirnames, filenames in os.walk(src_root, followlinks=False):
        base = Path(dirpath)
        for name in sorted(dirnames) + sorted(filenames):
            p = base / name
            rel = p.relative_to(src_root).as_posix()
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                raise RepoError("symlinks are not allowed", path=rel)
            if stat.S_ISDIR(st.st_mode):
                w.add_dir(rel)
            elif stat.S_ISREG(st.st_mode):
                if st.st_nlink > 1:
                    raise RepoError("hard links are not allowed", path=rel)
                with open(p, "rb") as fh:
                    w.add_file(rel, fh)
            else:
                raise RepoError("device files and FIFOs are not allowed", path=rel)


# --------------------------------------------------------------------------------------------------
# Layout and config checks
# --------------------------------------------------------------------------------------------------

def _host_path(value: str) -> bool:
    v = value.strip()
    if v.startswith(MODEL_DIR_VAR):
        v = v[len(MODEL_DIR_VAR):].lstrip("/")
        return ".." in v.split("/")
    return (v.startswith(("/", "~", "file:")) or bool(re.match(r"^[A-Za-z]:[\\/]", v))
            or ".." in re.split(r"[\\/]", v))


def _model_root(root: Path) -> Path:
    """The folder holding the models: the archive's root, or its single wrapping folder."""
    entries = [p for p in root.iterdir() if not p.name.startswith(".")]
    if any((p / triton.CONFIG_FILE).is_file() for p in entries if p.is_dir()):
        return root
    if len(entries) == 1 and entries[0].is_dir():
        inner = entries[0]
        if any((p / triton.CONFIG_FILE).is_file() for p in inner.iterdir() if p.is_dir()):
            return inner
    raise RepoError("no model found: a Triton repository holds <model>/config.pbtxt and <model>/<version>/ folders")


def _tensor_json(t: triton.TensorSpec) -> dict:
    return {"name": t.name, "data_type": t.data_type, "dims": list(t.dims)}


def _check_model(folder: Path, rel: str) -> RepoModel:
    name = folder.name
    if not triton.MODEL_NAME_RE.match(name):
        raise RepoError("a model folder's name is 1 to 64 characters from a-z A-Z 0-9 _ -", path=rel)
    cfg_rel = f"{rel}/{triton.CONFIG_FILE}"
    try:
        text = (folder / triton.CONFIG_FILE).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise RepoError("config.pbtxt is not UTF-8 text", path=cfg_rel) from None
    try:
        cfg = triton.parse_config(text)
    except ValueError as exc:
        raise RepoError(f"not a valid Triton model configuration: {exc}", path=cfg_rel) from None
    msg = cfg.message
    if cfg.name not in (None, name):
        raise RepoError(f"name {cfg.name!r} does not match its folder {name!r}", path=cfg_rel)
    backend = cfg.backend or PLATFORM_BACKENDS.get(cfg.platform or "")
    if cfg.backend and cfg.platform and cfg.platform not in PLATFORM_BACKENDS:
        backend = None
    if backend not in KNOWN_BACKENDS:
        raise RepoError(f"backend {cfg.backend or cfg.platform or '(none)'!r} is not served; allowed: "
                        f"{', '.join(KNOWN_BACKENDS)}", path=cfg_rel)
    for i, g in enumerate(msg.instance_group):
        if list(g.gpus) not in ([], [0]):
            raise RepoError(f"instance_group[{i}].gpus {list(g.gpus)} : a slice has one device, gpus must be "
                            "empty or [0]", path=cfg_rel)
        if g.count > 64:
            raise RepoError(f"instance_group[{i}].count {g.count} is more than 64", path=cfg_rel)
        if g.host_policy:
            raise RepoError(f"instance_group[{i}].host_policy is not allowed", path=cfg_rel)
    for key, value in msg.parameters.items():
        if _host_path(value.string_value):
            raise RepoError(f"parameters[{key!r}] names a host path ({value.string_value!r}); only paths inside "
                            f"the model folder ({MODEL_DIR_VAR}/...) are allowed", path=cfg_rel)
    if msg.default_model_filename and ("/" in msg.default_model_filename or _host_path(msg.default_model_filename)):
        raise RepoError("default_model_filename must be a file name inside the version folder", path=cfg_rel)
    if msg.HasField("model_repository_agents") and msg.model_repository_agents.agents:
        raise RepoError("model_repository_agents are not allowed", path=cfg_rel)
    versions = sorted(int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit() and int(p.name) > 0)
    if not versions:
        raise RepoError("no version folder (e.g. 1/) with the model's files", path=rel)
    want = msg.default_model_filename or DEFAULT_MODEL_FILES.get(backend)
    if want and not (folder / str(versions[-1]) / want).is_file():
        raise RepoError(f"the {backend} backend needs {want} in version {versions[-1]}",
                        path=f"{rel}/{versions[-1]}/{want}")
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    steps = [s.model_name for s in msg.ensemble_scheduling.step] if backend == "ensemble" else []
    return RepoModel(name=name, backend=backend, max_batch_size=cfg.max_batch_size,
                     inputs=[_tensor_json(t) for t in cfg.inputs], outputs=[_tensor_json(t) for t in cfg.outputs],
                     versions=versions, size_bytes=size, memory_mb=cfg.memory_mb, steps=steps,
                     decoupled=cfg.decoupled)


def validate_tree(root: Path) -> tuple[Path, Repo]:
    """Validate an unpacked repository; returns (the folder holding the models, its description)."""
    base = _model_root(root)
    prefix = base.relative_to(root).as_posix()
    models = []
    for p in sorted(base.iterdir()):
        rel = p.name if prefix == "." else f"{prefix}/{p.name}"
        if p.is_dir() and (p / triton.CONFIG_FILE).is_file():
            models.append(_check_model(p, rel))
        elif not p.name.startswith("."):
            raise RepoError("only model folders (<model>/config.pbtxt) belong at the top of the repository", path=rel)
    names = {m.name for m in models}
    for m in models:
        for s in m.steps:
            if s not in names:
                raise RepoError(f"ensemble step model {s!r} is not in the repository", path=f"{m.name}/config.pbtxt")
    files = sum(1 for p in base.rglob("*") if p.is_file())
    return base, Repo(models=models, file_count=files, size_bytes=sum(m.size_bytes for m in models))


def kind_of(head: bytes, filename: str = "") -> str:
    if head[:4] == b"PK\x03\x04" or head[:4] == b"PK\x05\x06":
        return "zip"
    if head[:2] == b"\x1f\x8b" or filename.endswith((".tar", ".tar.gz", ".tgz")):
        return "tar"
    raise RepoError("the archive must be a .tar.gz (or .tgz) or a .zip file", path=filename or None)


_Validated = TypeVar("_Validated")


@overload
def import_repository(source: BinaryIO | Path, dest: Path, limits: Limits, *, filename: str = "",
                      validate: None = None) -> Repo: ...


@overload
def import_repository(source: BinaryIO | Path, dest: Path, limits: Limits, *, filename: str = "",
                      validate: Callable[[Path], tuple[Path, _Validated]]) -> _Validated: ...


def import_repository(source: BinaryIO | Path, dest: Path, limits: Limits, *, filename: str = "",
                      validate: Callable[[Path], tuple[Path, object]] | None = None) -> object:
    """Unpack ``source`` (an archive file object, or a folder/archive path of the model store) and validate it
    (``validate``: ``validate_tree`` for a Triton repository, ``validate_adapter`` for a LoRA adapter); on
    success it lies at ``dest`` (created), on any refusal nothing is left behind."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.staging-", dir=dest.parent))
    try:
        w = _Writer(staging / "x", limits)
        w.root.mkdir()
        if isinstance(source, Path) and source.is_dir():
            _copy_tree(source, w)
        else:
            fh = open(source, "rb") if isinstance(source, Path) else source
            try:
                head = fh.read(4)
                fh.seek(0)
                (_extract_zip if kind_of(head, filename or str(source)) == "zip" else _extract_tar)(fh, w)
            finally:
                if isinstance(source, Path):
                    fh.close()
        base, repo = (validate or validate_tree)(w.root)
        for dirpath, _dirs, files in os.walk(base):  # Tessera's own: a tenant's model on the node never reads it
            Path(dirpath).chmod(0o700)
            for f in files:
                (Path(dirpath) / f).chmod(0o600)
        os.rename(base, dest)
        return repo
    finally:
        shutil.rmtree(staging, ignore_errors=True)


LORA_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
LORA_MAX_RANK = 512


@dataclass
class Adapter:
    rank: int
    base_model: str  # base_model_name_or_path of adapter_config.json (informational)
    target_modules: list[str]
    file_count: int
    size_bytes: int


def validate_adapter(root: Path) -> tuple[Path, Adapter]:
    """A LoRA adapter in PEFT's layout: ``adapter_config.json`` (``r``, ``target_modules``) and
    ``adapter_model.safetensors`` (or ``.bin``); a single wrapping folder is allowed."""
    base = root
    entries = [p for p in root.iterdir() if not p.name.startswith(".")]
    if not (root / "adapter_config.json").is_file() and len(entries) == 1 and entries[0].is_dir():
        base = entries[0]
    cfg_path = base / "adapter_config.json"
    if not cfg_path.is_file():
        raise RepoError("no adapter_config.json: a LoRA adapter is PEFT's adapter_config.json + adapter_model.*")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RepoError(f"not valid JSON ({exc})", path="adapter_config.json") from None
    rank = cfg.get("r") if isinstance(cfg, dict) else None
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= LORA_MAX_RANK:
        raise RepoError(f"r (the LoRA rank) must be an integer from 1 to {LORA_MAX_RANK}", path="adapter_config.json")
    if not any((base / f).is_file() for f in LORA_WEIGHT_FILES):
        raise RepoError(f"no {' or '.join(LORA_WEIGHT_FILES)}")
    files = [p for p in base.rglob("*") if p.is_file()]
    modules = cfg.get("target_modules") or []
    return base, Adapter(rank=rank, base_model=str(cfg.get("base_model_name_or_path") or "")[:300],
                         target_modules=[str(m) for m in modules] if isinstance(modules, list) else [str(modules)],
                         file_count=len(files), size_bytes=sum(p.stat().st_size for p in files))


def copy_models(src: Path, repo_dir: Path, names: list[str]) -> None:
    """Copy the named model folders of a stored repository into a slice's model repository (each replaced whole,
    staged then renamed, like ``triton.write_repository``)."""
    repo_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        if not triton.MODEL_NAME_RE.match(name):
            raise ValueError(f"bad model name {name!r}")
        staging = Path(tempfile.mkdtemp(prefix=f".{name}.tessera-new-", dir=repo_dir))
        shutil.rmtree(staging)
        shutil.copytree(src / name, staging, symlinks=True)
        for dirpath, _dirs, files in os.walk(staging):
            Path(dirpath).chmod(0o755)
            for f in files:
                (Path(dirpath) / f).chmod(0o644)
        target = repo_dir / name
        if target.exists():
            triton.remove_model(repo_dir, name)
        os.rename(staging, target)


MODEL_DIR_PLACEHOLDER = "${TESSERA_MODEL_DIR}"


def write_files(repo_dir: Path, files: dict[str, str], *, copies: dict[str, str] | None = None,
                copy_dirs: dict[str, str] | None = None) -> None:
    """Write generated model folders (``{"<model>/<path>": text}``, plus files ``copies`` and whole folders
    ``copy_dirs`` (e.g. a tenant's LoRA adapters) from the model store or the upload root) into a slice's
    repository, so its server reads nothing outside it: each model folder staged whole then renamed into place;
    a no-op when the folder already holds exactly these bytes. ``${TESSERA_MODEL_DIR}`` in a text becomes the
    model folder's path on this node."""
    repo_dir = Path(repo_dir)
    repo_dir.mkdir(parents=True, exist_ok=True)
    by_model: dict[str, dict[str, bytes]] = {}
    for path, text in files.items():
        model, rel = path.split("/", 1)
        if isinstance(text, str):
            text = text.replace(MODEL_DIR_PLACEHOLDER, str(repo_dir / model))
        by_model.setdefault(model, {})[rel] = text.encode() if isinstance(text, str) else bytes(text)
    for path, src in (copies or {}).items():
        model, rel = path.split("/", 1)
        by_model.setdefault(model, {})[rel] = Path(src).read_bytes()
    for path, src in (copy_dirs or {}).items():
        model, rel = path.split("/", 1)
        src_dir = Path(src)
        for f in sorted(src_dir.rglob("*")):
            if f.is_symlink():
                raise ValueError(f"symlink in {src_dir}")
            if f.is_file():
                by_model.setdefault(model, {})[f"{rel}/{f.relative_to(src_dir).as_posix()}"] = f.read_bytes()
    for model, content in by_model.items():
        if not triton.MODEL_NAME_RE.match(model):
            raise ValueError(f"bad model name {model!r}")
        target = repo_dir / model
        if target.is_dir() and triton_repository._read_tree(target) == content:
            continue
        staging = Path(tempfile.mkdtemp(prefix=f".{model}.tessera-new-", dir=repo_dir))
        for rel, data in content.items():
            _check_rel(rel)
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            (staging / rel).write_bytes(data)
        for dirpath, _dirs, names in os.walk(staging):
            Path(dirpath).chmod(0o755)
            for name in names:
                (Path(dirpath) / name).chmod(0o644)
        if target.exists():
            triton.remove_model(repo_dir, model)
        os.rename(staging, target)


def _check_rel(rel: str) -> None:
    if _clean_name(rel) != rel:
        raise ValueError(f"bad path {rel!r}")


def archive_bytes(files: dict[str, bytes | str], kind: str = "tar") -> bytes:
    """Build an archive from ``{path: content}`` (tests, the demo)."""
    buf = io.BytesIO()
    if kind == "zip":
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
            for path, content in files.items():
                zf.writestr(path, content)
    else:
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for path, content in files.items():
                data = content.encode() if isinstance(content, str) else content
                info = tarfile.TarInfo(str(PurePosixPath(path)))
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()
