"""Load a file under scripts/ as a module, for tests that call its functions or main() in-process.

scripts/ is not a package (its files are run as commands), so tests load them by path: one helper instead of an
importlib recipe per test file, and no sys.path edits that would outlive the test.
"""
import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str) -> ModuleType:
    """A fresh module from scripts/<relative> (e.g. "reproduce.py", "gaps/niid_min_size_odds.py")."""
    path = ROOT / "scripts" / relative
    if not path.is_file():
        raise FileNotFoundError(f"no script {path}")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
