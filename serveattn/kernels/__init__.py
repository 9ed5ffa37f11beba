"""Triton kernels, one file per kernel family. Wrappers in the package above validate and launch."""
