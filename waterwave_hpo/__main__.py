from waterwave_hpo.cli import main

raise SystemExit(main())
