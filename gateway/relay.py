"""What an answer costs as it passes through the gateway: the `Meter` a request's settle is
computed from, and the `SseRelay` that splits a node's event stream into events, counts the
output tokens, drops the usage chunk a client did not ask for, and writes the client's model
name into each chunk (`gateway.proxy` forwards; this module only reads and rewrites bytes).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.errors import ApiError
from gateway.nodeclient import NodeError
from gateway.nodeerrors import node_stream_error


class Phase(enum.Enum):
    PENDING = "pending"
    """Not sent yet, or refused before any response: nothing was generated."""
    SENT = "sent"
    """The node has the request; its answer has not completed."""
    DONE = "done"
    """The whole answer reached the client."""


@dataclass(slots=True)
class Meter:
    """What a request has cost so far; the settle is computed from it when the request ends."""

    prompt_tokens: int
    completion_tokens: int = 0
    exact_total: int | None = None
    phase: Phase = Phase.PENDING
    first_byte_s: float | None = None
    sent_s: float | None = None
    """When the request was sent to its node, seconds after its arrival."""
    ceiling: int = 0
    """The most the usage can be (`Inbound.usage_ceiling`; 0: no bound). The node's figures
    are its word: unbounded, one absurd report drains the tenant's bucket, pushes its fair
    order out of reach, or overflows the finish script's integer arithmetic halfway."""

    def node_ttft_ms(self) -> int | None:
        """ms from the dispatch to the node until the first token (None: no first token): the
        leader's release control counts VIP ones per node (scheduler.control)."""
        if self.first_byte_s is None or self.sent_s is None:
            return None
        return max(0, round((self.first_byte_s - self.sent_s) * 1000))

    def finish_args(self) -> tuple[int | None, bool]:
        """(usage to charge or None for a full refund, whether the task ends 'cancelled')."""
        if self.phase is Phase.PENDING:
            return None, True
        used = self.exact_total
        if used is None:
            used = self.prompt_tokens + self.completion_tokens
        used = max(0, used)
        if self.ceiling > 0:
            used = min(used, self.ceiling)
        return used, self.phase is not Phase.DONE

    def take_usage(self, usage: Any) -> None:
        if not isinstance(usage, dict):
            return
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        total = usage.get("total_tokens")
        if isinstance(prompt, int) and isinstance(completion, int):
            self.prompt_tokens = prompt
            self.completion_tokens = completion
            self.exact_total = total if isinstance(total, int) else prompt + completion
        elif isinstance(total, int):
            self.exact_total = total  # the total alone is still the node's count


MAX_EVENT_BYTES = 4 << 20
"""The longest SSE event the relay holds while it waits for the event's end. vLLM's events
are one token's chunk (kilobytes even with logprobs); a node that sends more without a blank
line is broken, and holding its bytes would let it grow the gateway without bound."""


class EventTooLarge(NodeError):
    """The node sent more than `MAX_EVENT_BYTES` without ending an event."""


class SseRelay:
    """Splits an SSE byte stream into events, counts output, drops the usage-only chunk, and
    writes the client's model name into each chunk (`reply_model`, None: left as sent)."""

    __slots__ = ("_cr", "_held", "_parts", "_reply_model", "_strip_usage", "ended", "failed",
                 "meter")

    def __init__(self, meter: Meter, *, strip_usage: bool, reply_model: str | None = None) -> None:
        self._parts: list[bytes] = []
        """The incomplete event's bytes, in the pieces they came in: joined once, when the
        event ends (joining on every piece would cost the square of the event's length)."""
        self._held = 0
        self._cr = False
        """The last piece ended in a CR, held back: its LF may start the next one."""
        self._strip_usage = strip_usage
        self._reply_model = reply_model
        self.meter = meter
        self.failed: ApiError | None = None
        """The node's error event, when it sent one: the generation ended on it."""
        self.ended = False
        """The stream's last event (`data: [DONE]`) is among the bytes `feed` returned: once
        they are written the client has the whole answer, whatever the connection does next
        (the OpenAI SDK's synchronous stream closes it there, before the body's end)."""

    def feed(self, data: bytes) -> bytes:
        """Bytes to send now: every complete event received so far, minus dropped ones.
        Raises `EventTooLarge` when an event grows past `MAX_EVENT_BYTES` unfinished.

        Lines may end in CRLF (SSE allows it; vLLM sends LF): they are relayed as LF, so
        that an event's end is found, counted and renamed whatever the node's framing."""
        if self._cr:
            data, self._cr = b"\r" + data, False
        if data.endswith(b"\r"):
            data, self._cr = data[:-1], True
        if b"\r\n" in data:
            data = data.replace(b"\r\n", b"\n")
        if not data:
            return b""  # (a read of a lone CR, held) an empty piece would hide an event's end
        if self._parts:
            if b"\n\n" not in data and not (
                    data[:1] == b"\n" and self._parts[-1][-1:] == b"\n"):
                self._hold(data)
                return b""
            data = b"".join(self._parts) + data
            self._parts.clear()
            self._held = 0
        end = data.rfind(b"\n\n")
        if end < 0:
            self._hold(data)
            return b""
        cut = end + 2
        complete = data[:cut]
        if cut < len(data):
            self._parts.append(data[cut:])
            self._held = len(data) - cut
        events = complete.split(b"\n\n")
        events.pop()  # the empty string after the last separator
        sent = [self._relay(event) for event in events]
        if all(out is event for out, event in zip(sent, events, strict=True)):
            return complete  # nothing dropped or rewritten: the bytes as they came
        return b"".join(out + b"\n\n" for out in sent if out is not None)

    def _hold(self, data: bytes) -> None:
        self._held += len(data)
        if self._held > MAX_EVENT_BYTES:
            self._parts.clear()
            self._held = 0
            raise EventTooLarge(f"the node sent over {MAX_EVENT_BYTES} bytes in one event")
        self._parts.append(data)

    def flush(self) -> bytes:
        """Whatever trails the last complete event (a well-formed stream leaves nothing)."""
        tail = b"".join(self._parts) + (b"\r" if self._cr else b"")
        self._parts.clear()
        self._held = 0
        self._cr = False
        return tail

    def _relay(self, event: bytes) -> bytes | None:
        """The event to send (itself when unchanged), or None to drop it. `[DONE]`, comments
        and anything that is not one JSON object pass untouched."""
        if not event.startswith(b"data:"):
            return event
        payload = event[5:].strip()
        if payload == b"[DONE]":
            self.ended = True
            return event
        if not payload.startswith(b"{"):
            return event
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return event
        if not isinstance(chunk, dict):
            return event
        if "error" in chunk or chunk.get("object") == "error":
            error = node_stream_error(chunk)
            if error is not None:
                self.failed = error
                return b"data: " + orjson.dumps(error.body())
        meter = self.meter
        choices = chunk.get("choices")
        usage = chunk.get("usage")
        if choices:
            if usage is None:
                for choice in choices:
                    if _carries_output(choice):
                        meter.completion_tokens += 1
            else:  # continuous usage stats: exact so far
                meter.take_usage(usage)
        elif usage is not None:
            meter.take_usage(usage)
            if self._strip_usage:
                return None
        if rename_model(chunk, self._reply_model):
            return b"data: " + orjson.dumps(chunk)
        return event


def rename_model(answer: dict[str, Any], model: str | None) -> bool:
    """Writes `model` into the answer's own `model` field when it names another; only an
    existing string field is replaced (an error object has none and gets none)."""
    if model is None:
        return False
    current = answer.get("model")
    if not isinstance(current, str) or current == model:
        return False
    answer["model"] = model
    return True


def _carries_output(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return False
    if choice.get("finish_reason") is not None or choice.get("text"):
        return True
    delta = choice.get("delta")
    # vLLM's reasoning field was `reasoning_content`, and is `reasoning` since early 2026.
    return isinstance(delta, dict) and bool(
        delta.get("content") or delta.get("reasoning") or delta.get("reasoning_content")
        or delta.get("tool_calls")
    )
