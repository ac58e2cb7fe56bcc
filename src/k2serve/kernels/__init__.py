"""Triton kernels, each with a torch reference in its test, the native CPU kernel (`cpu`: the
CPU experts and the CPU GEMV) and the kernel policy that picks them.

Importing this package (or `policy`) never imports Triton; the kernel modules do, through
`_triton`'s guard. Layering: kernels import nothing from k2serve but `envs` (the policy's
environment defaults).
"""
