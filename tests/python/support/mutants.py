"""The mutants of docs/notes/test-mutations.md, and their runner: each mutant is the smallest edit of
the library that produces one regression the tests must catch; the runner plants it in this
checkout, rebuilds the CPU library where the edit is C++, runs the test files that should catch
it, restores the file (always, also on an interruption) and records whether a test failed
(killed) or everything passed or skipped (survived).

    python3 tests/python/support/mutants.py                 (every mutant)
    python3 tests/python/support/mutants.py NAME ...        (these mutants)
    python3 tests/python/support/mutants.py --list

Run from the repository root of a clean checkout (it refuses to start with changes under src/,
python/, include/, scripts/ or .ci/), with the CPU library built in build/cpu (the README's CPU build). The
Megatron-Core mutants run their tests in the Python 3.12 environment of scripts/test.sh
(VENV312, default ~/.cache/expertact-py312); they are recorded as not run without it. A mutant
is never committed: the runner restores the file with ``git checkout``."""
import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
BUILD = os.path.join(ROOT, "build", "cpu")
VENV312 = os.environ.get("VENV312", os.path.expanduser("~/.cache/expertact-py312"))
T = "tests/python/"
FP8_MLP = T + "test_fp8_mlp.py"
# The test files that hold a recipe's node to its oracle, by recipe (the fast selection of
# test_fp8_mlp.py: every test that runs the recipe, none of the GPU's).
_RECIPE_K = {"rowwise": "(recipe_matches or small_shapes or other_expert or promoted or two_activation) and rowwise",
             "rowwise-bf16-wgrad": "bf16_weight_gradients",
             "rowwise-promoted-wgrad": "promoted",
             "blockwise": "(recipe_matches or small_shapes or other_expert or two_activation) and blockwise"}


def _mutant(name, path, old, new, tests, what, k=None, python=None):
    return dict(name=name, path=path, old=old, new=new, tests=tests, what=what, k=k, python=python)


def _fallback(recipe):
    """The dispatch of expert_mlp runs the bf16 node for one recipe."""
    return _mutant(f"fp8-{recipe}-runs-bf16", "python/expertact/moe/__init__.py",
                   "    recipe = fp8_recipe(fp8)\n",
                   f"    recipe = fp8_recipe(fp8)\n    recipe = None if recipe == {recipe!r} else recipe\n",
                   [FP8_MLP], f'fp8="{recipe}" runs the bf16 node (expert_mlp\'s dispatch)', k=_RECIPE_K[recipe])


MUTANTS = [
    # 1. FP8 silently falls back to bf16, whole or one GEMM
    *[_fallback(r) for r in ("rowwise", "rowwise-bf16-wgrad", "rowwise-promoted-wgrad", "blockwise")],
    _mutant("fp8-node-never-taken", "python/expertact/moe/__init__.py",
            "    if recipe is not None:\n        reason = _fp8.why_not",
            "    if False:\n        reason = _fp8.why_not",
            [FP8_MLP], "every recipe runs the bf16 node (the FP8 branch of expert_mlp never taken)",
            k="recipe_matches and halves and swiglu-"),
    _mutant("fp8-gate-up-gemm-bf16", "python/expertact/moe/_fp8.py",
            "    gate_up = _mm(xa, _weight(w13, plan), offs, plan)\n",
            "    gate_up = _gemm.gmm(x, w13, offs, plan)\n",
            [FP8_MLP], "the forward's gate_up GEMM in bf16 (the five others FP8)", k=_RECIPE_K["rowwise"]),
    _mutant("fp8-dh-gemm-bf16", "python/expertact/moe/_fp8.py",
            "            dh = _mm(dya, _weight(w2.transpose(-2, -1), plan), offs, plan)\n",
            "            dh = _gemm.gmm(dy, w2.transpose(-2, -1), offs, plan)\n",
            [FP8_MLP], "the input gradient dh = dy @ w2^T in bf16", k=_RECIPE_K["blockwise"]),
    _mutant("fp8-dw2-gemm-bf16", "python/expertact/moe/_fp8.py",
            "        if need.w2 and not wgrad:\n", "        if need.w2:\n",
            [FP8_MLP], "dw2's GEMM in bf16 in every recipe (dw13's FP8)", k=_RECIPE_K["rowwise"]),
    _mutant("fp8-dw2-bf16-values-only", "python/expertact/moe/_fp8.py",
            "            dw2 = _wgrad(_h_cols(gate_up, weights, b13, offs, pads, plan, ctx.hamax), dyc, pads, plan, w2)\n",
            "            dw2 = _wgrad(_h_cols(gate_up, weights, b13, offs, pads, plan, ctx.hamax), dyc, pads, plan, w2)\n"
            "            dw2 = gmm_wgrad(activation(gate_up, weights, plan.glu, b13, offs), dy, offs, plan, like=w2)\n",
            [FP8_MLP], "dw2's FP8 GEMM still called (the count right) but its result replaced by the bf16 one",
            k=_RECIPE_K["rowwise"]),
    # 2. fast against promoted accumulation
    _mutant("promoted-wgrad-takes-fast-accum", "python/expertact/moe/_gemm.py",
            '"rowwise-promoted-wgrad": Fp8Form(blockwise=False, wgrad_fp8=True, wgrad_fast_accum=False)',
            '"rowwise-promoted-wgrad": Fp8Form(blockwise=False, wgrad_fp8=True, wgrad_fast_accum=True)',
            [FP8_MLP], '"rowwise-promoted-wgrad"\'s weight gradients with use_fast_accum=True',
            k=_RECIPE_K["rowwise-promoted-wgrad"]),
    _mutant("rowwise-wgrad-takes-promoted", "python/expertact/moe/_gemm.py",
            '"rowwise": Fp8Form(blockwise=False, wgrad_fp8=True, wgrad_fast_accum=True)',
            '"rowwise": Fp8Form(blockwise=False, wgrad_fp8=True, wgrad_fast_accum=False)',
            [FP8_MLP], '"rowwise"\'s weight gradients with use_fast_accum=False', k=_RECIPE_K["rowwise"]),
    _mutant("mm-gemms-take-promoted", "python/expertact/moe/_fp8.py",
            "    out = _gemm.scaled_gmm(a[0], w[0], a[1], w[1], offs)\n",
            "    out = _gemm.scaled_gmm(a[0], w[0], a[1], w[1], offs, fast_accum=False)\n",
            [FP8_MLP], "the four M-grouped rowwise GEMMs with use_fast_accum=False", k=_RECIPE_K["rowwise"]),
    _mutant("cuda-operator-ignores-fast-accum", "python/expertact/moe/_gemm.py",
            "                                        use_fast_accum=fast_accum)",
            "                                        use_fast_accum=True)",
            [FP8_MLP], "scaled_gmm's CUDA branch passes use_fast_accum=True whatever it is asked",
            k="fast_accum or promoted"),
    # 3. a recipe's weight gradients in FP8 where it says bf16
    _mutant("bf16-wgrad-runs-fp8-wgrad", "python/expertact/moe/_gemm.py",
            '"rowwise-bf16-wgrad": Fp8Form(blockwise=False, wgrad_fp8=False, wgrad_fast_accum=False)',
            '"rowwise-bf16-wgrad": Fp8Form(blockwise=False, wgrad_fp8=True, wgrad_fast_accum=False)',
            [FP8_MLP], '"rowwise-bf16-wgrad"\'s weight gradients as FP8 GEMMs', k=_RECIPE_K["rowwise-bf16-wgrad"]),
    _mutant("blockwise-one-k-tile-sent-as-is", "python/expertact/moe/_gemm.py",
            "        if K <= TILE:  # one K tile: both operands widened to two (_widened), once for every expert\n",
            "        if False:  # one K tile: both operands widened to two (_widened), once for every expert\n",
            [FP8_MLP], "an M-grouped blockwise GEMM of one K tile sent to torch._scaled_mm as it is (scales that "
            "torch takes for rowwise ones)", k="scaled_mm"),
    # 4. blockwise scales (C++: the tile schedule and the scale, shared by CPU and CUDA)
    _mutant("row-tile-scale-over-64-columns", "src/cpu/fp8_tiles_cpu.cpp",
            "    for (int64_t j = c0; j < c1; ++j) amax = std::fmax(amax, std::fabs(v[j]));  // NaN ignored\n",
            "    for (int64_t j = c0; j < std::min(c1, c0 + 64); ++j) amax = std::fmax(amax, std::fabs(v[j]));\n",
            [T + "test_fp8_blocks.py", FP8_MLP], "a 1 x 128 row tile's scale from the amax of its first 64 columns",
            k="not cuda"),
    _mutant("row-tile-scale-over-256-columns", "src/cpu/fp8_tiles_cpu.cpp",
            "    for (int64_t j = c0; j < c1; ++j) amax = std::fmax(amax, std::fabs(v[j]));  // NaN ignored\n",
            "    for (int64_t j = c0; j < std::min(n, c0 + 256); ++j) amax = std::fmax(amax, std::fabs(v[j]));\n",
            [T + "test_fp8_blocks.py", FP8_MLP], "a 1 x 128 row tile's scale from the amax of 256 columns (its own "
            "and the next tile's)", k="not cuda"),
    _mutant("column-tile-scale-over-64-rows", "src/cpu/fp8_tiles_cpu.cpp",
            "    for (int64_t i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(buf[i * ld + c]));\n",
            "    for (int64_t i = 0; i < std::min<int64_t>(n, 64); ++i) amax = std::fmax(amax, std::fabs(buf[i * ld + c]));\n",
            [T + "test_fp8_blocks.py", FP8_MLP], "a 128 x 1 column tile's scale from the amax of its first 64 rows",
            k="not cuda"),
    _mutant("weight-block-scale-per-row", "src/cpu/fp8_tiles_cpu.cpp",
            "              amax = std::fmax(amax, std::fabs(v));\n",
            "              if (i == 0) amax = std::fmax(amax, std::fabs(v));\n",
            [T + "test_fp8_blocks.py", FP8_MLP], "a 128 x 128 weight block's scale from its first row's amax (a "
            "per-row scale)", k="not cuda"),
    _mutant("pow2-scale-dropped", "src/core/fp8.h",
            "  return math::as_float(math::as_bits(s) & 0x7f800000u);  // s is normal or 0 here\n",
            "  return s;\n",
            [T + "test_fp8_blocks.py", T + "test_fp8.py", FP8_MLP], "the scales 448 / amax, not rounded down to "
            "powers of two (every recipe)", k="not cuda"),
    # 5. biases ignored
    _mutant("expert-mlp-ignores-biases", "python/expertact/moe/__init__.py",
            "    biased = b13 is not None or b2 is not None\n",
            "    b13 = b2 = None\n    biased = False\n",
            [T + "test_moe.py", T + "test_bias.py"], "expert_mlp drops b13 and b2 (every node)"),
    _mutant("bf16-node-drops-b2", "python/expertact/moe/_bf16.py",
            "    if b2 is not None:  # y += weights * b2[e], in place over the GEMM's output\n",
            "    if False:  # y += weights * b2[e], in place over the GEMM's output\n",
            [T + "test_moe.py", T + "test_bias.py"], "the bf16 node's forward leaves b2 out of y"),
    _mutant("transformers-drops-biases", "python/expertact/transformers.py",
            "    b13, b2 = _biases_of(module, w13)\n", "    b13, b2 = _biases_of(module, w13)\n    b13 = b2 = None\n",
            [T + "test_bench_experts.py", T + "test_examples.py"], "expertact.transformers leaves GPT-OSS's "
            "expert biases out (the bench's expert rows, the fine-tuning example)", k="not gpu and not cuda"),
    _mutant("transformers-refuses-biases", "python/expertact/transformers.py",
            "    b13, b2 = _biases_of(module, w13)\n",
            "    b13, b2 = _biases_of(module, w13)\n    if b13 is not None:\n"
            "        raise NotImplementedError(\"biases unsupported\")\n",
            [T + "test_bench_experts.py", T + "test_examples.py"], "expertact.transformers refuses expert biases "
            "(NotImplementedError: what the bench reports as a skipped row)", k="not gpu and not cuda"),
    # 6. transformers
    _mutant("transformers-ignores-fp8", "python/expertact/transformers.py",
            "                               inplace_backward=inplace_backward, fp8=fp8)\n",
            "                               inplace_backward=inplace_backward, fp8=None)\n",
            [T + "test_transformers.py"], 'register(..., fp8=recipe) runs bf16', k="fp8"),
    # 7. DeepSpeed, Megatron
    _mutant("deepspeed-ignores-fp8", "python/expertact/deepspeed.py",
            "layout=\"halves\", recompute=recompute, inplace_backward=inplace, fp8=fp8)",
            "layout=\"halves\", recompute=recompute, inplace_backward=inplace, fp8=None)",
            [T + "test_deepspeed_experts.py"], "enable(experts=True, fp8=recipe) runs bf16", k="fp8"),
    _mutant("megatron-ignores-fp8", "python/expertact/megatron.py",
            "remake_weights=functools.partial(self._weights, x.dtype), **self.expertact_options)",
            "remake_weights=functools.partial(self._weights, x.dtype), "
            "**dict(self.expertact_options, fp8=None))",
            [T + "test_megatron.py"], "ExpertMLP(fp8=recipe) runs bf16", k="fp8", python="py312"),
    _mutant("megatron-experts-permuted", "python/expertact/megatron.py",
            "            w13 = torch.stack([e.linear_fc1.weight for e in self.local_experts]).to(dtype)\n",
            "            w13 = torch.stack([e.linear_fc1.weight for e in self.local_experts[::-1]]).to(dtype)\n",
            [T + "test_megatron.py", T + "test_megatron_example.py"], "ExpertMLP gives each expert's rows another "
            "expert's fc1 weights (the experts' order reversed)", python="py312"),
    # 8. ctest without a GPU (a CUDA build: build/cuda; scripts/test.sh's check of ctest's log)
    _mutant("cuda-kernels-entries-not-skipped", "tests/cpp/CMakeLists.txt",
            '      ENVIRONMENT EXPERTACT_CUDA_KERNEL=${choice} TIMEOUT 900 COST 1000  # long: start first\n'
            '      SKIP_REGULAR_EXPRESSION "${EXPERTACT_NO_GPU_LINE}")\n',
            '      ENVIRONMENT EXPERTACT_CUDA_KERNEL=${choice} TIMEOUT 900 COST 1000)\n',
            ["ctest-guard:build/cuda"], "the cuda_kernels_rows / _flat entries without their skip rule: counted "
            "as passed without a GPU"),
    _mutant("unknown-value-passes-on-no-gpu", "tests/cpp/CMakeLists.txt",
            '    PASS_REGULAR_EXPRESSION "EXPERTACT_CUDA_KERNEL=bogus is not one of auto, rows, flat"\n',
            '    PASS_REGULAR_EXPRESSION "EXPERTACT_CUDA_KERNEL=bogus is not one of auto, rows, flat|no GPU"\n',
            ["ctest-guard:build/cuda"], "cuda_kernels_unknown_value passes on the text \"no GPU\""),
    _mutant("unknown-value-not-skipped", "tests/cpp/CMakeLists.txt",
            '    PASS_REGULAR_EXPRESSION "EXPERTACT_CUDA_KERNEL=bogus is not one of auto, rows, flat"\n'
            '    SKIP_REGULAR_EXPRESSION "${EXPERTACT_NO_GPU_LINE}")\n',
            '    PASS_REGULAR_EXPRESSION "EXPERTACT_CUDA_KERNEL=bogus is not one of auto, rows, flat|no GPU")\n',
            ["ctest-guard:build/cuda"], "cuda_kernels_unknown_value without its skip rule, passing on \"no GPU\""),
    _mutant("gtest-cuda-cases-pass-without-a-gpu", "tests/cpp/support/backend.h",
            "GTEST_SKIP() << eat_why_;", "return;",
            ["ctest-guard:build/cpu"], "the CUDA instances of the GoogleTest cases return (pass) instead of "
            "skipping without a GPU"),
    # 9. scripts/test.sh's decisions (tests/python/test_ci_script.py runs it on stubs)
    _mutant("ci-passes-without-python-312", "scripts/test.sh",
            '  if ci; then echo "FAILED: CI=true and no Python 3.12 found',
            '  if false; then echo "FAILED: CI=true and no Python 3.12 found',
            [T + "test_ci_script.py"], "CI=true without Python 3.12 skips the Megatron-Core tests and passes"),
    _mutant("ci-passes-without-an-optional-dependency", "scripts/test.sh",
            '  step "$LOGS/install-$name.log" "$@" && return 0\n  if ci; then',
            '  step "$LOGS/install-$name.log" "$@" && return 0\n  if false; then',
            [T + "test_ci_script.py"], "CI=true with an optional dependency that did not install skips its tests"),
    _mutant("ci-passes-without-the-312-environment", "scripts/test.sh",
            "    if ! ci; then SKIPS+=(", "    if true; then SKIPS+=(",
            [T + "test_ci_script.py"], "CI=true with a Python 3.12 environment that could not be made passes"),
    _mutant("install-not-retried", "scripts/test.sh", "  for attempt in 1 2; do\n", "  for attempt in 1; do\n",
            [T + "test_ci_script.py"], "a failed install is not tried again"),
    _mutant("failed-step-log-not-printed", "scripts/test.sh", '  tail -40 "$log"\n', "",
            [T + "test_ci_script.py"], "a failed step's own output is not printed in the run's log"),
    _mutant("user-run-skips-silently", "scripts/test.sh",
            'for line in "${SKIPS[@]+"${SKIPS[@]}"}"; do echo "SKIPPED: $line"; done\n', "",
            [T + "test_ci_script.py"], "a user's run does not say which suites it skipped"),
    # 11. the activation's math on the CPU (C++; the float64-oracle tests: ctest's CPU cases, test_functional)
    _mutant("halves-swapped", "src/api.cpp",
            "      p.g = layout == Layout::kHalves ? base : second;\n      p.u = layout == Layout::kHalves ? second : base;\n",
            "      p.g = layout == Layout::kHalves ? second : base;\n      p.u = layout == Layout::kHalves ? base : second;\n",
            ["ctest", T + "test_functional.py"], "the forward reads up from the first half and gate from the second"),
    _mutant("gate-clamp-dropped", "src/core/math.h",
            "  S gc = clamp_hi(g, S(c.limit));\n  S uc = clamp_sym(u, S(c.limit));\n  return",
            "  S gc = g;\n  S uc = clamp_sym(u, S(c.limit));\n  return",
            ["ctest", T + "test_functional.py"], "the forward's gate clamp min(g, L) dropped (swiglu_clamped, "
            "swiglu_oai)"),
    _mutant("up-clamp-dropped", "src/core/math.h",
            "  S gc = clamp_hi(g, S(c.limit));\n  S uc = clamp_sym(u, S(c.limit));\n  return",
            "  S gc = clamp_hi(g, S(c.limit));\n  S uc = u;\n  return",
            ["ctest", T + "test_functional.py"], "the forward's up clamp dropped"),
    _mutant("limit-ignored-cpu", "src/cpu/glu_cpu_kernels.h",
            "  if constexpr (kClamp) return math::Coeffs{p.params.alpha, p.params.limit, p.params.beta, true};\n",
            "  if constexpr (kClamp) return math::Coeffs{p.params.alpha, __builtin_inff(), p.params.beta, true};\n",
            ["ctest", T + "test_functional.py"], "the CPU kernels run every clamped form with limit = +inf"),
    _mutant("alpha-ignored", "src/core/math.h",
            "  EA_HD static S fwd(S x, S alpha) { return x * sig(x, alpha); }\n",
            "  EA_HD static S fwd(S x, S alpha) { return x * sig(x, S(1)); }\n",
            ["ctest", T + "test_functional.py"], "silu's forward with alpha = 1 whatever it is given (swiglu_oai's "
            "1.702)"),
    _mutant("default-alpha-1", "python/expertact/_args.py", "DEFAULT_ALPHA = 1.702\n", "DEFAULT_ALPHA = 1.0\n",
            [T + "test_moe.py", T + "test_fp8.py", T + "test_fp8_backward.py"], "swiglu_oai's default alpha 1.0 in the "
            "Python layer"),
    _mutant("c-abi-default-alpha-1", "src/c_api.cpp", "std::isnan(alpha) ? 1.702f : alpha",
            "std::isnan(alpha) ? 1.0f : alpha", ["ctest", T + "test_functional.py", T + "test_package.py"],
            "the C ABI's swiglu_oai preset with alpha 1.0 by default"),
    _mutant("swiglu-clamped-unclamped", "python/expertact/_args.py",
            "    return act, a, lim, beta\n",
            "    return act, a, (INF if activation == \"swiglu_clamped\" else lim), beta\n",
            [T + "test_moe.py", T + "test_fp8.py", T + "test_fp8_backward.py"], "swiglu_clamped runs unclamped (its "
            "limit dropped in the Python layer)"),
]


def _git(*args):
    return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, check=True).stdout


def _dirty():
    return _git("status", "--porcelain", "--", "src", "python", "include", "scripts", ".ci", "tests/cpp").strip()


def _plant(m):
    path = os.path.join(ROOT, m["path"])
    with open(path) as f:
        text = f.read()
    n = text.count(m["old"])
    if n != 1:
        raise SystemExit(f"{m['name']}: the text to replace occurs {n} times in {m['path']}")
    with open(path, "w") as f:
        f.write(text.replace(m["old"], m["new"]))
    return _git("diff", "--", m["path"])


def _build():
    r = subprocess.run(["cmake", "--build", BUILD, "-j2", "--target", "expertact"], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError("the CPU build failed:\n" + r.stdout[-3000:] + r.stderr[-3000:])


def _ctest():
    """The CPU cases of the GoogleTest suite (the CUDA ones skip here), stopping at the first failure."""
    r = subprocess.run(["ctest", "--test-dir", BUILD, "-j2", "--stop-on-failure", "-E", "cuda"], capture_output=True,
                       text=True)
    failed = re.findall(r"^\s*\d+/\d+ Test\s+#\d+: (\S+) \.+\*\*\*Failed", r.stdout, re.M)
    summary = [line for line in r.stdout.splitlines() if "tests passed" in line]
    return r.returncode, dict(cmd="ctest --test-dir build/cpu -j2 --stop-on-failure -E cuda", failed=failed,
                              summary=summary[-1] if summary else r.stdout[-300:])


def _ctest_guard(build):
    """Builds ``build`` (a CMakeLists.txt or test support change), runs its whole ctest, then applies
    scripts/test.sh's check for CUDA cases counted as passed without a GPU (its own regex, read
    from the script): (1, ...) when the check or ctest fails."""
    build = os.path.join(ROOT, build)
    b = subprocess.run(["cmake", "--build", build, "-j2"], capture_output=True, text=True)
    if b.returncode:
        return b.returncode, dict(cmd="cmake --build", failed=["build"], summary=b.stdout[-500:])
    r = subprocess.run(["ctest", "--test-dir", build, "-j2"], capture_output=True, text=True)
    with open(os.path.join(ROOT, "scripts", "test.sh")) as f:
        regex = re.search(r'gpu_passed=\$\(grep -E "(.+?)" "\$BUILD/ctest.log"', f.read()).group(1)
    passed = [line for line in r.stdout.splitlines() if re.search(regex, line)]
    summary = [line for line in r.stdout.splitlines() if "tests passed" in line]
    skipped = len(re.findall(r"\(Skipped\)", r.stdout))
    info = dict(cmd=f"ctest --test-dir {build} -j2, then scripts/test.sh's check", failed=passed[:5],
                summary=f"{summary[-1] if summary else ''}; {skipped} skipped; {len(passed)} CUDA cases passed")
    return (1 if passed or r.returncode else 0), info


def _pytest(m):
    if m["tests"][0].startswith("ctest-guard:"):
        return _ctest_guard(m["tests"][0].split(":", 1)[1])
    if m["python"] == "py312":
        py = os.path.join(VENV312, "bin", "python")
        if not os.path.exists(py):
            return None, f"not run: no Python 3.12 environment at {VENV312}"
    else:
        py = sys.executable
    tests = [t for t in m["tests"] if t != "ctest"]
    if "ctest" in m["tests"]:
        rc, info = _ctest()
        if rc:
            return rc, info
    cmd = [py, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-rfEs", *[os.path.join(ROOT, t) for t in tests]]
    if m["k"]:
        cmd += ["-k", m["k"]]
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"),
               EXPERTACT_LIBRARY=os.path.join(BUILD, "libexpertact.so"))
    r = subprocess.run(cmd, cwd="/tmp", env=env, capture_output=True, text=True)
    out = r.stdout + r.stderr
    failed = re.findall(r"^FAILED (\S+)", out, re.M)
    summary = [line for line in out.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", line)]
    return r.returncode, dict(cmd=" ".join(cmd[1:]), failed=failed, summary=summary[-1] if summary else out[-500:])


def run(m, baseline=False):
    if baseline:  # the selection on the unmutated code: it must pass for a kill to mean anything
        t0 = time.time()
        rc, info = _pytest(m)
        verdict = {None: "not run", 0: "passes"}.get(rc, "BASELINE FAILS")
        return dict(name=m["name"], what=m["what"], diff="", verdict=verdict, seconds=round(time.time() - t0),
                    info=info)
    diff = _plant(m)
    cpp = m["path"].startswith(("src/", "include/"))
    guard = m["tests"][0].startswith("ctest-guard:")
    t0 = time.time()
    try:
        if cpp:
            _build()
        rc, info = _pytest(m)
    finally:
        _git("checkout", "--", m["path"])
        if cpp:
            _build()
        if guard:  # the build folder as it was (its tests rediscovered)
            subprocess.run(["cmake", "--build", os.path.join(ROOT, m["tests"][0].split(":", 1)[1]), "-j2"],
                           capture_output=True)
    verdict = {None: "not run", 0: "SURVIVED", 5: "NO TESTS"}.get(rc, "killed")
    return dict(name=m["name"], what=m["what"], diff=diff, verdict=verdict, seconds=round(time.time() - t0), info=info)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*")
    p.add_argument("--list", action="store_true")
    p.add_argument("--json", help="append each result as a JSON line to this file")
    p.add_argument("--baseline", action="store_true", help="run each chosen mutant's tests without planting it")
    p.add_argument("--tests", nargs="+", help="run these test files instead of the mutant's own (repository paths)")
    p.add_argument("-k", dest="k", help="with --tests: pytest's -k selection")
    a = p.parse_args()
    chosen = [m for m in MUTANTS if not a.names or m["name"] in a.names]
    if a.tests:  # another selection for the same mutants (which other tests see them)
        chosen = [dict(m, tests=a.tests, k=a.k) for m in chosen]
    if a.list:
        for m in MUTANTS:
            print(f"{m['name']:36} {m['what']}")
        return
    unknown = set(a.names) - {m["name"] for m in MUTANTS}
    if unknown:
        raise SystemExit(f"unknown mutants: {sorted(unknown)}")
    if _dirty():
        raise SystemExit("the checkout has changes under src/, python/, include/, scripts/ or .ci/: commit or stash "
                         "them first")
    seen = set()
    for m in chosen:
        key = (tuple(m["tests"]), m["k"], m["python"])
        if a.baseline and key in seen:  # the same selection: one baseline run
            continue
        seen.add(key)
        res = run(m, a.baseline)
        print(f"{res['verdict']:9} {m['name']}: {res['info'] if isinstance(res['info'], str) else res['info']['summary']}"
              + ("" if isinstance(res["info"], str) or not res["info"]["failed"] else f" [{res['info']['failed'][0]}]"),
              flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(res) + "\n")
        assert not _dirty(), "a mutant was left in place"


if __name__ == "__main__":
    main()
