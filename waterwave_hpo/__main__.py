"""``python -m waterwave_hpo``: the ``waterwave-hpo`` command line."""

from waterwave_hpo.cli import main

raise SystemExit(main())
