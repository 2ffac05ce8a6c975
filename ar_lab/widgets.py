"""ipywidgets explorers for the notebooks.

Every explorer is a thin shell: its callback calls a pure function from the chapter's
module (which unit tests call directly), and the builder returns the widget so tests
can set ``.value`` on its controls headlessly and read what it shows.
"""

from __future__ import annotations
