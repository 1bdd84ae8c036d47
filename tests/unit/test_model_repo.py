"""Validation of a tenant's own Triton model repository (marketplace/hardware/model_repo.py): each refusal names
the file and leaves nothing behind."""

from __future__ import annotations

import io
import json
import os
import tarfile
import time
import zipfile

import pytest

from marketplace.hardware import model_repo as mr

CONFIG = '''name: "echo"
backend: "python"
max_batch_size: 0
input [ { name: "prompt" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "text" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
'''
GOOD = {"echo/config.pbtxt": CONFIG, "echo/1/model.py": "class TritonPythonModel: pass\n"}
LIMITS = mr.Limits(max_files=20, max_expanded_bytes=64 * 1024)


def load(tmp_path, files=GOOD, kind="tar", limits=LIMITS, raw=None):
    data = raw if raw is not None else mr.archive_bytes(files, kind)
    dest = tmp_path / "store" / "repo-1"
    try:
        return mr.import_repository(io.BytesIO(data), dest, limits, filename=f"up.{kind}")
    finally:
        leftovers = os.listdir(tmp_path / "store") if (tmp_path / "store").exists() else []
        assert leftovers in ([], ["repo-1"]) and not any(n.startswith(".") for n in leftovers)


def refused(tmp_path, match, **kw):
    with pytest.raises(mr.RepoError, match=match) as exc:
        load(tmp_path, **kw)
    assert not (tmp_path / "store" / "repo-1").exists()  # nothing stored
    return exc.value


@pytest.mark.parametrize("kind", ["tar", "zip"])
def test_good_repository_is_stored(tmp_path, kind):
    repo = load(tmp_path, kind=kind)
    assert [(m.name, m.backend, m.versions) for m in repo.models] == [("echo", "python", [1])]
    assert repo.models[0].inputs == [{"name": "prompt", "data_type": "TYPE_STRING", "dims": [1]}]
    assert (tmp_path / "store/repo-1/echo/1/model.py").is_file()


def test_a_single_wrapping_folder_is_accepted(tmp_path):
    repo = load(tmp_path, files={f"my-repo/{k}": v for k, v in GOOD.items()})
    assert repo.models[0].name == "echo" and (tmp_path / "store/repo-1/echo/config.pbtxt").is_file()


def _tar(members):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _info(name, type_=tarfile.REGTYPE, data=b"", linkname=""):
    info = tarfile.TarInfo(name)
    info.type, info.size, info.linkname = type_, len(data) if type_ == tarfile.REGTYPE else 0, linkname
    return info, data if type_ == tarfile.REGTYPE else None


def _with(*extra):
    return _tar([_info(k, data=v.encode()) for k, v in GOOD.items()] + list(extra))


def test_path_traversal(tmp_path):
    e = refused(tmp_path, "path traversal", raw=_with(_info("echo/../../etc/cron.d/x", data=b"x")))
    assert e.path == "echo/../../etc/cron.d/x"


def test_absolute_path(tmp_path):
    refused(tmp_path, "absolute", raw=_with(_info("/etc/passwd", data=b"x")))
    refused(tmp_path, "absolute", files={**GOOD, "C:/x": "x"}, kind="zip")


def test_symlink_tar_and_zip(tmp_path):
    refused(tmp_path, "symlinks", raw=_with(_info("echo/1/link", tarfile.SYMTYPE, linkname="/etc/shadow")))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for k, v in GOOD.items():
            zf.writestr(k, v)
        info = zipfile.ZipInfo("echo/1/link")
        info.external_attr = (0o120777 << 16)
        zf.writestr(info, "/etc/shadow")
    refused(tmp_path, "symlinks", raw=buf.getvalue(), kind="zip")


def test_hard_link(tmp_path):
    refused(tmp_path, "hard links", raw=_with(_info("echo/1/h", tarfile.LNKTYPE, linkname="echo/1/model.py")))


@pytest.mark.parametrize("type_", [tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE])
def test_device_files(tmp_path, type_):
    refused(tmp_path, "device files", raw=_with(_info("echo/1/dev", type_)))


def test_too_many_files(tmp_path):
    files = {**GOOD, **{f"echo/1/f{i}.txt": "x" for i in range(25)}}
    assert refused(tmp_path, "too many files", files=files).path.startswith("echo/1/f")


def test_archive_bomb_counts_real_bytes(tmp_path):
    bomb = {**GOOD, "echo/1/zeros.bin": b"\0" * (1024 * 1024)}  # 1 MiB of zeros: compresses to ~1 KiB
    data = mr.archive_bytes(bomb, "zip")
    assert len(data) < 10_000
    refused(tmp_path, "expanded-size limit", raw=data, kind="zip")
    refused(tmp_path, "expanded-size limit", files=bomb)


def test_not_an_archive(tmp_path):
    refused(tmp_path, "must be a .tar.gz", raw=b"hello world", kind="txt")
    refused(tmp_path, "not a valid zip", raw=b"PK\x03\x04garbage", kind="zip")


def test_config_parsed_with_triton_schema(tmp_path):
    e = refused(tmp_path, "not a valid Triton model configuration",
                files={**GOOD, "echo/config.pbtxt": CONFIG + "max_batch_sise: 4\n"})
    assert e.path == "echo/config.pbtxt"


def test_backend_not_served(tmp_path):
    refused(tmp_path, "backend 'tensorflow' is not served",
            files={**GOOD, "echo/config.pbtxt": CONFIG.replace('"python"', '"tensorflow"')})


def test_instance_group_limited_to_one_device(tmp_path):
    cfg = CONFIG.replace("count: 1 kind: KIND_CPU", "count: 1 kind: KIND_GPU gpus: [ 0, 1 ]")
    refused(tmp_path, r"gpus \[0, 1\]", files={**GOOD, "echo/config.pbtxt": cfg})
    ok = CONFIG.replace("count: 1 kind: KIND_CPU", "count: 2 kind: KIND_GPU gpus: [ 0 ]")
    assert load(tmp_path, files={**GOOD, "echo/config.pbtxt": ok}).models[0].name == "echo"


@pytest.mark.parametrize("value", ["/opt/conda/envs/x.tar.gz", "~/.ssh/id_rsa", "../../other/model",
                                   "$$TRITON_MODEL_DIRECTORY/../../x", "file:///etc"])
def test_no_host_paths_in_parameters(tmp_path, value):
    cfg = CONFIG + f'parameters {{ key: "EXECUTION_ENV_PATH" value {{ string_value: "{value}" }} }}\n'
    refused(tmp_path, "host path", files={**GOOD, "echo/config.pbtxt": cfg})


def test_model_directory_parameter_is_allowed(tmp_path):
    cfg = CONFIG + ('parameters { key: "EXECUTION_ENV_PATH" '
                    'value { string_value: "$$TRITON_MODEL_DIRECTORY/env.tar.gz" } }\n')
    assert load(tmp_path, files={**GOOD, "echo/config.pbtxt": cfg}).models


def test_name_must_match_folder_and_files_must_exist(tmp_path):
    refused(tmp_path, "does not match its folder", files={**GOOD, "echo/config.pbtxt": CONFIG.replace('"echo"', '"x"')})
    refused(tmp_path, "needs model.py", files={"echo/config.pbtxt": CONFIG, "echo/1/other.py": ""})
    refused(tmp_path, "no version folder", files={"echo/config.pbtxt": CONFIG})
    refused(tmp_path, "no model found", files={"readme.txt": "hi"})


def test_ensemble_steps_must_be_in_the_repository(tmp_path):
    ens = '''name: "pipe"
platform: "ensemble"
max_batch_size: 0
input [ { name: "prompt" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "text" data_type: TYPE_STRING dims: [ 1 ] } ]
ensemble_scheduling { step [ { model_name: "MISSING" model_version: -1
  input_map { key: "prompt" value: "prompt" } output_map { key: "text" value: "text" } } ] }
'''
    refused(tmp_path, "ensemble step model 'MISSING'", files={**GOOD, "pipe/config.pbtxt": ens, "pipe/1/.keep": ""})
    repo = load(tmp_path, files={**GOOD, "pipe/config.pbtxt": ens.replace("MISSING", "echo"), "pipe/1/.keep": ""})
    assert {m.name: m.backend for m in repo.models} == {"echo": "python", "pipe": "ensemble"}


def test_model_store_folder_with_a_symlink_is_refused(tmp_path):
    src = tmp_path / "model-store" / "echo-repo"
    for k, v in GOOD.items():
        (src / k).parent.mkdir(parents=True, exist_ok=True)
        (src / k).write_text(v)
    ok = mr.import_repository(src, tmp_path / "out" / "a", LIMITS)
    assert ok.models[0].name == "echo"
    os.symlink("/etc/shadow", src / "echo/1/leak")
    with pytest.raises(mr.RepoError, match="symlinks"):
        mr.import_repository(src, tmp_path / "out" / "b", LIMITS)
    assert not (tmp_path / "out" / "b").exists()


# --- issue 28: bombs, config size, names that are not UTF-8, paths a config names ----------------------------------

def _zeros_archive(kind: str, members: int, member_bytes: int) -> bytes:
    """``members`` files of zeros in a model folder: a few KiB that expand to members x member_bytes."""
    return mr.archive_bytes({**GOOD, **{f"echo/1/zeros-{i}.bin": bytes(member_bytes) for i in range(members)}}, kind)


class _Recorder(mr._Writer):
    """The writer, recording the bytes it wrote and when it stopped."""

    written: list[int] = []

    def add_file(self, rel, src, size):
        try:
            return super().add_file(rel, src, size)
        finally:
            _Recorder.written.append(self.bytes)


@pytest.mark.parametrize("kind", ["zip", "tar"])
def test_a_bomb_stops_at_the_limit_at_once_and_leaves_nothing(tmp_path, kind, monkeypatch):
    limit = 8 * 1024 * 1024
    data = _zeros_archive(kind, members=64, member_bytes=4 * 1024 * 1024)  # 256 MiB expanded
    assert len(data) < 600_000  # the bomb: ~0.2% of what it expands to
    monkeypatch.setattr(mr, "_Writer", _Recorder)
    _Recorder.written = []
    started = time.monotonic()
    e = refused(tmp_path, "expanded-size limit", raw=data, kind=kind,
                limits=mr.Limits(max_files=100, max_expanded_bytes=limit))
    elapsed = time.monotonic() - started
    written = max(_Recorder.written, default=0)
    print(f"{kind} bomb: {len(data):,} bytes -> refused after {elapsed * 1000:.0f} ms, {written:,} bytes written "
          f"(limit {limit:,}), at {e.path}")
    assert elapsed < 3 and written <= limit  # the member that would cross the limit is never written
    if kind == "zip":
        assert written == 0  # the central directory declares it all: refused before a byte is written
    assert not any((tmp_path / "store").rglob("*"))  # staging gone too


def test_the_streaming_count_stops_a_member_longer_than_it_declared(tmp_path):
    class Endless(io.RawIOBase):
        def readable(self):
            return True

        def readinto(self, b):
            b[:] = bytes(len(b))
            return len(b)

    limit = 4 * 1024 * 1024
    w = mr._Writer(tmp_path / "x", mr.Limits(max_expanded_bytes=limit))
    (tmp_path / "x").mkdir()
    started = time.monotonic()
    with pytest.raises(mr.RepoError, match="expanded-size limit"):
        w.add_file("echo/1/endless.bin", io.BufferedReader(Endless()), 0)  # declares nothing, never ends
    assert time.monotonic() - started < 1 and w.bytes <= limit + mr.CHUNK
    assert (tmp_path / "x/echo/1/endless.bin").stat().st_size <= limit  # the crossing chunk was not written


def test_the_wall_clock_budget_stops_a_slow_unpack(tmp_path):
    class Slow(io.BytesIO):
        def read(self, n=-1):
            time.sleep(0.05)
            return super().read(n)

    data = _zeros_archive("tar", members=40, member_bytes=64 * 1024)
    dest = tmp_path / "store" / "repo-1"
    started = time.monotonic()
    with pytest.raises(mr.RepoError, match=r"took longer than 0.3 s \(the time limit\)"):
        mr.import_repository(Slow(data), dest, mr.Limits(max_files=100, max_expanded_bytes=2**30, max_seconds=0.3),
                             filename="up.tar.gz")
    assert time.monotonic() - started < 2 and not any((tmp_path / "store").rglob("*"))


@pytest.mark.parametrize("kind", ["tar", "zip"])
def test_config_pbtxt_over_the_cap_is_refused_before_it_is_parsed(tmp_path, kind, monkeypatch):
    big = CONFIG + "# padding\n" * 7000  # 70 KB
    limits = mr.Limits(max_files=20, max_expanded_bytes=1024**2, max_config_bytes=64 * 1024)
    monkeypatch.setattr(mr.triton, "parse_config", lambda text: pytest.fail("parsed"))
    needle = rf"config.pbtxt is {len(big):,} bytes; the limit is 65,536"
    e = refused(tmp_path, needle, files={**GOOD, "echo/config.pbtxt": big}, kind=kind, limits=limits)
    assert e.path == "echo/config.pbtxt"
    raw = tmp_path / "big.tar.gz"
    raw.write_bytes(mr.archive_bytes({**GOOD, "echo/config.pbtxt": big}, kind))
    with pytest.raises(mr.RepoError, match=needle):  # the headers alone show it (the web request's prescan)
        mr.prescan(raw, limits, filename=f"big.{kind}")
    folder = tmp_path / "tree" / "echo"  # and a model-store folder: its size is checked before it is read
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text(big)
    (folder / "1/model.py").write_text("")
    with pytest.raises(mr.RepoError, match=needle):
        mr.validate_tree(tmp_path / "tree", limits)


def _patched_zip(name: bytes, *, utf8_flag: bool) -> bytes:
    """A zip whose extra member is named with these exact bytes (zipfile itself writes only valid names)."""
    placeholder = "echo/1/" + "Q" * (len(name) - 7)
    data = bytearray(mr.archive_bytes({**GOOD, placeholder: "x"}, "zip"))
    for signature, flag_at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
        at = data.find(signature)
        while at >= 0:
            start = data.find(placeholder.encode(), at)
            if start - at in (30, 46):  # this header's own name
                data[start:start + len(name)] = name
                if utf8_flag:
                    data[at + flag_at] |= 0x08  # general purpose bit 11
            at = data.find(signature, at + 4)
    return bytes(data)


def _tar_named(name: bytes) -> bytes:
    return _with(_info(name.decode("utf-8", "surrogateescape"), data=b"x"))


@pytest.mark.parametrize("case,raw,kind,shown", [
    ("tar", _tar_named(b"ech\xff/config.pbtxt"), "tar", r"ech\xff/config.pbtxt"),
    ("tar folder", _tar_named(b"\xe9cho/1/model.py"), "tar", r"\xe9cho/1/model.py"),
    ("zip flagged UTF-8", _patched_zip(b"echo/1/\xff\xfe.bin", utf8_flag=True), "zip", r"echo/1/\xff\xfe.bin"),
    ("zip cp437", _patched_zip(b"echo/1/caf\x82.bin", utf8_flag=False), "zip", r"echo/1/caf\x82.bin"),
])
def test_a_name_that_is_not_utf8_is_refused_naming_the_entry_escaped(tmp_path, case, raw, kind, shown):
    e = refused(tmp_path, "not valid UTF-8", raw=raw, kind=kind)
    assert e.path == shown
    json.dumps({"archive": [str(e)]}).encode("utf-8")  # what an API answer does with it: no lone surrogates
    archive = tmp_path / f"up.{kind}"
    archive.write_bytes(raw)
    with pytest.raises(mr.RepoError, match="not valid UTF-8"):
        mr.prescan(archive, LIMITS, filename=archive.name)


def test_an_unflagged_zip_name_in_utf8_is_read_as_utf8(tmp_path):
    raw = _patched_zip("echo/1/café.bin".encode(), utf8_flag=False)  # what Info-ZIP and macOS write
    load(tmp_path, raw=raw, kind="zip")
    assert (tmp_path / "store/repo-1/echo/1/café.bin").read_bytes() == b"x"


def test_control_characters_in_a_name_are_refused(tmp_path):
    e = refused(tmp_path, "control character", raw=_with(_info("echo/1/a\nb", data=b"x")))
    assert e.path == r"echo/1/a\nb"


def _cfg(extra: str) -> dict:
    return {**GOOD, "echo/config.pbtxt": CONFIG + extra}


WARMUP = '''model_warmup [ {{ name: "w" batch_size: 1 inputs {{ key: "prompt" value: {{
  data_type: TYPE_STRING dims: [ 1 ] input_data_file: "{}" }} }} }} ]
'''


@pytest.mark.parametrize("value", ["../../../../etc/passwd", "../config.pbtxt", "/etc/passwd", "a/../../x",
                                   "missing.bin", "C:/x"])
def test_a_warmup_file_stays_inside_the_models_warmup_folder(tmp_path, value):
    e = refused(tmp_path, "input_data_file .* must name a file in the model's warmup/ folder",
                files={**_cfg(WARMUP.format(value)), "echo/warmup/prompt.bin": b"\0\0\0\1x"})
    assert e.path == "echo/config.pbtxt"


def test_a_warmup_file_in_the_warmup_folder_is_accepted(tmp_path):
    files = {**_cfg(WARMUP.format("prompt.bin")), "echo/warmup/prompt.bin": b"\0\0\0\1x"}
    assert load(tmp_path, files=files).models[0].name == "echo"
    files = {**_cfg(WARMUP.format("sub/prompt.bin")), "echo/warmup/sub/prompt.bin": b"\0\0\0\1x"}
    assert load(tmp_path / "2", files=files).models[0].name == "echo"


@pytest.mark.parametrize("extra,needle", [
    ('output [ { name: "labels" data_type: TYPE_STRING dims: [ 1 ] label_filename: "../../x" } ]\n',
     "label_filename"),
    ('sequence_batching { state [ { input_name: "s_in" output_name: "s_out" data_type: TYPE_FP32 dims: [ 1 ] '
     'initial_state [ { data_type: TYPE_FP32 dims: [ 1 ] name: "i" data_file: "../../../x" } ] } ] }\n',
     "initial_state data_file"),
    ('default_model_filename: "../model.py"\n', "default_model_filename"),
    ('cc_model_filenames { key: "9.0" value: "../../x.so" }\n', "cc_model_filenames"),
    ('runtime: "../../../../tmp/evil.so"\n', "runtime must be a file name"),
    ('model_operations { op_library_filename: "/tmp/evil.so" }\n', "model_operations"),
    ('optimization { execution_accelerators { gpu_execution_accelerator [ { name: "tensorrt" '
     'parameters { key: "trt_engine_cache_path" value: "/var/lib/other-tenant" } } ] } }\n', "names a host path"),
])
def test_every_path_a_config_names_stays_inside_the_model(tmp_path, extra, needle):
    refused(tmp_path, needle, files=_cfg(extra))


def test_a_label_file_inside_the_model_is_accepted(tmp_path):
    extra = 'output [ { name: "labels" data_type: TYPE_STRING dims: [ 1 ] label_filename: "labels.txt" } ]\n'
    assert load(tmp_path, files={**_cfg(extra), "echo/labels.txt": "cat\ndog\n"}).models[0].name == "echo"


def test_prescan_stops_at_its_budget_and_writes_nothing(tmp_path):
    archive = tmp_path / "big.tar.gz"
    archive.write_bytes(_zeros_archive("tar", members=8, member_bytes=1024 * 1024))
    limits = mr.Limits(max_files=100, max_expanded_bytes=2**30)
    assert mr.prescan(archive, limits, budget_bytes=512 * 1024) is False  # past the budget: the worker's part
    assert mr.prescan(archive, limits, budget_bytes=64 * 1024**2) is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.tar.gz"]
    with pytest.raises(mr.RepoError, match="expanded-size limit"):  # declared sizes: a bomb is a 400 at once
        mr.prescan(archive, mr.Limits(max_files=100, max_expanded_bytes=4 * 1024**2))


def test_no_message_names_a_node_path(tmp_path):
    archive = tmp_path / "deep" / "node" / "folder" / "x.archive"
    archive.parent.mkdir(parents=True)
    archive.write_bytes(b"\x1f\x8b\x08\x00garbage")  # gzip magic, then junk
    with pytest.raises(mr.RepoError) as exc:
        mr.import_repository(archive, tmp_path / "store" / "repo-1", LIMITS)
    assert "not a valid tar.gz" in str(exc.value) and str(tmp_path) not in str(exc.value)
    archive.write_bytes(b"junk")
    with pytest.raises(mr.RepoError) as exc:
        mr.import_repository(archive, tmp_path / "store" / "repo-1", LIMITS)
    assert str(exc.value) == "x.archive: the archive must be a .tar.gz (or .tgz) or a .zip file"
    text = ("load failed for model 'echo': [Errno 2] No such file: '/srv/triton/allocation-7/echo/1/model.py' "
            "(stub /opt/tritonserver/backends/python/triton_python_backend_stub, see http://docs.example/x)")
    assert mr.scrub_paths(text, {"/srv/triton/allocation-7": ""}) == (
        "load failed for model 'echo': [Errno 2] No such file: 'echo/1/model.py' (stub <node path>, see "
        "http://docs.example/x)")


def test_a_write_failure_is_the_servers_not_the_archives(tmp_path, monkeypatch):
    def full(*a, **k):
        raise OSError(28, "No space left on device", str(tmp_path / "store" / "x"))

    monkeypatch.setattr(mr.os, "rename", full)
    with pytest.raises(mr.StorageError):
        load(tmp_path)


def test_a_huge_pax_header_is_refused_before_tarfile_reads_it_into_memory(tmp_path):
    import tracemalloc

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        info, data = _info("echo/1/x", data=b"x")
        info.pax_headers = {"comment": "A" * (64 * 1024 * 1024)}  # 64 MiB that gzip makes 65 KB
        tar.addfile(info, io.BytesIO(data))
    archive = tmp_path / "pax.tar.gz"
    archive.write_bytes(buf.getvalue())
    assert archive.stat().st_size < 100_000
    tracemalloc.start()
    try:
        with pytest.raises(mr.RepoError, match="a tar header larger than 4,194,304 bytes"):
            mr.prescan(archive, LIMITS)  # the web request's part: it used to allocate ~200 MB here
        refused(tmp_path, "a tar header larger than", raw=buf.getvalue())
        assert tracemalloc.get_traced_memory()[1] < 16 * 1024 * 1024
    finally:
        tracemalloc.stop()
