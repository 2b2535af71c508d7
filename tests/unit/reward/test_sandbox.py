"""The code sandbox's security suite: every hostile program is contained and the run goes on.

Each case runs a real program in a real subprocess and asserts the status, the recorded
reason, and that the machine is unharmed: no process of the run is left (none of its uid, no
new descendant of this process), nothing was written outside the sandbox directory, the
parent's secrets did not leak, this process is alive. Both isolation modes are covered where
this machine allows them: ``bwrap`` (bubblewrap), ``namespace`` (root + unshare) and
``fallback`` (as root: under a fresh uid, with the system interpreter).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import pytest

from relayrl.reward import Sandbox, SandboxLimits, code_tests, detect_isolation
from relayrl.reward.sandbox import processes_of_uid
from relayrl.reward.sandbox.os_limits import cgroup_bases

ROOT = os.geteuid() == 0
BWRAP = detect_isolation() == "bwrap"
NAMESPACE = BWRAP or detect_isolation() == "namespace"
MODES = [
    pytest.param("bwrap", marks=pytest.mark.skipif(not BWRAP, reason="needs bubblewrap")),
    pytest.param(
        "namespace",
        marks=pytest.mark.skipif(not NAMESPACE, reason="needs root and unshare (namespaces)"),
    ),
    "fallback",
]
# the code reward uses the default interpreter, which a fresh uid cannot reach as root here
CODE_MODES = [
    *MODES[:2],
    pytest.param(
        "fallback",
        marks=pytest.mark.skipif(ROOT, reason="root fallback needs python= reachable by others"),
    ),
]
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"
LIMITS = SandboxLimits(cpu_s=1, wall_s=8, memory_mb=256, file_size_mb=8, max_processes=16)


def _descendants() -> set[int]:
    me = os.getpid()
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_bytes()
            fields = stat[stat.rindex(b")") + 2 :].split()
            if fields[0] != b"Z":
                parents[int(name)] = int(fields[1])
        except (OSError, ValueError):
            continue
    out = set()
    for pid in parents:
        p, hops = pid, 0
        while p in parents and hops < 64:
            p = parents[p]
            hops += 1
            if p == me:
                out.add(pid)
                break
    return out


def _sandbox_dirs(pid: int | None = None) -> set[str]:
    """Sandbox run dirs in the temp dir: those made by process ``pid`` (a sandbox run names
    its dir after the process that made it), or all when None. Another relayrl on the
    machine (a second test suite) makes its own: a check of this process's runs must not
    count them."""
    pattern = "relayrl-sbx-*" if pid is None else f"relayrl-sbx-{pid}-*"
    return {p.name for p in Path(tempfile.gettempdir()).glob(pattern)}


def _mounts() -> list[str]:
    """This process's mount table (mount points and sources): no run may change it."""
    with open("/proc/self/mountinfo") as f:
        return sorted(" ".join(line.split()[3:5]) for line in f)


class Unharmed:
    """Snapshot before a run; ``check(result)`` asserts nothing of the run is left."""

    def __init__(self, box_root: Path):
        self.box_root = box_root
        self.before = _descendants()
        self.dirs = _sandbox_dirs(os.getpid())
        self.mounts = _mounts()

    def check(self, result) -> None:
        deadline = time.monotonic() + 2.0
        while True:  # the kernel may take a moment to reap what was killed
            new = _descendants() - self.before
            left = processes_of_uid(result.uid) if result.uid is not None else []
            if (not new and not left) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert not new, f"processes left behind: {new}"
        assert not left, f"processes of the sandbox uid left: {left}"
        assert _mounts() == self.mounts, "the host's mount table changed"
        assert list(self.box_root.iterdir()) == [], "sandbox directory not removed"
        assert _sandbox_dirs(os.getpid()) <= self.dirs


@pytest.fixture
def box(tmp_path: Path, request: pytest.FixtureRequest):
    made: list[Path] = []

    def make(mode: str, **limits) -> tuple[Sandbox, Unharmed]:
        lim = SandboxLimits(**{**LIMITS.__dict__, **limits})
        if mode == "fallback" and ROOT:
            # as root the fallback runs the program under a fresh uid, which must be able
            # to reach the interpreter and the run directory
            root = Path(tempfile.mkdtemp(prefix="relayrl-test-boxes-", dir="/tmp"))
            os.chmod(root, 0o711)
            made.append(root)
            box = Sandbox(lim, isolation=mode, tmp_root=str(root), python=SYSTEM_PYTHON)
            return box, Unharmed(root)
        root = tmp_path / "boxes"
        root.mkdir(exist_ok=True)
        return Sandbox(lim, isolation=mode, tmp_root=str(root)), Unharmed(root)

    yield make
    for d in made:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("mode", MODES)
def test_normal_program_runs(box, mode: str) -> None:
    sb, unharmed = box(mode)
    r = sb.run(
        "import sys, os\nprint(sys.stdin.read().upper(), sys.argv[1:], open('data.txt').read())\n"
        "open('out.txt', 'w').write('ok')\nprint(os.path.exists('out.txt'))",
        stdin="hello",
        files={"data.txt": "payload"},
        argv=["a", "b"],
    )
    assert r.status == "ok" and r.reason is None and r.returncode == 0, r
    assert r.stdout == "HELLO ['a', 'b'] payload\nTrue\n"
    assert r.isolation == mode
    unharmed.check(r)


@pytest.mark.parametrize("mode", MODES)
def test_infinite_loop_hits_cpu_limit(box, mode: str) -> None:
    # a generous wall clock: on a loaded machine one CPU second can take several seconds
    sb, unharmed = box(mode, cpu_s=1, wall_s=12)
    t0 = time.monotonic()
    r = sb.run("while True:\n    pass")
    assert r.status == "cpu_limit" and "cpu limit" in r.reason, r
    assert time.monotonic() - t0 < 11
    unharmed.check(r)


@pytest.mark.parametrize("mode", MODES)
def test_sleep_past_timeout_is_killed(box, mode: str) -> None:
    # the wall clock counts the sandbox's start-up too: 5 s leaves a loaded machine time to print
    sb, unharmed = box(mode, wall_s=5)
    t0 = time.monotonic()
    r = sb.run("import time\nprint('started', flush=True)\ntime.sleep(60)")
    assert r.status == "timeout" and "timeout" in r.reason, r
    assert r.stdout == "started\n"
    assert time.monotonic() - t0 < 30  # killed at the wall clock, long before the 60 s sleep ends
    unharmed.check(r)


@pytest.mark.parametrize("mode", MODES)
def test_fork_bomb_is_contained(box, mode: str) -> None:
    sb, unharmed = box(mode, wall_s=2, max_processes=16)
    # the resilient kind: every process keeps forking and ignores the failures
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    r = sb.run(code)
    assert r.status in ("timeout", "cpu_limit", "killed"), r
    unharmed.check(r)
    # the plain kind dies on the first refused fork
    sb, unharmed = box(mode, wall_s=3, max_processes=16)
    r = sb.run("import os\nwhile True:\n    os.fork()")
    assert r.status in ("process_limit", "timeout", "cpu_limit"), r
    if r.status == "process_limit":
        assert "process limit" in r.reason
    unharmed.check(r)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "code",
    [
        "x = bytearray(8 * 1024**3)",
        "chunks = []\nwhile True:\n    chunks.append(bytearray(10**6))",
    ],
    ids=["one-big", "growing"],
)
def test_memory_bomb_hits_memory_limit(box, mode: str, code: str) -> None:
    sb, unharmed = box(mode, memory_mb=256)
    r = sb.run(code)
    assert r.status == "memory_limit" and "memory limit" in r.reason, r
    unharmed.check(r)


@pytest.mark.parametrize("mode", MODES)
def test_gigabytes_of_output_hit_file_size_limit(box, mode: str) -> None:
    sb, unharmed = box(mode, file_size_mb=8, max_output_bytes=1000)
    code = "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(4096):\n    sys.stdout.write(chunk)"
    r = sb.run(code)
    assert r.status == "output_limit" and "output limit" in r.reason, r
    assert len(r.stdout) < 1100  # only max_output_bytes are kept
    unharmed.check(r)


@pytest.mark.parametrize("mode", MODES)
def test_writing_outside_its_directory(box, tmp_path: Path, mode: str) -> None:
    sb, unharmed = box(mode)
    token = secrets.token_hex(6)
    targets = [
        str(tmp_path / f"escape-{token}"),
        f"/tmp/relayrl-escape-{token}",
        f"/var/tmp/relayrl-escape-{token}",
        f"/dev/shm/relayrl-escape-{token}",
        os.path.join(os.path.expanduser("~"), f"relayrl-escape-{token}"),
        f"/etc/relayrl-escape-{token}",
    ]
    code = (
        "import os\n"
        f"targets = {targets!r} + [os.path.abspath('../escape-{token}')]\n"
        "for t in targets:\n"
        "    try:\n"
        "        with open(t, 'w') as f:\n"
        "            f.write('escaped')\n"
        "        print('wrote', t)\n"
        "    except OSError as e:\n"
        "        print('denied', t, type(e).__name__)\n"
    )
    r = sb.run(code)
    assert r.status == "ok", r
    for t in targets:
        assert not os.path.exists(t), f"{t} was written on the host"
    assert not list(Path(tempfile.gettempdir()).glob(f"escape-{token}"))
    assert f"denied {tmp_path}" in r.stdout  # the test's own directory is out of reach
    unharmed.check(r)


@pytest.mark.parametrize("mode", MODES)
def test_reading_parent_environment_secrets(box, mode: str, monkeypatch) -> None:
    secret = "s3cr3t-" + secrets.token_hex(8)
    monkeypatch.setenv("RELAYRL_TEST_SECRET", secret)
    sb, unharmed = box(mode)
    code = (
        "import os\n"
        "print(dict(os.environ))\n"
        "for path in ['/proc/%d/environ' % os.getppid(), '/proc/1/environ', "
        f"'/proc/{os.getpid()}/environ']:\n"
        "    try:\n"
        "        print(path, open(path, 'rb').read())\n"
        "    except OSError as e:\n"
        "        print(path, 'denied', type(e).__name__)\n"
        "for pid in os.listdir('/proc'):\n"
        "    try:\n"
        "        data = open('/proc/%s/environ' % pid, 'rb').read()\n"
        "        print(pid, data)\n"
        "    except OSError:\n"
        "        pass\n"
    )
    r = sb.run(code)
    assert r.status in ("ok", "error"), r
    assert secret not in r.stdout and secret not in r.stderr
    assert "RELAYRL_TEST_SECRET" not in r.stdout
    unharmed.check(r)


@pytest.mark.parametrize("mode", MODES)
def test_network_connection_is_refused(box, mode: str) -> None:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        sb, unharmed = box(mode)
        code = (
            "import socket\n"
            "try:\n"
            f"    s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "    s.sendall(b'exfiltrated')\n"
            "    print('connected')\n"
            "except OSError as e:\n"
            "    print('blocked', type(e).__name__, e)\n"
        )
        r = sb.run(code)
        assert r.status == "ok", r
        assert r.stdout.startswith("blocked"), r.stdout
        word = {"bwrap": "refused", "namespace": "unreachable"}.get(mode, "disabled")
        assert word in r.stdout  # bwrap: its own loopback, where nobody listens
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody connected to the parent's server
        unharmed.check(r)
    finally:
        server.close()


@pytest.mark.parametrize("mode", MODES)
def test_killing_its_parent(box, mode: str) -> None:
    sb, unharmed = box(mode)
    me = os.getpid()
    code = (
        "import os, signal\n"
        f"for pid in (os.getppid(), {me}, -1, 1):\n"
        "    try:\n"
        "        os.kill(pid, signal.SIGKILL)\n"
        "        print('killed', pid)\n"
        "    except OSError as e:\n"
        "        print('refused', pid, type(e).__name__)\n"
    )
    r = sb.run(code)
    assert r.status in ("ok", "killed"), r  # whatever happened, it happened inside
    assert f"killed {me}" not in r.stdout
    os.kill(me, 0)  # still here
    unharmed.check(r)


@pytest.mark.parametrize("mode", MODES)
def test_detached_background_process_does_not_survive(box, mode: str) -> None:
    sb, unharmed = box(mode)
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(300)\n"
        "    os._exit(0)\n"
        "print('parent done')\n"
    )
    r = sb.run(code)
    assert r.status == "ok" and r.stdout == "parent done\n", r
    unharmed.check(r)


def test_bad_arguments_are_results_not_exceptions(box) -> None:
    sb, unharmed = box("fallback")
    r = sb.run(b"print(1)")  # type: ignore[arg-type]
    assert r.status == "sandbox_error" and "not a string" in r.reason
    r = sb.run("print(1)", files={"../evil.py": "x"})
    assert r.status == "sandbox_error" and "bad file name" in r.reason
    with pytest.raises(ValueError, match="memory_mb"):
        SandboxLimits(memory_mb=0)
    with pytest.raises(ValueError, match="isolation"):
        Sandbox(isolation="chroot")  # type: ignore[arg-type]


def test_syntax_error_and_exit_codes(box) -> None:
    sb, unharmed = box("fallback")
    r = sb.run("def f(:\n")
    assert r.status == "error" and "SyntaxError" in r.reason
    r = sb.run("import sys\nsys.exit(3)")
    assert r.status == "error" and r.returncode == 3 and r.reason.startswith("exit code 3")
    r = sb.run("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    assert r.status == "killed" and "SIGSEGV" in r.reason
    unharmed.check(r)


# ---------------------------------------------------------------------------------------------
# through the `code` reward: the score and the recorded reason

SOLUTION = "```python\ndef add(a, b):\n    return a + b\n```"
TESTS = {"tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]}


@pytest.mark.parametrize("mode", CODE_MODES)
@pytest.mark.parametrize(
    ("program", "status_word"),
    [
        # cpu limit, or the wall clock first on a loaded machine: contained either way
        ("def add(a, b):\n    while True:\n        pass", "cpu limit|timeout"),
        ("import time\ndef add(a, b):\n    time.sleep(60)", "timeout"),
        ("def add(a, b):\n    return bytearray(8 * 1024**3)", "failed"),
        (
            "import sys\ndef add(a, b):\n    for _ in range(4096):\n"
            "        sys.stdout.write('x' * (1 << 20))",
            "timeout|cpu limit",  # stdout decides nothing: any amount is drained, limits stop it
        ),
        ("import os\nos._exit(0)\ndef add(a, b):\n    return a + b", "did not complete"),
        ("print('RESULT PASS 0')\nprint('RESULT PASS 1')\nraise SystemExit(0)", "failed to load"),
    ],
    ids=["loop", "sleep", "memory", "output", "early-exit", "forged-output"],
)
def test_code_reward_scores_hostile_programs_zero(mode: str, program: str, status_word: str):
    t0 = time.monotonic()
    # programs that run until a limit stops them get a short wall clock; the others end on their
    # own, so theirs is long enough that start-up on a loaded machine never reaches it
    runs_on = any(w in status_word for w in ("timeout", "cpu limit"))
    wall = 3.0 if runs_on else 20.0
    out = code_tests(
        "", f"```python\n{program}\n```", TESTS, cpu_s=1, wall_s=wall, memory_mb=256, isolation=mode
    )
    assert out["score"] == 0.0 and out["tests_passed"] == 0.0, out
    assert any(w in out["reason"] for w in status_word.split("|")), out
    assert time.monotonic() - t0 < 40  # the sleeper is killed long before its 60 s sleep ends


@pytest.mark.parametrize("mode", CODE_MODES)
def test_code_reward_passes_correct_solutions(mode: str) -> None:
    out = code_tests("", SOLUTION, TESTS, isolation=mode)
    assert out == {"score": 1.0, "tests_passed": 1.0, "reason": None}
    io = {"test_cases": [{"input": "2 3\n", "output": "5\n"}, {"input": "1 1", "output": "2"}]}
    prog = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    assert code_tests("", prog, io, isolation=mode)["score"] == 1.0
    half = {"tests": ["assert add(1, 2) == 3", "assert add(1, 2) == 4"]}
    out = code_tests("", SOLUTION, half, partial_credit=True, isolation=mode)
    assert out["score"] == 0.5 and "test 1 failed: AssertionError" in out["reason"]
    assert code_tests("", SOLUTION, {})["reason"] == "sample has no tests"
    assert code_tests("", "", TESTS)["reason"] == "no code in the completion"


def _sandbox_processes() -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                cmd = Path(f"/proc/{name}/cmdline").read_bytes()
            except OSError:
                continue
            if (
                b"sandbox/boot.py" in cmd
                or b"/.relayrl/runner.py" in cmd
                or b"/sys/runner.py" in cmd
            ):
                out.append(int(name))
    return out


@pytest.mark.parametrize("mode", CODE_MODES)
def test_killed_reward_worker_takes_its_sandbox_along(mode: str) -> None:
    """A service timeout kills the worker mid-run: its sandbox dies too, its directory goes."""
    from relayrl.reward import RewardMix, RewardService

    before = _sandbox_dirs()
    # (a run killed on this machine earlier can leave its own: only new ones count)
    cgroups_before = {d for b in cgroup_bases().values() for d in b.glob("relayrl-*-*")}
    spec = {"fn": "code", "kwargs": {"cpu_s": 30, "wall_s": 30, "isolation": mode}}
    with RewardService(RewardMix([spec]), num_workers=1, timeout_s=1.5) as svc:
        fut = svc.submit_text("", "```python\nimport time\ntime.sleep(60)\n```", TESTS)
        r = fut.result(timeout=30)
        assert r.failed and "timeout" in r.error
        # The sandbox dies with its worker (asynchronously: the kernel's parent-death signal
        # reaches it after the worker is reaped) and its directory goes with the cleanup
        # that follows; both are waited for, neither is skipped.
        deadline = time.monotonic() + 5
        while (_sandbox_processes() or not _sandbox_dirs() <= before) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert _sandbox_processes() == []
        assert _sandbox_dirs() <= before
        cgroups = {d for b in cgroup_bases().values() for d in b.glob("relayrl-*-*")}
        assert not cgroups - cgroups_before


@pytest.mark.skipif(not ROOT, reason="the refusal is for root")
def test_root_fallback_refuses_what_a_fresh_uid_cannot_reach(tmp_path: Path) -> None:
    exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    r = Sandbox(LIMITS, isolation="fallback", tmp_root=str(tmp_path)).run("print(1)")
    if any(not os.stat(d).st_mode & 0o001 for d in Path(exe).parents):
        assert r.status == "sandbox_error"
        assert r.reason == (
            "fallback isolation refuses to run as root: the sandbox uid cannot reach the "
            f"interpreter {exe}; install bubblewrap or pass python="
        )
    box = Sandbox(LIMITS, isolation="fallback", tmp_root=str(tmp_path), python=SYSTEM_PYTHON)
    r = box.run("print(1)")
    assert r.status == "sandbox_error" and r.reason.startswith(
        "fallback isolation refuses to run as root: the sandbox uid cannot reach the run "
        f"directory under {tmp_path}"
    )


def test_weaker_modes_warn_once(box, caplog: pytest.LogCaptureFixture) -> None:
    from relayrl.reward.sandbox import api as sandbox_mod

    sandbox_mod._warned.discard("fallback")
    sb, _ = box("fallback")
    with caplog.at_level("WARNING", logger="relayrl.reward.sandbox"):
        sb.run("print(1)")
        sb.run("print(2)")
    warned = [r.getMessage() for r in caplog.records if "isolation 'fallback'" in r.getMessage()]
    assert warned == [sandbox_mod.WEAKER["fallback"]]


def test_boot_never_mounts_in_the_callers_namespace(tmp_path: Path) -> None:
    """The boot run outside a fresh namespace (the bug that once stacked tmpfs mounts on the
    host's /tmp) refuses before mounting anything."""
    import json
    import subprocess

    from relayrl.reward.sandbox import api as sandbox_mod

    cfg = {"mode": "namespace", "private_tmp": True, "limits": {"disk_mb": 1}, "env": {}}
    (tmp_path / "boot.json").write_text(json.dumps(cfg))
    before = _mounts()
    boot = Path(sandbox_mod.__file__).with_name("boot.py")
    # inside a private mount namespace of its own (but not pid 1 of a new pid namespace):
    # should a regression mount anything, it stays there
    wrap = ["unshare", "--mount"] if ROOT and shutil.which("unshare") else []
    r = subprocess.run(
        [*wrap, sys.executable, "-I", "-S", str(boot), str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == sandbox_mod.BOOT_FAILED
    assert r.stderr.strip() == (
        "relayrl-sandbox: boot failed: RuntimeError: namespace mode: not pid 1 of a fresh "
        "namespace, refusing to mount"
    )
    assert _mounts() == before
