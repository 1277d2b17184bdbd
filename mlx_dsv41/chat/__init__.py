"""Chat with DeepSeek-V4.1: the official encoding (`encoding.py`, whose names are re-exported
here: `chat.render`, `chat.encode`, ...) and the interactive terminal chat
(`python -m mlx_dsv41.chat`, `repl.py`, imported only when run)."""

from mlx_dsv41.chat.encoding import (  # noqa: F401 (the package's API)
    ASSISTANT,
    BOS,
    CONTROL_TOKENS,
    DEFAULT_EFFORT,
    DSML,
    EFFORT_ALIASES,
    EFFORT_NAMES,
    EFFORT_SENTENCE,
    END_THINK,
    EOS,
    OPENAI_EFFORTS,
    ROLES,
    SYSTEM,
    TEMPLATE_TYPE,
    THINK,
    TOOLS_INSTRUCTIONS,
    USER,
    ChatError,
    Piece,
    apply_chat_template,
    control_token_ids,
    encode,
    encode_continuation,
    parse_effort,
    register_with_mlx_lm,
    render,
    render_pieces,
    special_token_ids,
)
