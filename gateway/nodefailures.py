"""The ways an exchange with an inference node fails (gateway.nodeclient raises them; the proxy
turns each into the client's answer)."""

from __future__ import annotations


class NodeError(Exception):
    """The node failed to give a complete answer."""


class NodeUnreachable(NodeError):
    """No connection to the node could be made; the request was not sent."""


class NodeTimeout(NodeError, TimeoutError):
    """The node sent nothing for the read timeout."""


class NodeStuck(NodeTimeout):
    """Ended by `NodeClient.cut`: the node's engine was judged stuck, and this exchange had
    been silent long enough to be one of its victims. Handled as a timeout that came early."""


class HeadTooLarge(NodeError):
    """The answer's head is over gateway.nodeclient's `MAX_HEAD_BYTES` or `MAX_HEADER_FIELDS`:
    the connection was closed without reading the rest."""


class AnswerTooLarge(NodeError):
    """The body is longer than `NodeResponse.read`'s limit: the rest was not read, and the
    connection was closed (which also stops the node's generation)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the node's answer is over {limit} bytes")
        self.limit = limit
