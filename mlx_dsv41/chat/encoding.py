"""The DeepSeek-V4.1 chat encoding (docs/chat.md#chat-encoding): messages -> prompt string or token
ids.

    <｜begin▁of▁sentence｜>                                         once, first
    <｜System｜>Reasoning Effort: 75 (range 1-100, ...)\\n\\n          thinking mode, at message 0
    {system content}[\\n\\n## Tools ...]                              the first system message
    <｜User｜>{content}                                               user turns; tool results
                                                                   merge in as <tool_result>…
    <｜Assistant｜><think>   (thinking)  |  <｜Assistant｜></think>   header before an answer
    {reasoning}</think>{content}{DSML tool calls}<｜end▁of▁sentence｜>   an assistant turn

Rules (docs/chat.md#chat-encoding; the official `encoding/encoding.py` as its ports describe it):
- Reasoning effort is an integer 1..100 or a name: the official aliases low = 50, high = 75
  (default), max = 100 (not vLLM's mapping), and OpenAI's other `reasoning_effort` names mapped
  onto the same scale: minimal = 25 (half of low), medium = 62 (midway between low and high).
  Only thinking mode renders it, at message 0.
- Chat mode: every header is `<｜Assistant｜></think>` and no reasoning is rendered.
- drop_thinking (default on; off when the conversation carries tools): reasoning of assistant
  turns before the last user turn is dropped, and their headers become `</think>` headers.
- A mid-conversation system message is a `<｜System｜>` turn and counts as a user turn for the
  header. Consecutive user turns and tool results merge into one user turn, blocks joined by
  "\\n\\n", tool results in the order the assistant called them.
- DSML: `｜DSML｜` is a control token; the tag names after it start with a space
  (`<｜DSML｜ calls>`, `<｜DSML｜ invoke name="f">`, `<｜DSML｜ parameter name="k" string="true">`).

docs/chat.md gives the structure; the exact text of the `## Tools` instructions is taken from
third-party ports of the official file (docs/model.md#sources VLLM and others) and is not verified
against it.

Two outputs: `render` gives the string (what a Jinja template would produce); `encode` gives
token ids with every control token placed by id and every piece of text (user content, tool
output) tokenized with special-token matching off, so text that spells `<｜User｜>` stays text.
`apply_chat_template` is the mlx-lm chat-template protocol, so a tokenizer whose config names
`chat_template_type: "mlx_dsv41"` (after `register_with_mlx_lm()`) renders with these rules.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SYSTEM = "<｜System｜>"
THINK = "<think>"
END_THINK = "</think>"
DSML = "｜DSML｜"
CONTROL_TOKENS = (BOS, EOS, USER, ASSISTANT, SYSTEM, THINK, END_THINK, DSML)

EFFORT_ALIASES = {"low": 50, "high": 75, "max": 100}  # the official file's
OPENAI_EFFORTS = {"minimal": 25, "low": 50, "medium": 62, "high": 75}  # OpenAI's names, our mapping
EFFORT_NAMES = {**OPENAI_EFFORTS, **EFFORT_ALIASES}
DEFAULT_EFFORT = "high"
EFFORT_SENTENCE = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
ROLES = ("system", "user", "assistant", "tool")

TOOLS_INSTRUCTIONS = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{D} calls>" block like the following:

<{D} calls>
<{D} invoke name="$TOOL_NAME">
<{D} parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{D} parameter>
...
</{D} invoke>
<{D} invoke name="$TOOL_NAME2">
...
</{D} invoke>
</{D} calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {T}), you MUST output your complete reasoning inside {T}...{E} BEFORE any tool calls or final response.

Otherwise, output directly after {E} with tool calls or final response.

### Available Tool Schemas

{S}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


class ChatError(ValueError):
    """A conversation or option the encoding cannot express; the message says what and where."""


def parse_effort(value: Any) -> int:
    """An effort as given by a user (a name of EFFORT_NAMES or 1..100, int or digits) -> 1..100."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text in EFFORT_NAMES:
            return EFFORT_NAMES[text]
        if text.isdigit():
            value = int(text)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ChatError(f"reasoning effort must be {', '.join(EFFORT_NAMES)} or an integer 1..100; got {value!r}")
    if not 1 <= value <= 100:
        raise ChatError(f"reasoning effort must be in 1..100; got {value}")
    return value


@dataclass(frozen=True)
class Piece:
    """A run of prompt text; `control` marks one control token (placed by id when encoding)."""

    text: str
    control: bool = False


# ------------------------------------------------------------------------------ messages


def _text_content(content: Any, where: str) -> str:
    """str | None | OpenAI content blocks [{"type": "text", "text": ...}] -> text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, block in enumerate(content):
            if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                kind = block.get("type") if isinstance(block, dict) else type(block).__name__
                raise ChatError(f"{where}: content block {i} is {kind!r}; only text blocks are supported")
            parts.append(block["text"])
        return "\n\n".join(parts)
    raise ChatError(f"{where}: content must be a string, null or a list of text blocks; got {type(content).__name__}")


def _tool_call(call: Any, where: str) -> tuple[str, dict]:
    """An OpenAI tool call {"function": {"name", "arguments": JSON object text}} -> (name, args)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ChatError(f"{where}: a tool call must be {{'function': {{'name': ..., 'arguments': ...}}}}")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ChatError(f"{where}: arguments of tool call {fn['name']!r} are not JSON ({e})") from None
    if not isinstance(args, dict):
        raise ChatError(f"{where}: arguments of tool call {fn['name']!r} must be a JSON object")
    return fn["name"], args


def _tool_schema(tool: Any, i: int) -> dict:
    if (
        not isinstance(tool, dict)
        or not isinstance(tool.get("function"), dict)
        or not isinstance(tool["function"].get("name"), str)
    ):
        raise ChatError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., ...}}}}")
    return tool["function"]


def _turns(messages: Any, tools: list | None) -> list[dict]:
    """Validated messages -> turns: system/user/assistant, tool results merged into user turns."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("messages must be a non-empty list")
    turns: list[dict] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ChatError(f"{where} must be an object with a role")
        role = msg.get("role")
        if role not in ROLES:
            raise ChatError(f"{where}: role {role!r} is not one of {', '.join(ROLES)}")
        if role in ("user", "tool"):
            if role == "user":
                block = ("text", None, _text_content(msg.get("content"), where))
            else:
                block = ("tool_result", msg.get("tool_call_id"), _text_content(msg.get("content"), where))
            if turns and turns[-1]["role"] == "user":
                turns[-1]["blocks"].append(block)
            else:
                turns.append({"role": "user", "blocks": [block]})
        elif role == "system":
            turns.append({"role": "system", "text": _text_content(msg.get("content"), where), "tools": None})
        else:
            reasoning = msg.get("reasoning_content", msg.get("reasoning"))
            if reasoning is not None and not isinstance(reasoning, str):
                raise ChatError(f"{where}: reasoning_content must be a string")
            calls = msg.get("tool_calls") or []
            if not isinstance(calls, list):
                raise ChatError(f"{where}: tool_calls must be a list")
            turns.append(
                {
                    "role": "assistant",
                    "text": _text_content(msg.get("content"), where),
                    "reasoning": reasoning or "",
                    "calls": [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)],
                    "call_ids": [c.get("id") for c in calls],
                }
            )
    if tools:
        if not isinstance(tools, list):
            raise ChatError("tools must be a list")
        schemas = [_tool_schema(t, i) for i, t in enumerate(tools)]
        system = next((t for t in turns if t["role"] == "system"), None)
        if system is None:  # tool declarations live in a system message; an empty one if none
            system = {"role": "system", "text": "", "tools": None}
            turns.insert(0, system)
        system["tools"] = schemas
    _sort_tool_results(turns)
    return turns


def _sort_tool_results(turns: list[dict]) -> None:
    """Tool results in the order of the latest assistant tool calls (when every id is known)."""
    order: dict = {}
    for turn in turns:
        if turn["role"] == "assistant" and turn["calls"]:
            order = {cid: j for j, cid in enumerate(turn["call_ids"]) if cid is not None}
        elif turn["role"] == "user":
            results = [b for b in turn["blocks"] if b[0] == "tool_result"]
            if len(results) > 1 and all(b[1] in order for b in results):
                ranked = iter(sorted(results, key=lambda b: order[b[1]]))
                turn["blocks"] = [next(ranked) if b[0] == "tool_result" else b for b in turn["blocks"]]


# ------------------------------------------------------------------------------ rendering


def _dsml_tag(out: list[Piece], opening: str, tail: str) -> None:
    """`<｜DSML｜{tail}` or `</｜DSML｜{tail}`: the control token with plain text either side."""
    out += [Piece(opening), Piece(DSML, True), Piece(tail)]


def _tools_block(out: list[Piece], schemas: list[dict]) -> None:
    # Split the template on its control-token stand-ins before the schemas (user text) go in.
    marks = {"{D}": DSML, "{T}": THINK, "{E}": END_THINK}
    schema_text = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
    for part in re.split(r"(\{[DTE]\})", TOOLS_INSTRUCTIONS):
        out.append(Piece(marks[part], True) if part in marks else Piece(part.replace("{S}", schema_text)))


def _tool_calls(out: list[Piece], calls: list[tuple[str, dict]]) -> None:
    out.append(Piece("\n\n"))
    _dsml_tag(out, "<", " calls>\n")
    for j, (name, args) in enumerate(calls):
        if j:
            out.append(Piece("\n"))
        _dsml_tag(out, "<", f' invoke name="{name}">\n')
        for k, (key, value) in enumerate(args.items()):
            if k:
                out.append(Piece("\n"))
            is_str = isinstance(value, str)
            _dsml_tag(
                out,
                "<",
                f' parameter name="{key}" string="{"true" if is_str else "false"}">'
                + (value if is_str else json.dumps(value, ensure_ascii=False)),
            )
            _dsml_tag(out, "</", " parameter>")
        out.append(Piece("\n"))
        _dsml_tag(out, "</", " invoke>")
    out.append(Piece("\n"))
    _dsml_tag(out, "</", " calls>")


def render_pieces(
    messages: list[dict],
    *,
    tools: list | None = None,
    thinking: bool = True,
    effort: Any = DEFAULT_EFFORT,
    drop_thinking: bool = True,
    add_generation_prompt: bool = True,
) -> list[Piece]:
    """The prompt as pieces (control tokens marked), adjacent text merged."""
    effort = parse_effort(effort)
    turns = _turns(messages, tools)
    drop = drop_thinking and not any(t["role"] == "system" and t["tools"] for t in turns)
    asks = [i for i, t in enumerate(turns) if t["role"] == "user" or (t["role"] == "system" and i > 0)]
    last_ask = asks[-1] if asks else -1

    out = [Piece(BOS, True)]
    for i, turn in enumerate(turns):
        role = turn["role"]
        if i == 0 and (thinking or role == "system"):
            out.append(Piece(SYSTEM, True))
            if thinking:
                out.append(Piece(EFFORT_SENTENCE.format(effort)))
        if role == "system":
            if i > 0:
                out.append(Piece(SYSTEM, True))
            out.append(Piece(turn["text"]))
            if turn["tools"]:
                out.append(Piece("\n\n"))
                _tools_block(out, turn["tools"])
        elif role == "user":
            out.append(Piece(USER, True))
            for j, (kind, _, text) in enumerate(turn["blocks"]):
                out.append(
                    Piece(("\n\n" if j else "") + (text if kind == "text" else f"<tool_result>{text}</tool_result>"))
                )
        else:
            if thinking and (not drop or i > last_ask):
                out += [Piece(turn["reasoning"]), Piece(END_THINK, True)]
            out.append(Piece(turn["text"]))
            if turn["calls"]:
                _tool_calls(out, turn["calls"])
            out.append(Piece(EOS, True))
        # The header that opens an answer: after a user (or mid-conversation system) turn that is
        # followed by an assistant turn, or that ends the conversation.
        nxt = turns[i + 1]["role"] if i + 1 < len(turns) else None
        if i in asks and (nxt == "assistant" or (nxt is None and add_generation_prompt)):
            out.append(Piece(ASSISTANT, True))
            out.append(Piece(THINK if thinking and (not drop or i >= last_ask) else END_THINK, True))
    merged: list[Piece] = []
    for p in out:
        if not p.text:
            continue
        if merged and not p.control and not merged[-1].control:
            merged[-1] = Piece(merged[-1].text + p.text)
        else:
            merged.append(p)
    return merged


def render(messages: list[dict], **options) -> str:
    """The prompt string (see `render_pieces` for the options)."""
    return "".join(p.text for p in render_pieces(messages, **options))


# ------------------------------------------------------------------------------ tokens


_PLAIN: dict[int, tuple[Any, Any]] = {}  # id(backend) -> (backend, copy that never matches specials)


def _backend(tokenizer):
    """The `tokenizers.Tokenizer` behind an mlx-lm TokenizerWrapper, an HF fast tokenizer, or itself."""
    from tokenizers import Tokenizer

    seen = tokenizer
    for _ in range(4):
        if isinstance(seen, Tokenizer):
            return seen
        inner = getattr(seen, "backend_tokenizer", None) or getattr(seen, "_tokenizer", None)
        if inner is None:
            break
        seen = inner
    raise ChatError(f"cannot find a `tokenizers` backend in {type(tokenizer).__name__}")


def _plain_text_tokenizer(backend):
    """A copy of `backend` that tokenizes special-token spellings as ordinary text."""
    from tokenizers import Tokenizer

    held = _PLAIN.get(id(backend))
    if held is None or held[0] is not backend:
        plain = Tokenizer.from_str(backend.to_str())
        plain.encode_special_tokens = True
        held = _PLAIN[id(backend)] = (backend, plain)
    return held[1]


def control_token_ids(tokenizer) -> dict[str, int]:
    """Control token -> id; a tokenizer without one of them cannot carry this encoding."""
    backend = _backend(tokenizer)
    ids = {}
    for tok in CONTROL_TOKENS:
        tid = backend.token_to_id(tok)
        if tid is None:
            raise ChatError(f"the tokenizer has no {tok!r} token: it is not a DeepSeek-V4.1 tokenizer")
        ids[tok] = tid
    return ids


def special_token_ids(tokenizer) -> set[int]:
    """Ids of the tokenizer's special added tokens (the control tokens, pad, image, ...)."""
    return {i for i, t in _backend(tokenizer).get_added_tokens_decoder().items() if t.special}


def encode(tokenizer, messages: list[dict], **options) -> list[int]:
    """Token ids of the prompt: control tokens by id, all text with special-token matching off."""
    ids = control_token_ids(tokenizer)
    plain = _plain_text_tokenizer(_backend(tokenizer))
    out: list[int] = []
    for p in render_pieces(messages, **options):
        out += [ids[p.text]] if p.control else plain.encode(p.text, add_special_tokens=False).ids
    return out


def encode_continuation(tokenizer, text: str, *, thinking: bool = True) -> list[int]:
    """Tokens that continue an open user turn (a prompt encoded without its answer header) with
    `text`, then open the answer: how a cached chat prompt is continued."""
    ids = control_token_ids(tokenizer)
    body = _plain_text_tokenizer(_backend(tokenizer)).encode(text, add_special_tokens=False).ids
    return body + [ids[ASSISTANT], ids[THINK if thinking else END_THINK]]


# ------------------------------------------------------------------------------ mlx-lm glue


def apply_chat_template(
    messages,
    tools=None,
    add_generation_prompt: bool = False,
    enable_thinking: bool = True,
    reasoning_effort=None,
    drop_thinking: bool = True,
    continue_final_message: bool = False,
    **_unused,
) -> str:
    """mlx-lm's Python chat-template protocol (`mlx_lm.chat_templates.*`): the prompt string.

    Extra keyword arguments that HF callers pass to templates are ignored, as Jinja templates do."""
    if continue_final_message and add_generation_prompt:
        raise ChatError("continue_final_message and add_generation_prompt cannot both be set")
    text = render(
        messages,
        tools=tools,
        thinking=bool(enable_thinking),
        effort=DEFAULT_EFFORT if reasoning_effort is None else reasoning_effort,
        drop_thinking=drop_thinking,
        add_generation_prompt=add_generation_prompt,
    )
    if continue_final_message and messages[-1].get("role") == "assistant":
        text = text.removesuffix(EOS)
    return text


TEMPLATE_TYPE = "mlx_dsv41"  # the `chat_template_type` a converted tokenizer_config.json names


def register_with_mlx_lm() -> None:
    """Make `mlx_lm.chat_templates.mlx_dsv41` this module, where mlx-lm's tokenizer loader looks up
    `chat_template_type` (so `TokenizerWrapper.apply_chat_template` uses these rules)."""
    sys.modules.setdefault(f"mlx_lm.chat_templates.{TEMPLATE_TYPE}", sys.modules[__name__])
