"""A tenant's own Triton model repository: unpack an archive (tar.gz or zip) or copy a folder of the MSP's model
store into a staging folder, validate it, then move it into place. Pure Python (no Django).

Every refusal is a ``RepoError`` naming the file (``path``, as a tenant may be shown it: undecodable bytes and
control characters escaped) or field, and leaves nothing behind. Checked:

* archive members: names that are not UTF-8 (tar: as stored; zip: the UTF-8 flag, else the name's bytes must be
  UTF-8 — legacy code pages such as cp437 are refused, never guessed) or hold control characters, absolute paths,
  ``..`` (path traversal), symlinks, hard links, device files / FIFOs, too many entries, more expanded bytes than
  allowed (archive bombs: a member whose declared size would cross the limit is refused before it is written, and
  the bytes actually written are counted chunk by chunk as well), a wall-clock budget for the whole unpack and
  check, a zip central directory larger than the entry limit needs;
* layout: ``<model>/config.pbtxt`` and ``<model>/<version>/...`` (a single wrapping folder is allowed);
* each ``config.pbtxt``: at most ``Limits.max_config_bytes`` (checked before it is read), parsed with Triton's
  own protobuf schema (``triton.parse_model_config``): the name matches its folder, the backend (or platform) is
  one Tessera serves (``KNOWN_BACKENDS``; a tier may allow fewer, checked at deploy), every ``instance_group`` on
  the slice's one device (``gpus`` empty or ``[0]``), every file the config names inside the model folder
  (``model_warmup`` input files under ``warmup/``, output label files, sequence initial-state files under
  ``initial_state/``, ``default_model_filename`` / ``cc_model_filenames`` / ``runtime`` file names), no host
  paths in ``parameters`` or execution-accelerator parameters, no custom-op libraries or repository agents, the
  python/onnxruntime model file present, ensemble steps naming models of the same repository.

``prescan`` runs the member checks on an archive's headers only (nothing is written), within a budget: what the
web request can afford before the archive is unpacked by a worker.
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import os
import re
import shutil
import stat
import tarfile
import tempfile
import time
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, BinaryIO, TypeVar, cast, overload

from marketplace.hardware import triton
from marketplace.hardware.triton import repository as triton_repository

KNOWN_BACKENDS = ("python", "onnxruntime", "vllm", "tensorrtllm", "ensemble")
PLATFORM_BACKENDS = {"ensemble": "ensemble", "onnxruntime_onnx": "onnxruntime"}
DEFAULT_MODEL_FILES = {"python": "model.py", "onnxruntime": "model.onnx"}
MODEL_DIR_VAR = "$$TRITON_MODEL_DIRECTORY"
CHUNK = 1024 * 1024
ZIP_UTF8_FLAG = 0x800  # general purpose bit 11: the name is UTF-8
ZIP_DIRECTORY_BYTES_PER_ENTRY = 1024  # a central directory larger than this per allowed entry (+64 KiB) is refused
# Reading an archive can fail in any of these ways (corrupt gzip/deflate/xz data included).
_READ_ERRORS = (tarfile.TarError, zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, zlib.error,
                lzma.LZMAError, NotImplementedError)


def shown(name: str | bytes) -> str:
    """A file name as a tenant may be shown it: bytes that are not UTF-8 as ``\\xNN`` and control characters
    escaped (never a lone surrogate, which no response can encode)."""
    if isinstance(name, bytes):
        text = name.decode("utf-8", "backslashreplace")
    else:
        try:
            text = name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        except UnicodeEncodeError:
            text = name.encode("utf-8", "backslashreplace").decode("ascii")
    return "".join(c if c.isprintable() or c == " " else c.encode("unicode_escape").decode("ascii") for c in text)


class RepoError(ValueError):
    """A refused repository: ``message`` names the problem, ``path`` the member or file (escaped, see ``shown``),
    ``field`` the form field."""

    def __init__(self, message: str, *, path: str | bytes | None = None, field: str = "archive") -> None:
        path = shown(path) if path is not None else None
        super().__init__(f"{path}: {message}" if path else message)
        self.path, self.field = path, field


class StorageError(Exception):
    """Writing the unpacked repository failed on this machine (disk full, permissions): not the tenant's doing;
    the message may name node paths and is never shown to a tenant."""


@dataclass(frozen=True)
class Limits:
    max_files: int = 1000  # entries: files and folders
    max_expanded_bytes: int = 4 * 1024**3
    max_config_bytes: int = 1024 * 1024  # each config.pbtxt (and a LoRA adapter's adapter_config.json)
    max_seconds: float = 0.0  # wall-clock budget for unpacking and checking (0: none)


class Clock:
    """The wall-clock budget of one unpack-and-check (``Limits.max_seconds``)."""

    def __init__(self, max_seconds: float) -> None:
        self.max_seconds = max_seconds
        self.deadline = time.monotonic() + max_seconds if max_seconds > 0 else None

    def check(self) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise RepoError(f"unpacking and checking the repository took longer than {self.max_seconds:g} s "
                            "(the time limit)")


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
    """The member's relative POSIX path; ``None`` for a folder entry; ``RepoError`` if it is not UTF-8, holds a
    control character or leaves the root."""
    if "\x00" in name:
        raise RepoError("a NUL byte in the file name", path=name)
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise RepoError("the file name is not valid UTF-8", path=name) from None
    if any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in name):
        raise RepoError("a control character in the file name", path=name)
    norm = name.replace("\\", "/")
    if norm.startswith("/") or re.match(r"^[A-Za-z]:", norm):
        raise RepoError("absolute paths are not allowed", path=name)
    parts = [p for p in norm.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise RepoError("path traversal ('..') is not allowed", path=name)
    if not parts:
        return None
    return "/".join(parts)


def _is_config(rel: str) -> bool:
    """A model's config.pbtxt (``<model>/config.pbtxt``, or under one wrapping folder)."""
    parts = rel.split("/")
    return parts[-1] == triton.CONFIG_FILE and len(parts) in (2, 3)


class _Tally:
    """Entries and declared bytes of an archive against the limits, member by member, before anything of a member
    is written: a member that would cross a limit is refused at once (headers never understate what tarfile and
    zipfile will produce: both stop a member at its declared size)."""

    def __init__(self, limits: Limits) -> None:
        self.limits, self.entries, self.declared = limits, 0, 0

    def entry(self, rel: str) -> None:
        self.entries += 1
        if self.entries > self.limits.max_files:
            raise RepoError(f"too many files: more than {self.limits.max_files:,} files and folders", path=rel)

    def file(self, rel: str, size: int) -> None:
        self.entry(rel)
        if _is_config(rel) and size > self.limits.max_config_bytes:
            raise RepoError(f"config.pbtxt is {size:,} bytes; the limit is {self.limits.max_config_bytes:,}",
                            path=rel)
        self.declared += size
        if self.declared > self.limits.max_expanded_bytes:
            raise RepoError(f"the repository expands to more than {self.limits.max_expanded_bytes:,} bytes "
                            "(the expanded-size limit)", path=rel)


def _count(tally: _Tally, rel: str | None, is_dir: bool, size: int) -> None:
    if rel is None:
        return
    if is_dir:
        tally.entry(rel)
    else:
        tally.file(rel, size)


class _Writer:
    """Writes members under ``root``, counting entries and the bytes actually written (chunk by chunk) against the
    limits and the clock: the write that would cross the expanded-size limit never happens."""

    def __init__(self, root: Path, limits: Limits, clock: Clock | None = None) -> None:
        self.root, self.limits, self.clock = root, limits, clock or Clock(limits.max_seconds)
        self.tally, self.bytes = _Tally(limits), 0

    def add_dir(self, rel: str) -> None:
        self.tally.entry(rel)
        self.clock.check()
        try:
            (self.root / rel).mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise RepoError("a file and a folder of the same name", path=rel) from None
        except OSError as exc:
            raise StorageError(str(exc)) from None

    def add_file(self, rel: str, src: IO[bytes], size: int) -> None:
        """``size``: the member's declared size (checked before a byte is written)."""
        self.tally.file(rel, size)
        self.clock.check()
        target = self.root / rel
        if target.exists():
            raise RepoError("the file is in the archive twice", path=rel)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            out = open(target, "wb")
        except (FileExistsError, NotADirectoryError):
            raise RepoError("a file and a folder of the same name", path=rel) from None
        except OSError as exc:
            raise StorageError(str(exc)) from None
        with out:
            while True:
                chunk = src.read(CHUNK)
                if not chunk:
                    break
                self.bytes += len(chunk)
                if self.bytes > self.limits.max_expanded_bytes:
                    raise RepoError(f"the repository expands to more than {self.limits.max_expanded_bytes:,} "
                                    "bytes (the expanded-size limit)", path=rel)
                self.clock.check()
                try:
                    out.write(chunk)
                except OSError as exc:
                    raise StorageError(str(exc)) from None


def _tar_members(tar: tarfile.TarFile) -> Iterator[tuple[tarfile.TarInfo, str | None]]:
    """Each member with its clean name, after the checks a header allows."""
    for m in tar:
        rel = _clean_name(m.name)
        if m.issym():
            raise RepoError("symlinks are not allowed", path=m.name)
        if m.islnk():
            raise RepoError("hard links are not allowed", path=m.name)
        if m.ischr() or m.isblk() or m.isfifo() or m.isdev():
            raise RepoError("device files and FIFOs are not allowed", path=m.name)
        if not (m.isdir() or m.isfile()):
            raise RepoError("only regular files and folders are allowed", path=m.name)
        yield m, rel


TAR_MAX_READ = 4 * 1024 * 1024  # the largest single read tarfile may make (member data is read 1 MiB at a time)


class _CappedReads:
    """The decompressed tar stream, refusing any single read over ``TAR_MAX_READ``: tarfile reads a pax or GNU
    long-name header whole into memory before it yields the member, so a few KiB of gzip could otherwise make it
    allocate gigabytes (measured: a 100 KB archive holding a 100 MiB pax header took 315 MB and 1 s to list)."""

    def __init__(self, raw: BinaryIO | io.BufferedIOBase) -> None:
        self.raw = raw

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0 or size > TAR_MAX_READ:
            raise RepoError(f"a tar header larger than {TAR_MAX_READ:,} bytes (a pax or long-name header no model "
                            "repository needs)")
        return self.raw.read(size)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.raw.seek(offset, whence)

    def tell(self) -> int:
        return self.raw.tell()


def _open_tar(fileobj: BinaryIO) -> tarfile.TarFile:
    """A tar, plain or gzip/bzip2/xz-compressed, decompressed here (not by tarfile) so that its reads are capped."""
    head = fileobj.read(6)
    fileobj.seek(0)
    raw: BinaryIO | io.BufferedIOBase
    if head[:2] == b"\x1f\x8b":
        raw = gzip.GzipFile(fileobj=fileobj, mode="rb")
    elif head[:3] == b"BZh":
        raw = bz2.BZ2File(fileobj)
    elif head[:6] == b"\xfd7zXZ\x00":
        raw = lzma.LZMAFile(fileobj)
    else:
        raw = fileobj
    return tarfile.open(fileobj=cast(IO[bytes], _CappedReads(raw)), mode="r:")


def _extract_tar(fileobj: BinaryIO, w: _Writer) -> None:
    try:
        with _open_tar(fileobj) as tar:
            for m, rel in _tar_members(tar):
                if rel is None:
                    continue
                if m.isdir():
                    w.add_dir(rel)
                    continue
                src = tar.extractfile(m)
                if src is None:  # never for a regular file
                    raise RepoError("only regular files and folders are allowed", path=m.name)
                w.add_file(rel, src, m.size)
    except _READ_ERRORS as exc:
        raise RepoError(f"not a valid tar.gz archive ({_reason(exc)})") from None


# zipfile's own reader of the end of central directory record (zip64 included; private, unchanged since Python 2)
# and the record's fields it returns: total entries, central directory size.
_zip_end_record: Callable[[BinaryIO], list | None] = zipfile._EndRecData  # type: ignore[attr-defined]
_ECD_ENTRIES_TOTAL, _ECD_SIZE = 4, 5


def _open_zip(fileobj: BinaryIO, limits: Limits) -> zipfile.ZipFile:
    """The zip's central directory, read only when its entry count and size fit the limits (it is read whole
    into memory: a forged one listing millions of entries is refused from its end record)."""
    end_record = _zip_end_record(fileobj)
    if not end_record:
        raise RepoError("not a valid zip archive (no end of central directory)")
    entries, size = end_record[_ECD_ENTRIES_TOTAL], end_record[_ECD_SIZE]
    if entries > limits.max_files:
        raise RepoError(f"too many files: the archive lists {entries:,}; the limit is {limits.max_files:,} files "
                        "and folders")
    if size > limits.max_files * ZIP_DIRECTORY_BYTES_PER_ENTRY + 65536:
        raise RepoError(f"the zip's central directory is {size:,} bytes, more than {limits.max_files:,} entries "
                        "need")
    fileobj.seek(0)
    try:
        return zipfile.ZipFile(fileobj)
    except UnicodeDecodeError as exc:  # a name flagged UTF-8 that is not
        raise RepoError("the file name is not valid UTF-8 (its UTF-8 flag is set)",
                        path=bytes(exc.object)) from None


def _zip_name(info: zipfile.ZipInfo) -> str:
    """The entry's name: UTF-8 when flagged (zipfile decoded it strictly); unflagged names are read as UTF-8 too
    (what Info-ZIP, macOS and 7-Zip write) and refused when their bytes are not (cp437 and other legacy code pages
    are not guessed)."""
    if info.flag_bits & ZIP_UTF8_FLAG:
        return info.orig_filename
    raw = info.orig_filename.encode("cp437")  # zipfile decoded the bytes as cp437: this gives them back
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise RepoError("the file name is not valid UTF-8 (names in a legacy code page such as cp437 are not "
                        "accepted: re-create the archive with UTF-8 names)", path=raw) from None


def _zip_members(zf: zipfile.ZipFile) -> Iterator[tuple[zipfile.ZipInfo, str, str | None]]:
    for info in zf.infolist():
        name = _zip_name(info)
        rel = _clean_name(name)
        mode = info.external_attr >> 16
        if stat.S_ISLNK(mode):
            raise RepoError("symlinks are not allowed", path=name)
        if mode and (stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
            raise RepoError("device files and FIFOs are not allowed", path=name)
        yield info, name, rel


def _extract_zip(fileobj: BinaryIO, w: _Writer) -> None:
    try:
        with _open_zip(fileobj, w.limits) as zf:
            members = list(_zip_members(zf))
            tally = _Tally(w.limits)  # the whole directory first: a bomb is refused before a byte is written
            for info, _name, rel in members:
                _count(tally, rel, info.is_dir(), info.file_size)
            for info, _name, rel in members:
                if rel is None:
                    continue
                if info.is_dir():
                    w.add_dir(rel)
                    continue
                with zf.open(info) as src:  # zipfile stops at the declared size and checks the CRC
                    w.add_file(rel, src, info.file_size)
    except _READ_ERRORS as exc:
        raise RepoError(f"not a valid zip archive ({_reason(exc)})") from None


def _reason(exc: BaseException) -> str:
    """A read error's own words without any path (they are about the archive's bytes)."""
    text = exc.strerror if isinstance(exc, OSError) and exc.strerror and exc.filename else str(exc)
    return scrub_paths(text or type(exc).__name__)


def _copy_tree(src_root: Path, w: _Writer) -> None:
    """A folder of the model store, with the same checks as an archive (lstat: links are never followed)."""
    for dirpath, dirnames, filenames in os.walk(src_root, followlinks=False):
        base = Path(dirpath)
        dirnames.sort()
        for name in dirnames + sorted(filenames):
            p = base / name
            rel = _clean_name(p.relative_to(src_root).as_posix())
            if rel is None:
                continue
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                raise RepoError("symlinks are not allowed", path=rel)
            if stat.S_ISDIR(st.st_mode):
                w.add_dir(rel)
            elif stat.S_ISREG(st.st_mode):
                if st.st_nlink > 1:
                    raise RepoError("hard links are not allowed", path=rel)
                with open(p, "rb") as fh:
                    w.add_file(rel, fh, st.st_size)
            else:
                raise RepoError("device files and FIFOs are not allowed", path=rel)


def prescan(source: Path, limits: Limits, *, filename: str = "", budget_bytes: int = 64 * 1024**2) -> bool:
    """The member checks of an archive file from its headers alone (names, links, devices, counts, declared
    sizes, config.pbtxt sizes), writing nothing: a zip's central directory whole; a tar's headers up to
    ``budget_bytes`` into the (decompressed) stream, so that a large or bomb-like archive costs the caller at most
    that much decompression. Returns True when every member was seen. ``RepoError`` as ``import_repository``
    would raise it."""
    with open(source, "rb") as fh:
        kind = kind_of(fh.read(4), filename or source.name)
        fh.seek(0)
        if kind == "zip":
            try:
                with _open_zip(fh, limits) as zf:
                    tally = _Tally(limits)
                    for info, _name, rel in _zip_members(zf):
                        _count(tally, rel, info.is_dir(), info.file_size)
            except _READ_ERRORS as exc:
                raise RepoError(f"not a valid zip archive ({_reason(exc)})") from None
            return True
        if budget_bytes <= 0:
            return False
        try:
            with _open_tar(fh) as tar:
                tally = _Tally(limits)
                for m, rel in _tar_members(tar):
                    _count(tally, rel, m.isdir(), m.size)
                    if m.offset_data + m.size > budget_bytes:  # the next header lies past the budget
                        return False
        except _READ_ERRORS as exc:
            raise RepoError(f"not a valid tar.gz archive ({_reason(exc)})") from None
        return True


# --------------------------------------------------------------------------------------------------
# Node paths in messages
# --------------------------------------------------------------------------------------------------

# An absolute path: a "/" that starts a word (not "a/b", not "//" of a URL) and what follows up to a space,
# quote, bracket or separator.
_ABS_PATH = re.compile(r"(?<![\w.~/\-$<>)\]}*])/(?=[^\s/])[^\s'\"`,;:()\[\]{}<>]*")
NODE_PATH = "<node path>"


def scrub_paths(text: str, roots: dict[str, str] | None = None, *, any_path: bool = True) -> str:
    """``text`` as a tenant may read it: a path under a node folder of ``roots`` (``{folder: label}``) becomes
    relative to it (``label/`` in front when the label is not empty; the folder itself reads as the label, or
    ``.``), and (``any_path``) any other absolute path becomes ``<node path>`` (not for a refusal's own words,
    which quote the tenant's archive: its absolute member names and config values stay as the tenant wrote them)."""
    for root, label in sorted((roots or {}).items(), key=lambda kv: -len(kv[0])):
        root = root.rstrip("/")
        if len(root) <= 1:
            continue

        def relative(m: re.Match, label: str = label) -> str:
            if m.group(0).endswith("/"):
                return f"{label}/" if label else ""
            return label or "."

        text = re.sub(re.escape(root) + r"(?:/+|(?![\w.\-]))", relative, text)
    return _ABS_PATH.sub(NODE_PATH, text) if any_path else text


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


def _file_name(value: str) -> bool:
    """A plain file name (no folder, no '..', nothing absolute)."""
    return bool(value) and value not in (".", "..") and not re.search(r"[/\\\x00]", value) and ":" not in value[:2]


def _inside(folder: Path, sub: str, value: str) -> bool:
    """``value``, a path Triton joins to ``folder/sub``, names a regular file inside that folder (relative, no
    '..', no symlink on the way: there are none after unpacking, and resolving checks it once more)."""
    if not value or "\x00" in value or "\\" in value or value.startswith(("/", "~")) or re.match(r"^[A-Za-z]:", value):
        return False
    if ".." in value.split("/"):
        return False
    base = (folder / sub) if sub else folder
    target = base / value
    try:
        return (not target.is_symlink() and target.is_file()
                and target.resolve().is_relative_to(base.resolve()))
    except OSError:
        return False


def _check_config_paths(msg, folder: Path, cfg_rel: str) -> None:
    """Every file a config names stays inside the model folder (Triton's own rules for where it looks)."""
    for i, w in enumerate(msg.model_warmup):
        for key, inp in w.inputs.items():
            if inp.HasField("input_data_file") and not _inside(folder, "warmup", inp.input_data_file):
                raise RepoError(f"model_warmup[{i}] input {key!r}: input_data_file {shown(inp.input_data_file)!r} "
                                "must name a file in the model's warmup/ folder (relative, no '..')", path=cfg_rel)
    for o in msg.output:
        if o.label_filename and not _inside(folder, "", o.label_filename):
            raise RepoError(f"output {o.name!r}: label_filename {shown(o.label_filename)!r} must name a file in the "
                            "model folder (relative, no '..')", path=cfg_rel)
    if msg.HasField("sequence_batching"):
        for s in msg.sequence_batching.state:
            for init in s.initial_state:
                if init.HasField("data_file") and not _inside(folder, "initial_state", init.data_file):
                    raise RepoError(f"state {s.input_name!r}: initial_state data_file {shown(init.data_file)!r} must "
                                    "name a file in the model's initial_state/ folder (relative, no '..')",
                                    path=cfg_rel)
    if msg.default_model_filename and not _file_name(msg.default_model_filename):
        raise RepoError("default_model_filename must be a file name inside the version folder", path=cfg_rel)
    for cc, name in msg.cc_model_filenames.items():
        if not _file_name(name):
            raise RepoError(f"cc_model_filenames[{cc!r}] must be a file name inside the version folder",
                            path=cfg_rel)
    if msg.runtime and not _file_name(msg.runtime):
        raise RepoError("runtime must be a file name (the backend's library, or a model.py of the model)",
                        path=cfg_rel)
    if msg.HasField("model_operations") and msg.model_operations.op_library_filename:
        raise RepoError("model_operations (custom-op libraries) are not allowed: Triton loads them by a path on "
                        "the node", path=cfg_rel)
    for key, value in msg.parameters.items():
        if _host_path(value.string_value):
            raise RepoError(f"parameters[{key!r}] names a host path ({shown(value.string_value)!r}); only paths "
                            f"inside the model folder ({MODEL_DIR_VAR}/...) are allowed", path=cfg_rel)
    if msg.HasField("optimization"):
        accelerators = msg.optimization.execution_accelerators
        for group, items in (("gpu", accelerators.gpu_execution_accelerator),
                             ("cpu", accelerators.cpu_execution_accelerator)):
            for acc in items:
                for key, value in acc.parameters.items():
                    if _host_path(value):
                        raise RepoError(f"{group}_execution_accelerator {acc.name!r} parameter {key!r} names a host "
                                        f"path ({shown(value)!r})", path=cfg_rel)


def _read_config(path: Path, rel: str, limits: Limits) -> str:
    """A config file's text, its size checked before it is read."""
    size = path.stat().st_size
    if size > limits.max_config_bytes:
        raise RepoError(f"{path.name} is {size:,} bytes; the limit is {limits.max_config_bytes:,}", path=rel)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise RepoError(f"{path.name} is not UTF-8 text", path=rel) from None


def _check_model(folder: Path, rel: str, limits: Limits | None = None) -> RepoModel:
    limits = limits or Limits()
    name = folder.name
    if not triton.MODEL_NAME_RE.match(name):
        raise RepoError("a model folder's name is 1 to 64 characters from a-z A-Z 0-9 _ -", path=rel)
    cfg_rel = f"{rel}/{triton.CONFIG_FILE}"
    text = _read_config(folder / triton.CONFIG_FILE, cfg_rel, limits)
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
    _check_config_paths(msg, folder, cfg_rel)
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


def validate_tree(root: Path, limits: Limits | None = None, clock: Clock | None = None) -> tuple[Path, Repo]:
    """Validate an unpacked repository; returns (the folder holding the models, its description)."""
    limits = limits or Limits()
    clock = clock or Clock(limits.max_seconds)
    base = _model_root(root)
    prefix = base.relative_to(root).as_posix()
    models = []
    for p in sorted(base.iterdir()):
        clock.check()
        rel = p.name if prefix == "." else f"{prefix}/{p.name}"
        if p.is_dir() and (p / triton.CONFIG_FILE).is_file():
            models.append(_check_model(p, rel, limits))
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
Validate = Callable[[Path, Limits, Clock], tuple[Path, _Validated]]


@overload
def import_repository(source: BinaryIO | Path, dest: Path, limits: Limits, *, filename: str = "",
                      validate: None = None) -> Repo: ...


@overload
def import_repository(source: BinaryIO | Path, dest: Path, limits: Limits, *, filename: str = "",
                      validate: Validate[_Validated]) -> _Validated: ...


def import_repository(source: BinaryIO | Path, dest: Path, limits: Limits, *, filename: str = "",
                      validate: Validate[object] | None = None) -> object:
    """Unpack ``source`` (an archive file object, or a folder/archive path of the model store) and validate it
    (``validate``: ``validate_tree`` for a Triton repository, ``validate_adapter`` for a LoRA adapter) within
    ``limits`` (entries, expanded bytes, config sizes, wall-clock seconds); on success it lies at ``dest``
    (created), on any refusal (``RepoError``) or failure (``StorageError``) nothing is left behind."""
    dest = Path(dest)
    clock = Clock(limits.max_seconds)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.staging-", dir=dest.parent))
    except OSError as exc:
        raise StorageError(str(exc)) from None
    try:
        w = _Writer(staging / "x", limits, clock)
        w.root.mkdir()
        if isinstance(source, Path) and source.is_dir():
            _copy_tree(source, w)
        else:
            fh = open(source, "rb") if isinstance(source, Path) else source
            try:
                head = fh.read(4)
                fh.seek(0)
                kind = kind_of(head, filename or (source.name if isinstance(source, Path) else ""))
                (_extract_zip if kind == "zip" else _extract_tar)(fh, w)
            finally:
                if isinstance(source, Path):
                    fh.close()
        base, repo = (validate or validate_tree)(w.root, limits, clock)
        clock.check()
        try:
            for dirpath, _dirs, files in os.walk(base):  # Tessera's own: a tenant's model on the node never reads it
                Path(dirpath).chmod(0o700)
                for f in files:
                    (Path(dirpath) / f).chmod(0o600)
            os.rename(base, dest)
        except OSError as exc:
            raise StorageError(str(exc)) from None
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


def validate_adapter(root: Path, limits: Limits | None = None, clock: Clock | None = None) -> tuple[Path, Adapter]:
    """A LoRA adapter in PEFT's layout: ``adapter_config.json`` (``r``, ``target_modules``) and
    ``adapter_model.safetensors`` (or ``.bin``); a single wrapping folder is allowed."""
    base = root
    entries = [p for p in root.iterdir() if not p.name.startswith(".")]
    if not (root / "adapter_config.json").is_file() and len(entries) == 1 and entries[0].is_dir():
        base = entries[0]
    cfg_path = base / "adapter_config.json"
    if not cfg_path.is_file():
        raise RepoError("no adapter_config.json: a LoRA adapter is PEFT's adapter_config.json + adapter_model.*")
    text = _read_config(cfg_path, "adapter_config.json", limits or Limits())
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
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
