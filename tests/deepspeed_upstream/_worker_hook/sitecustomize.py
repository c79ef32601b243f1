"""Child-process half of the expertact_switch pytest plugin (see ../expertact_switch.py).

The plugin puts this folder on the PYTHONPATH of the processes pytest starts (DeepSpeed's
DistributedTest workers) and exports EXPERTACT_DS_SWITCH_ACTIVE. Python imports this module at
start-up; it waits for ``import deepspeed`` to finish (a one-shot meta-path finder that wraps the
loader of the ``deepspeed`` package) and then enables the same switch as the pytest process, so
nothing is imported early and DeepSpeed is never enabled half-initialized. Any other
sitecustomize further down sys.path still runs.
"""
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


class _AfterDeepSpeedImport(importlib.abc.MetaPathFinder):

    def find_spec(self, name, path=None, target=None):
        if name != "deepspeed":
            return None
        sys.meta_path.remove(self)  # one shot: let the real finders locate the package
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_switch(module):
            exec_module(module)
            try:
                import expertact_switch
                expertact_switch.worker_activate()
            except Exception as e:  # never break `import deepspeed`; the plugin's checks report it
                print(f"expertact_switch hook: pid {os.getpid()}: {e!r}", file=sys.stderr)

        spec.loader.exec_module = exec_then_switch
        return spec


if os.environ.get("EXPERTACT_DS_SWITCH_ACTIVE") and "deepspeed" not in sys.modules:
    sys.meta_path.insert(0, _AfterDeepSpeedImport())


def _chain():
    """Run the next sitecustomize on sys.path, which this one shadows."""
    others = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_chain()
