"""The bottom layer every engine stands on: collectives, the recorder, the mesh, cross-rank checks.

`comm` issues every collective and returns a `Handle`; `recorder` stamps when communication and
computation ran (`spans` is the record it produces, `intervals` the arithmetic on it); `groups`
lays out the DeviceMesh; `agreement` makes ranks that disagree fail together; `tuning` keeps the
fastest of a few measured settings. Nothing here imports an engine, a model or a tool.
"""
