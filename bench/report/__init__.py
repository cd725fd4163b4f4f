"""A study's and the drills' reports: figures from raw records, summary JSON, Markdown and PNG plots.

`holdback bench report DIR` (bench.report.study.render) regenerates a study's from DIR/raw/*.json;
`holdback bench drills --report DIR` (bench.report.drills.render) the drills'.
"""
