"""pytest plugin: run a test suite with expertact switched into DeepSpeed AutoEP.

Load it with ``pytest -p expertact_switch`` (this folder on PYTHONPATH). At
``pytest_configure`` it calls ``expertact.deepspeed.enable(experts=True, **kw)``, kw being the
JSON object in ``EXPERTACT_DS_SWITCH`` (empty or unset: ``{}``), e.g.
``EXPERTACT_DS_SWITCH='{"recompute": true}'`` or ``'{"inplace_backward": true}'``;
``{"experts": false}`` switches in the activation kernels only (plain ``enable()``). At
``pytest_unconfigure`` it calls ``disable()``.

DeepSpeed's DistributedTest runs test bodies in worker processes (forkserver or spawn), which
do not inherit what ``enable()`` changed in the pytest process. So the plugin also puts
``_worker_hook/`` (a ``sitecustomize``) and this folder on the PYTHONPATH its children inherit,
and exports the exact enable() arguments in ``EXPERTACT_DS_SWITCH_ACTIVE``: a child enables the
same switch as soon as its ``import deepspeed`` has finished.

Every process (pytest's and each worker) also checks each ``GroupedExperts`` call through a
global module forward pre-hook: the ``forward`` of the module's class must be expertact's (it
carries ``expertact_form``; without ``experts=True``, the registry entries must carry it). A call
through DeepSpeed's own forward raises AssertionError inside the test that made it. Each process
writes its tally to a log folder; at the end of the session the plugin prints the totals
(processes, calls checked) and fails the session when a process could not enable the switch or
a call was not expertact's. ``EXPERTACT_DS_SWITCH_REPORT=<file>`` also writes them as JSON.
"""
from __future__ import annotations

import glob
import inspect
import json
import os
import shutil
import sys
import tempfile

ENV = "EXPERTACT_DS_SWITCH"  # what the user asks for (JSON object of enable() keywords)
ENV_ACTIVE = "EXPERTACT_DS_SWITCH_ACTIVE"  # what the pytest process enabled, for its children
ENV_LOG = "EXPERTACT_DS_SWITCH_LOG"  # folder of per-process tallies
ENV_REPORT = "EXPERTACT_DS_SWITCH_REPORT"  # optional JSON summary file

HERE = os.path.dirname(os.path.abspath(__file__))
HOOK_DIR = os.path.join(HERE, "_worker_hook")

_state = {"kw": None, "role": None, "error": None, "calls": 0, "bad": 0, "hook": None, "first_bad": None}
_session = {"log_dir": None, "own_log_dir": False, "old_pythonpath": None}


# ---------------------------------------------------------------------------
# Enabling, and checking that it took
# ---------------------------------------------------------------------------


def requested_kwargs() -> dict:
    """enable() keywords from EXPERTACT_DS_SWITCH, with experts=True unless it says otherwise."""
    raw = os.environ.get(ENV, "").strip()
    try:
        kw = json.loads(raw) if raw else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{ENV}={raw!r} is not JSON: {e}") from None
    if not isinstance(kw, dict):
        raise ValueError(f"{ENV}={raw!r}: expected a JSON object of enable() keywords")
    kw.setdefault("experts", True)
    return kw


def enable(kw: dict) -> None:
    """expertact.deepspeed.enable(**kw), saying plainly when the installed expertact is too old."""
    import expertact.deepspeed as eds

    params = inspect.signature(eds.enable).parameters
    if kw.get("experts") is False and "experts" not in params:
        kw = {k: v for k, v in kw.items() if k != "experts"}  # an enable() from before experts=: the same thing
    unknown = sorted(k for k in kw if k not in params)
    if unknown:
        raise RuntimeError(f"expertact.deepspeed.enable{inspect.signature(eds.enable)} (from {eds.__file__}) "
                           f"takes no {', '.join(unknown)}; the expertact imported here is older than the one "
                           "the switch needs")
    eds.enable(**kw)


def _grouped_experts_cls():
    from deepspeed.moe.ep_experts import GroupedExperts
    return GroupedExperts


def describe() -> str:
    """What is switched in now: the expertact_form of GroupedExperts.forward (experts=True), or of
    the registry's fused kernels."""
    cls = _grouped_experts_cls()
    form = getattr(cls.forward, "expertact_form", None)
    if form is not None:
        return f"GroupedExperts.forward={cls.forward.__qualname__} expertact_form={form}"
    from deepspeed.moe.ep_experts import EXPERT_ACTIVATIONS
    forms = {n: getattr(e.fused_fn, "expertact_form", None) for n, e in EXPERT_ACTIVATIONS.items()}
    return f"GroupedExperts.forward={cls.forward.__qualname__} (DeepSpeed's); registry fused_fn forms={forms}"


def _switched_in(kw) -> bool:
    cls = _grouped_experts_cls()
    if kw.get("experts", True):
        return getattr(cls.forward, "expertact_form", None) is not None
    from deepspeed.moe.ep_experts import EXPERT_ACTIVATIONS
    return getattr(EXPERT_ACTIVATIONS["swiglu"].fused_fn, "expertact_form", None) is not None


def _write_log():
    log_dir = os.environ.get(ENV_LOG)
    if not log_dir or not os.path.isdir(log_dir):
        return
    rec = dict(pid=os.getpid(), role=_state["role"], kw=_state["kw"], error=_state["error"], calls=_state["calls"],
               bad=_state["bad"], first_bad=_state["first_bad"])
    try:
        rec["form"] = describe() if _state["error"] is None else None
    except Exception as e:  # deepspeed half imported: the tally is what matters
        rec["form"] = f"unknown ({e!r})"
    path = os.path.join(log_dir, f"{os.getpid()}.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(rec, f)
    os.replace(tmp, path)


def _check_call(module, args):
    """Global forward pre-hook: a GroupedExperts call must go through expertact's forward."""
    cls = type(module)
    if cls.__name__ != "GroupedExperts" or cls.__module__ != "deepspeed.moe.ep_experts":
        return None
    _state["calls"] += 1
    ok = _state["error"] is None and _switched_in(_state["kw"] or {})
    if not ok:
        _state["bad"] += 1
        if _state["first_bad"] is None:
            _state["first_bad"] = f"{describe()}; enable error: {_state['error']}"
    _write_log()  # every call: pool workers may end without running exit handlers
    if not ok:
        raise AssertionError(f"expertact_switch: GroupedExperts ran without expertact in pid {os.getpid()} "
                             f"({_state['role']}): {_state['first_bad']}")
    return None


def _install_check():
    if _state["hook"] is None:
        from torch.nn.modules.module import register_module_forward_pre_hook
        _state["hook"] = register_module_forward_pre_hook(_check_call)


def activate(kw: dict, role: str) -> None:
    """Enable the switch in this process and check every GroupedExperts call from now on."""
    _state["kw"], _state["role"] = dict(kw), role
    try:
        enable(kw)
        if not _switched_in(kw):
            raise RuntimeError(f"enable({kw}) returned but the switch is not in: {describe()}")
        _state["error"] = None
    except Exception as e:
        _state["error"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        _install_check()
        _write_log()


def worker_activate() -> None:
    """Called by _worker_hook/sitecustomize.py in a child once `import deepspeed` has finished."""
    kw = json.loads(os.environ[ENV_ACTIVE])
    try:
        activate(kw, "worker")
    except Exception as e:  # recorded; each GroupedExperts call in this process then fails loudly
        print(f"expertact_switch: pid {os.getpid()}: enable({kw}) failed: {e!r}", file=sys.stderr)


# ---------------------------------------------------------------------------
# pytest hooks (the pytest process)
# ---------------------------------------------------------------------------


def pytest_configure(config):
    import pytest

    if hasattr(config, "workerinput"):  # pytest-xdist worker: its controller exported the env already
        kw = json.loads(os.environ[ENV_ACTIVE])
    else:
        try:
            kw = requested_kwargs()
        except ValueError as e:
            raise pytest.UsageError(str(e)) from None
        log_dir = os.environ.get(ENV_LOG)
        if not log_dir:
            log_dir = tempfile.mkdtemp(prefix="expertact_switch_")
            _session["own_log_dir"] = True
        os.makedirs(log_dir, exist_ok=True)
        for stale in glob.glob(os.path.join(log_dir, "*.json")):
            os.remove(stale)
        _session["log_dir"] = log_dir
        os.environ[ENV_LOG] = log_dir
        os.environ[ENV_ACTIVE] = json.dumps(kw, sort_keys=True)
        # Children (DistributedTest's forkserver/spawn workers) import _worker_hook/sitecustomize.py.
        _session["old_pythonpath"] = os.environ.get("PYTHONPATH")
        parts = [p for p in (_session["old_pythonpath"] or "").split(os.pathsep) if p]
        os.environ["PYTHONPATH"] = os.pathsep.join([HOOK_DIR, HERE] + [p for p in parts if p not in (HOOK_DIR, HERE)])
    try:
        activate(kw, "pytest")
    except Exception as e:
        raise pytest.UsageError(f"expertact_switch: enable({kw}) failed: {e}") from None
    config._expertact_switch = (kw, describe())


def pytest_runtest_setup(item):
    if getattr(item.cls, "is_dist_test", False):  # DeepSpeed's DistributedTest: the body runs in workers
        _session.setdefault("dist_ids", set()).add(item.nodeid)


def pytest_runtest_logreport(report):
    if report.when == "call" and report.passed and report.nodeid in _session.get("dist_ids", ()):
        _session["dist_passed"] = _session.get("dist_passed", 0) + 1


def pytest_report_header(config):
    kw, form = getattr(config, "_expertact_switch", (None, None))
    if kw is not None:
        return [f"expertact_switch: enable({', '.join(f'{k}={v!r}' for k, v in sorted(kw.items()))})", f"  {form}"]
    return None


def _collect():
    log_dir = _session["log_dir"]
    recs = []
    for path in sorted(glob.glob(os.path.join(log_dir, "*.json"))) if log_dir else ():
        try:
            with open(path) as f:
                recs.append(json.load(f))
        except (OSError, ValueError):
            continue
    return recs


def pytest_sessionfinish(session, exitstatus):
    import pytest

    if _session["log_dir"] is None:
        return
    _write_log()
    recs = _collect()
    workers = [r for r in recs if r.get("role") == "worker"]
    summary = dict(
        kw=_state["kw"],
        form=getattr(session.config, "_expertact_switch", (None, None))[1],
        processes=len(recs),
        worker_processes=len(workers),
        worker_processes_with_calls=sum(1 for r in workers if r.get("calls")),
        grouped_experts_calls=sum(r.get("calls", 0) for r in recs),
        grouped_experts_calls_in_workers=sum(r.get("calls", 0) for r in workers),
        calls_not_expertact=sum(r.get("bad", 0) for r in recs),
        enable_errors=[dict(pid=r["pid"], role=r.get("role"), error=r["error"]) for r in recs if r.get("error")],
        first_bad=next((r["first_bad"] for r in recs if r.get("first_bad")), None),
        distributed_tests_passed=_session.get("dist_passed", 0),
    )
    if summary["distributed_tests_passed"] and not summary["worker_processes"]:
        # Their bodies ran in workers that never enabled the switch (no _worker_hook there).
        summary["enable_errors"].append(dict(pid=None, role="worker", error=(
            f"{summary['distributed_tests_passed']} DistributedTest test(s) passed but no worker process "
            "enabled the switch")))
    session.config._expertact_switch_summary = summary
    report = os.environ.get(ENV_REPORT)
    if report:
        with open(report, "w") as f:
            json.dump(summary, f, indent=1, sort_keys=True)
    if summary["calls_not_expertact"] or summary["enable_errors"]:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    s = getattr(config, "_expertact_switch_summary", None)
    if s is None:
        return
    tr = terminalreporter
    tr.section("expertact_switch")
    tr.write_line(f"enable({s['kw']}): {s['form']}")
    tr.write_line(f"processes that enabled it: {s['processes']} (pytest + {s['worker_processes']} workers, "
                  f"{s['worker_processes_with_calls']} of which ran GroupedExperts)")
    tr.write_line(f"GroupedExperts calls checked: {s['grouped_experts_calls']} "
                  f"({s['grouped_experts_calls_in_workers']} in workers); "
                  f"not through expertact's forward: {s['calls_not_expertact']}")
    for e in s["enable_errors"]:
        tr.write_line(f"enable failed in pid {e['pid']} ({e['role']}): {e['error']}", red=True)
    if s["first_bad"]:
        tr.write_line(f"first call without expertact: {s['first_bad']}", red=True)


def pytest_unconfigure(config):
    if getattr(config, "_expertact_switch", None) is None:
        return
    try:
        import expertact.deepspeed as eds
        eds.disable()
    finally:
        if _state["hook"] is not None:
            _state["hook"].remove()
            _state["hook"] = None
        if not hasattr(config, "workerinput"):
            old = _session["old_pythonpath"]
            if old is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = old
            os.environ.pop(ENV_ACTIVE, None)
            if _session["own_log_dir"] and _session["log_dir"]:
                shutil.rmtree(_session["log_dir"], ignore_errors=True)
                os.environ.pop(ENV_LOG, None)
