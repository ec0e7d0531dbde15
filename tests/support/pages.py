"""Reading the dashboard's pages in streamlit.testing.v1.AppTest."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from streamlit.testing.v1 import AppTest


def kpis(at: AppTest) -> dict[str, str]:
    """A page's top-row figures, label -> value as shown. ui.kpi draws each in a
    container of its own: its label in Markdown, then its value as a heading (st.metric's
    code made the row wait for it in the browser); no other block of a page starts so.
    Found by walking the page's blocks: the row is ui.kpi_row, not st.columns."""
    found: dict[str, str] = {}

    def walk(block) -> None:
        kids = list(getattr(block, "children", {}).values())
        if len(kids) >= 2 and kids[0].type == "markdown" and kids[1].type == "header":
            found[kids[0].value] = kids[1].value
        for kid in kids:
            walk(kid)

    walk(at.main)
    return found
