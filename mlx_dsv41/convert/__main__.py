"""`python -m mlx_dsv41.convert`: the converter's command line (mlx_dsv41/convert/cli.py)."""

from mlx_dsv41.convert.cli import main

main()
