"""What kvcached under an engine means whichever engine it is: the parts both wings share.

``releases``: the engine releases kvcached was tested on, the range of releases a patch target
holds for, and the one check a starting engine makes of its release; ``reserve``: the bounds of
the empty pages an engine keeps mapped, from its settings. Each wing (``kvcached.vllm``,
``kvcached.sglang``) keeps its own patch table and imports this package; this package imports no
wing.
"""
