"""The Triton kernels' backend: the forward (:mod:`.fwd`), the backward pair (:mod:`.bwd`) and
their tiles (:mod:`.config`)."""
