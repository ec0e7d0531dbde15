"""Runbooks: each alert's section of docs/runbooks.md, one click from the alert.

Alerts carry `runbook_url: docs/runbooks.md#<alert>`, a path in the repository that
no browser can open, shown as plain text off-screen. With CLUSTERPULSE_DOCS_URL set
it becomes a link there; without it the link opens the dashboard's own Runbooks page
(`runbooks?alert=<anchor>`, the section from docs/runbooks.md beside the dashboard's
code: a source checkout, or an image that ships docs/), and notifications can link
there too (deploy/alertmanager/examples/clusterpulse.tmpl).
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

from clusterpulse.dashboard.links import page_url

RUNBOOKS = Path(__file__).resolve().parents[1] / "docs" / "runbooks.md"


def anchor(runbook_url: str) -> str:
    """'docs/runbooks.md#gpudown' -> 'gpudown' ('' if the annotation has none)."""
    return runbook_url.partition("#")[2]


def link(runbook_url: str, docs_url: str, path: Path = RUNBOOKS) -> str | None:
    """The runbook's address under the published docs, else the dashboard's Runbooks
    page at its section; None when there is neither."""
    if not runbook_url:
        return None
    if docs_url:
        return f"{docs_url}/{runbook_url.removeprefix('docs/')}"
    return page_url("runbooks", {"alert": anchor(runbook_url)}) if text(runbook_url, path) \
        else None


@lru_cache(maxsize=4)
def _sections(path: Path) -> dict[str, tuple[str, str]]:
    try:
        text = path.read_text()
    except OSError:
        return {}
    out = {}
    for part in re.split(r"^## ", text, flags=re.M)[1:]:
        title, _, body = part.partition("\n")
        # GitHub's anchor: lower case, spaces to dashes, punctuation dropped
        key = re.sub(r"[^a-z0-9 -]", "", title.strip().lower()).replace(" ", "-")
        out[key] = (title.strip(), body.strip())
    return out


def titles(path: Path = RUNBOOKS) -> dict[str, str]:
    """Each section's anchor and title, in the document's order ({} without the file)."""
    return {k: title for k, (title, _) in _sections(path).items()}


def text(runbook_url: str, path: Path = RUNBOOKS) -> str | None:
    """The runbook section's markdown, or None if it (or the file) is not there."""
    section = _sections(path).get(anchor(runbook_url))
    return section[1] if section else None
