"""The parts of a chat request the token counter checks and lays out as the chat template
does (Qwen2.5's): a message's required content, token-id prompts, tool calls and tool
definitions; and the 400 every malformed part gets (`InvalidRequestError`, in OpenAI's error
shape). `gateway.estimator` counts what these render.
"""

from __future__ import annotations

import json
from typing import Any


class InvalidRequestError(ValueError):
    """The request cannot be counted; the gateway answers it with a 400 in OpenAI's error shape."""

    status = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def to_openai(self) -> dict[str, dict[str, str | None]]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }



MAX_TOKEN_ID = 2**31 - 1
"""No vocabulary comes near it; engines hold ids in 32-bit tensors. (Found by fuzzing: 2**63
passed as a token id and was admitted, to be refused only by the node.)"""


_CONTENT_OPTIONAL_WITH = ("tool_calls", "function_call", "audio", "refusal")
"""An assistant turn with any of these may omit `content` or send it null: it called a tool
(OpenAI: content is "required unless tool_calls or function_call is specified"), or it stands
for an earlier answer that was audio or a refusal, which the API's own answers carry with a
null content."""


def check_content_given(role: str, message: dict[str, Any], param: str) -> None:
    """The `content` OpenAI's API requires of a message of `role`: a node would take the turn
    as empty text and answer a conversation the client did not send."""
    if role == "assistant":
        if message.get("content") is None and all(
                message.get(key) is None for key in _CONTENT_OPTIONAL_WITH):
            raise InvalidRequestError(
                "content is required for an assistant message unless it has tool_calls or "
                "function_call", param=param)
    elif role == "function":  # legacy: the key is required, its value may be null
        if "content" not in message:
            raise InvalidRequestError("content is required for a function message (null "
                                      "for none)", param=param)
    elif message.get("content") is None:
        raise InvalidRequestError(f"content is required for a {role} message", param=param)


def token_ids_length(ids: object, param: str) -> int:
    if not isinstance(ids, list) or not ids:
        raise InvalidRequestError("token ids must be a non-empty list of integers", param=param)
    if not all(type(t) is int for t in ids) or min(ids) < 0 or max(ids) > MAX_TOKEN_ID:
        raise InvalidRequestError(
            f"token ids must be integers between 0 and {MAX_TOKEN_ID}", param=param)
    return len(ids)


def render_tool_calls(tool_calls: object, param: str) -> str:
    """Qwen2.5's layout: one `<tool_call>` JSON object per call after the content."""
    if not isinstance(tool_calls, list):
        raise InvalidRequestError("tool_calls must be a list", param=param)
    rendered: list[str] = []
    for k, call in enumerate(tool_calls):
        where = f"{param}[{k}]"
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise InvalidRequestError("tool call must be an object", param=where)
        name = function.get("name", "")
        arguments = function.get("arguments", "")
        if not isinstance(name, str):
            raise InvalidRequestError("function name must be a string", param=f"{where}.name")
        if not isinstance(arguments, str):
            arguments = to_json(arguments, f"{where}.arguments")
        rendered.append(
            f'\n<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'
        )
    return "".join(rendered)


def render_tools(tools: object) -> str:
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise InvalidRequestError("tools must be a list of objects", param="tools")
    for i, tool in enumerate(tools):
        _check_function_tool(tool, f"tools[{i}]")
    return "".join(f"\n{to_json(tool, 'tools')}" for tool in tools)


TEMPLATE_ITSELF = "chat_template"
"""A `chat_template_kwargs` key that is no argument of the template but replaces it (vLLM before
0.11 let it): refused, or forwarded and not counted, as the request's own `chat_template`."""


def template_arguments(kwargs: object) -> tuple[object, dict[str, object]]:
    """What `chat_template_kwargs` can put into the prompt: (the `tools` it sets, None if none;
    its other entries that may be printed).

    vLLM merges the object over the arguments it renders the template with, so `tools` or
    `documents` there replace the request's own and any other name reaches a template that may
    print it. Numbers, booleans and null steer the template (`enable_thinking`) and cost
    nothing of their own; everything else may be printed whole and is counted. The template
    itself (`TEMPLATE_ITSELF`) is left out: it is refused before counting, or trusted."""
    if kwargs is None:
        return None, {}
    if not isinstance(kwargs, dict):
        raise InvalidRequestError("chat_template_kwargs must be an object",
                                  param="chat_template_kwargs")
    # One pass, no call per entry: a 4 MB object of tiny entries is half a million of them.
    others = {name: value for name, value in kwargs.items()
              if value is not None and not isinstance(value, (bool, int, float))}
    others.pop(TEMPLATE_ITSELF, None)
    return others.pop("tools", None), others


def render_tool_list(tools: object, param: str) -> str:
    """`tools` set through `chat_template_kwargs` as `render_tools` lays out the request's own
    (the same tools are one cache entry and one count wherever the request puts them), without
    its checks: vLLM hands these to the template as they are. Anything but a list of objects
    as its JSON."""
    if isinstance(tools, list) and all(isinstance(tool, dict) for tool in tools):
        return "".join(f"\n{to_json(tool, param)}" for tool in tools)
    return to_json(tools, param)


def _check_function_tool(tool: dict[str, Any], param: str) -> None:
    """A function tool (`type` "function", or none: vLLM's default) needs its `function`, with
    a `name`; a tool of another type (OpenAI's custom tools) is the node's to accept."""
    kind = tool.get("type", "function")
    if not isinstance(kind, str):
        raise InvalidRequestError("type must be a string", param=f"{param}.type")
    if kind != "function":
        return
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InvalidRequestError("function is required for a tool of type function and must "
                                  "be an object", param=f"{param}.function")
    if not isinstance(function.get("name"), str):
        raise InvalidRequestError("function name is required and must be a string",
                                  param=f"{param}.function.name")


def to_json(value: object, param: str) -> str:
    """`value` as JSON text, or the 400 of a value that cannot be serialised."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):  # nested past the interpreter's stack
        raise InvalidRequestError("value is not JSON-serialisable", param=param) from None
