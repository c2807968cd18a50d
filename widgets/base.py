"""What every monarch widget shares: a live view plus static HTML and text for saved notebooks."""

from __future__ import annotations

import anywidget

from monarch.widgets.style import CSS, page


class StaticFallbackWidget(anywidget.AnyWidget):
    """An anywidget whose display also carries `text/html` and `text/plain`.

    Front-ends with the widget manager show the live view; nbconvert, GitHub and terminals show
    the static forms, so an executed notebook still reads well.
    """

    _css = CSS

    def static_html(self) -> str:
        raise NotImplementedError

    def static_text(self) -> str:
        raise NotImplementedError

    def _repr_mimebundle_(self, **kwargs):
        return {
            "text/plain": self.static_text(),
            "text/html": page(self.static_html()),
            "application/vnd.jupyter.widget-view+json": {
                "version_major": 2,
                "version_minor": 0,
                "model_id": self.model_id,
            },
        }
