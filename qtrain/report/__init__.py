"""Reports over run directories: tables, the papers' tables beside ours, plots.

``runs`` reads run directories, ``tables`` builds the runs table, ``paper`` compares with
``results/paper/``, ``plots`` draws the figures, ``cli`` is ``qtrain-report``.
"""
