"""Credentials inside URIs never leave the process: one function masks them in any text.

`https://user:token@host`, `s3://KEY:SECRET@bucket/path` and query parameters
such as `?token=...`, `access_key=...`, `X-Amz-Signature=...` are replaced by
`***` wherever the driver writes text: config.toml, summary.json, the report,
its logs, the MLflow and W&B parameters and the config inside each checkpoint. Pass credentials through the environment
(MLFLOW_TRACKING_TOKEN, AWS_SECRET_ACCESS_KEY, ...) instead.
"""

from __future__ import annotations

import logging
import re

MASK = "***"

# scheme://USERINFO@ (userinfo holds no '/', '?', '#' or '@': inside it they are percent-encoded)
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^\s/?#@\"']+)@")
# ?name=value or &name=value whose name says it is a credential
_SECRET_PARAM = re.compile(
    r"(?P<lead>[?&;](?P<name>[A-Za-z0-9_.-]*(?:token|secret|password|passwd|pwd|key|signature|sig|credential|auth)"
    r"[A-Za-z0-9_.-]*)=)(?P<value>[^&;#\s\"']+)",
    re.IGNORECASE,
)


def redact(text: str) -> str:
    """`text` with every credential inside a URI masked; other text unchanged."""
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{MASK}@", text)
    return _SECRET_PARAM.sub(lambda m: f"{m['lead']}{MASK}", text)


def redact_values(values: dict) -> dict:
    """`values` with credentials masked in every string value (a config as files, trackers and checkpoints hold it)."""
    return {key: redact(value) if isinstance(value, str) else value for key, value in values.items()}


class RedactFilter(logging.Filter):
    """A logging filter that masks credentials in each record's message (and its arguments)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = redact(message)
        if masked != message:
            record.msg, record.args = masked, None
        return True
