"""The sandbox's parts that need no root: kernel names, the command line it builds, its cgroup files (v1 and v2,
on a fake cgroup tree), its firewall rules and what its census reads."""

from __future__ import annotations

from pathlib import Path

import pytest

from marketplace.hardware import sandbox as sb

LIMITS = sb.Limits(memory_mib=1024, pids=256, cpu_weight=300, file_size_mib=64, tmpfs_mib=32)


def test_kernel_names_are_unique_per_installation_and_within_the_kernels_limits():
    a, b = sb.names("ab12cd", "allocation-1234567890"), sb.names("ef34gh", "allocation-1234567890")
    assert a.user == "tessera-ab12cd-1234567890" and len(a.user) <= 32  # useradd's limit
    assert len(a.host_if) <= sb.IFNAME_LEN and len(a.peer_if) <= sb.IFNAME_LEN
    assert a.host_if != b.host_if and a.table != b.table and a.cgroup != b.cgroup and a.netns != b.netns
    assert sb.names("ab12cd", "allocation-1") != sb.names("ab12cd", "allocation-2")


def test_limits_refuse_what_no_server_could_run_in():
    with pytest.raises(ValueError):
        sb.Limits(memory_mib=16, pids=256, cpu_weight=100)
    with pytest.raises(ValueError):
        sb.Limits(memory_mib=1024, pids=4, cpu_weight=100)


def _command(tmp_path: Path, **kw) -> list[str]:
    box = sb.Sandbox(installation="ab12", cgroup_root=tmp_path / "cg", state_dir=tmp_path)
    (tmp_path / "cg" / "cgroup.controllers").parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cg" / "cgroup.controllers").write_text("cpu memory pids\n")
    args = dict(uid=1234, gid=1234, argv=["/opt/tessera/triton/bin/tritonserver", "--model-repository=/models"],
                env={"PATH": "/usr/bin", "SECRET_LOOKING": "only-what-is-given"}, repo=tmp_path / "repo",
                runtime=tmp_path / "rt", binds=[tmp_path / "store", Path("/usr/lib/python3")], etc=tmp_path / "etc",
                devices=[], limits=LIMITS)
    args.update(kw)
    return box.command("allocation-7", **args)


def test_the_command_joins_the_cgroup_enters_the_namespaces_and_drops_to_the_slices_user(tmp_path):
    (tmp_path / "store").mkdir()
    cmd = _command(tmp_path)
    cg = tmp_path / "cg" / "tessera" / "ab12-allocation-7" / "cgroup.procs"
    assert cmd[:6] == ["/bin/sh", "-c", cmd[2], "sh", str(cg), "--"]  # joins before anything else runs
    assert cmd[6:11] == ["ip", "netns", "exec", sb.names("ab12", "allocation-7").netns, "bwrap"]
    for flag in ("--unshare-pid", "--unshare-ipc", "--unshare-uts", "--new-session", "--clearenv"):
        assert flag in cmd
    sep = cmd.index("--", 11)
    bwrap, rest = cmd[11:sep], cmd[sep + 1:]
    assert rest[:4] == ["prlimit", "--core=0", f"--fsize={64 << 20}", "--"]
    assert rest[4:12] == ["setpriv", "--reuid=1234", "--regid=1234", "--clear-groups", "--inh-caps=-all",
                          "--bounding-set=-all", "--no-new-privs", "--"]
    assert rest[12:] == ["/opt/tessera/triton/bin/tritonserver", "--model-repository=/models"]
    # every host path comes in read-only; the only writable places are tmpfs, sized
    binds = [(bwrap[i], bwrap[i + 1], bwrap[i + 2]) for i, a in enumerate(bwrap) if a in ("--bind", "--ro-bind",
                                                                                            "--dev-bind")]
    assert binds and all(kind == "--ro-bind" for kind, _, _ in binds)
    assert ("--ro-bind", str(tmp_path / "repo"), "/models") in binds
    assert ("--ro-bind", str(tmp_path / "rt"), sb.INNER_TRITON) in binds
    assert ("--ro-bind", str(tmp_path / "store"), str(tmp_path / "store")) in binds
    assert ("--ro-bind", str(tmp_path / "etc" / "passwd"), "/etc/passwd") in binds
    assert not any(dest in ("/", "/sys", "/run", "/var", "/root") for _, _, dest in binds)
    tmpfs = [bwrap[i + 1] for i, a in enumerate(bwrap) if a == "--tmpfs"]
    assert tmpfs == ["/tmp", "/dev/shm", sb.INNER_HOME]
    assert bwrap.count("--size") == 3 and str(32 << 20) in bwrap
    env = {bwrap[i + 1]: bwrap[i + 2] for i, a in enumerate(bwrap) if a == "--setenv"}
    assert env == {"PATH": "/usr/bin", "SECRET_LOOKING": "only-what-is-given"}
    assert "--dev-bind" not in bwrap and "/sys" not in bwrap  # no GPU here: neither devices nor /sys


def test_a_gpus_device_nodes_and_sys_come_in_only_when_there_are_any(tmp_path):
    dev = tmp_path / "nvidia0"
    dev.write_text("")
    cmd = _command(tmp_path, devices=[str(dev), "/dev/nvidia-does-not-exist"])
    assert ["--dev-bind", str(dev), str(dev)] == cmd[cmd.index("--dev-bind"):cmd.index("--dev-bind") + 3]
    assert cmd.count("--dev-bind") == 1 and ["--ro-bind", "/sys", "/sys"] == cmd[cmd.index("/sys") - 1:
                                                                                  cmd.index("/sys") + 2]


def _fake_v1(root: Path) -> None:
    for c in ("memory", "pids", "cpu"):
        (root / c).mkdir(parents=True)
        (root / c / "cgroup.procs").write_text("")


def test_cgroup_v1_limits_and_counters(tmp_path):
    _fake_v1(tmp_path)
    assert sb.Cgroups.supported(tmp_path) is None
    cg = sb.Cgroups(tmp_path, "tessera", "ab12-allocation-7")
    assert not cg.v2
    mem = tmp_path / "memory" / "tessera" / "ab12-allocation-7"
    mem.mkdir(parents=True)
    (mem / "memory.memsw.limit_in_bytes").write_text("0")
    cg.create(LIMITS)
    assert (mem / "memory.limit_in_bytes").read_text() == str(1024 << 20)
    assert (mem / "memory.memsw.limit_in_bytes").read_text() == str(1024 << 20)  # no swap beyond it
    assert (tmp_path / "pids" / "tessera" / "ab12-allocation-7" / "pids.max").read_text() == "256"
    assert (tmp_path / "cpu" / "tessera" / "ab12-allocation-7" / "cpu.shares").read_text() == str(3 * 1024)
    (mem / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    (mem / "memory.usage_in_bytes").write_text("123456")
    pids = tmp_path / "pids" / "tessera" / "ab12-allocation-7"
    (pids / "pids.events").write_text("max 17\n")
    (pids / "pids.current").write_text("88\n")
    assert cg.counters() == (3, 17, 123456, 88)
    assert [p.parent.name for p in cg.procs_files()] == ["ab12-allocation-7"] * 3


def test_cgroup_v2_limits_and_counters(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("")
    assert sb.Cgroups.supported(tmp_path) is None
    cg = sb.Cgroups(tmp_path, "tessera", "ab12-allocation-7")
    assert cg.v2
    d = tmp_path / "tessera" / "ab12-allocation-7"
    d.mkdir(parents=True)
    (d / "memory.swap.max").write_text("max")
    cg.create(LIMITS)
    assert (d / "memory.max").read_text() == str(1024 << 20) and (d / "memory.swap.max").read_text() == "0"
    assert (d / "pids.max").read_text() == "256" and (d / "cpu.weight").read_text() == "300"
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 2\noom_kill 2\n")
    (d / "memory.current").write_text("4096")
    (d / "pids.events").write_text("max 5\n")
    (d / "pids.current").write_text("70")
    assert cg.counters() == (2, 5, 4096, 70)
    assert cg.procs_files() == [d / "cgroup.procs"]


def test_a_host_without_the_controllers_says_which(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpu io\n")
    assert sb.Cgroups.supported(tmp_path) == "cgroup v2 lacks the controller(s) memory, pids"
    assert "no cgroup v1 hierarchy for memory, pids, cpu" in sb.Cgroups.supported(tmp_path / "none")


def test_host_rules_drop_what_the_slice_opens_and_dnat_only_its_ports():
    local = sb.host_rules("tessera_ab12_x", "tsabcdefh")
    assert "table ip" not in local  # loopback serving address: no NAT, clients use the inner address
    assert 'iifname "tsabcdefh" ct state established,related accept\n    iifname "tsabcdefh" drop' in local
    assert 'oifname "tsabcdefh" ct status dnat accept' in local and 'oifname "tsabcdefh" drop' in local
    remote = sb.host_rules("tessera_ab12_x", "tsabcdefh", "10.1.2.3", "10.213.0.2", (20000, 20001, 20002))
    assert remote.count("ip daddr 10.1.2.3 tcp dport { 20000, 20001, 20002 } dnat to 10.213.0.2") == 2
    assert 'oifname "tsabcdefh" ct status dnat masquerade' in remote


def test_stub_command_lines_name_their_model():
    assert sb._model_of("/models/honest/1/model.py") == "honest"
    # a model loaded from anywhere else (an override in a temp folder) never passes for a deployed one
    assert sb._model_of("/tmp/folderXYZ/1/model.py") == "/tmp/folderXYZ/1/model.py"


def test_passwd_names_only_root_and_the_slices_user(tmp_path):
    folder = sb.passwd_files(tmp_path / "etc", "tessera-ab12-7", 990, 990)
    assert (folder / "passwd").read_text().splitlines() == [
        "root:x:0:0:root:/nonexistent:/usr/sbin/nologin",
        "tessera-ab12-7:x:990:990:slice:/slice:/usr/sbin/nologin"]
    assert oct((folder / "passwd").stat().st_mode & 0o777) == "0o644"


def test_a_log_its_models_flood_is_trimmed_to_its_tail_before_the_file_limit_stops_the_server(tmp_path):
    from marketplace.hardware import runtime as rt

    work = tmp_path / "work"
    work.mkdir()
    log = work / rt.LOG_FILE
    spec = rt.ServerSpec(name="allocation-7", repo_dir=tmp_path / "repo", work_dir=work, device_uuid="MIG-x",
                         address="127.0.0.1", http_port=1, grpc_port=2, metrics_port=3, secret="s",
                         limits=sb.Limits(memory_mib=512, pids=64, cpu_weight=100, file_size_mib=4))
    with open(log, "ab") as writer:  # the server's stdout: O_APPEND, as the runtime opens it
        writer.write(b"x" * (3 << 20) + b"the last line\n")
        writer.flush()
        run = rt.ProcessRuntime(run_as_root=False)
        assert run.trim_log(spec)  # 3 MiB > half of 4 MiB
        writer.write(b"written after the trim\n")
    text = log.read_bytes()
    assert len(text) < (1 << 20) + 100 and text.startswith(b"--- earlier log trimmed by Tessera ---\n")
    assert text.endswith(b"the last line\nwritten after the trim\n")
    assert not run.trim_log(spec)
