"""A training run behind `python train.py` (`jfsdp.cli`), by layer: `config` (TrainConfig) and `console`
(one-line errors, notices, exit statuses) are jax-free, so the command line uses them before it chooses
the platform; `run` (the Run and `train`), `build` (its pieces), `loop`, `progress`, `report`, `metrics`
and `distributed` (more than one process) are imported once jax may start."""
