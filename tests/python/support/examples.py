"""The examples/ scripts, loaded as modules by the tests that check them."""
import importlib.util
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def load(name):
    """examples/<name>.py as a module (not registered in sys.modules), its top level run."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
