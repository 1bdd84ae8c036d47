"""Triton model specs, config.pbtxt, the repository writer and the simulated backend (no DB, no server)."""

from __future__ import annotations

import os
import re

import pytest
from tritonclient.utils import InferenceServerException

from marketplace.hardware import triton as t
from marketplace.hardware.triton import (
    DynamicBatching,
    HttpTritonBackend,
    InstanceGroup,
    ModelSpec,
    PbtxtError,
    SimTritonBackend,
    TensorSpec,
    TritonBackend,
    demo_generate,
    demo_text_model,
    get_triton_backend,
    parse_config,
    remove_model,
    render_config,
    write_repository,
)


def onnx_spec(**overrides):
    kwargs = dict(
        name="resnet50",
        backend="onnxruntime",
        max_batch_size=16,
        inputs=[TensorSpec("input__0", "TYPE_FP32", [3, 224, 224])],
        outputs=[TensorSpec("output__0", "TYPE_FP32", [1000])],
        instance_group=InstanceGroup(count=2, kind="KIND_GPU", gpus=[0]),
        dynamic_batching=DynamicBatching(preferred_batch_size=[4, 8], max_queue_delay_microseconds=100),
        files={"model.onnx": b"\x08\x01fake-onnx"},
        parameters={"note": 'say "hi"\n'},
        memory_mb=2048,
    )
    kwargs.update(overrides)
    return ModelSpec(**kwargs)


# ---------------------------------------------------------------------------------------------- spec
class TestModelSpecValidation:
    def test_demo_model_is_valid_and_cpu(self):
        spec = demo_text_model()
        assert spec.name == "tiny-gen" and spec.backend == "python"
        assert spec.instance_group.kind == "KIND_CPU"
        assert [i.name for i in spec.inputs] == ["prompt", "max_tokens"]
        assert spec.inputs[0].data_type == "TYPE_STRING" and spec.inputs[1].optional
        assert [o.name for o in spec.outputs] == ["text", "input_tokens", "output_tokens"]
        assert "model.py" in spec.files

    def test_dicts_are_coerced(self):
        spec = ModelSpec(name="m", backend="python", inputs=[{"name": "x", "data_type": "TYPE_FP32", "dims": (4,)}],
                         outputs=[{"name": "y", "data_type": "TYPE_FP32", "dims": [-1]}],
                         instance_group={"count": 1, "kind": "KIND_CPU"}, max_batch_size=4,
                         dynamic_batching={"preferred_batch_size": [2]}, parameters={"flag": True, "n": 3})
        assert isinstance(spec.inputs[0], TensorSpec) and spec.inputs[0].dims == [4]
        assert isinstance(spec.instance_group, InstanceGroup)
        assert spec.dynamic_batching.preferred_batch_size == [2]
        assert spec.parameters == {"flag": "true", "n": "3"}

    @pytest.mark.parametrize("name", ["", "a" * 65, "has space", "dot.name", "slash/name", "ümlaut", "../x", None])
    def test_bad_model_names(self, name):
        with pytest.raises(ValueError, match="model name .* is invalid"):
            onnx_spec(name=name)

    @pytest.mark.parametrize("name", ["a", "A-b_9", "x" * 64, "tiny-gen"])
    def test_good_model_names(self, name):
        assert onnx_spec(name=name).name == name

    @pytest.mark.parametrize("overrides, message", [
        ({"backend": "caffe"}, "backend 'caffe' is not one of"),
        ({"max_batch_size": -1}, "max_batch_size must be an integer >= 0"),
        ({"max_batch_size": True}, "max_batch_size must be an integer"),
        ({"inputs": []}, "at least one input is required"),
        ({"outputs": []}, "at least one output is required"),
        ({"inputs": [TensorSpec("x", "TYPE_FLOAT", [1])]}, "data_type 'TYPE_FLOAT' is not one of"),
        ({"inputs": [TensorSpec("x", "TYPE_FP32", [])]}, "dims must be a non-empty list"),
        ({"inputs": [TensorSpec("x", "TYPE_FP32", [0])]}, "must be positive integers or -1"),
        ({"inputs": [TensorSpec("x", "TYPE_FP32", [-2])]}, "must be positive integers or -1"),
        ({"inputs": [TensorSpec("1x", "TYPE_FP32", [1])]}, "tensor name '1x' is invalid"),
        ({"inputs": [TensorSpec("x", "TYPE_FP32", [1]), TensorSpec("x", "TYPE_FP32", [1])]}, "duplicate input"),
        ({"outputs": [TensorSpec("y", "TYPE_FP32", [1], optional=True)]}, "cannot be optional"),
        ({"instance_group": InstanceGroup(count=0)}, "count must be an integer from 1 to 64"),
        ({"instance_group": InstanceGroup(kind="KIND_TPU")}, "kind 'KIND_TPU' is not one of"),
        ({"instance_group": InstanceGroup(kind="KIND_CPU", gpus=[0])}, "gpus is only allowed with kind KIND_GPU"),
        ({"instance_group": {"count": 1, "colour": "red"}}, "unexpected keyword argument"),
        ({"max_batch_size": 0}, "dynamic_batching needs max_batch_size >= 1"),
        ({"dynamic_batching": DynamicBatching([32])}, "preferred_batch_size 32 must be between 1 and max_batch_size"),
        ({"dynamic_batching": DynamicBatching([4, 4])}, "has duplicates"),
        ({"dynamic_batching": DynamicBatching([4], -5)}, "max_queue_delay_microseconds must be an integer >= 0"),
        ({"version": 0}, "version must be an integer >= 1"),
        ({"files": {"/etc/passwd": b"x"}}, "must stay inside the version folder"),
        ({"files": {"../up.py": b"x"}}, "must stay inside the version folder"),
        ({"files": {"a//b": b"x"}}, "must stay inside the version folder"),
        ({"files": {"a\\b": b"x"}}, "non-empty relative POSIX path"),
        ({"files": {"model.onnx": 42}}, "content must be bytes or str"),
        ({"parameters": {"bad key": "v"}}, "parameter key 'bad key' is invalid"),
        ({"parameters": {"tessera_memory_mb": "5"}}, "is reserved; set memory_mb"),
        ({"parameters": {"k": [1]}}, "parameter 'k' must be a string"),
        ({"memory_mb": -1}, "memory_mb must be an integer >= 0"),
    ])
    def test_invalid_specs(self, overrides, message):
        with pytest.raises(ValueError, match=re.escape(message) if "'" in message or "(" in message else message):
            onnx_spec(**overrides)

    def test_vllm_may_leave_io_to_autocomplete(self):
        spec = ModelSpec(name="llm", backend="vllm", files={"model.json": '{"model": "x"}'})
        assert "input [" not in render_config(spec)


# --------------------------------------------------------------------------------------------- render
class TestRenderConfig:
    def test_key_fields_parse_back(self):
        spec = onnx_spec()
        cfg = parse_config(render_config(spec))
        assert cfg.name == "resnet50" and cfg.backend == "onnxruntime" and cfg.max_batch_size == 16
        assert [(i.name, i.data_type, i.dims) for i in cfg.inputs] == [("input__0", "TYPE_FP32", [3, 224, 224])]
        assert [(o.name, o.data_type, o.dims) for o in cfg.outputs] == [("output__0", "TYPE_FP32", [1000])]
        assert cfg.instance_kind == "KIND_GPU" and cfg.instance_count == 2
        assert cfg.parameters == {"note": 'say "hi"\n', "tessera_memory_mb": "2048"}
        assert cfg.memory_mb == 2048
        msg = cfg.message
        assert list(msg.instance_group[0].gpus) == [0]
        db = msg.dynamic_batching
        assert list(db.preferred_batch_size) == [4, 8] and db.max_queue_delay_microseconds == 100

    def test_demo_config_text(self):
        text = render_config(demo_text_model())
        assert text.startswith('name: "tiny-gen"\nbackend: "python"\nmax_batch_size: 8\n')
        assert "    data_type: TYPE_STRING\n    dims: [ 1 ]\n" in text
        assert "    optional: true\n" in text
        assert "instance_group [\n  {\n    count: 1\n    kind: KIND_CPU\n  }\n]\n" in text
        assert 'parameters {\n  key: "tessera_memory_mb"\n  value: { string_value: "64" }\n}\n' in text
        cfg = parse_config(text)
        assert [i.optional for i in cfg.inputs] == [False, True]

    def test_deterministic_and_no_optional_fields_when_unset(self):
        spec = onnx_spec(dynamic_batching=None, max_batch_size=0, parameters={}, memory_mb=0,
                         instance_group=InstanceGroup())
        text = render_config(spec)
        assert text == render_config(onnx_spec(dynamic_batching=None, max_batch_size=0, parameters={}, memory_mb=0,
                                               instance_group=InstanceGroup()))
        assert "dynamic_batching" not in text and "parameters" not in text and "gpus" not in text
        assert "max_batch_size: 0\n" in text

    def test_parses_with_the_real_protobuf_schema(self):
        """Where protobuf is installed (a dev dependency via nvidia-pytriton): Triton's own ModelConfig."""
        pytest.importorskip("google.protobuf")
        model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
        from google.protobuf import text_format

        for spec in (onnx_spec(), demo_text_model()):
            msg = text_format.Parse(render_config(spec), model_config_pb2.ModelConfig())
            assert msg.name == spec.name and msg.backend == spec.backend
            assert msg.max_batch_size == spec.max_batch_size
            assert [i.name for i in msg.input] == [i.name for i in spec.inputs]
            assert msg.parameters["tessera_memory_mb"].string_value == str(spec.memory_mb)
        msg = text_format.Parse(render_config(onnx_spec()), model_config_pb2.ModelConfig())
        assert msg.parameters["note"].string_value == 'say "hi"\n'
        assert list(msg.dynamic_batching.preferred_batch_size) == [4, 8]
        assert msg.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_GPU


class TestPbtxtParser:
    """config.pbtxt is parsed with Triton's own schema (tritonclient.grpc.model_config_pb2)."""

    def test_general_syntax(self):
        cfg = parse_config("""
            # comment
            name: 'a' "b"   # adjacent strings concatenate
            max_batch_size: 0x10
            backend: "python"
            input { name: "x" data_type: TYPE_FP32 dims: [1, -1] }, input < name: "y" data_type: TYPE_INT32 dims: 3 >
            instance_group [ { kind: KIND_CPU count: 2 } ]
            parameters { key: "esc" value { string_value: "tab\\there\\101" } }
        """)
        assert cfg.name == "ab" and cfg.max_batch_size == 16 and cfg.backend == "python"
        assert [(i.name, i.data_type, i.dims) for i in cfg.inputs] == [("x", "TYPE_FP32", [1, -1]),
                                                                        ("y", "TYPE_INT32", [3])]
        assert cfg.instance_kind == "KIND_CPU" and cfg.instance_count == 2
        assert cfg.parameters == {"esc": "tab\thereA"}

    @pytest.mark.parametrize("text", ['name: "x', "input {", "name: {", "dims: [1 2]", "x y", "name:", "a: @",
                                      "max_batch_size: [1", "}", "no_such_field: 1", "max_batch_size: \"8\"",
                                      "instance_group [ { kind: KIND_TPU } ]", "input { data_type: TYPE_FP99 }"])
    def test_errors(self, text):
        with pytest.raises(PbtxtError):
            parse_config(text)


# ---------------------------------------------------------------------------------------------- write
def tree(root):
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = open(p, "rb").read()
    return out


class TestWriteRepository:
    def test_layout(self, tmp_path):
        result = write_repository(tmp_path / "repo", demo_text_model())
        assert result.changed and result.path == tmp_path / "repo" / "tiny-gen"
        assert sorted(tree(tmp_path / "repo")) == ["tiny-gen/1/model.py", "tiny-gen/config.pbtxt"]
        assert (result.path / "config.pbtxt").read_text() == render_config(demo_text_model())
        assert (result.path / "1" / "model.py").read_text() == t.DEMO_TEXT_MODEL_PY
        assert oct((result.path / "1").stat().st_mode & 0o777) == "0o755"
        assert oct((result.path / "config.pbtxt").stat().st_mode & 0o777) == "0o644"

    def test_nested_files_and_bytes(self, tmp_path):
        spec = onnx_spec(files={"model.onnx": b"\x00\xff", "assets/vocab.txt": "a\nb\n"}, version=3)
        write_repository(tmp_path, spec)
        assert tree(tmp_path / "resnet50") == {"config.pbtxt": render_config(spec).encode(),
                                               "3/model.onnx": b"\x00\xff", "3/assets/vocab.txt": b"a\nb\n"}

    def test_idempotent(self, tmp_path):
        first = write_repository(tmp_path, demo_text_model())
        before = tree(tmp_path)
        inode = os.stat(first.path).st_ino
        mtime = os.stat(first.path / "config.pbtxt").st_mtime_ns
        second = write_repository(tmp_path, demo_text_model())
        assert not second.changed and tree(tmp_path) == before
        assert os.stat(first.path).st_ino == inode  # folder not replaced
        assert os.stat(first.path / "config.pbtxt").st_mtime_ns == mtime
        assert sorted(os.listdir(tmp_path)) == ["tiny-gen"]  # no staging left behind

    def test_change_replaces_the_folder_whole(self, tmp_path):
        write_repository(tmp_path, demo_text_model(version=1))
        (tmp_path / "tiny-gen" / "1" / "stray.txt").write_text("left over")
        result = write_repository(tmp_path, demo_text_model(version=2))
        assert result.changed
        assert sorted(tree(tmp_path)) == ["tiny-gen/2/model.py", "tiny-gen/config.pbtxt"]
        assert sorted(os.listdir(tmp_path)) == ["tiny-gen"]

    def test_stray_file_makes_it_rewrite(self, tmp_path):
        write_repository(tmp_path, demo_text_model())
        (tmp_path / "tiny-gen" / "1" / "stray.txt").write_text("x")
        assert write_repository(tmp_path, demo_text_model()).changed
        assert not (tmp_path / "tiny-gen" / "1" / "stray.txt").exists()

    def test_atomic_failure_keeps_the_old_model(self, tmp_path, monkeypatch):
        write_repository(tmp_path, demo_text_model())
        before = tree(tmp_path)
        real_rename = os.rename
        calls = []

        def failing_rename(src, dst):
            calls.append((str(src), str(dst)))
            if len(calls) == 2:  # old folder moved aside, new one about to go in
                raise OSError("disk on fire")
            return real_rename(src, dst)

        monkeypatch.setattr(t.repository.os, "rename", failing_rename)
        with pytest.raises(OSError, match="disk on fire"):
            write_repository(tmp_path, demo_text_model(version=2))
        monkeypatch.undo()
        assert tree(tmp_path) == before  # old model put back, staging removed
        assert sorted(os.listdir(tmp_path)) == ["tiny-gen"]

    def test_failure_while_writing_files_leaves_nothing_partial(self, tmp_path, monkeypatch):
        monkeypatch.setattr(t.repository.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError("no space")))
        with pytest.raises(OSError, match="no space"):
            write_repository(tmp_path, demo_text_model())
        assert os.listdir(tmp_path) == []

    def test_stale_staging_is_cleaned(self, tmp_path):
        (tmp_path / ".tiny-gen.tessera-new-abc" / "1").mkdir(parents=True)
        write_repository(tmp_path, demo_text_model())
        assert sorted(os.listdir(tmp_path)) == ["tiny-gen"]

    def test_remove_model(self, tmp_path):
        write_repository(tmp_path, demo_text_model())
        write_repository(tmp_path, demo_text_model("other"))
        assert remove_model(tmp_path, "tiny-gen") is True
        assert sorted(os.listdir(tmp_path)) == ["other"]
        assert remove_model(tmp_path, "tiny-gen") is False
        with pytest.raises(ValueError, match="invalid"):
            remove_model(tmp_path, "../other")

    def test_invalid_spec_is_not_written(self, tmp_path):
        spec = demo_text_model()
        spec.max_batch_size = -3  # mutated after construction: validated again
        with pytest.raises(ValueError, match="max_batch_size"):
            write_repository(tmp_path, spec)
        assert not (tmp_path / "tiny-gen").exists()


# ------------------------------------------------------------------------------------------- demo gen
class TestDemoGenerate:
    def test_deterministic_words(self):
        assert demo_generate("hello big world", 5) == ("world big hello world big", 3, 5)
        assert demo_generate("hello big world", 5) == demo_generate("hello big world", 5)
        assert demo_generate("  a\tb \n", None) == (" ".join(["b", "a"] * 8), 2, 16)
        assert demo_generate("", 10) == ("", 0, 0)
        assert demo_generate("x", 0) == ("", 1, 0)

    @pytest.mark.parametrize("n", [-1, 1025])
    def test_bounds(self, n):
        with pytest.raises(ValueError, match="max_tokens must be between 0 and 1024"):
            demo_generate("x", n)

    def test_model_source_embeds_the_same_function(self):
        assert "def demo_generate(prompt, max_tokens=16):" in t.DEMO_TEXT_MODEL_PY
        compile(t.DEMO_TEXT_MODEL_PY, "model.py", "exec")


# ------------------------------------------------------------------------------------------------ sim
@pytest.fixture
def repo(tmp_path):
    write_repository(tmp_path, demo_text_model())
    return tmp_path


class TestSimTritonBackend:
    def test_is_a_triton_backend(self, repo):
        assert isinstance(SimTritonBackend(repo), TritonBackend)
        assert issubclass(HttpTritonBackend, TritonBackend)

    def test_lifecycle(self, repo):
        sim = SimTritonBackend(repo, clock=lambda: 1_700_000_000.0)
        assert sim.is_server_ready()
        assert sim.repository_index() == [{"name": "tiny-gen"}]
        assert not sim.is_model_ready("tiny-gen")
        sim.load_model("tiny-gen")
        assert sim.is_model_ready("tiny-gen")
        assert sim.repository_index() == [{"name": "tiny-gen", "version": "1", "state": "READY"}]
        assert sim.used_memory_mb == 64

        out = sim.infer_text("tiny-gen", "hello big world", 5)
        assert out == {"text": "world big hello world big", "input_tokens": 3, "output_tokens": 5}
        sim.infer_text("tiny-gen", "one two")
        stats = sim.statistics("tiny-gen")
        assert stats["name"] == "tiny-gen" and stats["version"] == "1"
        assert stats["inference_count"] == stats["execution_count"] == stats["success_count"] == 2
        assert stats["fail_count"] == 0 and stats["compute_infer_ns"] > 0
        assert stats["last_inference"] == 1_700_000_000_000
        assert set(t.STAT_KEYS) <= set(stats)

        metrics = sim.metrics_text()
        assert 'nv_inference_count{model="tiny-gen",version="1"} 2' in metrics
        assert 'nv_inference_request_success{model="tiny-gen",version="1"} 2' in metrics
        assert 'nv_inference_request_failure{model="tiny-gen",reason="BACKEND",version="1"} 0' in metrics
        assert "# TYPE nv_inference_count counter" in metrics
        for family in ("nv_inference_exec_count", "nv_inference_request_duration_us",
                       "nv_inference_queue_duration_us", "nv_inference_compute_infer_duration_us"):
            assert re.search(rf'^{family}{{model="tiny-gen",version="1"}} \d+$', metrics, re.MULTILINE)

        sim.unload_model("tiny-gen")
        assert not sim.is_model_ready("tiny-gen")
        assert sim.repository_index() == [{"name": "tiny-gen", "version": "1", "state": "UNAVAILABLE",
                                           "reason": "unloaded"}]
        assert "tiny-gen" not in sim.metrics_text()
        assert sim.used_memory_mb == 0
        with pytest.raises(InferenceServerException, match="'tiny-gen' has no available versions") as info:
            sim.infer_text("tiny-gen", "x")
        assert info.value.status() == "404"
        with pytest.raises(InferenceServerException, match="requested model 'tiny-gen' is not available"):
            sim.statistics("tiny-gen")
        sim.unload_model("tiny-gen")  # twice: no-op, as on the real server
        sim.unload_model("never-there")

    def test_reload_keeps_counters(self, repo):
        sim = SimTritonBackend(repo)
        sim.load_model("tiny-gen")
        sim.infer_text("tiny-gen", "a")
        sim.load_model("tiny-gen")
        assert sim.statistics("tiny-gen")["inference_count"] == 1

    def test_unknown_model(self, repo):
        sim = SimTritonBackend(repo)
        with pytest.raises(InferenceServerException) as info:
            sim.load_model("missing")
        assert info.value.status() == "500"
        assert info.value.message() == "failed to load 'missing', failed to poll from model repository"
        assert "no model folder" in info.value.debug_details()
        with pytest.raises(InferenceServerException, match="Request for unknown model: 'missing' is not found"):
            sim.infer_text("missing", "x")
        with pytest.raises(InferenceServerException, match="requested model 'missing' is not available") as info:
            sim.statistics("missing")
        assert info.value.status() == "400"
        assert not sim.is_model_ready("missing")

    def test_refuses_missing_config(self, repo):
        (repo / "tiny-gen" / "config.pbtxt").unlink()
        sim = SimTritonBackend(repo)
        with pytest.raises(InferenceServerException, match="failed to poll from model repository") as info:
            sim.load_model("tiny-gen")
        assert "config.pbtxt is missing" in info.value.debug_details()
        assert not sim.is_model_ready("tiny-gen")

    def test_refuses_unparsable_config(self, repo):
        (repo / "tiny-gen" / "config.pbtxt").write_text('name: "tiny-gen"\ninput [ { name: "x" ')
        sim = SimTritonBackend(repo)
        with pytest.raises(InferenceServerException, match="failed to poll from model repository") as info:
            sim.load_model("tiny-gen")
        assert "is not valid" in info.value.debug_details()
        assert sim.repository_index() == [{"name": "tiny-gen"}]

    def test_refuses_name_mismatch_no_version_and_missing_model_py(self, repo):
        sim = SimTritonBackend(repo)
        cfg = repo / "tiny-gen" / "config.pbtxt"
        cfg.write_text(cfg.read_text().replace('name: "tiny-gen"', 'name: "other"'))
        with pytest.raises(InferenceServerException, match="unexpected model name 'other'"):
            sim.load_model("tiny-gen")
        write_repository(repo, demo_text_model())
        (repo / "tiny-gen" / "1" / "model.py").unlink()
        with pytest.raises(InferenceServerException, match="model.py does not exist"):
            sim.load_model("tiny-gen")
        (repo / "tiny-gen" / "1").rmdir()
        (repo / "tiny-gen" / "0").mkdir()  # folders starting with 0 are ignored
        with pytest.raises(InferenceServerException, match="at least one version must be available") as info:
            sim.load_model("tiny-gen")
        assert info.value.status() == "400"

    def test_refuses_model_larger_than_the_slice(self, tmp_path):
        write_repository(tmp_path, demo_text_model("small", memory_mb=6000))
        write_repository(tmp_path, demo_text_model("big", memory_mb=12000))
        write_repository(tmp_path, demo_text_model("huge", memory_mb=20000))
        sim = SimTritonBackend(tmp_path, memory_mb=18432)  # a 1g.18gb slice
        with pytest.raises(InferenceServerException, match=r"declared memory 20000 MB exceeds the slice's free "
                                                            r"memory \(18432 of 18432 MB\)") as info:
            sim.load_model("huge")
        assert info.value.status() == "400"
        sim.load_model("small")
        sim.load_model("big")
        sim.load_model("big")  # a reload does not count itself twice
        assert sim.used_memory_mb == 18000
        write_repository(tmp_path, demo_text_model("more", memory_mb=1000))
        with pytest.raises(InferenceServerException, match=r"free memory \(432 of 18432 MB\)"):
            sim.load_model("more")
        sim.unload_model("big")
        sim.load_model("more")
        assert sim.is_model_ready("more") and not sim.is_model_ready("huge")

    def test_failed_reload_keeps_the_old_model(self, repo):
        sim = SimTritonBackend(repo)
        sim.load_model("tiny-gen")
        (repo / "tiny-gen" / "config.pbtxt").write_text("garbage {")
        with pytest.raises(InferenceServerException):
            sim.load_model("tiny-gen")
        assert sim.is_model_ready("tiny-gen")

    def test_model_error_is_500_and_counted_like_triton(self, repo):
        sim = SimTritonBackend(repo)
        sim.load_model("tiny-gen")
        with pytest.raises(InferenceServerException, match="max_tokens must be between 0 and 1024") as info:
            sim.infer_text("tiny-gen", "x", -1)
        assert info.value.status() == "500"
        stats = sim.statistics("tiny-gen")
        assert stats["inference_count"] == stats["success_count"] == 1 and stats["fail_count"] == 0

    def test_model_without_text_interface(self, tmp_path):
        spec = onnx_spec(instance_group=InstanceGroup(kind="KIND_CPU"))
        write_repository(tmp_path, spec)
        sim = SimTritonBackend(tmp_path)
        sim.load_model("resnet50")
        with pytest.raises(InferenceServerException, match="unexpected inference input 'prompt'"):
            sim.infer_text("resnet50", "x")

    def test_server_down(self, repo):
        sim = SimTritonBackend(repo)
        sim.server_ready = False
        assert not sim.is_server_ready()
        with pytest.raises(InferenceServerException, match="failed to connect"):
            sim.load_model("tiny-gen")

    def test_sees_models_written_after_start(self, tmp_path):
        sim = SimTritonBackend(tmp_path / "repo")
        assert sim.repository_index() == []
        write_repository(tmp_path / "repo", demo_text_model())
        sim.load_model("tiny-gen")
        assert sim.is_model_ready("tiny-gen")


# -------------------------------------------------------------------------------------------- factory
class TestFactory:
    def test_sim_is_shared_per_repository(self, repo):
        t.reset_sim_backends()
        try:
            a = get_triton_backend("sim", repo_dir=repo)
            a.load_model("tiny-gen")
            b = get_triton_backend("sim", repo_dir=str(repo))
            assert b is a and b.is_model_ready("tiny-gen")
            assert get_triton_backend("sim", repo_dir=repo, memory_mb=100) is not a
        finally:
            t.reset_sim_backends()

    def test_http(self):
        backend = get_triton_backend("http", url="http://127.0.0.1:1")
        try:
            assert isinstance(backend, HttpTritonBackend)
            assert backend.url == "127.0.0.1:1" and backend.metrics_url == "http://127.0.0.1:8002/metrics"
            assert backend.is_server_ready() is False  # nothing listens: not ready, no exception
        finally:
            backend.close()

    def test_default_kind_from_settings(self, repo, settings):
        settings.TESSERA_TRITON_BACKEND = "sim"
        assert isinstance(get_triton_backend(repo_dir=repo), SimTritonBackend)
        t.reset_sim_backends()

    @pytest.mark.parametrize("kwargs, message", [
        ({"kind": "grpc"}, "unknown Triton backend 'grpc'"),
        ({"kind": "http"}, "needs url"),
        ({"kind": "sim"}, "needs repo_dir"),
    ])
    def test_errors(self, kwargs, message):
        with pytest.raises(ValueError, match=message):
            get_triton_backend(**kwargs)

    def test_statistics_flattening(self):
        raw = {"name": "m", "version": "2", "last_inference": 5, "inference_count": 7, "execution_count": 3,
               "inference_stats": {"success": {"count": 6, "ns": 100}, "fail": {"count": 1, "ns": 9},
                                   "queue": {"count": 6, "ns": 10}, "compute_infer": {"count": 3, "ns": 50}},
               # two executions of batch 1 and one of batch 4: execution time is what batch_stats add up to
               "batch_stats": [{"batch_size": 1, "compute_input": {"count": 2, "ns": 4},
                                "compute_infer": {"count": 2, "ns": 30}, "compute_output": {"count": 2, "ns": 2}},
                               {"batch_size": 4, "compute_infer": {"count": 1, "ns": 20}}]}
        flat = t.flatten_statistics(raw)
        assert flat == {"name": "m", "version": "2", "inference_count": 7, "execution_count": 3, "success_count": 6,
                        "fail_count": 1, "success_ns": 100, "queue_ns": 10, "compute_input_ns": 0,
                        "compute_infer_ns": 50, "compute_output_ns": 0, "execution_ns": 56, "last_inference": 5}
