"""Runbooks on the Alerts page: a link into the published docs, or the section's text.

Alerts carry `runbook_url: docs/runbooks.md#<alert>`, a path in the repository that
no browser can open, shown as plain text off-screen. With CLUSTERPULSE_DOCS_URL set
it becomes a link there; without it the page shows the section from docs/runbooks.md
beside the dashboard's code (a source checkout, or an image that ships docs/).
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

RUNBOOKS = Path(__file__).resolve().parents[1] / "docs" / "runbooks.md"


def anchor(runbook_url: str) -> str:
    """'docs/runbooks.md#gpudown' -> 'gpudown' ('' if the annotation has none)."""
    return runbook_url.partition("#")[2]


def link(runbook_url: str, docs_url: str) -> str | None:
    """The runbook's address under the published docs, or None when none is set."""
    if not docs_url or not runbook_url:
        return None
    return f"{docs_url}/{runbook_url.removeprefix('docs/')}"


@lru_cache(maxsize=4)
def _sections(path: Path) -> dict[str, str]:
    try:
        text = path.read_text()
    except OSError:
        return {}
    out = {}
    for part in re.split(r"^## ", text, flags=re.M)[1:]:
        title, _, body = part.partition("\n")
        # GitHub's anchor: lower case, spaces to dashes, punctuation dropped
        key = re.sub(r"[^a-z0-9 -]", "", title.strip().lower()).replace(" ", "-")
        out[key] = body.strip()
    return out


def text(runbook_url: str, path: Path = RUNBOOKS) -> str | None:
    """The runbook section's markdown, or None if it (or the file) is not there."""
    return _sections(path).get(anchor(runbook_url))
