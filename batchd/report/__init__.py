"""`batchd report`: one batch as a self-contained HTML page of plots and totals.

data.py reads the batch's jobs and results from the database, figures.py turns them into
plotly figures (binned here, so a 100,000-job batch makes a page of the same size as a small
one), page.py writes the page with plotly's JavaScript inlined: it opens without a network.
"""
