"""Written by ddpnb as RUN_DIR/.ddpnb/sitecustomize.py: its hooks, then any other sitecustomize.

Activates ``ddpnb_watch`` and ``ddpnb_observe`` (each idle unless its variable is set) and calls
their ``install`` once the script imports torch. Nothing here may stop the script.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))


def _activate(module) -> None:
    """``module.activate(folder)`` in a worker (RANK set) of a run that asks for it (its folder
    variable set), once, and not in the processes the worker starts (mp.spawn's, subprocesses)."""
    folder, pid = os.environ.get(module.DIR_ENV), str(os.getpid())
    if folder and "RANK" in os.environ and module.active is None:
        if (os.environ.get(module.OWNER_ENV) or pid) == pid:
            os.environ[module.OWNER_ENV] = pid
            module.activate(folder)


_hooks = []
for _name in ("ddpnb_watch", "ddpnb_observe"):
    try:
        _module = importlib.import_module(_name)
        _activate(_module)
        _hooks.append(_module)
    except Exception as e:  # never stop the script for ddpnb's sake
        sys.stderr.write(f"ddpnb: {_name} not loaded: {e!r}\n")


def _installed(torch) -> None:
    for module in _hooks:
        try:
            module.install(torch)
        except Exception as e:
            sys.stderr.write(f"ddpnb: {module.__name__} could not hook torch: {e!r}\n")


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Calls each hook's ``install`` right after ``import torch`` finishes (the script's own)."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _installed(module)

        spec.loader.exec_module = exec_module
        return spec


if "torch" in sys.modules:
    _installed(sys.modules["torch"])
else:
    sys.meta_path.insert(0, _AfterTorch())

_paths = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _paths)
if _spec is not None and _spec.loader is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
