"""Make ``import kfac`` resolve to :mod:`torchsso2.kfac` (opt-in, for unchanged kfac_pytorch scripts).

::

    import torchsso2.kfac
    torchsso2.kfac.install_as_kfac()            # once, before the script's kfac imports

    import kfac                                  # torchsso2.kfac
    from kfac.preconditioner import KFACPreconditioner
    from kfac.scheduler import LambdaParamScheduler

It registers ``kfac`` and the mirrored submodules (``kfac.preconditioner``, ``kfac.enums``,
``kfac.scheduler``, ``kfac.hyperparams``, ``kfac.base_preconditioner``, ``kfac.warnings``)
in ``sys.modules`` (and torchsso2's own, ``kfac.layer`` is ``torchsso2.kfac.layer``); kfac_pytorch's
internals (``kfac.layers``, ``kfac.assignment``,
``kfac.distributed``, ``kfac.gpt_neox``, ``kfac.tracing``) are not provided. Without the
call nothing is registered, and an installed kfac_pytorch stays importable as ``kfac``.
"""
from __future__ import annotations

import sys
from types import ModuleType
from typing import Dict

__all__ = ["MIRRORED", "install_as_kfac"]

MIRRORED = ("base_preconditioner", "enums", "hyperparams", "preconditioner", "scheduler", "warnings")


def install_as_kfac(force: bool = False) -> ModuleType:
    """Register :mod:`torchsso2.kfac` as ``kfac`` in ``sys.modules``; returns it.

    Args:
        force: replace a ``kfac`` (e.g. kfac_pytorch) that is already imported. Without it,
            an already imported foreign ``kfac`` raises, since objects made from it would mix
            with ours.

    Raises:
        RuntimeError: another ``kfac`` is already imported and ``force`` is False.
    """
    import torchsso2.kfac as ours

    current = sys.modules.get("kfac")
    if current is not None and current is not ours and not force:
        raise RuntimeError(f"a different 'kfac' module is already imported ({getattr(current, '__file__', current)!r}); "
                           "call install_as_kfac() before importing it, or pass force=True to replace it")
    if current is not None and current is not ours:
        for key in [k for k in sys.modules if k == "kfac" or k.startswith("kfac.")]:
            del sys.modules[key]
    modules: Dict[str, ModuleType] = {"kfac": ours}
    for name in MIRRORED:
        modules[f"kfac.{name}"] = sys.modules[f"torchsso2.kfac.{name}"]
    # our own submodules too (all imported with the package): `import kfac.layer` must give the module
    # torchsso2.kfac uses, not a second copy loaded from the same file (whose classes isinstance misses)
    prefix = "torchsso2.kfac."
    for key, module in list(sys.modules.items()):
        if key.startswith(prefix) and module is not None:
            modules.setdefault("kfac." + key[len(prefix):], module)
    sys.modules.update(modules)
    return ours
