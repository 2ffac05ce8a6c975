"""The performance layer: timing side by side, this machine's peaks and measured passes, the
analytic roofline, GPU datasheets, real models' costs and KV sizes, and quality measures."""
