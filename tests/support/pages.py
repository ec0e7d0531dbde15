"""Reading the dashboard's pages in streamlit.testing.v1.AppTest."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from streamlit.testing.v1 import AppTest


def kpis(at: AppTest) -> dict[str, str]:
    """A page's top-row figures, label -> value as shown. ui.kpi draws each in a column
    of its own: its label in Markdown, its value as a heading (st.metric's code made
    the row wait for it in the browser); no other column of a page has a heading."""
    return {col.markdown[0].value: col.header[0].value
            for col in at.columns if len(col.header) and len(col.markdown)}
