"""`ulyssesd` with a bug planted in one of its tick steps, for tests only (a real daemon process to watch).

ULS_BUG_TARGET names the function behind the step ("module:attribute"); once the file ULS_BUG_FLAG exists,
every call of it raises RuntimeError("planted bug"); before that it runs normally. The rest is `ulyssesd`.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path


def _plant() -> None:
    module_name, attribute = os.environ["ULS_BUG_TARGET"].split(":")
    module = importlib.import_module(module_name)
    real = getattr(module, attribute)
    flag = Path(os.environ["ULS_BUG_FLAG"])

    def planted(*args, **kwargs):
        if flag.exists():
            raise RuntimeError("planted bug")
        return real(*args, **kwargs)

    setattr(module, attribute, planted)


if __name__ == "__main__":
    _plant()
    from ulyssesd.daemon.cli import main

    sys.exit(main(sys.argv[1:]))
