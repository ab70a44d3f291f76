"""The block-table backend: flex's kernels over a block mask's tables, forward (:mod:`.fwd`) and
backward (:mod:`.bwd`), the Hopper ones (:mod:`.gluon`) where they apply; what both read of a call
(:mod:`.args`). A built-in window runs here as its band's tables."""
