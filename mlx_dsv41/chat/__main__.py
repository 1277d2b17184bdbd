"""`python -m mlx_dsv41.chat`: the interactive chat (mlx_dsv41/chat/repl.py)."""

from mlx_dsv41.chat.repl import main

main()
