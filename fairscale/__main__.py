"""``python -m fairscale plan|validate|report ...``: the same as the ``fairscale`` command."""

from fairscale.cli import main

raise SystemExit(main())
