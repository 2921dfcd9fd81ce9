"""The leaves of the library: errors, the mesh spec, the policies (strategy, precision, remat, prefetch),
the XLA flags per platform, the command lines' argument parser and the `models/` import guard. Nothing
here imports the rest of jfsdp or jax at module level (numpy and ml_dtypes only): the command lines read
these before they choose the platform and set XLA's flags."""
