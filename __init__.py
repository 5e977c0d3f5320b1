"""hbmd: a per-GPU memory daemon, its client and its wire protocol.

The subpackages are ``hbmd.proto`` (messages, codec, errors), ``hbmd.daemon``
(the ``hbmd`` command), ``hbmd.client`` (``connect``, ``ExtensibleTensor``,
``hbmctl``), ``hbmd.driver`` (the one CUDA driver module) and
``hbmd.integrations`` (the vLLM plugin). Importing ``hbmd`` itself loads none
of them.
"""

import importlib.metadata


def _package_version() -> str:
    try:
        return importlib.metadata.version("hbmd")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


__version__ = _package_version()
"""The installed hbmd's version, from the package metadata: what the daemon reports and both CLIs print."""
