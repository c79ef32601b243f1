"""scripts/test.sh's decisions, run on stubs: under CI (CI=true) a missing Python 3.12, a failed
install of an optional test dependency, a Python 3.12 environment that cannot be made, or a CUDA
case counted as passed on a machine without a GPU fails the run with a message naming it; a
user's run without them goes on and says what it skips. The script runs as it is, copied into a
temporary folder, with every program it calls (python, pip, cmake, ctest, dpkg) replaced by a stub
on a PATH that holds nothing else: nothing is built, installed or downloaded."""
import os
import shutil
import subprocess
import textwrap

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# What the script calls besides the stubs (coreutils and the like), linked into the stub PATH.
TOOLS = ("bash", "env", "dirname", "id", "nproc", "mkdir", "sleep", "tail", "head", "ls", "rm", "grep", "cat",
         "sed", "tr", "wc", "sort", "true", "false", "ln")

# python (PYTHON) and python3.12 (PY312): "-" prints the packages the script should install
# (STUB_MISSING); "-m pip install" fails for any argument containing STUB_FAIL; "-m pip wheel -w
# DIR" writes a wheel file into DIR; "-m venv" fails where STUB_VENV_FAILS is set; "-m pytest"
# exits with STUB_PYTEST_RC; the rest succeeds. ctest prints STUB_CTEST_LOG and exits with STUB_CTEST_RC.
PYTHON = textwrap.dedent("""\
    #!/bin/bash
    if [ "$1" = - ]; then cat > /dev/null; echo "${STUB_MISSING:-}"; exit 0; fi
    if [ "$1 $2" = "-m venv" ]; then
      [ -n "${STUB_VENV_FAILS:-}" ] && { echo "stub: venv refused"; exit 1; }
      mkdir -p "$3/bin"; ln -sf "$0" "$3/bin/python"; exit 0
    fi
    if [ "$1 $2 $3" = "-m pip install" ]; then
      for a in "$@"; do
        if [ -n "${STUB_FAIL:-}" ] && [[ "$a" == *"$STUB_FAIL"* ]]; then
          echo "ERROR: stub: no matching distribution for $a"; exit 1
        fi
      done
      exit 0
    fi
    if [ "$1 $2 $3" = "-m pip wheel" ]; then
      while [ $# -gt 0 ]; do
        if [ "$1" = -w ]; then mkdir -p "$2"; : > "$2/expertact-0.0.0-py3-none-linux_x86_64.whl"; fi
        shift
      done
      exit 0
    fi
    if [ "$1 $2" = "-m pytest" ]; then echo "stub pytest $*"; exit "${STUB_PYTEST_RC:-0}"; fi
    exit 0
    """)
CTEST = textwrap.dedent("""\
    #!/bin/bash
    if [ -n "${STUB_CTEST_LOG:-}" ]; then cat "$STUB_CTEST_LOG"; else echo "100% tests passed, 0 tests failed out of 3"; fi
    exit "${STUB_CTEST_RC:-0}"
    """)


@pytest.fixture
def script(tmp_path):
    """run(env) -> (status, stdout + stderr) of scripts/test.sh under the stubs, from a copy of the script."""
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    repo, bin_ = tmp_path / "repo", tmp_path / "bin"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "scripts", "test.sh"), repo / "scripts" / "test.sh")
    bin_.mkdir()
    for tool in TOOLS:
        path = shutil.which(tool)
        if path:
            os.symlink(path, bin_ / tool)
    stubs = {"python": PYTHON, "ctest": CTEST, "cmake": "#!/bin/bash\nexit 0\n", "dpkg": "#!/bin/bash\nexit 0\n"}
    for name, text in stubs.items():
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    (tmp_path / "pyenv").mkdir()

    def run(**env):
        base = {"PATH": str(bin_), "HOME": str(tmp_path), "PYTHON": str(bin_ / "python"),
                "PYENV_ROOT": str(tmp_path / "pyenv"), "BUILD_DIR": str(tmp_path / "build"), "RETRY_PAUSE": "0",
                "VENV312": str(tmp_path / "venv312")}
        base.update({k: str(v) for k, v in env.items()})
        r = subprocess.run(["bash", str(repo / "scripts" / "test.sh")], env=base, capture_output=True, text=True,
                           timeout=120)
        return r.returncode, r.stdout + r.stderr

    run.bin = bin_
    return run


def test_everything_there_passes(script):
    rc, out = script(PY312=script.bin / "python", CI="true")
    assert rc == 0, out
    assert "== all tests passed\n" in out and "SKIPPED" not in out, out


def test_no_python_312(script):
    """CI fails naming what would not run; a user's run says what it skips and passes."""
    rc, out = script(CI="true")
    assert rc != 0, out
    assert ("FAILED: CI=true and no Python 3.12 found (set PY312): the Megatron-Core tests (test_megatron.py, "
            "test_megatron_example.py) would not run") in out, out
    rc, out = script()
    assert rc == 0, out
    assert ("SKIPPED: the Megatron-Core tests (test_megatron.py, test_megatron_example.py): skipped, no Python 3.12 "
            "(set PY312 to one)") in out, out
    assert "== all tests passed (but for the suites skipped above)" in out, out


@pytest.mark.parametrize("name", ["deepspeed", "transformers", "torchtitan", "torchao"])
def test_an_optional_dependency_that_does_not_install(script, name):
    """Each install is tried twice, its log's end printed; then CI fails naming the package and the
    suites it serves; a user's run records them as skipped and passes."""
    py312 = script.bin / "python"
    rc, out = script(PY312=py312, CI="true", STUB_MISSING=name, STUB_FAIL=name)
    assert rc != 0, out
    assert out.count("   failed (attempt ") == 2 and f"---- the end of " in out, out
    assert f"ERROR: stub: no matching distribution for {name}" in out, out  # the failing step's own output
    assert f"FAILED: CI=true and {name} did not install" in out, out
    rc, out = script(PY312=py312, STUB_MISSING=name, STUB_FAIL=name)
    assert rc == 0, out
    assert f"skipped, {name} did not install" in out and "SKIPPED: the " in out, out


def test_a_python_312_environment_that_cannot_be_made(script):
    rc, out = script(PY312=script.bin / "python", CI="true", STUB_VENV_FAILS=1)
    assert rc != 0, out
    assert "the Python 3.12 environment could not be made" in out and "stub: venv refused" in out, out
    assert "Megatron-Core tests 1" in out, out
    rc, out = script(PY312=script.bin / "python", STUB_VENV_FAILS=1)
    assert rc == 0, out
    assert "skipped, the Python 3.12 environment could not be made" in out, out


def test_a_failing_test_suite_fails_the_run(script, tmp_path):
    """pytest's status and ctest's each fail the run, named; a failed C++ build (no ctest summary in
    its log) ends with its log's last lines, which say why."""
    py312 = script.bin / "python"
    rc, out = script(PY312=py312, STUB_PYTEST_RC=1)
    assert rc != 0 and "FAILED: pytest status 1, C++ build and ctest status 0, Megatron-Core tests 1" in out, out
    log = tmp_path / "ctest-stub.log"
    log.write_text("FAILED: tests/cpp/CMakeFiles/expertact_tests.dir/test_fp8.cpp.o\nerror: stub compile error\n")
    rc, out = script(PY312=py312, STUB_CTEST_RC=8, STUB_CTEST_LOG=log)
    assert rc != 0 and "FAILED: pytest status 0, C++ build and ctest status 8, Megatron-Core tests 0" in out, out
    assert "error: stub compile error" in out, out


def test_a_cuda_case_passed_without_a_gpu_fails_the_run(script, tmp_path):
    """On a machine without a GPU (no nvidia-smi here) a CUDA case that ctest counts as passed fails
    the run, named; the same cases skipped, and the CPU-only cases whose names say CUDA, pass."""
    lines = ["  1/4 Test  #22: CudaBuild.MissingDriverIsAClearError ....   Passed    0.03 sec",
             "  2/4 Test #487: All/CAbiRun.StridedSlicesAndByteOffset/cuda_interleaved_bf16 ....***Skipped   0.01 sec",
             "  3/4 Test #537: cuda_kernels_rows ....***Skipped   0.03 sec",
             "  4/4 Test #516: Backends/BiasTest.GluBiasAgainstFloat64/cpu ....   Passed    0.20 sec",
             "100% tests passed, 0 tests failed out of 4"]
    log = tmp_path / "ctest-stub.log"
    log.write_text("\n".join(lines) + "\n")
    rc, out = script(PY312=script.bin / "python", CI="true", STUB_CTEST_LOG=log)
    assert rc == 0 and "FAILED" not in out, out
    for passed in ("  5/5 Test #538: cuda_kernels_flat ....   Passed    0.02 sec",
                   "  5/5 Test #520: Backends/BiasTest.Refusals/cuda ....   Passed    0.01 sec"):
        log.write_text("\n".join(lines[:-1] + [passed, lines[-1]]) + "\n")
        rc, out = script(PY312=script.bin / "python", STUB_CTEST_LOG=log)
        assert rc != 0, out
        assert "FAILED: ctest counted CUDA cases as passed on a machine without a GPU" in out and passed in out, out
        assert "C++ build and ctest status 1" in out, out
