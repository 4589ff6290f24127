"""Grids: a grid file's cells expanded (``grid``), run on local processes or Ray (``runner``,
``cell_process``, ``pools``), the tiny worlds their cells need pre-trained first (``pretraining``),
and the results folder they fill (``results_folder``)."""
