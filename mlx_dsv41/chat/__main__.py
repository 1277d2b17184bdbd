"""`python -m mlx_dsv41.chat`: the interactive chat (mlx_dsv41/chat/repl.py)."""

from .repl import main

main()
