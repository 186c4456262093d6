"""``python -m fairscale plan|validate|report ...``: the same as the ``fairscale`` command."""

import gc

from fairscale.cli import main


def command() -> int:
    """The ``fairscale`` executable and ``python -m fairscale``: :func:`fairscale.cli.main`, after
    which the process ends."""
    gc.freeze()  # what importing torch and fairscale made lives as long as the process: never walk it again
    code = main()
    gc.freeze()  # spare the collector a last walk over the planning garbage (a 1T model's graph: ~1 s)
    return code


if __name__ == "__main__":
    raise SystemExit(command())
