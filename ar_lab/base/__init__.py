"""The shared base under every layer: argument checks (``args``) and the clock (``timing``)."""
