"""The state browser (``icestate ui``): a local web page for looking at state tables.

It shows the state tables of a namespace, and of one table its state variables, savepoints
and forks, its checkpoints over time, the skew of a checkpoint across key groups and units,
one key's state and history, the changes between two checkpoints, and the answers of SQL
queries. It only reads: every page is a GET, the SQL box runs read queries alone on a
confined DuckDB connection (``catalog.sql.connect``), and nothing on a page writes to a table.

Everything the page needs ships in this package (templates, one style sheet); its charts are
SVG drawn on the server with matplotlib. No script or style comes from elsewhere.

Module guide: ``app`` (the Flask application: routes and error pages; ``create_app`` takes
how to open and list tables, so that the command line and tests each bring their own),
``keys`` (typed key text to key values), ``charts`` (the SVG charts), ``grids`` (any Arrow
table or query result as rows to show), ``sql_box`` (read-only queries over cached
connections).
"""

from catalog.ui.app import create_app, state_table_names

__all__ = ["create_app", "state_table_names"]
