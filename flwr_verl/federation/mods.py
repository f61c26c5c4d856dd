"""Light Flower plumbing shared by the ClientApp and the ServerApp (imports Flower only).

- ``secaggplus_when_requested``: Flower's ``secaggplus_mod`` for messages of a SecAgg+ round;
  plain messages pass through, so one ClientApp serves runs with SecAgg+ on and off.
- ``concise_errors``: the outermost client mod. An exception raised while handling a message
  (bad data, a reward function that fails, a wrong adapter shape, ...) becomes an error reply
  whose reason is one line, ``partition <i>: <ErrorType>: <message>`` (``client <client-id>: ...``
  when the node config names one); the server reports it
  with the round's failures. A ``FlwrVerlError`` is logged on the node as one ERROR line; any
  other exception is a bug and keeps its traceback in the node's log.
- ``ConciseErrors``: a filter for Flower's logger that prints a ``FlwrVerlError`` escaping an
  app as one ERROR line instead of a traceback (the run is still marked failed).

Nothing here imports torch, transformers or verl: in a deployment every message runs in a
fresh ClientApp process, and three of SecAgg+'s four stages per round need only Flower.
"""

from __future__ import annotations

import logging
from logging import ERROR

from flwr.app import Context, Error, Message
from flwr.client.mod import secaggplus_mod
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import log
from flwr.common.constant import ErrorCode
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

from flwr_verl.config import FlwrVerlError


def secaggplus_when_requested(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower's ``secaggplus_mod`` for messages of a SecAgg+ round; plain messages pass through."""
    if msg.has_content() and RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def concise_errors(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Turn an exception into a one-line error reply that names the partition."""
    try:
        return call_next(msg, context)
    except Exception as error:  # noqa: BLE001 - every failure must reach the server as a reply
        node = context.node_config
        who = f"client {node['client-id']}" if "client-id" in node else f"partition {node.get('partition-id', '?')}"
        reason = f"{who}: {describe(error)}"
        if isinstance(error, FlwrVerlError):
            log(ERROR, "flwr-verl: %s", reason)
        else:
            log(ERROR, "flwr-verl: %s", reason, exc_info=error)
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=msg)


def _user_error(error: BaseException | None) -> FlwrVerlError | None:
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, FlwrVerlError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


class ConciseErrors(logging.Filter):
    """Print a record that carries a ``FlwrVerlError`` as one line, without the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and (error := _user_error(record.exc_info[1])):
            record.msg, record.args = "flwr-verl: run failed: %s", (describe(error),)
            record.exc_info, record.exc_text = None, None
        return True


def install_concise_errors() -> None:
    logger = logging.getLogger("flwr")
    if not any(isinstance(f, ConciseErrors) for f in logger.filters):
        logger.addFilter(ConciseErrors())
