"""`python -m veloxquant_mlx` runs the `veloxquant` command line."""

from veloxquant_mlx.cli.main import main

raise SystemExit(main())
