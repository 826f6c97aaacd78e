"""`python -m fila.cli`: the same as the `fila` console script."""

from fila.cli import main

main()
