"""Resume requests after recovery (engine-core process). Not yet available."""

from __future__ import annotations

import logging

log = logging.getLogger("vllm.ftproxy.resume")


def install() -> None:
    log.warning("FTPROXY_RESUME_AFTER_RECOVERY is not supported by this build; ignored")
