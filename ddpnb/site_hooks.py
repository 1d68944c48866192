"""Written by ddpnb as RUN_DIR/.ddpnb/sitecustomize.py: starts ddpnb's hooks in a worker, has them
hook torch once imported, then runs any other sitecustomize. Nothing here may stop the script."""

import faulthandler
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
# A worker killed by a signal (an abort in C++: gloo, NCCL, CUDA; a segfault; a bus error)
# prints every thread's Python stack to its stderr: the diagnosis names the line it was at.
if "RANK" in os.environ and not faulthandler.is_enabled():
    try:
        faulthandler.enable(all_threads=True)
    except Exception:  # no usable stderr
        pass
_hooks = []
for _name in ("ddpnb_watch", "ddpnb_observe"):
    try:
        _module = importlib.import_module(_name)
        _folder, _pid = os.environ.get(_module.DIR_ENV), str(os.getpid())
        # Only in a worker (RANK set), and not in the processes it starts (their owner is it).
        if _folder and "RANK" in os.environ:
            if os.environ.setdefault(f"{_module.DIR_ENV}_OWNER", _pid) == _pid:
                _module.activate(_folder)
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
    """Calls each hook's ``install`` right after the script's ``import torch`` finishes."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is not None and spec.loader is not None:
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
