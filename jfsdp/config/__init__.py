"""The leaves of the library: errors, the mesh spec, the policies (strategy, precision, remat) and the XLA
flags per platform. Nothing here imports another part of jfsdp, and nothing imports jax at module level
except `policy` (dtypes): the command lines read these before they choose the platform."""
