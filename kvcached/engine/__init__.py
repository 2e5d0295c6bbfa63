"""What kvcached under an engine means whichever engine it is: the parts both wings share.

``config``: the core's configuration, one struct each wing's config extends, and the one reading
of the settings both plugins use; ``control``: the memory report kvctl gets and the floor a
limit may not go below unforced; ``releases``: the engine releases kvcached was tested on, the
range of releases a patch target holds for, and the one check a starting engine makes of its
release; ``targets``: the one record of a patch target both tables' rows extend, and the one
check of a table; ``reserve``: the bounds of the empty pages an engine keeps mapped; ``metrics``:
kvcached's series for an engine's ``/metrics``, one collector each wing puts in place. Each wing
(``kvcached.vllm``, ``kvcached.sglang``) keeps its own patch table and imports this package; this
package imports no wing.
"""
