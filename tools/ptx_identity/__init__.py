"""Prove a kernel refactor leaves the compiled code unchanged: compile flashlite's kernels
offline for sm_90 (no GPU needed), before and after, and compare the normalised PTX.

Run it as ``python -m tools.ptx_identity`` from the repository root; README.md says how.
"""
