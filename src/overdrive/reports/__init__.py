"""What a finished run did: its metrics read back, summarised, plotted and compared.

    summary.py  metrics.jsonl and resolved.json read back; the summary, its markdown, run differences
    plots.py    the report's pictures (matplotlib, files only)
    write.py    `overdrive report`: summary.md and the pictures in one directory
"""
