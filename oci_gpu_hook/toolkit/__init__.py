"""The host toolkit: commands people run (doctor, cdi, install, validate, demo, simulate).

May import anything (click, yaml, jsonschema, NVML bindings) and the start path's modules; the
start path never imports from here.
"""
