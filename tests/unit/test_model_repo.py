"""Validation of a tenant's own Triton model repository (marketplace/hardware/model_repo.py): each refusal names
the file and leaves nothing behind."""

from __future__ import annotations

import io
import os
import tarfile
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
