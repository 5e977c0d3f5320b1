"""hbmd: a per-GPU memory daemon, its client and its wire protocol.

The subpackages are ``hbmd.proto`` (messages, codec, errors), ``hbmd.daemon``
(the ``hbmd`` command), ``hbmd.client`` (``connect``, ``ExtensibleTensor``,
``hbmctl``), ``hbmd.driver`` (the one CUDA driver module) and
``hbmd.integrations`` (the vLLM plugin). Importing ``hbmd`` itself loads none
of them.

A checkout's root is this package, so from the directory a clone sits in
(where ``git clone`` made ``hbmd/``) Python finds the clone before what pip
installed: the current directory comes first on ``sys.path`` for
``python -m``, ``python -c`` and the REPL. Where a package is installed
beside it, the clone hands the import over to it (:func:`_installed_elsewhere`).
"""

import importlib.metadata
import importlib.util
import os
import sys


def _package_version() -> str:
    try:
        return importlib.metadata.version("hbmd")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


__version__ = _package_version()
"""The installed hbmd's version, from the package metadata: what the daemon reports and both CLIs print."""


def _installed_elsewhere() -> str | None:
    """The directory of the hbmd pip installed, where this package is a checkout found instead of it; None where this
    is the package installed (a wheel's, or a checkout's own editable install), or nothing is."""
    here = os.path.dirname(os.path.abspath(__file__))
    if not os.path.isfile(os.path.join(here, "pyproject.toml")):
        return None  # installed from a wheel, which carries no pyproject.toml
    try:
        installed = os.path.dirname(str(importlib.metadata.distribution("hbmd").locate_file("hbmd/__init__.py")))
    except importlib.metadata.PackageNotFoundError:
        return None
    # An editable install has no files of its own there: its finder maps hbmd to its checkout.
    if not os.path.isfile(os.path.join(installed, "__init__.py")) or os.path.samefile(installed, here):
        return None
    return installed


def _import_installed(directory: str) -> None:
    """Make the package in ``directory`` the one imported as ``hbmd``, subpackages and all: the import system returns
    what ``sys.modules`` holds once this module has run."""
    spec = importlib.util.spec_from_file_location(
        __name__, os.path.join(directory, "__init__.py"), submodule_search_locations=[directory]
    )
    assert spec is not None and spec.loader is not None  # a file location always has a loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[__name__] = module
    spec.loader.exec_module(module)


_installed = _installed_elsewhere()
if _installed is not None:
    _import_installed(_installed)
