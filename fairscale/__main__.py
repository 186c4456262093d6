"""``python -m fairscale plan|validate|report ...``: the same as the ``fairscale`` command."""

from fairscale.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
