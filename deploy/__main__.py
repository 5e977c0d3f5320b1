"""``python -m hbmd.deploy``: the directory of the installed deployment files, for ``install`` and ``cp``."""

from pathlib import Path

print(Path(__file__).parent)
